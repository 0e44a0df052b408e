"""WeightSubscriber against live daemons: deltas from several base versions reconstruct the
trainer's parameters at each version (bf16-rounded torch.optim reference), through a PS killed
mid-subscription; element-level deltas move only the elements that changed; a LoRA job's
subscriber moves only adapters; a timeout raises, naming what is missing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import train_model
from shardline import PSOptimizer, WeightSubscriber, connect
from shardline.services.errors import ShardlineTimeoutError
from shardline.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)

STEPS = 10
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_rollout.py"
EXAMPLE_STEPS = 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A dispatcher (2 s heartbeat timeout: a killed node is noticed fast) and three PS nodes,
    shared by the module; the last test kills one."""
    with LocalCluster(tmp_path_factory.mktemp("subscriber")) as c:
        c.start_dispatcher(heartbeat_timeout=2, heartbeat_interval=0.5)
        for h in [c.add_node(node_id=f"ps{i}", wait=False) for i in range(3)]:
            c.wait_ready(h)
        c.wait_for_nodes(3, timeout=30)
        yield c


def assert_bf16_of(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """``got`` (bf16) is the bf16 rounding of a value within float32 round-off (1e-6, the BSP
    contract's tolerance) of the fp32 reference ``want``: |got - want| <= half a bf16 ulp + 1e-6."""
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for name, ref in want.items():
        g = got[name].float()
        assert g.dtype == torch.float32 and got[name].dtype == torch.bfloat16 and g.shape == ref.shape
        ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))))
        err = (g - ref).abs() - (ulp / 2 + 1e-6)
        assert float(err.max()) <= 0, f"{what}: {name} differs from bf16(reference) by {float(err.max())} beyond"


def test_element_deltas_move_only_changed_elements(cluster):
    """SGD with gradients on 3 elements of a 4096-element tensor (4 blocks): after the first poll a
    subscriber receives 6 bytes per changed element (uint32 index + bf16 value), from the base it
    holds, whether that is the previous version or one 3 versions back; values equal torch.optim's."""
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(4096, generator=g)
    creator = connect(cluster.address, job="sub-sparse")
    creator.init({"emb": w0}, optimizer="sgd", lr=0.5, block_elements=1024)
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([ref], lr=0.5)
    every = WeightSubscriber(cluster.address, "sub-sparse", pull_timeout=30)
    rarely = WeightSubscriber(cluster.address, "sub-sparse", pull_timeout=30)
    late = None
    try:
        for s in (every, rarely):
            version, changed = s.poll()
            assert version == 0 and [n for n, _ in changed] == ["emb"]
            assert s.stats.last_poll_bytes == 4096 * 2 and s.stats.dense_blocks == 4
        first_front = every.poll()[1]   # nothing changed: nothing moves, nothing returned
        assert first_front == [] and every.stats.last_poll_bytes == 0
        for step, touched in enumerate(([5, 2000, 4000], [6, 7, 3000], [5, 1500, 1501])):
            grad = torch.zeros(4096)
            grad[touched] = 1.0
            creator.push({"emb": grad})
            ref.grad = grad.clone()
            opt.step()
            version, changed = every.poll()
            assert version == step + 1 and [n for n, _ in changed] == ["emb"]
            assert every.stats.last_poll_bytes == 6 * 3, every.stats
            assert torch.equal(changed[0][1], ref.detach().to(torch.bfloat16))
        version, changed = rarely.wait_for(3)
        assert version == 3 and rarely.stats.last_poll_bytes == 6 * 8  # 8 distinct elements since version 0
        assert torch.equal(changed[0][1], ref.detach().to(torch.bfloat16))
        late = WeightSubscriber(cluster.address, "sub-sparse", pull_timeout=30)
        version, changed = late.poll()   # a new reader gets dense blocks
        assert version == 3 and late.stats.last_poll_bytes == 4096 * 2 and late.stats.delta_blocks == 0
        assert torch.equal(changed[0][1], ref.detach().to(torch.bfloat16))
        assert every.stats.delta_blocks >= 3 and every.stats.checksum_failures == 0
    finally:
        creator.close(), every.close(), rarely.close()
        if late is not None:
            late.close()


def test_double_buffer_keeps_returned_tensors_until_the_poll_after_next(cluster):
    creator = connect(cluster.address, job="sub-buffers")
    creator.init({"w": torch.zeros(64)}, optimizer="sgd", lr=1.0)
    sub = WeightSubscriber(cluster.address, "sub-buffers", pull_timeout=30)
    try:
        _, first = sub.poll()
        held = first[0][1]
        snapshot = held.clone()
        creator.push({"w": torch.ones(64)})
        version, second = sub.poll()
        assert version == 1 and torch.equal(held, snapshot)   # the reader's weights did not move
        assert torch.equal(second[0][1], torch.full((64,), -1.0, dtype=torch.bfloat16))
        assert second[0][1].data_ptr() != held.data_ptr()
        # a poll that changed nothing switches nothing: the reader's tensors stay the current ones
        assert sub.poll() == (1, []) and sub.current()["w"].data_ptr() == second[0][1].data_ptr()
        assert torch.equal(sub.current()["w"], second[0][1])
    finally:
        creator.close(), sub.close()


