"""The error-code enum the Python code uses is the data plane's, name for name."""

from shardline.services.errors import ErrorCode
from shardline.services.pb import dataplane_pb2 as dp


def test_error_codes_are_the_protos():
    assert [c.value for c in ErrorCode] == list(dp.ErrorCode.keys())


def test_a_code_is_its_name_on_the_wire():
    assert ErrorCode.NOT_OWNER == "NOT_OWNER"
    assert dp.ErrorCode.Value(ErrorCode.NOT_OWNER) == dp.NOT_OWNER
