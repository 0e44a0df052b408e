"""Failpoints: named points where a fault test makes a process exit, pause, raise or sleep.

The code marks a point with ``hit(name, step)``; a test arms points through the environment
(docs/architecture.md, "Fault injection"):

``SHARDLINE_FAILPOINTS``
    Entries separated by commas, each ``name[@step][=[count*]action]``:

    * ``@step`` — the point fires at that step or a later one (a node that was busy joining when
      the step went by fires at its next); a hit that names no step always matches. Without it,
      every hit matches.
    * ``count*`` — fire on ``count`` matching hits, then stay quiet (default: every matching hit).
    * ``action`` — what a firing does:

      ``exit`` (the default: ``name`` and ``name@step`` alone mean exit)
          end the process at once with ``os._exit(EXIT_CODE)``, as a ``kill -9`` would (no
          cleanup), after one log line naming the failpoint;
      ``pause`` or ``pause(timeout)``
          hold the calling thread until released (below), at most ``timeout`` seconds (default
          PAUSE_TIMEOUT); a pause not released by then means its test is gone: the process logs
          it and exits with PAUSE_TIMEOUT_EXIT_CODE rather than run the test's scenario on out of
          order;
      ``raise`` or ``raise(ErrorName)``
          raise ``FailpointError``, or the named class of ``services/errors.py`` (one that takes a
          message alone, e.g. ``ShardlineConnectionError``);
      ``sleep(seconds)``
          sleep, then go on;
      ``off``
          nothing (a point listed but disarmed).

    e.g. ``worker.after_push@6`` (exit at step 6), ``ps.after_apply=2*sleep(0.5)``,
    ``worker.before_push@3=raise(ShardlineConnectionError),train.before_step=pause(60)``.

``SHARDLINE_FAILPOINTS_DIR``
    Where a ``pause`` meets its test (required when one is armed). A paused thread logs
    ``failpoint <name> paused`` and its process keeps ``<dir>/<name>.<pid>.paused`` (holding the
    step of its thread paused longest); it goes on once ``<dir>/<name>.release`` exists — empty:
    released for good; holding a step N: hits at steps below N pass, N and later pause again (a
    test paces training so) — and logs ``failpoint <name> released``. ``release``, ``paused`` and
    ``wait_paused`` below are the test's side.

A bad entry is a ShardlineConfigError quoting it, raised when this module is imported (process
start), never a point silently left unarmed. Unset (production), ``hit`` costs one dict lookup.

Names in use (where a fault splits a protocol step):

* ``worker.before_push`` / ``worker.after_push`` — a worker before its step's pushes / between
  its pushes and its commit;
* ``worker.commit_partial`` — a worker that committed its step on one node only (armed, the worker
  commits on its first node, then fires);
* ``worker.host_group_ready`` — a member of a host group, its READY sent (worker/host_group.py);
* ``worker.host_group_leader_summed`` — a host group's leader, its members' gradients summed, before
  it returns to push them;
* ``ps.after_apply`` — a primary that applied a step before replicating it;
* ``ps.holder_replay`` — a copy holder that received a step's gradients to replay, before it
  replayed or acknowledged them;
* ``ps.replay_diverge`` — a copy holder replaying a step (armed with ``raise``: instead of raising,
  it moves one element of the first copy it replays by one ulp, as a node of another build might;
  ps_server/store/copies.py), for the divergence check's tests;
* ``ps.checkpoint.<stage>`` — a node in the middle of writing a checkpoint
  (ps_server/checkpoint.py write stages);
* ``train.before_step`` — the test training script (tests/integration/train_model.py) before it
  starts a step: the fault tests pause it there to pace training.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

from shardline.services import errors
from shardline.services.errors import ShardlineConfigError, ShardlineError

log = logging.getLogger("shardline.failpoints")

ENV = "SHARDLINE_FAILPOINTS"
DIR_ENV = "SHARDLINE_FAILPOINTS_DIR"
EXIT_CODE = 137                 # what a shell reports for SIGKILL
PAUSE_TIMEOUT = 900.0           # s: no test holds a process that long; its harness is gone
PAUSE_TIMEOUT_EXIT_CODE = 124   # what timeout(1) reports: told apart from a fired exit
POLL_INTERVAL = 0.02            # s between a paused process's looks at its release file

ACTIONS = ("exit", "pause", "raise", "sleep", "off")
_ENTRY = re.compile(r"(?P<name>[A-Za-z0-9_.\-]+)(?:@(?P<step>\d+))?"
                    r"(?:=(?:(?P<count>\d+)\*)?(?P<action>[a-z]+)(?:\((?P<arg>[^()]*)\))?)?")


class FailpointError(ShardlineError):
    """Raised by a failpoint armed with ``raise``."""


class Failpoint:
    """One armed point: where it matches (``step``), how many more times it fires (``count``,
    None: always) and what it does (``action`` with its ``argument``)."""

    __slots__ = ("name", "step", "count", "action", "argument", "_lock", "_paused")

    def __init__(self, name: str, step: int | None, count: int | None, action: str, argument=None):
        self.name, self.step, self.count, self.action, self.argument = name, step, count, action, argument
        self._lock = threading.Lock()
        self._paused: list[int | None] = []  # the steps of this process's threads paused here, oldest first

    def matches(self, step: int | None) -> bool:
        """Whether a hit at ``step`` would fire it now."""
        return (self.action != "off" and self.count != 0
                and (self.step is None or step is None or step >= self.step))

    def fire(self, step: int | None) -> None:
        if not self.matches(step):
            return
        if self.action == "pause" and _released(self.name, step):
            return  # a released pause neither holds nor counts
        with self._lock:  # threads of one process may hit it at once: each firing counts once
            if self.count is not None:
                if self.count == 0:
                    return
                self.count -= 1
        _RUN[self.action](self, step)


def _parse_entry(entry: str, directory: str | None) -> Failpoint:
    m = _ENTRY.fullmatch(entry)
    try:
        if m is None:
            raise ValueError("expected name[@step][=[count*]action], e.g. worker.after_push@6=pause")
        action, arg = m["action"] or "exit", m["arg"]
        count = int(m["count"]) if m["count"] is not None else None
        if count == 0:
            raise ValueError("a count must be at least 1 (use 'off' to disarm a point)")
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r} (one of {', '.join(ACTIONS)})")
        if action == "pause" and not directory:
            raise ValueError(f"a pause needs {DIR_ENV}, the directory of its release file")
        argument = _ARGUMENT[action](action, arg)
    except ValueError as exc:
        raise ShardlineConfigError(f"{ENV}: bad failpoint entry {entry!r}: {exc}") from None
    return Failpoint(m["name"], int(m["step"]) if m["step"] is not None else None, count, action, argument)


def _no_argument(action: str, arg: str | None) -> None:
    if arg is not None:
        raise ValueError(f"{action} takes no argument")


def _seconds(action: str, arg: str | None) -> float:
    """``sleep``'s seconds (required), ``pause``'s timeout (default PAUSE_TIMEOUT)."""
    if arg is None:
        if action == "sleep":
            raise ValueError("sleep needs its seconds, e.g. sleep(0.5)")
        return PAUSE_TIMEOUT
    try:
        seconds = float(arg)
    except ValueError:
        raise ValueError(f"{action}'s argument must be seconds, got {arg!r}") from None
    if not 0 <= seconds < float("inf"):  # NaN fails too
        raise ValueError(f"{action}'s seconds must be finite and at least 0, got {arg!r}")
    return seconds


def _error_class(action: str, arg: str | None) -> type[Exception]:
    """``raise``'s error: FailpointError, or a class of services/errors.py taking a message alone."""
    error = getattr(errors, arg, None) if arg else FailpointError
    if not (isinstance(error, type) and issubclass(error, Exception)):
        raise ValueError(f"{arg!r} is not an error class of shardline.services.errors")
    try:
        error("failpoint")
    except TypeError:
        raise ValueError(f"{arg} cannot be raised with a message alone") from None
    return error