def test_a_tensor_added_after_the_subscriber_started_is_followed(cluster):
    """The trainer adds a tensor at step 1 (Client.extend): the subscriber's next poll returns it
    with the version that has it, equal to torch.optim's (bf16-rounded), and then only what changes."""
    g = torch.Generator().manual_seed(3)
    w0, b0, gw, gb = (torch.randn(256, generator=g) for _ in range(4))
    creator = connect(cluster.address, job="sub-extend")
    creator.init({"w": w0}, optimizer="sgd", lr=0.5)
    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    opt = torch.optim.SGD([w], lr=0.5)
    sub = WeightSubscriber(cluster.address, "sub-extend", pull_timeout=30)
    try:
        assert [n for n, _ in sub.poll()[1]] == ["w"]
        creator.push({"w": gw})
        w.grad = gw.clone()
        opt.step()
        creator.extend({"b": b0}, initialize=True)
        opt.add_param_group({"params": [b]})
        creator.push({"w": gw, "b": gb})
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
        version, changed = sub.wait_for(2)
        assert version == 2 and sorted(n for n, _ in changed) == ["b", "w"]
        assert_bf16_of(dict(changed), {"w": w.detach(), "b": b.detach()}, "after the extension")
        creator.push({"w": None, "b": gb})
        b.grad = gb.clone()
        torch.optim.SGD([b], lr=0.5).step()
        version, changed = sub.wait_for(3)
        assert version == 3 and [n for n, _ in changed] == ["b"]
        assert_bf16_of(sub.current(), {"w": w.detach(), "b": b.detach()}, "step 3")
    finally:
        creator.close(), sub.close()


def test_wait_for_times_out_naming_job_version_and_nodes(cluster):
    creator = connect(cluster.address, job="sub-timeout")
    creator.init({"w": torch.zeros(8)}, optimizer="sgd", lr=0.1)
    sub = WeightSubscriber(cluster.address, "sub-timeout", pull_timeout=30)
    try:
        started = time.monotonic()
        with pytest.raises(ShardlineTimeoutError) as err:
            sub.wait_for(5, timeout=1.0)
        took = time.monotonic() - started
        message = str(err.value)
        assert "'sub-timeout'" in message and "version 5" in message and "nodes behind it: ps" in message and "(at 0)" in message, message
        assert took < 1.0 + 6, took   # the wait, then at most the straggler query and one probe
    finally:
        creator.close(), sub.close()


