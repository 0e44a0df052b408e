"""Shardline weight-subscriber benchmark: bytes a rollout engine pulls per policy version, against
the whole model in bf16 and against a plain bf16 delta pull (a ``Client`` bound to bf16 tensors,
block-level deltas, no element-level ones) measured in the same run, on the same versions.

    .venv/bin/python bench/subscriber.py --out bench/results/subscriber.json    # full run (~1-2 min)
    .venv/bin/python bench/subscriber.py --quick                                # sanity run (~30 s)

Workloads, on a local cluster of 1 dispatcher and 2 PS nodes (``LocalCluster``), a trainer in this
process (PSOptimizer, AdamW, world size 1) on a random Llama built from a config (nothing
downloaded), random token batches:

* **full-bf16**: full fine-tuning at learning rates 1e-5 and 1e-4; per version the subscriber's
  bytes, the plain bf16 pull's bytes and the model's bf16 bytes, and the share of elements whose
  bf16 value changed;
* **lora**: LoRA (r 8 on q/v projections); per version the subscriber's bytes vs the adapters'
  and the model's bf16 bytes.

Also the time of a subscriber poll against the plain pull of the same version (ratio). The machine
is shared and noisy: only the ratios mean much. Every daemon started is stopped at the end.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import statistics
import sys
import tempfile
import time

from report import run_and_report  # bench/report.py (the script's folder is on sys.path)

import torch

from shardline import PSOptimizer, WeightSubscriber, connect
from shardline.local_cluster import LocalCluster


def build_model(hidden: int, layers: int, vocab: int, lora_r: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    if lora_r:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_r, lora_alpha=16, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj"]))
    return model


def run_workload(address: str, job: str, *, lr: float, versions: int, size: dict, lora_r: int = 0) -> dict:
    model = build_model(**size, lora_r=lora_r)
    params = dict(model.named_parameters())
    model_bytes = 2 * sum(p.numel() for p in params.values())
    trainable_bytes = 2 * sum(p.numel() for p in params.values() if p.requires_grad)
    opt = PSOptimizer(model.named_parameters(), cluster=address, job=job, optimizer="adamw", lr=lr, world_size=1,
                      rank=0, weight_decay=0.0)
    sub = WeightSubscriber(address, job, pull_timeout=120)
    plain = connect(address, job=job)
    bound = {n: torch.zeros(p.shape, dtype=torch.bfloat16) for n, p in params.items()}
    for n, t in bound.items():
        plain.bind(n, t)
    rows = []
    try:
        sub.poll()
        plain.pull(copy=False)
        held = {n: t.clone() for n, t in bound.items()}
        g = torch.Generator().manual_seed(1)
        for v in range(1, versions + 1):
            tokens = torch.randint(0, size["vocab"], (4, 32), generator=g)
            opt.zero_grad()
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            started = time.perf_counter()
            version, changed = sub.poll()
            poll_seconds = time.perf_counter() - started
            before = plain.stats.pulled_bytes
            started = time.perf_counter()
            plain.pull(min_step=v, copy=False)
            plain_seconds = time.perf_counter() - started
            changed_elements = sum(int((bound[n].view(torch.int16) != held[n].view(torch.int16)).sum()) for n in bound)
            held = {n: t.clone() for n, t in bound.items()}
            got = dict(changed)
            assert version == v and all(torch.equal(got[n], bound[n]) for n in got), "subscriber != plain bf16 pull"
            rows.append({"version": version, "subscriber_bytes": sub.stats.last_poll_bytes,
                         "plain_bf16_pull_bytes": plain.stats.pulled_bytes - before,
                         "changed_bf16_elements": changed_elements, "delta_blocks": sub.stats.delta_blocks,
                         "poll_seconds": poll_seconds, "plain_pull_seconds": plain_seconds})
    finally:
        sub.close(), plain.close(), opt.close()
    steady = rows[1:] or rows   # the first version after the initial pull can differ (Adam's first step)
    mean_sub = statistics.mean(r["subscriber_bytes"] for r in steady)
    mean_plain = statistics.mean(r["plain_bf16_pull_bytes"] for r in steady)
    return {"job": job, "lr": lr, "lora_r": lora_r, "model_bf16_bytes": model_bytes,
            "trainable_bf16_bytes": trainable_bytes, "versions": rows,
            "mean_subscriber_bytes_per_version": mean_sub, "mean_plain_bf16_pull_bytes_per_version": mean_plain,
            "subscriber_vs_model": mean_sub / model_bytes, "subscriber_vs_plain_pull": mean_sub / max(1, mean_plain),
            "subscriber_vs_trainable": mean_sub / max(1, trainable_bytes),
            "changed_element_share": statistics.mean(r["changed_bf16_elements"] for r in steady) / (model_bytes / 2),
            "poll_time_vs_plain_pull": statistics.median(r["poll_seconds"] / max(1e-9, r["plain_pull_seconds"])
                                                         for r in steady)}


def run(args) -> dict:
    size = dict(hidden=64, layers=2, vocab=512) if args.quick else dict(hidden=256, layers=4, vocab=4096)
    versions = 3 if args.quick else args.versions
    torch.set_num_threads(1)
    results = []
    with LocalCluster(tempfile.mkdtemp(prefix="shardline-subbench-")) as cluster:
        cluster.start_dispatcher()
        cluster.add_node(node_id="ps1")
        cluster.add_node(node_id="ps2")
        cluster.wait_for_nodes(2, timeout=60)
        for lr in (1e-5, 1e-4):
            results.append(run_workload(cluster.address, f"full-{lr:g}", lr=lr, versions=versions, size=size))
        results.append(run_workload(cluster.address, "lora", lr=1e-3, versions=versions, size=size, lora_r=8))
    return {"benchmark": "subscriber", "when": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "host": platform.node(), "python": sys.version.split()[0], "torch": torch.__version__,
            "model": size, "quick": bool(args.quick), "workloads": results}


def print_table(result: dict) -> None:
    print(f"weight subscriber, model {result['model']} (bytes per version, mean over versions 2..)")
    print(f"{'workload':>12} {'model bf16':>12} {'subscriber':>12} {'plain bf16':>12} {'sub/model':>10} "
          f"{'sub/plain':>10} {'changed':>8} {'poll/pull t':>11}")
    for w in result["workloads"]:
        print(f"{w['job']:>12} {w['model_bf16_bytes']:>12,} {w['mean_subscriber_bytes_per_version']:>12,.0f} "
              f"{w['mean_plain_bf16_pull_bytes_per_version']:>12,.0f} {w['subscriber_vs_model']:>10.3f} "
              f"{w['subscriber_vs_plain_pull']:>10.3f} {w['changed_element_share']:>8.3f} "
              f"{w['poll_time_vs_plain_pull']:>11.2f}")
        if w["lora_r"]:
            print(f"{'':>12} adapters {w['trainable_bf16_bytes']:,} B bf16: subscriber / adapters "
                  f"{w['subscriber_vs_trainable']:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the result JSON here")
    ap.add_argument("--quick", action="store_true", help="a small model, 3 versions")
    ap.add_argument("--versions", type=int, default=6)
    return run_and_report(run, print_table, ap.parse_args(argv), stopped="daemons")


if __name__ == "__main__":
    sys.exit(main())
