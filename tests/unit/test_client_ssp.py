"""The client's bookkeeping of SSP steps in flight (no network: requests are recorded): which
steps it keeps, and what it resends to a node that came back at a given step."""

import pytest
import torch

from shardline.services.errors import ShardlineStateError
from shardline.services.pb import common_pb2
from shardline.services.pb import dataplane_pb2 as dp
from shardline.worker.client import Client
from shardline.worker.recovery import Replay, StepsInFlight


class OneNode:
    nodes = {"ps0": None}

    def owner(self, job, tensor, index):
        return "ps0"


def bare_client(sync="ssp", staleness=2):
    """A Client with a job spec and no connections; ``sent`` records every request it makes."""
    client = Client.__new__(Client)
    client.job, client.rank = "j", 0
    client.spec = common_pb2.JobSpec(name="j", sync=sync, staleness=staleness, world_size=2)
    client._inflight, client.routing, client._oldest = StepsInFlight(), OneNode(), {}
    client._replay, client._durable_steps = Replay(client._inflight), {}
    client.sent = []

    def exchange(node_id, keys, op, step, weight, grads, min_step, timeout):
        client.sent.append((dp.Op.Name(op), step, list(keys)))
        return step + 1 if op == dp.OP_COMMIT else step

    client._exchange = exchange
    return client


def send_steps(client, steps):
    for step in steps:
        record = client._inflight.record(step, 1.0, client.staleness)
        record.grads[("w", 0)] = torch.ones(2)
        record.committed = True


def test_ssp_keeps_the_last_staleness_plus_one_steps_bsp_the_last_two():
    """BSP keeps the step before too: its pull may have been served before the copy holders
    acknowledged that step (docs/architecture.md, "Reads before the acknowledgement")."""
    ssp, bsp = bare_client(staleness=2), bare_client(sync="bsp", staleness=0)
    send_steps(ssp, range(6))
    send_steps(bsp, range(6))
    assert sorted(ssp._inflight) == [3, 4, 5]
    assert sorted(bsp._inflight) == [4, 5]


def test_a_node_back_at_a_step_gets_every_step_in_flight_from_there_oldest_first():
    client = bare_client(staleness=2)
    send_steps(client, [3, 4, 5])
    assert client._resend_inflight("ps0", 4) == 6
    assert client.sent == [("OP_PUSH", 4, [("w", 0)]), ("OP_COMMIT", 4, []),
                           ("OP_PUSH", 5, [("w", 0)]), ("OP_COMMIT", 5, [])]
    client.sent.clear()
    assert client._resend_inflight("ps0", 6) == 6 and not client.sent  # it holds them all
    with pytest.raises(ShardlineStateError, match="updates of steps 2..2 are lost"):
        client._resend_inflight("ps0", 2)  # behind the oldest step this worker still holds


@pytest.mark.parametrize("staleness", [1.5, -1, True, "2"])
def test_a_staleness_that_is_no_integer_is_refused_quoting_it(staleness):
    from shardline.services.errors import ShardlineConfigError

    with pytest.raises(ShardlineConfigError, match=f"got {staleness!r}"):
        bare_client().init({"w": torch.zeros(2)}, sync="ssp", staleness=staleness)