_ARGUMENT = {"exit": _no_argument, "off": _no_argument, "pause": _seconds, "sleep": _seconds, "raise": _error_class}


def parse(spec: str, directory: str | None = None) -> dict[str, Failpoint]:
    """The failpoints ``spec`` (SHARDLINE_FAILPOINTS's syntax) arms, by name; a bad or repeated
    entry raises ShardlineConfigError quoting it."""
    armed: dict[str, Failpoint] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        point = _parse_entry(entry, directory)
        if point.name in armed:
            raise ShardlineConfigError(f"{ENV}: failpoint {point.name!r} is armed twice (entry {entry!r})")
        armed[point.name] = point
    return armed


def configure(spec: str, directory: str | os.PathLike | None = None) -> None:
    """Arm the failpoints of ``spec`` (pauses meet their test in ``directory``), disarming the
    others. The environment's are armed at import; tests call this to arm some in-process."""
    global _ARMED, _DIRECTORY
    directory = os.fspath(directory) if directory else None
    _ARMED = parse(spec, directory)
    _DIRECTORY = Path(directory) if directory else None


def armed(name: str, step: int | None = None) -> bool:
    """Whether ``hit(name, step)`` would fire now."""
    point = _ARMED.get(name)
    return point is not None and point.matches(step)


def hit(name: str, step: int | None = None) -> None:
    """Do what failpoint ``name`` is armed to do, if it is armed at ``step``."""
    point = _ARMED.get(name)
    if point is not None:
        point.fire(step)


