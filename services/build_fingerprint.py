"""A PS node's build fingerprint: what decides whether two nodes compute an optimizer step bit for
bit alike (docs/architecture.md, "Replication", "Build fingerprints").

Replaying gradients (a copy holder runs its primary's optimizer step on its own copy) is exact only
if every node steps with the same kernels: the same torch build (version, git revision, build
configuration), the same CPU kernels torch dispatches to (its CPU capability: DEFAULT, AVX2,
AVX512...), the same Python and machine architecture. A PS node reports this string when it
registers and in every heartbeat; the dispatcher compares them (dispatcher/replay_policy.py).

The fingerprint is a short readable string of ``key=value`` fields separated by ``;``, so that an
error naming two of them shows what differs. ``SHARDLINE_BUILD_FINGERPRINT_OVERRIDE`` replaces it
(tests only: it lets one machine emulate nodes of different builds).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re

from shardline.services.errors import ShardlineConfigError

OVERRIDE_ENV = "SHARDLINE_BUILD_FINGERPRINT_OVERRIDE"
MAX_LENGTH = 256
_VALID = re.compile(r"[\x20-\x7e]{1,%d}" % MAX_LENGTH)   # printable ASCII


def valid(fingerprint: object) -> bool:
    """Whether ``validate`` accepts ``fingerprint``."""
    return isinstance(fingerprint, str) and (not fingerprint or bool(_VALID.fullmatch(fingerprint)))


def validate(fingerprint: object, what: str = "build_fingerprint") -> str:
    """A reported fingerprint: "" (not reported) or 1..256 printable ASCII characters."""
    if not valid(fingerprint):
        raise ShardlineConfigError(f"{what} must be 1..{MAX_LENGTH} printable ASCII characters (or empty), "
                                   f"got {fingerprint!r}")
    return fingerprint


def compute() -> str:
    """This process's fingerprint, from torch and the platform (no override)."""
    import torch

    config = hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:12]
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):   # a torch without the query
        capability = "unknown"
    git = (getattr(torch.version, "git_version", "") or "unknown")[:12]
    fields = (("torch", torch.__version__), ("git", git), ("config", config), ("cpu", capability),
              ("python", platform.python_version()), ("machine", platform.machine() or "unknown"))
    return ";".join(f"{key}={value}" for key, value in fields)


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """This process's fingerprint: ``SHARDLINE_BUILD_FINGERPRINT_OVERRIDE`` if set (tests), else
    ``compute()``. Computed once per process."""
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        return validate(override, OVERRIDE_ENV)
    return compute()