def test_lora_subscriber_moves_only_adapter_bytes(cluster):
    """A tiny Llama (built from a config) with LoRA adapters: the base is sent once, then each
    version moves at most the adapters' bf16 bytes, and only adapter tensors are returned."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardline import PSOptimizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    model = peft.get_peft_model(LlamaForCausalLM(config), peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0,
                                                                          target_modules=["q_proj", "v_proj"]))
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    adapter_bf16_bytes = 2 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    model_bf16_bytes = 2 * sum(p.numel() for p in model.parameters())
    opt = PSOptimizer(model.named_parameters(), cluster=cluster.address, job="sub-lora", optimizer="adamw", lr=0.01,
                      world_size=1, rank=0)
    sub = WeightSubscriber(cluster.address, "sub-lora", pull_timeout=30)
    try:
        version, changed = sub.poll()
        assert version == 0 and len(changed) == len(list(model.named_parameters()))
        assert sub.stats.last_poll_bytes == model_bf16_bytes
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        for step in range(3):
            opt.zero_grad()
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            version, changed = sub.poll()
            assert version == step + 1
            assert changed and {n for n, _ in changed} <= adapters, sorted({n for n, _ in changed} - adapters)
            assert 0 < sub.stats.last_poll_bytes <= adapter_bf16_bytes, (sub.stats.last_poll_bytes, adapter_bf16_bytes)
            params = dict(model.named_parameters())
            for n, t in changed:   # what the trainer itself holds after the step, rounded to bf16
                assert torch.equal(t, params[n].detach().to(torch.bfloat16)), n
        print(f"LoRA subscriber: {sub.stats.last_poll_bytes:,} B per version, adapters {adapter_bf16_bytes:,} B, "
              f"whole model {model_bf16_bytes:,} B (bf16)")
    finally:
        sub.close(), opt.close()


def test_rl_rollout_example_runs_end_to_end(cluster, tmp_path):
    """examples/rl_rollout.py as a user runs it against a running cluster: a trainer and 2 rollout
    engine processes; every sample names its policy version, the engines follow the versions to the
    end and the reward of the samples rises."""
    argv = [sys.executable, str(EXAMPLE), "--cluster", cluster.address, "--job", "rl-example", "--steps", str(EXAMPLE_STEPS),
            "--rollouts", "2", "--lr", "0.1", "--spool", str(tmp_path / "spool"), "--timeout", "60"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = re.findall(r"step (\d+): reward (\S+), sample staleness mean (\S+) max (\d+)", out.stdout)
    assert [int(s[0]) for s in steps] == list(range(EXAMPLE_STEPS)), out.stdout[-2000:]
    assert all(int(s[3]) >= 0 for s in steps)
    reports = json.loads(out.stdout.strip().splitlines()[-1])["rollouts"]
    assert len(reports) == 2
    for r in reports:
        versions = {int(v) for v in r["versions"]}
        assert EXAMPLE_STEPS in versions and len(versions) >= 3, (r, out.stdout[-3000:])   # followed to the end
        assert r["checksum_failures"] == 0 and r["polls"] >= len(versions)
    rewards = [float(s[1]) for s in steps]   # the reward of the samples each step learned from
    assert sum(rewards[-3:]) > sum(rewards[:3]), out.stdout[-3000:]
    # every sample line names the version that produced it, never one the trainer had not made
    for path in (tmp_path / "spool").glob("rollout-*.jsonl"):
        for line in path.read_text().splitlines():
            assert 0 <= json.loads(line)["version"] <= EXAMPLE_STEPS


def test_subscribers_from_several_bases_through_a_killed_ps(cluster):
    """A trainer (BSP AdamW, replication 2) steps while one subscriber polls every version (the
    trainer waits for it) and another waits for versions 2, 6 and 10 (bases 4 versions apart). A
    PS is SIGKILLed at version 3: both go on, and every version either returned equals the
    single-process torch.optim reference at that version, cast to bf16. (Last in the module: it
    kills a node.)"""
    trained: dict = {}
    polled = {"version": 0}   # the newest version the polling subscriber returned

    def train():
        model = train_model.SmallModel()
        opt = PSOptimizer(model.named_parameters(), cluster=cluster.address, job="sub-kill", optimizer="adamw",
                          world_size=1, rank=0, block_elements=16, pull_timeout=60, **train_model.HYPER["adamw"])
        try:
            for step in range(STEPS):
                # paced by the polling subscriber, so it sees every version (the other's bases differ)
                deadline = time.monotonic() + 30
                while polled["version"] < step and time.monotonic() < deadline:
                    time.sleep(0.01)
                tokens, targets = train_model.batch(step, 0)
                opt.zero_grad()
                train_model.loss_fn(model, tokens, targets).backward()
                opt.step()
            trained.update({n: p.detach().clone() for n, p in model.state_dict().items()})
        except BaseException as exc:  # reported by the test below
            trained["error"] = exc
        finally:
            opt.close()

    trainer = threading.Thread(target=train, name="trainer", daemon=True)
    trainer.start()
    every = WeightSubscriber(cluster.address, "sub-kill", pull_timeout=60)
    sparse = WeightSubscriber(cluster.address, "sub-kill", pull_timeout=60)
    try:
        seen: dict[int, dict[str, torch.Tensor]] = {}
        sparse_seen: dict[int, dict[str, torch.Tensor]] = {}
        engine: dict[str, torch.Tensor] = {}   # what an inference engine would hold
        held: dict[str, torch.Tensor] = {}
        killed = False
        waits = iter([2, 6, STEPS])
        target = next(waits)
        while every.version != STEPS or target is not None:
            assert "error" not in trained, trained.get("error")
            version, changed = every.poll(timeout=30)
            assert version >= (max(seen) if seen else 0)
            engine.update({n: t.clone() for n, t in changed})
            seen[version] = dict(engine)
            polled["version"] = version
            if not killed and version >= 3:
                cluster.kill(cluster.nodes[1])
                killed = True
            if target is not None and version >= target:
                v, changed = sparse.wait_for(target, timeout=30)
                assert v >= target
                held.update({n: t.clone() for n, t in changed})
                sparse_seen[v] = dict(held)
                target = next(waits, None)
            time.sleep(0.02)
        trainer.join(60)
    finally:
        every.close(), sparse.close()
    assert not trainer.is_alive() and "error" not in trained, trained.get("error")
    want = train_model.reference("adamw", STEPS, world_size=1)
    assert all(float((trained[n] - w).abs().max()) <= 1e-6 for n, w in want.items())
    assert killed and set(range(1, STEPS + 1)) <= set(seen) and len(sparse_seen) == 3, (sorted(seen), sorted(sparse_seen))
    for version, state in [*seen.items(), *sparse_seen.items()]:
        assert_bf16_of(state, train_model.reference("adamw", version, world_size=1), f"version {version}")
    assert every.stats.checksum_failures == 0 and sparse.stats.checksum_failures == 0
