"""Crash-safe checkpoints of one PS node's blocks: safetensors data plus JSON manifests.

No sockets; the only threads are short-lived helpers that hash large files while
:meth:`CheckpointDir.write` writes them. A background writer takes :class:`JobSnapshot` copies at
step boundaries and hands them to :meth:`CheckpointDir.write`; a restarting node calls
:meth:`CheckpointDir.load`; :func:`read_job_tensors` assembles full tensors offline from the
directories of every node of a cluster. Nothing here unpickles or evaluates anything.

On-disk layout under ``root`` (the node's ``checkpoint_dir``)::

    NODE.json                                  {"node_id": ..., "format": 1}
    <job>/<S>.values.safetensors               "{tensor}#{index}" -> 1-D float32 value (bfloat16: frozen)
    <job>/<S>.state.safetensors                "{tensor}#{index}#{key}" -> optimizer state entry
    <job>/<S>.manifest.json                    written last: a checkpoint exists once this does

``<S>`` is the job step, zero-padded to 12 digits. Integer state entries are stored as 0-dim
int64 tensors and listed in the manifest, so they load back as Python ints. A checkpoint is
``full`` (every held block) or ``incremental`` (only blocks changed since ``base_step``, the
previous checkpoint of its chain; ``full_step`` names the chain's full checkpoint). Every
manifest lists ``held``: every block the node held at that step with its version, so a restore
knows the exact block set (a replica copy not yet carried through the step is not held there:
``JobStore.snapshot``).

Crash safety: each file goes to a temporary ``.<name>.tmp-<hex>`` in the same folder, is
fsync'ed and renamed into place; the folder is fsync'ed before and after the manifest's rename.
The sha256 of a data file is computed from the buffers being written, by helper threads while the
calling thread writes and fsyncs (hashlib releases the GIL on large buffers), so hashing overlaps
the I/O; the manifest, which holds the digests, is written only once every hash is done.
A kill at any moment leaves every earlier checkpoint loadable; temporaries and data files
without a manifest are invisible to readers and removed by the next write or retention. A failed
write (disk full, I/O error) removes what it made and raises :class:`CheckpointError`. Deletions
(``retain``, ``discard_after``) remove manifests before data files.

Concurrency: calls that modify one job (``write``, ``retain``, ``delete_job``) must be
serialized by the caller; different jobs may be handled concurrently. Readers only ever see
complete checkpoints of a concurrent ``write``; a concurrent ``retain`` may remove one under
them (it is then skipped or reported).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
import struct
import sys
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from shardline.services.blocks import DEFAULT_BLOCK_ELEMENTS, block_slices
from shardline.services.errors import ShardlineConfigError, ShardlineStateError

__all__ = [
    "FORMAT",
    "WRITE_STAGES",
    "CheckpointError",
    "BlockSnapshot",
    "JobSnapshot",
    "CheckpointInfo",
    "LoadedBlock",
    "LoadedCheckpoint",
    "CheckpointDir",
    "read_job_tensors",
]

FORMAT = 1
NODE_FILE = "NODE.json"

# Stages a write passes, in order; ``failpoint(stage)`` is called right after each (tests use it
# to capture what a crash at that moment leaves on disk).
WRITE_STAGES = (
    "values.tmp",        # values temporary written and fsync'ed (the state temporary is written too)
    "values.renamed",
    "state.tmp",
    "state.renamed",
    "data.synced",       # folder fsync'ed: both data files durable under their names
    "manifest.tmp",
    "manifest.renamed",  # the checkpoint is now visible
    "synced",            # folder fsync'ed again: the checkpoint is durable
)

_STEP_DIGITS = 12
_FILE_RE = re.compile(rf"(\d{{{_STEP_DIGITS},}})\.(values\.safetensors|state\.safetensors|manifest\.json)")
_TMP_MARK = ".tmp-"
_DELETED_PREFIX = ".deleted."
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_COPY_CHUNK = 8 << 20
# Files at least this big are hashed by a helper thread while they are written; smaller ones
# (manifests, NODE.json, small checkpoints) inline, where a thread would cost more than it saves.
_HASH_THREAD_MIN_BYTES = 4 << 20
# The helper hashes at most this much per call, so a cancelled hash stops soon.
_HASH_CHUNK = 8 << 20
# A single write(2) on Linux moves at most 0x7ffff000 bytes.
_MAX_WRITE = 1 << 30

# torch dtype <-> safetensors dtype name (the subset a PS state can reasonably hold).
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
# A block's value: float32, or bfloat16 for a frozen tensor stored in its own dtype.
VALUE_DTYPES = (torch.float32, torch.bfloat16)


class CheckpointError(ShardlineStateError):
    """A checkpoint cannot be written, found or trusted. The message names the path involved."""


# ---------------------------------------------------------------------- data given and returned


@dataclass
class BlockSnapshot:
    """A private copy of one block taken at a step boundary (the writer never mutates it)."""

    tensor: str                  # no '#': it separates the parts of safetensors keys
    index: int
    version: int                 # job step that last changed the block
    value: torch.Tensor          # 1-D float32 (bfloat16: a frozen tensor stored so)
    state: dict                  # optimizer state: str -> torch.Tensor (any shape, incl. 0-dim) | int


@dataclass
class JobSnapshot:
    """What one node holds of a job at ``step``.

    ``held`` maps every block the node holds to its version. ``blocks`` is every held block when
    ``full``; otherwise only those changed (or newly held) since the checkpoint at ``base_step``.
    """

    job: str
    uid: str
    node_id: str
    epoch: int
    step: int
    spec: dict                   # JobSpec as MessageToDict(..., preserving_proto_field_name=True)
    held: dict                   # (tensor, index) -> version
    blocks: list                 # [BlockSnapshot]
    full: bool
    base_step: int | None = None


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    kind: str                    # "full" | "incremental"
    base_step: int | None
    full_step: int
    uid: str
    epoch: int
    manifest_path: str
    bytes_written: int           # both data files plus the manifest
    blocks: int                  # blocks written in this checkpoint
    created_unix_ms: int


class LoadedBlock(NamedTuple):
    version: int
    value: torch.Tensor          # 1-D float32 (bfloat16: a frozen tensor's), owns its storage
    state: dict                  # exactly the snapshotted keys and types


@dataclass
class LoadedCheckpoint:
    job: str
    step: int
    uid: str
    epoch: int
    spec: dict
    chain: list                  # steps replayed: the full checkpoint, then the incrementals
    blocks: dict                 # (tensor, index) -> LoadedBlock; exactly the target's held set
    bytes_read: int              # every byte this call read, including skipped attempts
    seconds: float
    skipped: list                # [(step, reason)] of newer checkpoints that could not be used


# ---------------------------------------------------------------------- small helpers


def _step_prefix(step: int) -> str:
    return f"{step:0{_STEP_DIGITS}d}"


def _file_names(step: int) -> tuple[str, str, str]:
    p = _step_prefix(step)
    return f"{p}.values.safetensors", f"{p}.state.safetensors", f"{p}.manifest.json"


def _parse_name(name: str) -> tuple[int, str] | None:
    """(step, "values.safetensors" | "state.safetensors" | "manifest.json") of a checkpoint file name."""
    m = _FILE_RE.fullmatch(name)
    if m is None or m.group(1) != _step_prefix(int(m.group(1))):
        return None  # not a name this module writes (padded to exactly 12 digits)
    return int(m.group(1)), m.group(2)


def _is_temporary(name: str) -> bool:
    """A file a write or claim left unfinished (see _mkstemp)."""
    return name.startswith(".") and _TMP_MARK in name


def _block_key(tensor: str, index: int) -> str:
    return f"{tensor}#{index}"


def _state_block(key: str) -> str | None:
    """The block key of state key "tensor#index#entry" (the entry itself may contain '#')."""
    parts = key.split("#", 2)
    return f"{parts[0]}#{parts[1]}" if len(parts) == 3 else None


def _parse_block_key(key: str) -> tuple[str, int]:
    tensor, sep, index = key.partition("#")
    if not tensor or not sep or not index.isdigit() or (len(index) > 1 and index[0] == "0"):
        raise ValueError(f"block key {key!r} is not 'tensor#index'")
    return tensor, int(index)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_job_name(job: str) -> str:
    # The name becomes a folder under root: one path component, not hidden (temporaries and
    # deleted jobs are dot-names), and not the node file.
    if (not isinstance(job, str) or not job or job.startswith(".") or job == NODE_FILE
            or "/" in job or "\\" in job or "\0" in job):
        raise CheckpointError(f"job name {job!r} cannot name a checkpoint folder")
    return job


def _check_byteorder() -> None:
    # Tensors are written and read as raw bytes; safetensors data is little-endian.
    if sys.byteorder != "little":
        raise CheckpointError("checkpoints are little-endian safetensors; this host is big-endian")


def _os_error(what: str, path: str, exc: OSError) -> CheckpointError:
    return CheckpointError(f"cannot {what} {path}: {exc.strerror or exc}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _os_error("fsync directory", path, exc) from None


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (safetensors data is little-endian)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, data) -> None:
    """Write all of ``data`` (a bytes-like object) to ``fd``; raises OSError (e.g. ENOSPC)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view[:_MAX_WRITE])
        view = view[n:]


