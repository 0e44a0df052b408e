"""One error hierarchy for every Shardline component.

Names follow torch.distributed.elastic: the suffix says what kind of failure it is, so callers can
catch ``ShardlineTimeoutError`` without caring which component timed out.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """The data plane's error codes: the names of ``ErrorCode`` in ``protos/dataplane.proto``.

    A ``StrEnum``, so a member equals its name and goes onto the wire as ``dp.ErrorCode.Value(code)``;
    tests/unit/test_errors.py holds it equal to the proto's enum.
    """

    OK = "OK"
    BAD_FRAME = "BAD_FRAME"                  # malformed prefix/header/lengths: the connection closes
    INVALID_ARGUMENT = "INVALID_ARGUMENT"    # a well-formed frame with wrong content
    UNKNOWN_JOB = "UNKNOWN_JOB"
    UNKNOWN_TENSOR = "UNKNOWN_TENSOR"
    NOT_OWNER = "NOT_OWNER"                  # not owned at the client's epoch: refresh routing, retry
    STALE_STEP = "STALE_STEP"                # a push/commit for a step the node is not at
    NONFINITE = "NONFINITE"                  # a NaN/Inf gradient, refused
    TIMEOUT = "TIMEOUT"                      # a waiting pull gave up
    TOO_LARGE = "TOO_LARGE"                  # a payload over the node's frame limit
    INTERNAL = "INTERNAL"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    UNAVAILABLE = "UNAVAILABLE"              # stopping or restoring: refresh routing and retry
    WORKER_LOST = "WORKER_LOST"              # a worker was lost and the job fails
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # a node bound is reached: retry later
    COPY_BEHIND = "COPY_BEHIND"              # a copy holder cannot serve this read: ask the primary
    AGGREGATE_CONFLICT = "AGGREGATE_CONFLICT"  # an aggregated push overlaps a rank's own: push alone


class ShardlineError(Exception):
    """Base class of every error Shardline raises on purpose."""


class ShardlineConfigError(ShardlineError, ValueError):
    """A configuration value or argument is invalid. The message quotes the key and the bad value."""


class ShardlineTimeoutError(ShardlineError, TimeoutError):
    """An operation did not finish within its ``*_timeout``."""


class StepTimeoutError(ShardlineTimeoutError):
    """A BSP step was not applied within ``pull_timeout``; ``ranks`` are the ranks that had not
    committed it (empty if every rank had: the nodes waited for replicas or a handover), ``step``
    the step."""

    def __init__(self, message: str, ranks: tuple[int, ...] = (), step: int | None = None):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.step = step


class ShardlineStateError(ShardlineError):
    """An operation is not valid in the current state (e.g. a push for a step the node is not at)."""


class ShardlineConnectionError(ShardlineError, ConnectionError):
    """A peer could not be reached or closed the connection."""


class NotLeaderError(ShardlineConnectionError):
    """The dispatcher asked is a follower; ``leader`` is the leader's address ('' while none is known)."""

    def __init__(self, message: str, leader: str = ""):
        super().__init__(message)
        self.leader = leader


class ShardlineWorkerLostError(ShardlineStateError):
    """A worker of the job was lost (its lease expired) and the job fails (``on_worker_failure:
    fail``); ``ranks`` are the lost ranks."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class ShardlineChecksumError(ShardlineError):
    """Data kept failing its end-to-end checksum (a subscriber's block, pulled again each time)."""


class FrameError(ShardlineError):
    """A data-plane frame is malformed; the connection it came on cannot be trusted further."""


class FrameTooLargeError(FrameError):
    """A frame's header or payload exceeds the configured limit."""


class RequestError(ShardlineError):
    """A data-plane request refused where it is handled (a PS node, a rack cache).

    The connection loop (services/dataplane_server.py) answers it with an error reply carrying
    ``code`` (an :class:`ErrorCode`), the message and the server's routing epoch. The PS's store
    raises it under the name ``StoreError``.
    """

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code

    @property
    def reply_message(self) -> str:
        """The text the error reply carries."""
        return str(self)


class RemoteError(ShardlineError):
    """A data-plane peer answered with an error reply.

    ``code`` is the ``ErrorCode`` name from ``dataplane.proto`` (e.g. ``"UNKNOWN_TENSOR"``).
    """

    def __init__(self, code: str, message: str, *, epoch: int = 0, step: int = 0):
        # not super(): NotOwnerError puts RequestError next in the MRO, whose signature differs
        ShardlineError.__init__(self, f"{code}: {message}")
        self.code = code
        self.remote_message = message
        self.epoch = epoch
        self.step = step


class NotOwnerError(RemoteError, RequestError):
    """The node does not own a requested block at the client's epoch; ``epoch`` is the node's.

    One type on both sides: the node raises it (a :class:`RequestError`: the error reply names
    NOT_OWNER and this ``epoch``), the client raises it again from that reply (a
    :class:`RemoteError`), and a rack cache passes a node's on as its own refusal.
    """

    def __init__(self, code: str = ErrorCode.NOT_OWNER, message: str = "", *, epoch: int = 0, step: int = 0):
        super().__init__(code, message, epoch=epoch, step=step)

    @property
    def reply_message(self) -> str:
        return self.remote_message
