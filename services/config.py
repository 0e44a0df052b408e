"""One configuration schema for the dispatcher, PS and worker daemons.

Every option is declared once, in :data:`OPTIONS`, with its type, bounds, default and help; the
three ``main`` modules build their command lines from it (:func:`add_options`) and
:func:`parse_daemon_args` resolves each option, first match wins:

1. the command-line flag (``--heartbeat-timeout 5``),
2. the environment variable ``SHARDLINE_<KEY>`` (``SHARDLINE_HEARTBEAT_TIMEOUT=5``; empty = unset),
3. the YAML file given by ``--config FILE`` (or ``SHARDLINE_CONFIG``),
4. the default.

The file is either *sectioned* -- one file for every host::

    common:     {cluster: 10.0.0.5:7000, cluster_token_file: /etc/shardline/cluster.token}  # every daemon
    dispatcher: {heartbeat_timeout: 5}
    ps:         {listen: 10.0.0.6:7100, checkpoint_dir: /var/lib/shardline/checkpoints}
    worker:     {block_elements: 262144}

each daemon reads ``common`` and its own section (its own section wins) and *validates* the other
sections too, so a typo in ``ps:`` fails on the dispatcher host as well -- or *flat*: a mapping of
one daemon's option keys. Unknown sections and keys, values of the wrong type or out of bounds are
:class:`ShardlineConfigError` naming the key, where it came from, and quoting the value.

``python -m shardline.services.config --markdown`` prints docs/configuration.md;
``python -m shardline.services.config --check FILE`` validates a file for all three daemons.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import yaml

from shardline.services.errors import ShardlineConfigError

__all__ = [
    "DAEMONS", "COMMON", "SECTIONS", "ENV_PREFIX", "Option", "OPTIONS", "options_for", "add_options",
    "parse_daemon_args", "load_config_file", "log_configuration", "require_positive_number", "parse_size",
    "render_markdown", "check_file",
]

DAEMONS = ("dispatcher", "ps", "worker")
COMMON = "common"
SECTIONS = (COMMON, *DAEMONS)
ENV_PREFIX = "SHARDLINE_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Defaults shared with the code that uses them (a unit test keeps them equal).
DEFAULT_BLOCK_ELEMENTS = 262_144            # services.blocks.DEFAULT_BLOCK_ELEMENTS: 1 MiB of fp32
MAX_BLOCK_ELEMENTS = 64 * 1024 * 1024       # services.blocks.MAX_BLOCK_ELEMENTS
DEFAULT_MAX_PAYLOAD_BYTES = 1024 ** 3       # services.frame.DEFAULT_LIMITS.max_payload_bytes
DEFAULT_SHM_RING_BYTES = 16 * 1024 ** 2     # services.transport.shm.DEFAULT_RING_BYTES


def parse_address_list(value: str, *, what: str = "cluster") -> list[str]:
    """``"a:7000,b:7000"`` -> ``["a:7000", "b:7000"]``; each must be HOST:PORT (port > 0: addresses to
    connect to); no empty entries."""
    from shardline.services.daemon import parse_host_port

    if not isinstance(value, str) or not value.strip():
        raise ShardlineConfigError(f"{what} must be HOST:PORT[,HOST:PORT...], got {value!r}")
    parts = [p.strip() for p in value.split(",")]
    if any(not p for p in parts):
        raise ShardlineConfigError(f"{what} has an empty entry: {value!r}")
    for part in parts:
        if parse_host_port(part, what=what)[1] == 0:
            raise ShardlineConfigError(f"{what} needs the dispatcher's port (port 0 only means 'pick one' when "
                                       f"binding), got {value!r}")
    if len(set(parts)) != len(parts):
        raise ShardlineConfigError(f"{what} lists an address twice: {value!r}")
    return parts


def require_positive_number(value, what: str) -> float:
    """Return ``value`` as a float if it is a finite real number > 0 (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ShardlineConfigError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


def require_nonnegative_number(value, what: str) -> float:
    """Return ``value`` as a float if it is a finite real number >= 0 (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ShardlineConfigError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


# -- sizes -----------------------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "m": 1024 ** 2, "mib": 1024 ** 2, "g": 1024 ** 3, "gib": 1024 ** 3,
    "t": 1024 ** 4, "tib": 1024 ** 4,
    "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value, what: str = "size") -> int:
    """Bytes from an integer or a string with a unit: ``1048576``, ``"64MiB"``, ``"1G"`` (K/M/G/T and
    KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            number = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
            if number == int(number):
                return int(number)
    raise ShardlineConfigError(f"{what} must be a size in bytes (an integer or a string such as '64MiB'), got {value!r}")


# -- the schema ------------------------------------------------------------------------------------

_KIND_TEXT = {
    "int": "an integer", "float": "a number", "str": "a string", "path": "a path (a string)",
    "address": "HOST:PORT", "addresses": "HOST:PORT[,HOST:PORT...]", "size": "a size in bytes",
    "bool": "true or false", "choice": "one of",
}
_METAVAR = {"int": "N", "float": "NUMBER", "str": "TEXT", "path": "PATH", "address": "HOST:PORT",
            "addresses": "HOST:PORT[,...]",
            "size": "BYTES", "bool": "BOOL"}


@dataclass(frozen=True)
class Option:
    """One configuration knob.

    ``name`` is the key in files, the argparse dest, ``--name-with-dashes`` on the command line and
    ``SHARDLINE_NAME`` in the environment. ``common`` options may also be set in the ``common:``
    section. ``default`` is a value or a ``{daemon: value}`` mapping; ``default_text`` describes a
    computed default for the docs. ``minimum``/``above``/``maximum`` bound numbers (>=, >, <=).
    """

    name: str
    kind: str
    help: str
    daemons: tuple[str, ...]
    default: Any = None
    common: bool = False
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    above: float | None = None
    maximum: float | None = None
    aliases: tuple[str, ...] = ()
    required: tuple[str, ...] = ()          # daemons that cannot start without it
    default_text: str | None = None
    unit: str = ""
    metavar: str | None = None
    note: str = ""                          # extra docs text (wiring, caveats)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def default_for(self, daemon: str | None):
        if isinstance(self.default, Mapping):
            return self.default.get(daemon)
        return self.default

    # -- conversion and validation --
    def convert(self, value, where: str, *, text: bool):
        """Validate ``value`` (a string from a flag or the environment if ``text``, else a YAML value)."""
        if value is None:
            if self.default_for(None) is None and not isinstance(self.default, Mapping):
                return None
            raise ShardlineConfigError(f"{where} must be {self._expected()}, got None")
        kind, raw = self.kind, value
        if kind == "int":
            value = self._number(value, where, text, int)
        elif kind == "float":
            value = self._number(value, where, text, float)
        elif kind == "size":
            if text and isinstance(value, str) and value.strip().isdigit():
                value = int(value.strip())
            value = parse_size(value, where)
        elif kind == "bool":
            value = _as_bool(where, value)
        else:  # string kinds
            if not isinstance(value, str):
                raise ShardlineConfigError(f"{where} must be {self._expected()}, got {value!r}")
            if kind == "choice":
                canon = {c.lower(): c for c in self.choices}
                if value.strip().lower() not in canon:
                    raise ShardlineConfigError(f"{where} must be one of {', '.join(self.choices)}, got {value!r}")
                value = canon[value.strip().lower()]
            elif kind == "address":
                from shardline.services.daemon import parse_host_port

                parse_host_port(value, what=where)
            elif kind == "addresses":
                value = ",".join(parse_address_list(value, what=where))
            elif kind in ("path", "str") and not value.strip():
                raise ShardlineConfigError(f"{where} must be a non-empty string, got {value!r}")
        self._check_bounds(value, where, raw)
        return value

    def _expected(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        return _KIND_TEXT[self.kind]

    def _number(self, value, where: str, text: bool, cls):
        if text and isinstance(value, str):
            try:
                value = cls(value.strip())
            except ValueError:
                raise ShardlineConfigError(f"{where} must be {_KIND_TEXT[self.kind]}, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (cls is int and not isinstance(value, int)):
            raise ShardlineConfigError(f"{where} must be {_KIND_TEXT[self.kind]}, got {value!r}")
        if not math.isfinite(value):
            raise ShardlineConfigError(f"{where} must be a finite number, got {value!r}")
        return cls(value)

    def _check_bounds(self, value, where: str, raw) -> None:
        """Bounds of numbers; the message quotes the value as given (``raw``)."""
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return
        value_text = repr(raw)
        if self.minimum is not None and self.maximum is not None and not self.minimum <= value <= self.maximum:
            raise ShardlineConfigError(f"{where} must be in {_num(self.minimum)}..{_num(self.maximum)}, got {value_text}")
        if self.minimum is not None and value < self.minimum:
            raise ShardlineConfigError(f"{where} must be >= {_num(self.minimum)}, got {value_text}")
        if self.above is not None and value <= self.above:
            raise ShardlineConfigError(f"{where} must be > {_num(self.above)}, got {value_text}")
        if self.maximum is not None and value > self.maximum:
            raise ShardlineConfigError(f"{where} must be <= {_num(self.maximum)}, got {value_text}")

    # -- docs --
    def type_text(self) -> str:
        if self.kind == "choice":
            return " \\| ".join(f"`{c}`" for c in self.choices)
        base = {"int": "integer", "float": "number", "str": "string", "path": "path", "address": "HOST:PORT",
                "addresses": "HOST:PORT[,HOST:PORT...]",
                "size": "bytes (`64MiB`, `1G`...)", "bool": "boolean"}[self.kind]
        bounds = []
        if self.minimum is not None and self.maximum is not None:
            bounds.append(f"{_num(self.minimum)}..{_num(self.maximum)}")
        else:
            if self.minimum is not None:
                bounds.append(f">= {_num(self.minimum)}")
            if self.above is not None:
                bounds.append(f"> {_num(self.above)}")
            if self.maximum is not None:
                bounds.append(f"<= {_num(self.maximum)}")
        if self.unit == "s":
            base = "seconds"
        return base + (f", {', '.join(bounds)}" if bounds else "")

    def default_doc(self, daemon: str | None = None) -> str:
        if self.default_text is not None:
            return self.default_text
        if isinstance(self.default, Mapping):
            if daemon is not None:
                return f"`{_show(self.default.get(daemon))}`"
            return ", ".join(f"{d}: `{_show(v)}`" for d, v in self.default.items())
        if self.default is None:
            return "required" if self.required else "unset"
        if self.kind == "size":
            return f"`{_show_size(self.default)}`"
        return f"`{_show(self.default)}`"


def _show_size(n: int) -> str:
    for unit, factor in (("TiB", 1024 ** 4), ("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _show(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


_ALL = DAEMONS
_PS_WORKER = ("ps", "worker")

OPTIONS: tuple[Option, ...] = (
    # -- common: every daemon, or the PS and the worker alike --
    Option("cluster", "addresses", "Cluster address: the dispatcher's HOST:PORT, or several dispatchers' "
           "separated by commas (they share an etcd state store; clients follow the leader). A dispatcher "
           "reads it only in the rack-cache role (cache_bytes): the main dispatchers it registers with.", _ALL,
           common=True, required=_PS_WORKER),
    Option("cluster_token_file", "path", "File holding the shared cluster token (at least 16 printable bytes; "
           "`shardline up` generates one). A PS with a token admits only data-plane clients that prove they hold "
           "it (HMAC challenge); workers answer the challenge with it; every daemon's gRPC calls (but the health "
           "service) must carry it as `authorization: Bearer` metadata. Unset: no authentication, so a daemon "
           "then binds only loopback addresses unless allow_insecure is set.", _ALL, common=True),
    Option("allow_insecure", "bool", "Let a daemon without a cluster token bind a non-loopback address "
           "(listen, data_listen, metrics). It logs a WARNING at start and `shardline status` shows it: anyone "
           "who reaches the address can read and change every job. Without it such a daemon refuses to start "
           "(exit code 2). Only for a network you trust.", _ALL, default=False, common=True),
    Option("tls_cert_file", "path", "PEM certificate (chain) of this daemon's gRPC server: with tls_key_file, "
           "gRPC speaks TLS (the token travels encrypted). Needs tls_ca_file too (daemons call each other). "
           "The data plane and metrics are not encrypted.", _ALL, common=True),
    Option("tls_key_file", "path", "PEM private key of tls_cert_file (keep it 0600).", _ALL, common=True),
    Option("tls_ca_file", "path", "PEM CA bundle this daemon's gRPC clients verify servers with (the dispatcher, "
           "PS nodes): set, every outgoing gRPC channel uses TLS. Clients in training scripts and the CLI read "
           "`SHARDLINE_TLS_CA_FILE`.", _ALL, common=True),
    Option("log_level", "choice", "Lowest level logged: DEBUG shows per-request events, INFO only "
           "lifecycle and cluster events.", _ALL, default="INFO", common=True, choices=LOG_LEVELS),
    Option("log_format", "choice", "Log lines on stdout: `text` (one readable line per event) or `json` "
           "(one JSON object per line: ts, level, component, logger, msg and event fields).", _ALL,
           default="text", common=True, choices=("text", "json")),
    Option("rpc_timeout", "float", "Deadline of one control-plane call to the dispatcher (a dispatcher: in the "
           "rack-cache role).", _ALL,
           default=10.0, common=True, above=0, unit="s"),
    Option("connect_timeout", "float", "How long to wait at start for the dispatcher (a dispatcher: for its "
           "etcd state_store, else it exits 1; a worker: also for its job to be created and for data-plane "
           "connections).", _ALL, default=60.0, common=True, above=0, unit="s"),
    Option("transport", "choice", "Data-plane transport: `auto` uses RDMA when a device is present, else "
           "shared memory to a PS on the same host and TCP to others; `shm` only shared memory (a PS not on "
           "this host is an error); `rdma` fails at start without a device. A dispatcher uses it in the "
           "rack-cache role.", _ALL, default="auto",
           common=True, choices=("tcp", "rdma", "auto", "shm")),
    Option("torch_threads", "int", "torch intra-op threads (PS: optimizer math, whose connection threads "
           "already run in parallel; worker: forward/backward).", _PS_WORKER, default=1, common=True,
           minimum=1, aliases=("--threads",)),
    # -- per daemon: addresses and files differ between daemons on one host --
    Option("listen", "address", "gRPC bind address (port 0 picks a free port); metrics bind on its host. "
           "Loopback by default: a non-loopback host needs cluster_token_file or allow_insecure.",
           _ALL, default={"dispatcher": "127.0.0.1:7000", "ps": "127.0.0.1:7100", "worker": "127.0.0.1:0"}),
    Option("metrics_port", "int", "Prometheus metrics port on the --listen host (0 picks a free port).",
           _ALL, default=0, minimum=0, maximum=65535, metavar="PORT"),
    Option("ready_file", "path", "Once serving, write a JSON object (pid, grpc, metrics, ...) here.", _ALL),
    # -- dispatcher --
    Option("heartbeat_timeout", "float", "Failure timeout: a PS node silent this long is declared dead and "
           "leaves the ring.", ("dispatcher",), default=5.0, above=0, unit="s"),
    Option("heartbeat_interval", "float", "Heartbeat interval the dispatcher tells PS nodes to use; must be "
           "below heartbeat_timeout.", ("dispatcher",), above=0, unit="s",
           default_text="`1`, or heartbeat_timeout / 3 if that is less"),
    Option("isolation_share", "float", "When more than this share of the PS nodes stop heartbeating together, the "
           "dispatcher suspects its own isolation and declares none of them dead (nor any worker lost) until "
           "heartbeats return (docs/architecture.md, \"Failure detection and partitions\").", ("dispatcher",),
           default=0.5, above=0, maximum=1),
    Option("isolation_timeout", "float", "Longest the dispatcher suspects its own isolation: after it, the silent "
           "nodes are declared dead (those that hold blocks no other node holds stay in the ring). 0: no limit.",
           ("dispatcher",), default=60.0, minimum=0, unit="s"),
    Option("vnodes_per_capacity", "int", "Virtual nodes on the ring per unit of node capacity.",
           ("dispatcher",), default=128, minimum=1),
    Option("state_dir", "path", "Directory of the dispatcher's durable state (jobs, node registrations, "
           "the ring epoch; SQLite in WAL mode). Created if missing. Unset (and no state_store): state lives in "
           "memory only and a restart forgets every job (a WARNING says so at start).", ("dispatcher",)),
    Option("state_store", "str", "A replicated state store instead of state_dir: `etcd://HOST:PORT[,HOST:PORT...]`. "
           "Several dispatchers on one store elect a leader through an etcd lease; the others redirect "
           "clients to it.", ("dispatcher",)),
    Option("state_prefix", "str", "Key prefix of this cluster in the state store (several clusters may share "
           "one etcd).", ("dispatcher",), default="/shardline"),
    Option("leader_lease_timeout", "float", "With state_store: a leader that cannot renew its etcd lease for "
           "this long loses leadership, and another dispatcher takes over (a lease TTL: whole seconds, >= 1; "
           "renewed every third of it).", ("dispatcher",), default=3.0, above=0, unit="s"),
    Option("advertise_address", "address", "The gRPC address other dispatchers send clients to when this one "
           "leads.", ("dispatcher",), default_text="the --listen address (its bound port)"),
    Option("replication", "int", "Copies of every block for jobs that do not choose (capped at the number of "
           "live PS nodes).", ("dispatcher",), default=2, minimum=1),
    Option("rebalance_interval", "float", "How often the leading dispatcher plans a rebalance of the ring from the "
           "PS nodes' measured load (bytes/s in + out): virtual-node counts move through a pending ring change, "
           "with hysteresis and a cool-down of one interval. 0: never.", ("dispatcher",), default=60.0, minimum=0,
           unit="s"),
    Option("reader_racks", "bool", "With rebalance_interval: every interval, keep one copy of each block of a "
           "job (replication >= 2) on the rack most of its reads come from (>= 60 %, kept down to 40 %), moved "
           "through a pending ring change (docs/architecture.md, \"Reader racks\").", ("dispatcher",),
           default=False),
    Option("heat_half_life", "float", "Half-life of the dispatcher's access heatmap (`shardline status --hot`, "
           "rebalancing): older accesses weigh half as much per half-life.", ("dispatcher",), default=30.0,
           above=0, unit="s"),
    # -- PS --
    Option("node_id", "str", "Node id on the ring (keep it stable across restarts).", ("ps",),
           default_text="host name and data port"),
    Option("rack", "str", "Rack of this daemon. PS: replicas go to distinct racks when possible; worker: its "
           "pulls go through the rack's cache (L2) when one is registered, else straight to the PS nodes; "
           "dispatcher: with cache_bytes, the rack whose readers this cache serves.", ("dispatcher", "ps", "worker"),
           default={"ps": "default"}, default_text="ps: `default`; worker: unset (no rack cache)"),
    Option("capacity", "float", "Relative weight of this node on the ring.", ("ps",), default=1.0, above=0),
    Option("data_listen", "address", "Data-plane bind address (a dispatcher: in the rack-cache role).",
           ("dispatcher", "ps"),
           default_text="the --listen host, a free port"),
    Option("max_payload_bytes", "size", "Largest data-plane frame payload the node accepts; bigger frames "
           "get TOO_LARGE and the connection is closed.", ("ps",), default=DEFAULT_MAX_PAYLOAD_BYTES, above=0),
    Option("payload_timeout", "float", "A data-plane frame's header and payload must arrive within this long of "
           "its first byte (and a reply must be taken within it); a peer that stalls is dropped and what its "
           "frame reserved is freed.", ("ps",), default=60.0, above=0, unit="s"),
    Option("max_inflight_bytes", "size", "Bound on the bytes of payload buffers all data-plane connections of "
           "the node hold at once; a frame that would exceed it waits up to payload_timeout, then gets "
           "RESOURCE_EXHAUSTED (its client retries). At least max_payload_bytes.", ("ps",),
           default=4 * 1024 ** 3, above=0),
    Option("delta_history_bytes", "size", "Bound on the bf16 block images the node keeps of what it sent to "
           "weight subscribers, the bases of element-level deltas (docs/architecture.md, \"Weight subscribers\"); "
           "a subscriber whose base is no longer held gets dense blocks. 0 = keep none.", ("ps",),
           default=256 * 1024 ** 2, minimum=0),
    Option("malloc", "choice", "How the node's C allocator (glibc malloc) gives freed memory back: `bounded` "
           "maps every allocation of 128 KiB or more on its own (freed: back to the kernel at once) and keeps two "
           "arenas; `system` leaves glibc's defaults (a freed buffer of a step may stay in the process). "
           "MALLOC_MMAP_THRESHOLD_ and MALLOC_ARENA_MAX in the environment win over either (docs/operations.md, "
           "\"Memory\").", ("ps",), default="bounded", choices=("bounded", "system")),
    Option("frozen_values", "choice", "Where the node keeps frozen tensors' values (a LoRA job's base): `files` "
           "in one unnamed file per job in `spill_dir`, mapped and served from the page cache, out of the "
           "process's resident set between reads; `memory` in the process heap.", ("ps",), default="files",
           choices=("files", "memory")),
    Option("spill_dir", "path", "Directory of the node's frozen-value files (unnamed: freed when the node "
           "exits, however it exits; never read by a later process). Created if missing and checked writable at "
           "start. A tmpfs keeps them in memory, as shared memory.", ("ps",), default="/var/tmp"),
    Option("shm_ring_bytes", "size", "Size of the shared-memory ring the node sends through on each shm "
           "data-plane connection (transport auto/shm, local peers): it bounds the node's shared memory to "
           "this times the open shm connections.", ("ps",), default=DEFAULT_SHM_RING_BYTES, minimum=64 * 1024,
           maximum=1024 ** 3),
    Option("max_connections", "int", "Most data-plane connections the node keeps open; further ones are "
           "answered RESOURCE_EXHAUSTED and closed (metric shardline_ps_dataplane_connections_refused_total).",
           ("ps",), default=1024, minimum=1),
    Option("replica_check_interval", "int", "Every N applied steps a primary's copy holders that replay gradients "
           "compare a checksum of each block they stepped (value and optimizer state) with the primary's; a holder "
           "that differs is resynced with a full copy (metric shardline_ps_replica_divergence_total, a WARNING). "
           "0 = no check.", ("ps",), default=100, minimum=0),
    Option("checkpoint_dir", "path", "Directory of this node's checkpoints (safetensors + JSON manifests, "
           "one folder per job). Created if missing and checked writable at start; the node restores every "
           "job found there before it serves. Unset: no checkpoints, a restart loses the node's blocks.",
           ("ps",)),
    Option("checkpoint_every_steps", "int", "Checkpoint each job every N applied steps (a job may set its "
           "own at creation); 0 = only on demand (`shardline checkpoint`) and at a graceful stop.", ("ps",),
           default=0, minimum=0),
    Option("checkpoint_full_every", "int", "Write a full checkpoint after this many incremental ones "
           "(incrementals hold only the blocks changed since the previous checkpoint); bounds the chain a "
           "restore replays.", ("ps",), default=10, minimum=0),
    Option("checkpoint_keep", "int", "Keep the newest N full checkpoint chains of each job (older ones "
           "are deleted, except what the cluster's consistent step still needs).", ("ps",),
           default=2, minimum=1),
    # -- worker --
    Option("job", "path", "Job file (YAML) to train.", ("worker",), required=("worker",)),
    Option("rank", "int", "This worker's rank.", ("worker",), minimum=0, default_text="`$RANK`, else 0"),
    Option("world_size", "int", "Number of workers of the job.", ("worker",), minimum=1,
           default_text="`$WORLD_SIZE`, else 1"),
    Option("steps", "int", "Override train.steps of the job file.", ("worker",), minimum=1,
           default_text="the job file's"),
    Option("result_file", "path", "Write the training result here as JSON.", ("worker",)),
    Option("pull_timeout", "float", "How long one step may wait for the slowest worker (server-side pull "
           "wait).", ("worker",), default=600.0, above=0, unit="s"),
    Option("straggler_warning_seconds", "float", "A step still waiting this long for other workers logs a "
           "WARNING on every waiting worker naming the ranks that have not committed it and the PS nodes "
           "waiting for them, then again at doubling intervals (up to 5 min); the pull_timeout error names "
           "them too. 0 = no warning.", ("worker",), default=30.0, minimum=0, unit="s"),
    Option("recovery_timeout", "float", "How long a worker waits for a PS node that failed (restart, failover "
           "to a replica) before it gives up.", ("worker",), default=120.0, above=0, unit="s"),
    Option("block_elements", "int", "Block size, in fp32 elements, of jobs this worker creates (262144 = "
           "1 MiB); a job keeps the block size it was created with.", ("worker",),
           default=DEFAULT_BLOCK_ELEMENTS, minimum=1, maximum=MAX_BLOCK_ELEMENTS),
    Option("cache_bytes", "size", "Worker: bound on its L1 cache. The client caches every tensor of its "
           "job in full (fp32; pulls land in the model's parameters), so a job whose tensors need more "
           "fails at start with exit code 2 instead of running out of memory. 0 = no bound. Dispatcher: > 0 "
           "runs it as the rack cache (L2) of `rack` for the main dispatchers `cluster`, holding at most this "
           "many bytes of blocks; 0 = a main dispatcher.", ("dispatcher", "worker"),
           default=0, minimum=0),
    Option("prefetch_window", "int", "Steps the parameter pull may run behind `step()`: 0, `step()` "
           "returns with the new version; 1, it returns after the commit and the pull overlaps the "
           "preparation of the next batch until the next forward pass needs the parameters (a fast BSP "
           "worker stops waiting idle for the slowest). BSP allows no more.", ("worker",),
           default=0, minimum=0, maximum=1),
    Option("progress", "choice", "Progress display on stderr: redrawn line (tty), periodic lines (plain), "
           "none (off), or tty when stderr is a terminal (auto).", ("worker",), default="auto",
           choices=("auto", "tty", "plain", "off")),
    Option("summary", "choice", "At the end print the result with sample answers (full) or only the "
           "`done:` line.", ("worker",), default="full", choices=("full", "line")),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def options_for(daemon: str) -> list[Option]:
    if daemon not in DAEMONS:
        raise ValueError(f"unknown daemon {daemon!r}")
    return [o for o in OPTIONS if daemon in o.daemons]


def _as_bool(what: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ShardlineConfigError(f"{what} must be true or false, got {value!r}")


# -- command line ----------------------------------------------------------------------------------

def add_options(parser: argparse.ArgumentParser, daemon: str) -> None:
    """Declare ``daemon``'s options (and ``--config``) on ``parser`` from the schema.

    Values stay unparsed strings until :func:`parse_daemon_args`, which validates them like values
    from the environment or a file; absent flags are absent from the namespace (so sources can be told apart).
    """
    declared = {}
    for opt in options_for(daemon):
        metavar = opt.metavar or ("{" + ",".join(opt.choices) + "}" if opt.kind == "choice"
                                  else "SECONDS" if opt.unit == "s" else _METAVAR[opt.kind])
        if daemon in opt.required:
            default = "required"
        elif isinstance(opt.default, Mapping):
            default = f"default: {opt.default_for(daemon)}"
        else:
            default = f"default: {opt.default_doc(daemon)}"
        help_text = f"{opt.help} ({default}; env {opt.env})".replace("`", "").replace("%", "%%")
        # A bare boolean flag means true (``--allow-insecure``); ``--allow-insecure false`` also works.
        extra = {"nargs": "?", "const": "true"} if opt.kind == "bool" else {}
        parser.add_argument(opt.flag, *opt.aliases, dest=opt.name, default=argparse.SUPPRESS, metavar=metavar,
                            help=help_text, **extra)
        declared[opt.name] = opt
    parser.add_argument("--config", metavar="FILE", default=None,
                        help=f"YAML config file (env {ENV_PREFIX}CONFIG); see docs/configuration.md")
    parser._shardline_daemon = daemon  # type: ignore[attr-defined]
    parser._shardline_options = declared  # type: ignore[attr-defined]


# Parser options that never come from the environment or a file.
_NOT_CONFIGURABLE = {"config", "help"}


def _given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    given = set()
    for action in parser._actions:  # argparse has no public API for "was this flag given"
        for opt in action.option_strings:
            if any(tok == opt or tok.startswith(opt + "=") for tok in argv):
                given.add(action.dest)
    return given


def _option_from_action(action: argparse.Action, daemon: str | None) -> Option:
    """An Option for a flag a main declared directly on its parser (not in the schema)."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        kind = "bool"
    else:
        kind = {int: "int", float: "float", None: "str", str: "str"}.get(action.type, "str")
    if action.choices is not None and kind == "str":
        return Option(action.dest, "choice", action.help or "", (daemon,) if daemon else DAEMONS,
                      default=action.default, choices=tuple(map(str, action.choices)))
    return Option(action.dest, kind, action.help or "", (daemon,) if daemon else DAEMONS, default=action.default)


def parse_daemon_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, *,
                      env_prefix: str = ENV_PREFIX, daemon: str | None = None,
                      environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` and resolve every option: flag > ``SHARDLINE_*`` environment > file > default.

    The namespace also carries ``config`` (the file used, or None), ``config_sources``
    (``{key: "flag" | "env SHARDLINE_X" | "file common.x" | "default"}``) and ``config_warnings``
    (messages to log once logging is set up, see :func:`log_configuration`).
    Raises ShardlineConfigError naming the key and quoting the value.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    daemon = daemon or getattr(parser, "_shardline_daemon", None)
    schema: dict[str, Option] = dict(getattr(parser, "_shardline_options", {}))
    args = parser.parse_args(argv)
    tokens_given = _given_on_command_line(parser, argv)

    options: dict[str, Option] = {}
    for action in parser._actions:
        if action.option_strings and action.dest not in _NOT_CONFIGURABLE and action.dest != argparse.SUPPRESS:
            options[action.dest] = schema.get(action.dest) or _option_from_action(action, daemon)

    sources: dict[str, str] = {}
    for dest, opt in options.items():
        if dest in schema:
            if hasattr(args, dest):  # schema flags default to SUPPRESS: present means given
                setattr(args, dest, opt.convert(getattr(args, dest), f"{opt.flag} ({dest})", text=True))
                sources[dest] = "flag"
        elif dest in tokens_given:
            sources[dest] = "flag"

    config_path = getattr(args, "config", None) or environ.get(env_prefix + "CONFIG") or None
    file_values = load_config_file(config_path, daemon, options) if config_path else {}

    for dest, opt in options.items():
        if dest in sources:
            continue
        env_name = env_prefix + dest.upper()
        raw = environ.get(env_name)
        if raw not in (None, ""):
            setattr(args, dest, opt.convert(raw, f"{env_name} in the environment", text=True))
            sources[dest] = f"env {env_name}"
        elif dest in file_values:
            value, where = file_values[dest]
            setattr(args, dest, value)
            sources[dest] = where
        elif dest in schema:
            setattr(args, dest, opt.default_for(daemon))
            sources[dest] = "default"
        else:
            sources[dest] = "default"  # argparse already set the parser's default

    for dest, opt in schema.items():
        if daemon in opt.required and getattr(args, dest) is None:
            raise ShardlineConfigError(
                f"{dest} is required: give {opt.flag}, set {opt.env} or put {dest} in the config file")

    args.config = config_path
    args.config_sources = sources
    args.config_warnings = _unknown_env_warnings(environ, env_prefix)
    return args


def _unknown_env_warnings(environ: Mapping[str, str], env_prefix: str) -> list[str]:
    # PARENT_PID: set by supervisors for services.daemon.arm_parent_death_signal; FAILPOINTS(_DIR):
    # fault tests (services/failpoints.py). Not options.
    known = {env_prefix + o.name.upper() for o in OPTIONS} | {env_prefix + "CONFIG", env_prefix + "PARENT_PID",
                                                             env_prefix + "FAILPOINTS", env_prefix + "FAILPOINTS_DIR"}
    warnings = []
    for name in sorted(environ):
        if name.startswith(env_prefix) and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            warnings.append(f"ignoring environment variable {name}: not a Shardline option{hint}")
    return warnings


# -- files -----------------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _value in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        except TypeError:  # unhashable key: construct_mapping reports it
            pass
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            loaded = yaml.load(fh, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except OSError as exc:
        raise ShardlineConfigError(f"cannot read --config {path!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ShardlineConfigError(f"--config {path!r} is not valid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ShardlineConfigError(f"--config {path!r} must hold a mapping of sections or option keys, "
                                   f"got {type(loaded).__name__}")
    return loaded


def _unknown_key(key, where: str, allowed: Iterable[str], hint: str = "") -> ShardlineConfigError:
    allowed = sorted(allowed)
    close = difflib.get_close_matches(str(key), allowed, n=1)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    return ShardlineConfigError(f"unknown key {key!r} in {where}{suggestion}{hint}. Known keys: {', '.join(allowed)}")


def _placement_hint(name: str, section: str | None) -> str:
    """Why a known option is not accepted here, if it is an option somewhere else."""
    opt = BY_NAME.get(name)
    if opt is None:
        return ""
    homes = [d for d in opt.daemons]
    if section == COMMON:
        return f" ({name!r} differs per daemon: put it under {', '.join(h + ':' for h in homes)})"
    return f" ({name!r} is an option of {', '.join(homes)}{', or of common:' if opt.common else ''})"


def load_config_file(path: str, daemon: str | None, own: Mapping[str, Option] | None = None) -> dict[str, tuple[Any, str]]:
    """Read and validate ``path``; return ``{key: (value, source)}`` for ``daemon``.

    ``own`` are the options of ``daemon`` (default: its schema options); every section is validated,
    also those of the other daemons.
    """
    if own is None:
        own = {o.name: o for o in options_for(daemon)} if daemon else {}
    data = _read_yaml(path)
    where_file = f"--config {path!r}"
    keys = [str(k) for k in data]
    if not any(k in SECTIONS for k in keys):  # a flat file of this daemon's keys
        values = {}
        for key, value in data.items():
            name = str(key).replace("-", "_")
            opt = own.get(name)
            if opt is None:
                raise _unknown_key(key, where_file, own, _placement_hint(name, daemon))
            values[name] = (opt.convert(value, f"{name} in {where_file}", text=False), f"file {name}")
        return values

    common_values, own_values = {}, {}
    for key, body in data.items():
        section = str(key)
        if section not in SECTIONS:
            hint = ""
            if section.replace("-", "_") in BY_NAME:
                opt = BY_NAME[section.replace("-", "_")]
                homes = ([COMMON] if opt.common else []) + list(opt.daemons)
                hint = f" (in a sectioned file put {section!r} under {' or '.join(h + ':' for h in homes)})"
            raise ShardlineConfigError(f"unknown section {section!r} in {where_file}{hint}; "
                                       f"sections are {', '.join(SECTIONS)}")
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ShardlineConfigError(f"section {section!r} in {where_file} must be a mapping of option keys, "
                                       f"got {body!r}")
        if section == COMMON:
            allowed = {o.name: o for o in OPTIONS if o.common}
        elif section == daemon:
            allowed = dict(own)
        else:
            allowed = {o.name: o for o in options_for(section)}
        for k, value in body.items():
            name = str(k).replace("-", "_")
            opt = allowed.get(name)
            if opt is None:
                raise _unknown_key(k, f"section {section!r} of {where_file}", allowed, _placement_hint(name, section))
            converted = opt.convert(value, f"{section}.{name} in {where_file}", text=False)
            if section == COMMON and name in own:
                common_values[name] = (converted, f"file {COMMON}.{name}")
            elif section == daemon:
                own_values[name] = (converted, f"file {section}.{name}")
    return {**common_values, **own_values}


def check_file(path: str) -> dict[str, dict[str, Any]]:
    """Validate ``path`` for every daemon; return ``{daemon: {key: value}}`` of what each would read."""
    return {d: {k: v for k, (v, _src) in load_config_file(path, d).items()} for d in DAEMONS}


# -- reporting -------------------------------------------------------------------------------------

def log_configuration(logger: logging.Logger, args: argparse.Namespace) -> None:
    """Log the configuration warnings, one INFO line with the values taken from the environment or
    the file (flags are visible on the command line), and one DEBUG line with every non-default value."""
    for message in getattr(args, "config_warnings", []):
        logger.warning(message)
    sources = getattr(args, "config_sources", {})
    config_file = getattr(args, "config", None)

    def listing(keys) -> str:
        return " ".join(f"{k}={getattr(args, k, None)!s} ({sources[k]})" for k in sorted(keys))

    external = [k for k, src in sources.items() if src.startswith(("env ", "file "))]
    if external or config_file:
        logger.info("configuration: %s%s", f"file {config_file}, " if config_file else "",
                    listing(external) or "no values from the file")
    logger.debug("configuration (every non-default value): %s",
                 listing(k for k, src in sources.items() if src != "default") or "all defaults")


# -- docs ------------------------------------------------------------------------------------------

_DOC_HEAD = """\
# Configuration

<!-- Generated by `python -m shardline.services.config --markdown > docs/configuration.md`; do not edit by hand.
     tests/unit/test_config.py fails when this page and services/config.py disagree. -->

Every option of the three daemons (`shardline-dispatcher`, `shardline-ps`, `shardline-worker`) is
declared once, in `services/config.py`, and can be given four ways. The first that is set wins:

1. a command-line flag: `--heartbeat-timeout 5`
2. an environment variable `SHARDLINE_<KEY>`: `SHARDLINE_HEARTBEAT_TIMEOUT=5` (an empty value counts as
   unset; this is the form systemd `EnvironmentFile=`s use, see `deploy/env/`)
3. the YAML file given by `--config FILE` or `SHARDLINE_CONFIG=FILE`
4. the default listed below.

## The file

One file can configure every daemon, so the same `/etc/shardline/shardline.yaml` can ship to every
host (example: `deploy/shardline.yaml`):

```yaml
common:                      # read by every daemon
  cluster: 10.0.0.5:7000
  cluster_token_file: /etc/shardline/cluster.token   # needed to bind non-loopback addresses
  log_format: json
dispatcher:
  listen: 0.0.0.0:7000       # default 127.0.0.1:7000
  heartbeat_timeout: 5
ps:
  listen: 0.0.0.0:7100
  checkpoint_dir: /var/lib/shardline/checkpoints
worker:
  block_elements: 262144
```

Each daemon reads `common:` and its own section (its own section wins over `common:`), and validates
the other sections too: a typo anywhere in the file stops every daemon at start, not only the one it
concerns. Keys in `common:` that a daemon does not use (`cluster` for the dispatcher) are ignored by
it. A file without sections is read as a flat mapping of one daemon's keys (`heartbeat_timeout: 5`).

Validation happens before anything starts (cross-checks too: `heartbeat_interval` must be below
`heartbeat_timeout`, a worker's `rank` below its `world_size`). An unknown section or key, a value of the wrong type or
out of bounds, or a duplicate key stops the daemon with exit code 2 and a message that names the key,
where it came from and the bad value, for example:

```
shardline-ps: error: ps.capacity in --config '/etc/shardline/shardline.yaml' must be > 0, got 0
shardline-dispatcher: error: unknown key 'heartbeat_timout' in section 'dispatcher' of --config '/etc/shardline/shardline.yaml' (did you mean 'heartbeat_timeout'?). Known keys: ...
```

`python -m shardline.services.config --check FILE` validates a file for all three daemons without starting
anything and prints what each daemon would read. At start every daemon logs one INFO line with the values it
took from the environment or the file and where each came from (DEBUG adds the flags), and warns
about `SHARDLINE_*` variables that are no option. Sizes take an integer number of bytes or a unit: `K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB`
are powers of 1024, `KB`/`MB`/`GB`/`TB` powers of 1000. Durations are seconds (fractions allowed).
Keys may use `-` or `_`.

Every daemon binds 127.0.0.1 unless told otherwise. A daemon that binds a non-loopback address (its
`listen`, a PS's `data_listen`, the metrics endpoint on the `listen` host) refuses to start (exit code
2) unless it has a `cluster_token_file`, or `allow_insecure: true` (a WARNING at start, and `shardline
status` shows it). TLS on gRPC: `tls_cert_file`, `tls_key_file`, `tls_ca_file`. See the Security
section of docs/operations.md.

The worker's `--rank` and `--world-size` fall back to `RANK`/`WORLD_SIZE` (as torchrun sets them) when
neither flag, `SHARDLINE_RANK`/`SHARDLINE_WORLD_SIZE` nor the file sets them.
"""


def _table(options: list[Option], *, used_by: bool, daemon: str | None = None) -> list[str]:
    head = "| Key | Flag | Environment | Type | Default | " + ("Used by | " if used_by else "") + "Description |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for o in options:
        flags = " ".join(f"`{f}`" for f in (o.flag, *o.aliases))
        desc = o.help + (f" **({o.note}.)**" if o.note else "")
        cells = [f"`{o.name}`", flags, f"`{o.env}`", o.type_text(), o.default_doc(daemon)]
        if used_by:
            cells.append(", ".join(o.daemons))
        cells.append(desc)
        lines.append("| " + " | ".join(c.replace("\n", " ") for c in cells) + " |")
    return lines


def render_markdown() -> str:
    out = [_DOC_HEAD]
    out.append("## `common:` — options every daemon, or the PS and the worker alike, read\n")
    out.append("These may be set in `common:` or in a daemon's own section.\n")
    out += _table([o for o in OPTIONS if o.common], used_by=True)
    titles = {"dispatcher": "`dispatcher:` — `shardline-dispatcher`", "ps": "`ps:` — `shardline-ps`",
              "worker": "`worker:` — `shardline-worker`"}
    for daemon in DAEMONS:
        own = [o for o in options_for(daemon) if not o.common]
        common = [o.name for o in options_for(daemon) if o.common]
        out.append(f"\n## {titles[daemon]}\n")
        out.append(f"Also reads from `common:` (or its own section): {', '.join(f'`{n}`' for n in common)}.\n")
        out += _table(own, used_by=False, daemon=daemon)
    out.append("\n`--config FILE` (`SHARDLINE_CONFIG`) names the file; it cannot be set inside a file.\n")
    out.append("\n## Logs\n")
    out.append(
        "Every daemon writes one line per event to stdout (journald-friendly; under systemd, lines carry a\n"
        "`<N>` syslog priority prefix that journald turns into the entry's priority, and no timestamp,\n"
        "which journald adds). `text`: `TIME LEVEL COMPONENT[PID] LOGGER: message key=value ...`;\n"
        "`json`: one object per line with `ts` (RFC 3339, UTC), `level`, `component`, `logger`, `msg`,\n"
        "`pid`, the event's fields and `exc` for a traceback. Newlines inside a message are escaped, so a\n"
        "traceback stays one line. At INFO a daemon logs lifecycle and cluster events (serving, node\n"
        "registered or declared dead, job created, routing changed, stopping), never one line per request;\n"
        "per-request failures are DEBUG.\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardline.services.config", description="Shardline configuration schema")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--markdown", action="store_true", help="print docs/configuration.md")
    g.add_argument("--check", metavar="FILE", help="validate FILE for every daemon and print what each reads")
    args = p.parse_args(argv)
    if args.markdown:
        sys.stdout.write(render_markdown())
        return 0
    try:
        per_daemon = check_file(args.check)
    except ShardlineConfigError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    for daemon, values in per_daemon.items():
        shown = ", ".join(f"{k}={_show(v)}" for k, v in sorted(values.items())) or "(defaults only)"
        print(f"{daemon}: {shown}")
    print(f"{args.check}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