def _readinto_exact(f, view: memoryview, path: str) -> None:
    while view:
        n = f.readinto(view)
        if not n:
            raise CheckpointError(f"checkpoint file {path} ends early (truncated)")
        view = view[n:]


@dataclass(frozen=True)
class _Digest:
    sha256: str
    bytes: int


# ---------------------------------------------------------------------- safetensors streaming


def _safetensors_parts(items: list[tuple[str, torch.Tensor]]) -> list:
    """Header and data buffers of a safetensors file holding ``items``, in file order.

    Tensors are laid out by descending element size so each is aligned to its element size (as
    the safetensors library does); the data is referenced, not copied.
    """
    items = sorted(items, key=lambda kv: -kv[1].element_size())  # stable: keeps given order within a size
    header: dict = {"__metadata__": {"format": "pt"}}
    views = []
    offset = 0
    for key, t in items:
        view = _bytes_view(t)
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(view)]}
        offset += len(view)
        views.append(view)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return [struct.pack("<Q", len(raw)) + raw, *views]


def _parse_safetensors_header(header, path: str, data_bytes: int) -> list[tuple[int, int, str, torch.dtype, list]]:
    """(start, stop, key, dtype, shape) of every tensor, by offset; the data must be covered exactly."""
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint file {path} has a malformed safetensors header")
    entries = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _TORCH_DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            start, stop = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"checkpoint file {path} has a malformed header entry for {key!r}") from None
        if min(shape, default=0) < 0 or stop - start != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"checkpoint file {path}: entry {key!r} has inconsistent shape and offsets")
        entries.append((start, stop, key, dtype, shape))
    entries.sort()
    offset = 0
    for start, stop, key, _, _ in entries:
        if start != offset:
            raise CheckpointError(f"checkpoint file {path}: entry {key!r} does not follow the previous one")
        offset = stop
    if offset != data_bytes:
        raise CheckpointError(f"checkpoint file {path} holds {data_bytes} data bytes, its header describes {offset}")
    return entries


