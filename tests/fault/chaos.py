"""A seeded fault schedule against a real cluster that trains: nothing may be lost or hang.

The cluster: two dispatchers on etcd (one leader), three PS nodes (replication 2, checkpoint
directories), two worker processes (tests/integration/train_model.py, AdamW BSP). One fault at a
time, chosen by a seeded RNG, each at a random point of the BSP step:

* ``ps_kill9`` — SIGKILL a PS; once declared dead it is restarted from its checkpoint directory
  and rejoins (a two-phase ring change: it syncs what changed, then serves);
* ``ps_restart`` — SIGTERM a PS (it leaves the ring: its blocks move, then it stops) and start it
  again (it moves back): migration both ways while the workers train;
* ``ps_failpoint`` — restart a PS armed to die right after applying a step, before replicating it
  (``ps.after_apply``), or in the middle of writing a checkpoint (``ps.checkpoint.<stage>``);
* ``ps_stop`` — SIGSTOP a PS for a while (maybe past the failure timeout), then SIGCONT;
* ``worker_kill9`` — SIGKILL a worker at a random moment and start it again (it resumes at
  ``opt.version``);
* ``worker_failpoint`` — a worker dies before its push, between its push and its commit, or after
  committing on one node only, and is started again;
* ``leader_kill9`` / ``leader_stop`` — SIGKILL or SIGSTOP the leading dispatcher (another takes
  over; the stopped one comes back fenced).

With ``--partitions`` (make chaos) every daemon, etcd and each worker run on an emulated host of
their own (tests/emulated_cluster.py), and the schedule also cuts the network (docs/architecture.md,
"Failure detection and partitions"), each for a random 1-8 s, shorter or longer than the failure
timeout:

* ``ps_cut`` — a PS loses its network;
* ``leader_cut`` — the leading dispatcher loses its network, etcd included (another takes over);
* ``worker_cut`` — a worker loses its network;
* ``ps_dispatcher_loss`` — the frames between a PS and the leading dispatcher are lost, one way
  or both (the PS goes on serving the workers while the dispatcher moves its blocks away).

With ``cover`` (``--cover``; make test's run) the schedule is every kind once and every failpoint
once, in a seeded order, with room in the training for each, and a worker whose failpoint has not
fired yet is let reach it before another fault restarts it. Otherwise (make chaos) each fault's
kind is drawn by weight. Either way a PS failpoint that did not fire counts as not injected, and
the report lists the worker failpoints that fired.

With ``--rebalance`` the dispatchers also rebalance the ring from measured load every
REBALANCE_INTERVAL seconds (heat half-life 1 s), so faults also land on pending rebalances (a
node killed or restarted, the leader killed mid-rebalance); the report counts the rebalances
the leaders started.

With ``--host-aggregation`` the two workers aggregate their pushes as one host's
(``host_aggregation=True``, worker/host_group.py) and the host group's failpoints (the leader
after summing, a member after handing its gradients over) join the worker failpoints.

After each fault the harness waits for the next applied step and records how long it took. At
the end every worker must report the full number of steps and parameters equal to one process
running torch.optim (no step lost), and no wait may have hung.

    python tests/fault/chaos.py --seeds 1,2,3 --faults 40 --out bench/results/chaos.json   # make chaos
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration"))
sys.path.insert(0, str(HERE.parent))

import train_model  # noqa: E402
from etcd_server import EtcdServer  # noqa: E402
from emulated_cluster import EmulatedCluster  # noqa: E402
from shardline.local_cluster import LocalCluster  # noqa: E402

FAULTS = {  # kind -> weight
    "ps_kill9": 3, "ps_restart": 2, "ps_failpoint": 2, "ps_stop": 2,
    "worker_kill9": 3, "worker_failpoint": 3, "leader_kill9": 2, "leader_stop": 1,
}
# --partitions: faults of the network between emulated hosts (kind -> weight)
PARTITIONS = {"ps_cut": 2, "leader_cut": 1, "worker_cut": 1, "ps_dispatcher_loss": 2}
PARTITION_SECONDS = (1.0, 8.0)
WORKER_FAILPOINTS = ("worker.before_push", "worker.after_push", "worker.commit_partial")
# --host-aggregation: the workers of this host sum their gradients (worker/host_group.py); a
# leader dies after summing, a member after handing its gradients over (each fires on its role only)
HOST_GROUP_FAILPOINTS = ("worker.host_group_leader_summed", "worker.host_group_ready")
PS_FAILPOINTS = ("ps.after_apply", "ps.checkpoint.values.tmp", "ps.checkpoint.state.renamed",
                 "ps.checkpoint.manifest.tmp")
POINTS = {"ps_failpoint": PS_FAILPOINTS, "worker_failpoint": WORKER_FAILPOINTS}
# Steps of training a fault of this kind may take (3 for the others): a PS failpoint waits past
# the step and past the next checkpoints, a worker failpoint may be armed 4 steps ahead.
STEP_ROOM = {"ps_failpoint": 13, "worker_failpoint": 5}
RECOVERY_TIMEOUT = 90.0
LEASE = 1
HEARTBEAT_TIMEOUT = 2.0
REBALANCE_INTERVAL = 2.0   # --rebalance: seconds between the leader's plans


@dataclass
class Report:
    seed: int
    faults: list = field(default_factory=list)   # (kind, detail, seconds to the next applied step)
    steps: int = 0
    steps_lost: int = 0
    worker_failpoints_fired: list = field(default_factory=list)
    max_abs_diff: float = 0.0
    seconds: float = 0.0
    rebalances: int | None = None   # started by the leaders (--rebalance), None: rebalancing off

    def recovery(self) -> list[float]:
        return [f["recovery_seconds"] for f in self.faults if f["recovery_seconds"] is not None]

    def to_dict(self) -> dict:
        rec = sorted(self.recovery())
        pct = (lambda q: rec[min(len(rec) - 1, int(q * len(rec)))] if rec else None)
        return {"seed": self.seed, "faults_injected": sum(1 for f in self.faults if f.get("injected", True)),
                "steps": self.steps,
                "steps_lost": self.steps_lost, "max_abs_diff_vs_no_fault_run": self.max_abs_diff,
                "recovery_p50_seconds": pct(0.5), "recovery_p99_seconds": pct(0.99),
                "recovery_mean_seconds": statistics.mean(rec) if rec else None, "wall_seconds": self.seconds,
                "by_kind": {k: sum(1 for f in self.faults if f["kind"] == k) for k in {**FAULTS, **PARTITIONS}},
                "rebalances_started": self.rebalances, "worker_failpoints_fired": self.worker_failpoints_fired,
                "faults": self.faults}


def cover_schedule(rng: random.Random, kinds=FAULTS) -> list[tuple[str, str | None]]:
    """(kind, failpoint or None): every kind, each failpoint kind once per failpoint, shuffled."""
    deck = [(kind, point) for kind in kinds for point in POINTS.get(kind, (None,))]
    rng.shuffle(deck)
    return deck


class Chaos:
    """``faults`` faults drawn by weight, or with ``cover`` the :func:`cover_schedule` (``faults`` unused).
    With ``partitions`` the cluster runs on emulated hosts with an etcd of its own (``etcd`` unused)
    and the faults include PARTITIONS."""

    def __init__(self, workdir: Path, etcd, seed: int, faults: int = 0, log=print, keep_checkpoints: bool = False,
                 rebalance: bool = False, cover: bool = False, partitions: bool = False,
                 host_aggregation: bool = False):
        self.host_aggregation = host_aggregation
        self.worker_failpoints = WORKER_FAILPOINTS + (HOST_GROUP_FAILPOINTS if host_aggregation else ())
        self.keep_checkpoints = keep_checkpoints  # every chain kept: a divergence can be found step by step
        self.rebalance = rebalance
        self.partitions = partitions
        self.kinds = {**FAULTS, **PARTITIONS} if partitions else dict(FAULTS)
        self.rng = random.Random(seed)
        self.workdir = workdir
        self.etcd = etcd
        self.cover = cover
        self.schedule = cover_schedule(self.rng, self.kinds) if cover else None
        self.n_faults = len(self.schedule) if cover else faults
        self.log = log
        self.steps = (12 + sum(STEP_ROOM.get(kind, 3) for kind, _ in self.schedule) if cover
                      else 3 * faults + 12)
        self.report = Report(seed, steps=self.steps)
        self.job = f"chaos-{seed}"
        self.held = workdir / "failpoints"   # the workers pause before each step they are not allowed yet
        self.allowed = 0
        self.armed: dict[int, tuple[str, int]] = {}   # rank -> (worker failpoint, step) its process has

    # -- cluster ---------------------------------------------------------------------------
    def start(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        # on emulated hosts (partitions) each daemon is placed on its own: the first argument
        placed = (lambda host: (host,)) if self.partitions else (lambda host: ())
        if self.partitions:
            self.etcd = cluster.start_etcd("etcd")
        for i in range(2):
            cluster.add_dispatcher(*placed(f"disp{i}"), state_store=self.etcd.url,
                                   state_prefix=f"/chaos-{self.report.seed}",
                                   leader_lease_timeout=LEASE, heartbeat_timeout=HEARTBEAT_TIMEOUT,
                                   heartbeat_interval=0.5, wait=False,
                                   **({"rebalance_interval": REBALANCE_INTERVAL, "heat_half_life": 1.0}
                                      if self.rebalance else {}))
        for h in cluster.dispatchers:
            cluster.wait_ready(h)
        cluster.leader()
        self.nodes = [cluster.add_node(*placed(f"ps{i}"), node_id=f"ps{i}", wait=False,
                                       checkpoint_dir=str(self.workdir / f"ps{i}-ckpt"), checkpoint_every_steps=5,
                                       **({"checkpoint_keep": 10_000} if self.keep_checkpoints else {}))
                      for i in range(3)]
        for h in self.nodes:
            cluster.wait_ready(h)
        cluster.wait_for_nodes(3, timeout=60)
        self.allow(3)
        self.workers = {r: w for r, w in enumerate(train_model.start_workers(
            cluster.address, self.job, "adamw", "bsp", self.workdir, steps=self.steps, step_sleep=0.05,
            env=self.worker_env(), log_output=True, wrap=self.wrap))}

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        """Where worker ``rank`` runs: its own host with partitions, here otherwise."""
        return self.cluster.on_host(f"w{rank}", argv) if self.partitions else argv

    def worker_env(self, failpoint: str = "") -> dict:
        """A worker's environment: held before each step not allowed yet; ``failpoint``: one more
        SHARDLINE_FAILPOINTS entry."""
        return {**train_model.held_env(self.held, also=failpoint), "SHARDLINE_TEST_LOG_LEVEL": "INFO",
                **(self.cluster.worker_env if self.partitions else {}),
                **({"SHARDLINE_TEST_HOST_AGGREGATION": "1"} if self.host_aggregation else {})}

    def allow(self, steps: int) -> None:
        """Let training run up to ``steps`` (each fault gets a few steps around it)."""
        self.allowed = min(steps, self.steps)
        train_model.allow(self.held, self.allowed)

    def progress(self) -> int:
        return min(train_model.steps_done(p) for _, _, p in self.workers.values())

    def restart_worker(self, rank: int, failpoint: str = "") -> None:
        if self.cover and rank in self.armed:
            self.let_fire(rank)  # cover: every failpoint fires; killing its worker first would disarm it
        proc = self.workers[rank][0]
        if proc.poll() is None:
            proc.kill()
        if proc.wait() == 137 and rank in self.armed:   # failpoints exit 137, a SIGKILL -9
            self.report.worker_failpoints_fired.append(self.armed[rank][0])
        self.armed.pop(rank, None)
        (self.workers[rank],) = train_model.start_workers(self.cluster.address, self.job, "adamw", "bsp",
                                                          self.workdir, steps=self.steps, ranks=[rank],
                                                          env=self.worker_env(failpoint), step_sleep=0.05,
                                                          log_output=True, wrap=self.wrap)

    def let_fire(self, rank: int, timeout: float = 20.0) -> None:
        """Let training reach the step of ``rank``'s armed failpoint; wait up to ``timeout`` s for it."""
        proc, (_, at) = self.workers[rank][0], self.armed[rank]
        self.allow(max(self.allowed, at + 1))
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline and self.progress() < self.steps:
            self.revive_workers()  # the other rank's failpoint may fire first
            time.sleep(0.05)

    def wait_serving(self, n: int = 3) -> None:
        self.cluster.wait_for_nodes(n, timeout=RECOVERY_TIMEOUT)

    def revive_workers(self) -> None:
        """Start again (unarmed) a worker whose failpoint fired; a worker that failed is an error."""
        for rank, entry in self.workers.items():
            proc = entry[0]
            if proc.poll() not in (None, 0, 137):
                raise AssertionError(f"worker {rank} failed (exit {proc.returncode}):\n"
                                     f"{train_model.worker_output(entry)[-3000:]}")
            if proc.poll() == 137:
                self.restart_worker(rank)

    def wait_step_after(self, step: int, started: float) -> float:
        deadline = started + RECOVERY_TIMEOUT
        while self.progress() <= step:
            self.revive_workers()
            if self.progress() >= self.steps:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"no step applied within {RECOVERY_TIMEOUT:g} s of the fault (at step {step})")
            time.sleep(0.02)
        return time.monotonic() - started

    # -- faults ----------------------------------------------------------------------------
    def inject(self) -> dict:
        if self.schedule:
            kind, point = self.schedule.pop(0)
        else:
            kind, point = self.rng.choices(list(self.kinds), weights=list(self.kinds.values()))[0], None
        self.not_reached = False
        at = self.progress()
        self.allow(at + 3)  # the fault lands while these steps run
        started = time.monotonic()
        self.fault_started, self.stepped_during = (at, started), None
        detail = getattr(self, f"_{kind}")(*([point] if point else []))
        recovery = (self.stepped_during if self.stepped_during is not None
                    else self.wait_step_after(at, started) if self.progress() < self.steps else None)
        if self.not_reached:  # the armed point never came: no fault, no recovery to time
            recovery = None
        return {"kind": kind, "detail": detail, "at_step": at, "recovery_seconds": recovery,
                "injected": not self.not_reached}

    def _pick_node(self):
        return self.rng.choice(self.nodes)

    def _ps_kill9(self) -> str:
        node = self._pick_node()
        self.cluster.kill(node)
        self.cluster.wait_for_node_state(node.node_id, "dead", timeout=RECOVERY_TIMEOUT)
        self.cluster.restart(node, wait=True)
        return node.node_id

    def _ps_restart(self) -> str:
        node = self._pick_node()
        self.cluster.restart(node, wait=True)
        return node.node_id

    def _ps_failpoint(self, point: str | None = None) -> str:
        node = self._pick_node()
        point = point or self.rng.choice(PS_FAILPOINTS)
        at = self.progress() + self.rng.randint(1, 3)
        # ps.after_apply fires at that step; a checkpoint failpoint at the node's next checkpoint
        placed = node.env   # (an emulated host's namespace: kept)
        node.env = {**(placed or {}), "SHARDLINE_FAILPOINTS": f"{point}@{at}" if point == "ps.after_apply" else point}
        self.cluster.restart(node, wait=True)
        node.env = placed
        # The point fires only on a node in the ring (it applies, it checkpoints): wait for the
        # rejoin before letting training on, or the steps it names may go by first.
        def rejoined(status) -> bool:
            self.revive_workers()  # a worker armed by the previous fault may die meanwhile
            return not node.alive() or (not status.routing.pending_epoch and any(
                n.node_id == node.node_id for n in status.routing.nodes))

        self.cluster.wait_until(rejoined, RECOVERY_TIMEOUT, f"{node.node_id} to rejoin the ring")
        self.allow(self.progress() + 13)  # past the step and past the next checkpoints (every 5)
        deadline = time.monotonic() + 20
        while node.alive() and time.monotonic() < deadline and self.progress() < self.steps:
            self.revive_workers()  # a worker armed by the previous fault may die meanwhile
            time.sleep(0.05)
        if node.alive():   # not reached: disarm it
            self.cluster.restart(node, wait=True)
            self.not_reached = True
            return f"{node.node_id} {point}@{at} (not reached)"
        self.cluster.wait_for_node_state(node.node_id, "dead", timeout=RECOVERY_TIMEOUT)
        self.cluster.restart(node, wait=True)
        return f"{node.node_id} {point}@{at}"

    def _pause(self, handle, low: float, high: float) -> float:
        """SIGSTOP ``handle`` for a random time in [low, high] s, then SIGCONT; returns the time."""
        pause = self.rng.uniform(low, high)
        self.cluster.kill(handle, signal.SIGSTOP)
        time.sleep(pause)
        self.cluster.kill(handle, signal.SIGCONT)
        return pause

    def _ps_stop(self) -> str:
        node = self._pick_node()
        return f"{node.node_id} {self._pause(node, 0.5, 3.5):.1f}s"

    def _worker_kill9(self) -> str:
        rank = self.rng.randrange(2)
        time.sleep(self.rng.uniform(0, 0.3))
        self.restart_worker(rank)
        return f"rank {rank}"

    def _worker_failpoint(self, point: str | None = None) -> str:
        rank = self.rng.randrange(2)
        point = point or self.rng.choice(self.worker_failpoints)
        at = self.progress() + self.rng.randint(2, 4)
        self.restart_worker(rank, failpoint=f"{point}@{at}")
        self.armed[rank] = (point, at)  # it fires when training gets there, maybe during the next faults
        return f"rank {rank} {point}@{at}"

    def _leader_kill9(self) -> str:
        leader = self.cluster.leader()
        self.cluster.kill(leader)
        self.cluster.restart(leader, wait=True)
        return leader.name

    def _leader_stop(self) -> str:
        leader = self.cluster.leader()
        return f"{leader.name} {self._pause(leader, 1.5, 3.0):.1f}s"

    def _partition(self, fault, what: str) -> str:
        """Apply ``fault(link)`` for a random PARTITION_SECONDS, then mend it. Meanwhile workers
        whose failpoint fired are started again, and a step applied during the fault is the
        fault's recovery time (training that goes on through a partition took no time to recover)."""
        seconds = self.rng.uniform(*PARTITION_SECONDS)
        at, started = self.fault_started
        fault(self.cluster.link)
        try:
            while time.monotonic() < started + seconds:
                self.revive_workers()
                if self.stepped_during is None and self.progress() > at:
                    self.stepped_during = time.monotonic() - started
                time.sleep(0.02)
        finally:
            self.cluster.link.mend()
        return f"{what} {seconds:.1f}s"

    def _leader_host(self) -> str:
        return f"disp{self.cluster.dispatchers.index(self.cluster.leader())}"

    def _ps_cut(self) -> str:
        node = self._pick_node()
        return self._partition(lambda link: link.cut(node.node_id), node.node_id)

    def _leader_cut(self) -> str:
        host = self._leader_host()
        return self._partition(lambda link: link.cut(host), host)

    def _worker_cut(self) -> str:
        rank = self.rng.randrange(2)
        return self._partition(lambda link: link.cut(f"w{rank}"), f"rank {rank}")

    def _ps_dispatcher_loss(self) -> str:
        node, leader = self._pick_node().node_id, self._leader_host()
        way = self.rng.choice(["ps-to-dispatcher", "dispatcher-to-ps", "both"])

        def fault(link) -> None:
            if way != "dispatcher-to-ps":
                link.drop(node, leader)
            if way != "ps-to-dispatcher":
                link.drop(leader, node)
        return self._partition(fault, f"{node} {way} {leader}")

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> Report:
        t0 = time.monotonic()
        make = (lambda path, **kw: EmulatedCluster(path, ["etcd", "disp0", "disp1", "ps0", "ps1", "ps2", "w0", "w1"],
                                                   **kw)) if self.partitions else LocalCluster
        with make(self.workdir / "cluster", start_timeout=90) as cluster:
            try:   # a worker paused before a step it is not allowed exits only at its pause timeout
                self.start(cluster)
                self.wait_step_after(1, time.monotonic())
                for _ in range(self.n_faults):
                    fault = self.inject()
                    self.report.faults.append(fault)
                    self.log(f"[seed {self.report.seed}] {fault['kind']:<16} {fault['detail']:<40} at step "
                             f"{fault['at_step']:>3}: next step after {fault['recovery_seconds'] or 0:.2f} s")
                    self.wait_serving()
                self.allow(self.steps)
                deadline = time.monotonic() + 600
                while self.progress() < self.steps:   # a worker armed by the last faults may still die
                    self.revive_workers()
                    if time.monotonic() > deadline:
                        raise AssertionError(f"training did not finish: at step {self.progress()} of {self.steps}")
                    time.sleep(0.05)
                results = train_model.finish_workers(list(self.workers.values()), timeout=600)
            finally:
                train_model.kill_started()   # every incarnation it started, the revived ones too
            if self.rebalance:
                self.report.rebalances = sum(h.log_path.read_text(errors="replace").count("rebalancing the ring")
                                             for h in cluster.dispatchers)
        expected = train_model.reference("adamw", self.steps, world_size=2)
        self.report.steps_lost = sum(self.steps - int(r["_version"]) for r in results)
        self.report.max_abs_diff = max((r[name] - want).abs().max().item()
                                       for r in results for name, want in expected.items())
        self.report.seconds = time.monotonic() - t0
        return self.report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (one run each)")
    ap.add_argument("--faults", type=int, default=40, help="faults per run")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="run in DIR/seed-N and keep it (daemon logs, checkpoints) instead of a temporary directory")
    ap.add_argument("--prune", action="store_true",
                    help="with --keep: prune old checkpoints as a run without --keep does (keep the logs only)")
    ap.add_argument("--cover", action="store_true",
                    help="every kind and every failpoint once (make test's schedule) instead of --faults draws")
    ap.add_argument("--rebalance", action="store_true",
                    help=f"the dispatchers rebalance the ring every {REBALANCE_INTERVAL:g} s meanwhile")
    ap.add_argument("--host-aggregation", action="store_true",
                    help="the workers aggregate their pushes as one host (host_aggregation=True) and the "
                         "host group's failpoints join the worker failpoints")
    ap.add_argument("--partitions", action="store_true",
                    help="run every daemon and worker on an emulated host and cut the network too (needs root, "
                         "iproute2 and nftables)")
    args = ap.parse_args(argv)
    reports = []
    options = dict(rebalance=args.rebalance, cover=args.cover, partitions=args.partitions,
                   host_aggregation=args.host_aggregation)
    with contextlib.nullcontext() if args.partitions else EtcdServer() as etcd:   # partitions: one per cluster
        for seed in (int(s) for s in args.seeds.split(",")):
            if args.keep:
                workdir = Path(args.keep) / f"seed-{seed}"
                workdir.mkdir(parents=True, exist_ok=False)
                report = Chaos(workdir, etcd, seed, args.faults, keep_checkpoints=not args.prune,
                               **options).run().to_dict()
            else:
                with tempfile.TemporaryDirectory(prefix=f"shardline-chaos-{seed}-") as tmp:
                    report = Chaos(Path(tmp), etcd, seed, args.faults, **options).run().to_dict()
            reports.append(report)
            print(json.dumps({k: v for k, v in report.items() if k != "faults"}, indent=1), flush=True)
    ok = all(r["steps_lost"] == 0 and r["max_abs_diff_vs_no_fault_run"] <= 1e-6 for r in reports)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"runs": reports, "ok": ok}, indent=1) + "\n")
    print("chaos:", "nothing lost, parameters equal the no-fault run" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
