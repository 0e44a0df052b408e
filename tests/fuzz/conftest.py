"""Fuzz tests of the data-plane codec and of a live PS connection loop (hypothesis).

Profiles (``SHARDLINE_FUZZ_PROFILE``):

- ``ci`` (default, ``make test``): few examples, derandomized (a fixed seed: every run tries the
  same inputs), no example database; all fuzz tests together stay well under a minute.
- ``fuzz`` (``make fuzz``): thousands of examples from fresh random seeds; failures are kept in
  ``.hypothesis/`` and replayed first on the next run.
- ``dev``: in between, for a quick local look.

``SHARDLINE_FUZZ_EXAMPLES=N`` overrides the example count of whichever profile is chosen.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

from shardline.local_cluster import LocalCluster

# The bad-input and data-plane-limits tests' helpers (raw sockets, /proc readings) are reused here.
sys.path.insert(0, str(Path(__file__).parent.parent / "integration"))

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
settings.register_profile("ci", max_examples=60, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate, Phase.shrink], **_COMMON)
settings.register_profile("dev", max_examples=300, **_COMMON)
settings.register_profile("fuzz", max_examples=3000, **_COMMON)

PROFILE = os.environ.get("SHARDLINE_FUZZ_PROFILE", "ci")
settings.load_profile(PROFILE)
if os.environ.get("SHARDLINE_FUZZ_EXAMPLES"):
    settings.register_profile("override", settings(settings.get_profile(PROFILE),
                                                   max_examples=int(os.environ["SHARDLINE_FUZZ_EXAMPLES"])))
    settings.load_profile("override")


# Short enough that a stalled frame is dropped within one health check's patience.
PAYLOAD_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def live_ps(tmp_path_factory):
    """A dispatcher and one PS node, real processes on 127.0.0.1 (port 0, ready files); every
    daemon is stopped and reaped afterwards."""
    with LocalCluster(tmp_path_factory.mktemp("fuzz")) as c:
        c.start_dispatcher()
        ps = c.add_node(node_id="ps1", payload_timeout=PAYLOAD_TIMEOUT)
        c.wait_for_nodes(1, timeout=30)
        yield c, ps