def _read_safetensors(path: str, expect: _Digest, select: Callable[[str], bool], verify: bool,
                      counter: list) -> dict[str, torch.Tensor]:
    """The tensors of ``path`` whose key ``select`` accepts, each read straight into its own storage.

    The size is always checked against ``expect``; with ``verify`` every byte is hashed as it is
    read (skipped tensors too) and the sha256 compared at the end. ``counter[0]`` accumulates the
    bytes read. Errors name the file.
    """
    try:
        f = open(path, "rb", buffering=0)
    except OSError as exc:
        raise _os_error("open checkpoint file", path, exc) from None
    try:
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != expect.bytes:
                raise CheckpointError(f"checkpoint file {path} has {size} bytes, its manifest says {expect.bytes}")
            h = hashlib.sha256() if verify else None

            def take(view: memoryview) -> None:
                _readinto_exact(f, view, path)
                counter[0] += len(view)
                if h is not None:
                    h.update(view)

            head = bytearray(8)
            take(memoryview(head))
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(f"checkpoint file {path} declares a {n}-byte header in {size} bytes")
            raw = bytearray(n)
            take(memoryview(raw))
            try:
                header = json.loads(raw)
            except ValueError as exc:
                raise CheckpointError(f"checkpoint file {path} has an unparsable header: {exc}") from None
            out: dict[str, torch.Tensor] = {}
            scratch = None
            for start, stop, key, dtype, shape in _parse_safetensors_header(header, path, size - 8 - n):
                if select(key):
                    t = torch.empty(shape, dtype=dtype)
                    take(_bytes_view(t))
                    out[key] = t
                elif h is not None:
                    # Unused bytes still count towards the file's hash.
                    if scratch is None:
                        scratch = memoryview(bytearray(min(_COPY_CHUNK, size)))
                    left = stop - start
                    while left:
                        chunk = scratch[:min(left, len(scratch))]
                        take(chunk)
                        left -= len(chunk)
                else:
                    f.seek(stop - start, os.SEEK_CUR)
            if h is not None and h.hexdigest() != expect.sha256:
                raise CheckpointError(f"checkpoint file {path} has sha256 {h.hexdigest()}, its manifest says {expect.sha256}")
            return out
    except OSError as exc:
        raise _os_error("read checkpoint file", path, exc) from None


# ---------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class _Manifest:
    path: str
    size: int
    step: int
    kind: str
    base_step: int | None
    full_step: int
    uid: str
    epoch: int
    spec: dict
    created_unix_ms: int
    held: dict                   # "tensor#index" -> version
    blocks: dict                 # "tensor#index" -> {"version": int, "int_state": [keys stored as int64]}
    files: dict                  # file name -> _Digest

    def info(self) -> CheckpointInfo:
        return CheckpointInfo(self.step, self.kind, self.base_step, self.full_step, self.uid, self.epoch, self.path,
                              sum(d.bytes for d in self.files.values()) + self.size, len(self.blocks),
                              self.created_unix_ms)


