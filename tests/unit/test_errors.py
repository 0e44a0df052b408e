"""The error-code enum the Python code uses is the data plane's, name for name."""

from shardline.services.errors import ErrorCode
from shardline.services.pb import dataplane_pb2 as dp


def test_error_codes_are_the_protos():
    assert [c.value for c in ErrorCode] == list(dp.ErrorCode.keys())


def test_a_code_is_its_name_on_the_wire():
    assert ErrorCode.NOT_OWNER == "NOT_OWNER"
    assert dp.ErrorCode.Value(ErrorCode.NOT_OWNER) == dp.NOT_OWNER


def test_one_not_owner_on_both_sides():
    """The node refuses with NotOwnerError (a RequestError: the reply carries its epoch and its
    message as given); the client raises the same type from that reply (a RemoteError)."""
    from shardline.services.errors import NotOwnerError, RemoteError, RequestError

    refused = NotOwnerError(ErrorCode.NOT_OWNER, "block w[0] is not owned by node 'a' at epoch 7", epoch=7)
    assert isinstance(refused, RequestError) and isinstance(refused, RemoteError)
    assert (refused.code, refused.epoch, refused.reply_message) == ("NOT_OWNER", 7, "block w[0] is not owned by node "
                                                                                   "'a' at epoch 7")
    assert str(refused) == "NOT_OWNER: block w[0] is not owned by node 'a' at epoch 7"
    plain = RequestError(ErrorCode.UNKNOWN_JOB, "job 'x' does not exist on this cluster")
    assert (plain.code, plain.reply_message, str(plain)) == ("UNKNOWN_JOB", "job 'x' does not exist on this cluster",
                                                            "job 'x' does not exist on this cluster")