# -- actions ---------------------------------------------------------------------------------------

def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()


def _exit(point: Failpoint, step: int | None) -> None:
    log.error("failpoint %s hit at step %s: exiting now", point.name, step)
    _flush_logs()
    os._exit(EXIT_CODE)


def _release_path(name: str) -> Path:
    return _DIRECTORY / f"{name}.release"


def _released(name: str, step: int | None) -> bool:
    """Whether ``name``'s release file lets a hit at ``step`` pass."""
    try:
        text = _release_path(name).read_text().strip()
    except FileNotFoundError:
        return False
    if not text:
        return True
    try:
        until_step = int(text)
    except ValueError:  # release() writes it whole (a rename): a test wrote it by hand
        log.error("failpoint %s: release file %s holds %r, not a step: still paused",
                  name, _release_path(name), text)
        return False
    return step is None or step < until_step


def _mark_paused(point: Failpoint, step: int | None, paused: bool) -> None:
    """Keep ``<dir>/<name>.<pid>.paused`` while a thread of this process is paused at ``point``,
    holding the step of the one paused longest."""
    marker = _DIRECTORY / f"{point.name}.{os.getpid()}.paused"
    with point._lock:
        if paused:
            point._paused.append(step)
        else:
            point._paused.remove(step)
        if point._paused:
            _DIRECTORY.mkdir(parents=True, exist_ok=True)
            oldest = point._paused[0]
            marker.write_text("" if oldest is None else str(oldest))
        else:
            marker.unlink(missing_ok=True)


def _pause(point: Failpoint, step: int | None) -> None:
    _mark_paused(point, step, True)
    log.warning("failpoint %s paused at step %s: waiting for %s", point.name, step, _release_path(point.name))
    _flush_logs()
    started = time.monotonic()
    while not _released(point.name, step):
        if time.monotonic() - started > point.argument:
            log.error("failpoint %s at step %s: not released within pause timeout %g s: exiting",
                      point.name, step, point.argument)
            _flush_logs()
            os._exit(PAUSE_TIMEOUT_EXIT_CODE)
        time.sleep(POLL_INTERVAL)
    _mark_paused(point, step, False)
    log.warning("failpoint %s released at step %s after %.2f s", point.name, step, time.monotonic() - started)


def _raise(point: Failpoint, step: int | None) -> None:
    log.warning("failpoint %s hit at step %s: raising %s", point.name, step, point.argument.__name__)
    raise point.argument(f"failpoint {point.name} at step {step}")


def _sleep(point: Failpoint, step: int | None) -> None:
    log.info("failpoint %s hit at step %s: sleeping %g s", point.name, step, point.argument)
    time.sleep(point.argument)


_RUN = {"exit": _exit, "pause": _pause, "raise": _raise, "sleep": _sleep, "off": lambda point, step: None}


# -- the test's side of a pause --------------------------------------------------------------------

def release(directory: str | os.PathLike, name: str, until_step: int | None = None) -> None:
    """Release the processes paused at failpoint ``name`` (their SHARDLINE_FAILPOINTS_DIR is
    ``directory``): for good, or with ``until_step`` only hits at steps below it (later ones
    pause again until a further release)."""
    path = Path(directory) / f"{name}.release"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("" if until_step is None else str(int(until_step)))
    os.replace(tmp, path)  # whole or not at all: a paused process never reads half of it


def paused(directory: str | os.PathLike, name: str) -> dict[int, int | None]:
    """The processes paused at failpoint ``name`` now: pid -> the step they paused at."""
    held = {}
    for marker in Path(directory).glob(f"{name}.*.paused"):
        pid = marker.name[len(name) + 1:-len(".paused")]
        try:
            text = marker.read_text().strip()
        except FileNotFoundError:  # released meanwhile
            continue
        if pid.isdigit():
            held[int(pid)] = int(text) if text else None
    return held


def wait_paused(directory: str | os.PathLike, name: str, processes: int = 1, step: int | None = None,
                timeout: float = 60.0) -> dict[int, int | None]:
    """Wait until ``processes`` processes are paused at failpoint ``name`` (at ``step``, if given);
    returns ``paused``'s answer."""
    deadline = time.monotonic() + timeout
    while True:
        held = paused(directory, name)
        if sum(step is None or at == step for at in held.values()) >= processes:
            return held
        if time.monotonic() > deadline:
            where = "" if step is None else f" at step {step}"
            raise errors.ShardlineTimeoutError(f"{processes} process(es) not paused at failpoint {name}{where} "
                                               f"within {timeout:g} s (paused: {held})")
        time.sleep(POLL_INTERVAL)


_DIRECTORY: Path | None = None
_ARMED: dict[str, Failpoint] = {}
configure(os.environ.get(ENV, ""), os.environ.get(DIR_ENV))