def _parse_manifest(path: str, job: str, node_id: str, step: int, counter: list) -> _Manifest:
    """The manifest at ``path`` if it is a well-formed manifest of this job, node and step."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise _os_error("read manifest", path, exc) from None
    counter[0] += len(raw)
    try:
        m = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"manifest {path} is not valid JSON: {exc}") from None
    if not isinstance(m, dict):
        raise CheckpointError(f"manifest {path} is not a JSON object")
    if m.get("format") != FORMAT:
        raise CheckpointError(f"manifest {path} has format {m.get('format')!r}, expected {FORMAT}")
    if m.get("job") != job:
        raise CheckpointError(f"manifest {path} belongs to job {m.get('job')!r}, not {job!r}")
    if m.get("node_id") != node_id:
        raise CheckpointError(f"manifest {path} belongs to node {m.get('node_id')!r}, not {node_id!r}")
    try:
        if not isinstance(m["spec"], dict):
            raise ValueError("'spec' must be a JSON object")
        if m["step"] != step or not _is_int(m["step"]):
            raise ValueError(f"step {m['step']!r} does not match the file name")
        kind, base, full = m["kind"], m.get("base_step"), m["full_step"]
        if kind == "full":
            if base is not None or full != step:
                raise ValueError("a full checkpoint has no base_step and is its own full_step")
        elif kind == "incremental":
            if not (_is_int(base) and _is_int(full) and 0 <= full <= base < step):
                raise ValueError(f"base_step {base!r} / full_step {full!r} must satisfy full_step <= base_step < step")
        else:
            raise ValueError(f"kind {kind!r} is not 'full' or 'incremental'")
        held = m["held"]
        if not isinstance(held, dict) or not all(_is_int(v) for v in held.values()):
            raise ValueError("'held' must map block keys to versions")
        for key in held:
            _parse_block_key(key)
        blocks = m["blocks"]
        if not isinstance(blocks, dict) or any(held.get(k) != b.get("version") or not isinstance(b.get("int_state", []), list)
                                               for k, b in blocks.items()):
            raise ValueError("'blocks' must list held blocks with their held version")
        if kind == "full" and len(blocks) != len(held):
            raise ValueError("a full checkpoint must write every held block")
        files = {}
        for name in _file_names(step)[:2]:
            d = m["files"][name]
            if not (isinstance(d["sha256"], str) and _is_int(d["bytes"])):
                raise ValueError(f"files entry for {name} needs sha256 and bytes")
            files[name] = _Digest(d["sha256"], d["bytes"])
        return _Manifest(path, len(raw), step, kind, base, full, str(m["uid"]), int(m["epoch"]), m["spec"],
                         int(m.get("created_unix_ms", 0)), held, blocks, files)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"manifest {path} is malformed: {exc}") from None


# ---------------------------------------------------------------------- the directory


class CheckpointDir:
    """The checkpoint directory of one node. See the module docstring for the layout.

    ``CheckpointDir(root, node_id)`` creates ``root`` if needed, checks that files can be created
    there and claims it for ``node_id`` via ``NODE.json`` (a root claimed by another node is a
    :class:`CheckpointError`). :meth:`open_read_only` opens an existing root without writing.
    ``failpoint`` (tests) is called with each name of :data:`WRITE_STAGES` during a write.
    """

    def __init__(self, root: str | os.PathLike, node_id: str, *,
                 failpoint: Callable[[str], None] | None = None):
        if not isinstance(node_id, str) or not node_id:
            raise ShardlineConfigError(f"node_id must be a non-empty string, got {node_id!r}")
        _check_byteorder()
        self.root = os.path.abspath(os.fspath(root))
        self.node_id = node_id
        self.read_only = False
        self._failpoint = failpoint
        self._ensure_writable_root()
        self._claim_root()
        self._remove_deleted_jobs()

    @classmethod
    def open_read_only(cls, root: str | os.PathLike) -> CheckpointDir:
        """An existing checkpoint root, owned by whichever node its ``NODE.json`` names; writes are refused."""
        _check_byteorder()
        self = cls.__new__(cls)
        self.root = os.path.abspath(os.fspath(root))
        self.read_only = True
        self._failpoint = None
        node = self._read_node_file()
        if node is None:
            raise CheckpointError(f"{self.root} is not a checkpoint directory: it has no {NODE_FILE}")
        self.node_id = node
        return self

    def __repr__(self) -> str:
        return f"CheckpointDir({self.root!r}, node_id={self.node_id!r}{', read_only=True' if self.read_only else ''})"

    # --- root ---------------------------------------------------------------------------------
    def _ensure_writable_root(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
            # A real file creation: os.access() says yes to root and to read-only mounts.
            fd, probe = _mkstemp(self.root, ".write-probe")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise CheckpointError(f"checkpoint dir {self.root} is not a writable directory: {exc.strerror or exc}") from None

    def _read_node_file(self) -> str | None:
        path = os.path.join(self.root, NODE_FILE)
        try:
            with open(path, "rb") as f:
                node = json.loads(f.read())
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _os_error("read", path, exc) from None
        except ValueError as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(node, dict) or node.get("format") != FORMAT or not isinstance(node.get("node_id"), str):
            raise CheckpointError(f"{path} is not a format-{FORMAT} node file: {node!r}")
        return node["node_id"]

    def _claim_root(self) -> None:
        owner = self._read_node_file()
        path = os.path.join(self.root, NODE_FILE)
        if owner is None:
            data = json.dumps({"node_id": self.node_id, "format": FORMAT}).encode() + b"\n"
            tmp, _ = _write_temp(self.root, NODE_FILE, [data])
            try:
                # link(2) never replaces: of two nodes claiming one root at once, one loses.
                os.link(tmp, path)
            except FileExistsError:
                pass
            except OSError as exc:
                raise _os_error("create", path, exc) from None
            finally:
                _unlink_quietly(tmp)
            _fsync_dir(self.root)
            owner = self._read_node_file()
        if owner != self.node_id:
            raise CheckpointError(f"checkpoint dir {self.root} belongs to node {owner!r} ({path}), not to node {self.node_id!r}")

    def _remove_deleted_jobs(self) -> None:
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith(_DELETED_PREFIX):
                shutil.rmtree(path, ignore_errors=True)
            elif _is_temporary(name):
                _unlink_quietly(path)

    def _check_writable(self) -> None:
        if self.read_only:
            raise CheckpointError(f"checkpoint dir {self.root} was opened read-only")

    def _job_dir(self, job: str) -> str:
        return os.path.join(self.root, _check_job_name(job))

    # --- reading ------------------------------------------------------------------------------
    def jobs(self) -> list[str]:
        """Names of the job folders that hold at least one manifest (not checked further), sorted."""
        out = []
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name)
            if name.startswith(".") or not os.path.isdir(path):
                continue
            if any((p := _parse_name(f)) and p[1] == "manifest.json" for f in os.listdir(path)):
                out.append(name)
        return out

    def _scan(self, job: str, counter: list) -> tuple[dict[int, _Manifest], dict[int, str]]:
        """Manifests of ``job`` that parse and name this job and node, and the reasons of those that don't."""
        jobdir = self._job_dir(job)
        good: dict[int, _Manifest] = {}
        bad: dict[int, str] = {}
        try:
            names = os.listdir(jobdir)
        except FileNotFoundError:
            return good, bad
        except OSError as exc:
            raise _os_error("list", jobdir, exc) from None
        for name in names:
            parsed = _parse_name(name)
            if parsed and parsed[1] == "manifest.json":
                step = parsed[0]
                try:
                    good[step] = _parse_manifest(os.path.join(jobdir, name), job, self.node_id, step, counter)
                except CheckpointError as exc:
                    bad[step] = str(exc)
        return good, bad

    def list(self, job: str) -> list[CheckpointInfo]:
        """Complete checkpoints of ``job`` (manifest parses and names this job and node), by step. No hashing."""
        good, _ = self._scan(job, [0])
        return [good[s].info() for s in sorted(good)]

    def load(self, job: str, *, at_most: int | None = None, exact: int | None = None,
             verify: bool = True) -> LoadedCheckpoint:
        """Restore the blocks of ``job``: the target's chain (full, then incrementals) replayed in order.

        Target: ``exact`` (that step, else CheckpointError), or the latest step <= ``at_most``
        (default: the latest). Without ``exact``, a target whose chain cannot be used (missing,
        truncated or mismatching file, broken chain, foreign or unparsable manifest) is recorded
        in ``skipped`` and the previous step is tried; CheckpointError lists every reason when
        none loads. With ``verify``, each file's sha256 is checked against its manifest.
        """
        return self._load(job, at_most=at_most, exact=exact, verify=verify, with_state=True)

    def _load(self, job: str, *, at_most: int | None, exact: int | None, verify: bool,
              with_state: bool) -> LoadedCheckpoint:
        started = time.perf_counter()
        counter = [0]
        jobdir = self._job_dir(job)
        good, bad = self._scan(job, counter)
        if exact is not None:
            candidates = [exact]
        else:
            candidates = sorted((s for s in {*good, *bad} if at_most is None or s <= at_most), reverse=True)
        failed_files: dict[str, str] = {}  # a file found bad once fails every chain through it
        skipped: list[tuple[int, str]] = []
        for step in candidates:
            try:
                if step in bad:
                    raise CheckpointError(bad[step])
                if step not in good:
                    raise CheckpointError(f"job {job!r} has no checkpoint at step {step} in {jobdir}")
                chain = _chain(good, bad, step)
                blocks = _replay(jobdir, chain, verify, with_state, failed_files, counter)
            except CheckpointError as exc:
                if exact is not None:
                    raise
                skipped.append((step, str(exc)))
                continue
            target = chain[-1]
            return LoadedCheckpoint(job, step, target.uid, target.epoch, target.spec, [m.step for m in chain], blocks,
                                    counter[0], time.perf_counter() - started, skipped)
        limit = "" if at_most is None else f" at or before step {at_most}"
        if not skipped:
            raise CheckpointError(f"job {job!r} has no checkpoint{limit} in {jobdir}")
        raise CheckpointError(f"no checkpoint of job {job!r}{limit} in {jobdir} can be loaded: "
                              + "; ".join(f"step {s}: {r}" for s, r in skipped))

    # --- writing ------------------------------------------------------------------------------
    def _stage(self, name: str) -> None:
        if self._failpoint is not None:
            self._failpoint(name)

    def write(self, snap: JobSnapshot) -> CheckpointInfo:
        """Write ``snap`` as the checkpoint of its step, crash-safely; returns what was written.

        Refuses (CheckpointError) a snapshot that is inconsistent, of another node, of a step
        that already has a checkpoint, or an incremental whose base checkpoint is missing, of
        another uid, or disagrees with it about a block not written. On an I/O error (e.g. a full
        disk) everything this call made is removed and CheckpointError names the path and error.
        """
        self._check_writable()
        jobdir = self._job_dir(snap.job)
        held, blocks, ints = self._check_snapshot(snap)
        values_name, state_name, manifest_name = _file_names(snap.step)
        manifest_path = os.path.join(jobdir, manifest_name)
        if os.path.exists(manifest_path):
            raise CheckpointError(f"job {snap.job!r} already has a checkpoint at step {snap.step}: {manifest_path}")
        if snap.full:
            full_step = snap.step
        else:
            full_step = self._check_base(snap, held, {_block_key(b.tensor, b.index) for b in blocks})
        manifest = {
            "format": FORMAT, "job": snap.job, "uid": snap.uid, "node_id": self.node_id, "step": snap.step,
            "epoch": snap.epoch, "kind": "full" if snap.full else "incremental", "base_step": snap.base_step,
            "full_step": full_step, "spec": snap.spec, "created_unix_ms": int(time.time() * 1000), "held": held,
            "blocks": {_block_key(b.tensor, b.index): ({"version": b.version, "int_state": ints[i]} if ints[i]
                                                       else {"version": b.version}) for i, b in enumerate(blocks)},
        }
        try:
            json.dumps(snap.spec)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"spec of job {snap.job!r} is not JSON-serializable: {exc}") from None

        if not os.path.isdir(jobdir):
            try:
                os.makedirs(jobdir, exist_ok=True)
            except OSError as exc:
                raise _os_error("create job folder", jobdir, exc) from None
            _fsync_dir(self.root)
        _remove_temporaries(jobdir)

        values_items = [(_block_key(b.tensor, b.index), b.value.detach().contiguous()) for b in blocks]
        state_items = [
            (f"{_block_key(b.tensor, b.index)}#{k}",
             torch.tensor(v, dtype=torch.int64) if _is_int(v) else v.detach().contiguous())
            for b in blocks for k, v in b.state.items()
        ]
        temps: list[str] = []
        placed: list[str] = []       # final names this call renamed into place, manifest last
        files = [(values_name, _safetensors_parts(values_items), "values"),
                 (state_name, _safetensors_parts(state_items), "state")]
        hashing: dict[str, _Sha256] = {}
        opened: list[_TempFile] = []
        try:
            # Hashing overlaps the I/O (all of it only reads the snapshot's buffers): the largest
            # file's hash starts now, in a helper thread, and runs while this thread writes both
            # files; the other file's hash starts once the writes are done and runs while this thread
            # waits in fsync. The manifest waits for the digests.
            largest = max(files, key=lambda f: sum(len(p) for p in f[1]))
            hashing[largest[0]] = _Sha256(largest[1])
            for name, parts, _ in files:
                opened.append(_TempFile(jobdir, name, temps))
                opened[-1].write(parts)
            for name, parts, _ in files:
                if name not in hashing:
                    hashing[name] = _Sha256(parts)
            for f, (name, _, stage) in zip(opened, files):
                f.sync_and_close()
                self._stage(f"{stage}.tmp")
                _rename(f.path, os.path.join(jobdir, name), temps, placed)
                self._stage(f"{stage}.renamed")
            # The data files' names must be durable before a manifest can point at them.
            _fsync_dir(jobdir)
            self._stage("data.synced")
            digests = {}
            for f, (name, _, _) in zip(opened, files):
                digests[name] = hashing.pop(name).result(f.size)
            manifest["files"] = {n: {"sha256": d.sha256, "bytes": d.bytes} for n, d in digests.items()}
            manifest["values_bytes"] = digests[values_name].bytes
            manifest["state_bytes"] = digests[state_name].bytes
            manifest["data_bytes"] = manifest["values_bytes"] + manifest["state_bytes"]
            # Compact: held/blocks have an entry per block (jq makes it readable).
            data = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode() + b"\n"
            tmp, _ = _write_temp(jobdir, manifest_name, [data], temps)
            self._stage("manifest.tmp")
            _rename(tmp, manifest_path, temps, placed)
            self._stage("manifest.renamed")
            _fsync_dir(jobdir)
            self._stage("synced")
        except BaseException:
            for pending in hashing.values():
                pending.cancel()
            for f in opened:
                f.close()
            # Manifest first: a half-removed checkpoint must never look complete.
            for path in [*reversed(placed), *temps]:
                _unlink_quietly(path)
            try:
                _fsync_dir(jobdir)
            except CheckpointError:
                pass
            raise
        return CheckpointInfo(snap.step, manifest["kind"], snap.base_step, full_step, snap.uid, snap.epoch,
                              manifest_path, manifest["data_bytes"] + len(data), len(blocks), manifest["created_unix_ms"])

    def _check_snapshot(self, snap: JobSnapshot) -> tuple[dict, list, list]:
        """(held as "tensor#index" -> version, blocks sorted by key, int state keys per block)."""
        where = f"snapshot of job {snap.job!r} at step {snap.step!r}"
        if snap.node_id != self.node_id:
            raise CheckpointError(f"{where} is of node {snap.node_id!r}; {self.root} belongs to node {self.node_id!r}")
        if not (_is_int(snap.step) and snap.step >= 0 and _is_int(snap.epoch) and snap.epoch >= 0):
            raise CheckpointError(f"{where}: step and epoch must be integers >= 0, got {snap.step!r}, {snap.epoch!r}")
        if not isinstance(snap.uid, str) or not isinstance(snap.spec, dict):
            raise CheckpointError(f"{where}: uid must be a string and spec a dict")
        if snap.full:
            if snap.base_step is not None:
                raise CheckpointError(f"{where}: a full checkpoint has no base_step (got {snap.base_step!r})")
        elif not (_is_int(snap.base_step) and 0 <= snap.base_step < snap.step):
            raise CheckpointError(f"{where}: an incremental needs a base_step < step, got {snap.base_step!r}")
        held = {}
        for block, version in snap.held.items():
            tensor, index = block if isinstance(block, tuple) and len(block) == 2 else (None, None)
            if not (isinstance(tensor, str) and tensor and "#" not in tensor and _is_int(index) and index >= 0):
                raise CheckpointError(f"{where}: held block {block!r} must be (tensor name without '#', index >= 0)")
            if not (_is_int(version) and 0 <= version <= snap.step):
                raise CheckpointError(f"{where}: block {tensor}#{index} has version {version!r}, not in 0..{snap.step}")
            held[_block_key(tensor, index)] = version
        blocks = sorted(snap.blocks, key=lambda b: (b.tensor, b.index))
        ints = []
        for n, b in enumerate(blocks):
            key = _block_key(b.tensor, b.index)
            if held.get(key) is None or held[key] != b.version:
                raise CheckpointError(f"{where}: written block {key} (version {b.version!r}) is not held at that version")
            if n and (blocks[n - 1].tensor, blocks[n - 1].index) == (b.tensor, b.index):
                raise CheckpointError(f"{where}: block {key} is written twice")
            v = b.value
            if not (isinstance(v, torch.Tensor) and v.dtype in VALUE_DTYPES and v.dim() == 1 and v.device.type == "cpu"):
                raise CheckpointError(f"{where}: value of block {key} must be a 1-D float32 (or, frozen, bfloat16) "
                                      f"CPU tensor")
            block_ints = []
            for k, s in b.state.items():
                if not isinstance(k, str) or not k:
                    raise CheckpointError(f"{where}: block {key} has state key {k!r}; keys are non-empty strings")
                if _is_int(s):
                    if not -2**63 <= s < 2**63:
                        raise CheckpointError(f"{where}: state {key}#{k} = {s} does not fit int64")
                    block_ints.append(k)
                elif not (isinstance(s, torch.Tensor) and s.dtype in _DTYPES and s.device.type == "cpu"):
                    raise CheckpointError(f"{where}: state {key}#{k} must be an int or a CPU tensor of "
                                          f"{sorted(map(str, _DTYPES))}, got {type(s).__name__}")
            ints.append(sorted(block_ints))
        if snap.full and len(blocks) != len(held):
            missing = sorted(set(held) - {_block_key(b.tensor, b.index) for b in blocks})
            raise CheckpointError(f"{where}: a full checkpoint must write every held block; missing {missing[:5]}")
        return held, blocks, ints

    def _check_base(self, snap: JobSnapshot, held: dict, written: set) -> int:
        """full_step of an incremental's chain, after checking the base agrees with the snapshot."""
        jobdir = self._job_dir(snap.job)
        path = os.path.join(jobdir, _file_names(snap.base_step)[2])
        if not os.path.exists(path):
            raise CheckpointError(f"incremental checkpoint of job {snap.job!r} at step {snap.step} needs its base "
                                  f"checkpoint at step {snap.base_step}, and {path} does not exist")
        base = _parse_manifest(path, snap.job, self.node_id, snap.base_step, [0])
        if base.uid != snap.uid:
            raise CheckpointError(f"base checkpoint {path} is of job uid {base.uid!r}, the snapshot of {snap.uid!r}")
        for key, version in held.items():
            if key not in written and base.held.get(key) != version:
                raise CheckpointError(f"incremental checkpoint of job {snap.job!r} at step {snap.step} omits block {key} "
                                      f"(version {version}) but base {path} holds it at version {base.held.get(key)}")
        return base.full_step

    # --- retention ----------------------------------------------------------------------------
    def retain(self, job: str, keep_full: int, protect: Iterable[int] = ()) -> list[str]:
        """Keep the newest ``keep_full`` full checkpoints, every checkpoint after the oldest kept one
        and the whole chain of every step in ``protect``; delete the rest, stray temporaries and
        data files without a manifest. Unparsable manifests are kept while newer than the oldest
        kept full checkpoint. Manifests go first. Returns the removed paths.
        """
        self._check_writable()
        if not _is_int(keep_full) or keep_full < 1:
            raise ShardlineConfigError(f"keep_full must be an integer >= 1, got {keep_full!r}")
        jobdir = self._job_dir(job)
        good, bad = self._scan(job, [0])
        fulls = sorted(s for s, m in good.items() if m.kind == "full")[-keep_full:]
        oldest = fulls[0] if fulls else math.inf
        keep = {s for s in {*good, *bad} if s >= oldest}
        # A kept checkpoint is only useful with its whole chain (normally all >= oldest anyway).
        for step in [*keep, *protect]:
            while step in good:
                keep.add(step)
                if good[step].kind == "full":
                    break
                step = good[step].base_step
        return _remove_steps(jobdir, lambda step: step not in keep)

    def discard_after(self, job: str, step: int) -> list[str]:
        """Delete every checkpoint of ``job`` newer than ``step`` (and stray temporaries).

        For a node restored to an older step than its newest checkpoint: those belong to a
        timeline that was abandoned, and new checkpoints will reuse their step numbers (``write``
        refuses a step that already has one). Manifests go first. Returns the removed paths.
        """
        self._check_writable()
        if not _is_int(step):
            raise ShardlineConfigError(f"step must be an integer, got {step!r}")
        return _remove_steps(self._job_dir(job), lambda s: s > step)

    def delete_job(self, job: str) -> None:
        """Remove every checkpoint of ``job``. The folder disappears atomically (renamed away, then removed)."""
        self._check_writable()
        jobdir = self._job_dir(job)
        gone = os.path.join(self.root, f"{_DELETED_PREFIX}{job}.{secrets.token_hex(4)}")
        try:
            os.rename(jobdir, gone)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _os_error("delete job folder", jobdir, exc) from None
        _fsync_dir(self.root)
        try:
            shutil.rmtree(gone)
        except OSError as exc:
            # Invisible already; the next CheckpointDir() on this root retries.
            raise _os_error("remove deleted job folder", gone, exc) from None


