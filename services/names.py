"""Name rules every daemon checks the same way (the dispatcher on creation, PS nodes on each frame)."""

from __future__ import annotations

import re

from shardline.services.errors import ShardlineConfigError

JOB_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


def validate_job_name(name: object) -> str:
    """Return ``name`` if it is a valid job name, else raise ShardlineConfigError quoting it."""
    if not isinstance(name, str) or not JOB_NAME_RE.fullmatch(name):
        raise ShardlineConfigError(f"job name must be 1..128 characters of [A-Za-z0-9._-], got {name!r}")
    return name