# ---------------------------------------------------------------------- write helpers


def _mkstemp(dirpath: str, name: str) -> tuple[int, str]:
    path = os.path.join(dirpath, f".{name}{_TMP_MARK}{secrets.token_hex(6)}")
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), path


class _Sha256:
    """sha256 and byte count of ``parts`` (bytes-like objects, in order), for a file being written.

    At least :data:`_HASH_THREAD_MIN_BYTES` in all: computed by a helper thread from the moment
    this is created, so the hashing runs alongside the caller's write(2) and fsync(2) calls
    (hashlib and os.write both release the GIL on large buffers); less: inline, on creation. The
    buffers must stay unchanged until :meth:`result` or :meth:`cancel` returns (snapshots are
    private copies nobody mutates). Always end a threaded one with ``result`` or ``cancel``.
    """

    def __init__(self, parts: list):
        self._views = [memoryview(p).cast("B") for p in parts]
        self._size = sum(len(v) for v in self._views)
        self._h = hashlib.sha256()
        self._error: BaseException | None = None
        self._cancelled = False
        self._thread = None
        if self._size < _HASH_THREAD_MIN_BYTES:
            self._run()
        else:
            self._thread = threading.Thread(target=self._run, name="checkpoint-sha256", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            for view in self._views:
                for i in range(0, len(view), _HASH_CHUNK):
                    if self._cancelled:
                        return
                    self._h.update(view[i:i + _HASH_CHUNK])
        except BaseException as exc:  # noqa: BLE001 - re-raised by result() in the caller's thread
            self._error = exc

    def result(self, written: int) -> _Digest:
        """The digest, once the hash is done; ``written`` (bytes the caller wrote) must be the size hashed."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        if self._cancelled or written != self._size:
            raise CheckpointError(f"internal error: hashed {self._size} bytes, wrote {written}")
        return _Digest(self._h.hexdigest(), self._size)

    def cancel(self) -> None:
        """Stop hashing (within one chunk) and wait for the helper to end."""
        self._cancelled = True
        if self._thread is not None:
            self._thread.join()


class _TempFile:
    """A new temporary for ``name`` in ``dirpath``, listed in ``temps`` (whoever owns that list
    removes it on failure). I/O errors become CheckpointError("cannot write <temporary>: ...")."""

    def __init__(self, dirpath: str, name: str, temps: list):
        try:
            self.fd, self.path = _mkstemp(dirpath, name)
        except OSError as exc:
            raise _os_error("create a temporary file in", dirpath, exc) from None
        temps.append(self.path)
        self.size = 0

    def write(self, parts: list) -> None:
        try:
            for part in parts:
                _write_all(self.fd, part)
                self.size += len(part)
        except OSError as exc:
            raise _os_error("write", self.path, exc) from None

    def sync_and_close(self) -> None:
        fd, self.fd = self.fd, None
        try:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _os_error("write", self.path, exc) from None

    def close(self) -> None:
        """Close without syncing (failure paths)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.close(fd)
            except OSError:
                pass


def _write_temp(dirpath: str, name: str, parts: list, temps: list | None = None) -> tuple[str, _Digest]:
    """Write ``parts`` to a new temporary for ``name`` in ``dirpath``, hashing as it goes, and fsync it.

    The temporary is appended to ``temps``; without ``temps`` it is removed here if the write fails.
    """
    mine: list = [] if temps is None else temps
    f = _TempFile(dirpath, name, mine)
    pending = None
    try:
        pending = _Sha256(parts)
        f.write(parts)
        f.sync_and_close()
        return f.path, pending.result(f.size)
    except BaseException:
        if pending is not None:
            pending.cancel()
        f.close()
        if temps is None:
            _unlink_quietly(f.path)
        raise


def _rename(tmp: str, final: str, temps: list, placed: list) -> None:
    try:
        os.replace(tmp, final)
    except OSError as exc:
        raise _os_error(f"rename {tmp} to", final, exc) from None
    temps.remove(tmp)
    placed.append(final)


def _remove_steps(jobdir: str, doomed: Callable[[int], bool]) -> list[str]:
    """Delete the files of every step for which ``doomed(step)``, and stray temporaries.

    All manifests go (and the folder is fsync'ed) before any data file, so a checkpoint is never
    seen complete with files missing. Files that are not ours are left alone.
    """
    try:
        names = sorted(os.listdir(jobdir))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise _os_error("list", jobdir, exc) from None
    manifests, data = [], []
    for name in names:
        parsed = _parse_name(name)
        if parsed and doomed(parsed[0]):
            (manifests if parsed[1] == "manifest.json" else data).append(os.path.join(jobdir, name))
        elif _is_temporary(name):
            data.append(os.path.join(jobdir, name))
    removed = []
    for group in (manifests, data):
        for path in group:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise _os_error("delete", path, exc) from None
            removed.append(path)
        if group:
            _fsync_dir(jobdir)
    return removed


def _remove_temporaries(jobdir: str) -> None:
    for name in os.listdir(jobdir):
        if _is_temporary(name):
            _unlink_quietly(os.path.join(jobdir, name))


# ---------------------------------------------------------------------- restore helpers


def _chain(good: dict[int, _Manifest], bad: dict[int, str], step: int) -> list[_Manifest]:
    """Manifests from the full checkpoint to ``step``, following base_step links."""
    chain = [good[step]]
    while chain[-1].kind == "incremental":
        m = chain[-1]
        base = good.get(m.base_step)
        if base is None:
            why = bad.get(m.base_step, f"{_file_names(m.base_step)[2]} is missing")
            raise CheckpointError(f"step {m.step} needs its base checkpoint at step {m.base_step}: {why}")
        if base.uid != m.uid or base.full_step != m.full_step:
            raise CheckpointError(f"manifest {m.path} names base step {m.base_step} of chain {m.full_step} (uid {m.uid!r}), "
                                  f"but {base.path} is of chain {base.full_step} (uid {base.uid!r})")
        chain.append(base)
    chain.reverse()
    return chain


def _replay(jobdir: str, chain: list[_Manifest], verify: bool, with_state: bool, failed_files: dict,
            counter: list) -> dict:
    """Blocks of the chain's last step: each read from the newest checkpoint of the chain that wrote it."""
    target = chain[-1]
    source: dict[str, int] = {}
    for i, m in enumerate(chain):
        for key in m.blocks:
            if key in target.held:
                source[key] = i
    for key, version in target.held.items():
        if key not in source:
            raise CheckpointError(f"chain {[m.step for m in chain]} of {target.path} has no data for held block {key}")
        found = chain[source[key]].blocks[key]["version"]
        if found != version:
            raise CheckpointError(f"chain {[m.step for m in chain]} is inconsistent: block {key} is version {found} in "
                                  f"{chain[source[key]].path}, {target.path} holds version {version}")
    out = {}
    for i, m in enumerate(chain):
        wanted = {key for key, j in source.items() if j == i}
        values_name, state_name, _ = _file_names(m.step)
        values = _read_file(jobdir, values_name, m, wanted.__contains__, verify, failed_files, counter)
        state = {}
        if with_state:
            state = _read_file(jobdir, state_name, m, lambda k, wanted=wanted: _state_block(k) in wanted, verify, failed_files, counter)
        by_block: dict[str, dict] = {key: {} for key in wanted}
        for k, t in state.items():
            by_block[_state_block(k)][k.split("#", 2)[2]] = t
        for key in wanted:
            value = values.get(key)
            path = os.path.join(jobdir, values_name)
            if value is None or value.dtype not in VALUE_DTYPES or value.dim() != 1:
                raise CheckpointError(f"checkpoint file {path} lacks a 1-D float32 (or bfloat16) value for block {key}")
            entries = by_block[key]
            for k in m.blocks[key].get("int_state", []) if with_state else ():
                t = entries.get(k)
                if t is None or t.dtype != torch.int64 or t.dim() != 0:
                    raise CheckpointError(f"checkpoint file {os.path.join(jobdir, state_name)} lacks int state {key}#{k}")
                entries[k] = int(t)
            out[_parse_block_key(key)] = LoadedBlock(target.held[key], value, entries)
    return out


def _read_file(jobdir: str, name: str, m: _Manifest, select, verify: bool, failed_files: dict, counter: list) -> dict:
    path = os.path.join(jobdir, name)
    if path in failed_files:
        raise CheckpointError(failed_files[path])
    try:
        return _read_safetensors(path, m.files[name], select, verify, counter)
    except CheckpointError as exc:
        failed_files[path] = str(exc)
        raise


# ---------------------------------------------------------------------- offline export


def read_job_tensors(dirs: list, job: str, *, step: int | None = None) -> tuple[int, dict, dict[str, torch.Tensor]]:
    """Full tensors of ``job`` assembled from the checkpoint dirs of all the nodes of a cluster.

    ``dirs`` are CheckpointDir objects or paths (opened read-only; their NODE.json names the
    node). The step is ``step``, else the latest step that every dir holding the job can load
    exactly. Each block of each tensor of the spec must come from exactly one dir. Returns
    ``(step, spec, {name: float32 tensor shaped as the spec})``. Optimizer state is not read.
    """
    opened = [d if isinstance(d, CheckpointDir) else CheckpointDir.open_read_only(d) for d in dirs]
    listed = {d.root: {i.step for i in d.list(job)} for d in opened}
    holding = [d for d in opened if listed[d.root]]
    if not holding:
        raise CheckpointError(f"none of the checkpoint dirs {[d.root for d in opened]} holds a checkpoint of job {job!r}")
    if step is not None:
        candidates = [step]
    else:
        candidates = sorted(set.intersection(*(listed[d.root] for d in holding)), reverse=True)
    reasons = []
    for s in candidates:
        try:
            return s, *_assemble(holding, job, s)
        except CheckpointError as exc:
            if step is not None:
                raise
            reasons.append(f"step {s}: {exc}")
    raise CheckpointError(f"no step of job {job!r} loads in every dir holding it ({[d.root for d in holding]})"
                          + (": " + "; ".join(reasons) if reasons else ": they have no step in common"))


def _assemble(holding: list[CheckpointDir], job: str, step: int) -> tuple[dict, dict[str, torch.Tensor]]:
    spec = uid = None
    tensors: dict[str, tuple[torch.Tensor, tuple, list]] = {}
    source: dict[tuple[str, int], tuple[str, int]] = {}   # block -> (dir, version) of the copy used
    for d in holding:
        loaded = d._load(job, at_most=None, exact=step, verify=True, with_state=False)
        if spec is None:
            spec, uid = loaded.spec, loaded.uid
            block_elements = int(spec.get("block_elements", 0)) or DEFAULT_BLOCK_ELEMENTS
            for t in spec.get("tensors", []):
                shape = tuple(int(x) for x in t.get("shape", []))
                flat = torch.empty(math.prod(shape), dtype=torch.float32)
                tensors[t["name"]] = (flat, shape, block_slices(flat.numel(), block_elements))
        elif loaded.uid != uid or loaded.spec != spec:
            raise CheckpointError(f"{d.root} holds job {job!r} uid {loaded.uid!r} at step {step} with a different "
                                  f"spec or uid than {holding[0].root} (uid {uid!r})")
        for (name, index), block in loaded.blocks.items():
            where = f"block {name}#{index} in {d.root}"
            if name not in tensors or index >= len(tensors[name][2]):
                raise CheckpointError(f"{where} is not a block of the spec of job {job!r}")
            # Replicas: several dirs hold copies of a block; the newest version is the primary's
            # (a replica's copy lags at most by the step its primary was applying).
            seen = source.get((name, index))
            if seen is not None and seen[1] >= block.version:
                continue
            flat, _, slices = tensors[name]
            sl = slices[index]
            if block.value.numel() != sl.numel:
                raise CheckpointError(f"{where} has {block.value.numel()} elements, the spec says {sl.numel}")
            flat[sl.start:sl.stop] = block.value
            source[(name, index)] = (d.root, block.version)
        del loaded  # before the next dir's blocks: one node's blocks in memory at a time
    for name, (_, _, slices) in tensors.items():
        missing = [s.index for s in slices if (name, s.index) not in source]
        if missing:
            raise CheckpointError(f"tensor {name!r} of job {job!r} at step {step}: block(s) {missing[:10]} are in "
                                  f"none of the checkpoint dirs {[d.root for d in holding]}")
    return spec, {name: flat.view(shape) for name, (flat, shape, _) in tensors.items()}
