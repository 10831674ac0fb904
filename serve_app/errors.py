"""One exception hierarchy and the one table that maps failures to gRPC status codes.

Stages raise these; only the ingress turns them into `Error{code, message}` (or a gRPC
status). Codes are google.rpc.Code values, kept here as ints so no stage imports grpc. The
engines' own InvalidImage (engines/images.py: the image policy, which knows nothing of the
server) is mapped here with the foreign failures.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import IntEnum
from typing import TypeVar

from google.protobuf.message import DecodeError, Message
from ray import exceptions as ray_exceptions
from ray.serve import exceptions as serve_exceptions

from engines.images import InvalidImage


class Code(IntEnum):
    """The google.rpc.Code values raystream answers with (grpc.StatusCode's numbers)."""

    OK = 0
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    INTERNAL = 13
    UNAVAILABLE = 14


def code_name(code: int) -> str:
    """The status name of `code` ("OK", "INVALID_ARGUMENT", ...), as metrics and logs say
    it and as grpc.StatusCode spells it; the number itself for a code not in the table."""
    try:
        return Code(code).name
    except ValueError:
        return str(code)


class RaystreamError(Exception):
    """Base of every error raystream reports on purpose; `code` is its gRPC status code."""

    code = Code.INTERNAL


class InvalidArgument(RaystreamError):
    code = Code.INVALID_ARGUMENT


class ModelNotFound(RaystreamError):
    code = Code.NOT_FOUND


class DuplicateRequest(RaystreamError):
    code = Code.ALREADY_EXISTS


class ModelControlOff(RaystreamError):
    """A model load or unload where the config does not allow them (model_control)."""

    code = Code.FAILED_PRECONDITION


class Overloaded(RaystreamError):
    code = Code.RESOURCE_EXHAUSTED


class StageBusy(Overloaded):
    """A stage replica's port refused a call: the replica holds its deployment's
    `max_ongoing_requests` calls already. The caller sends it to another replica, or by
    Serve's handle, which queues it (serve_app/transport/stage_port.py)."""


class DeadlineExceeded(RaystreamError):
    """The request's deadline (its `timeout_ms`, or the call's gRPC deadline) passed first."""

    code = Code.DEADLINE_EXCEEDED


class Unavailable(RaystreamError):
    """Not able to serve now (a model version that failed to load)."""

    code = Code.UNAVAILABLE


class StageError(RaystreamError):
    """A stage's failure as a stage port's answer carried it (serve_app/transport/codec.py):
    its status code, its one-line message, and whether a replica was lost on the way."""

    def __init__(self, code: int, message: str, replica_lost: bool = False) -> None:
        super().__init__(message)
        self.code = Code(code) if code in Code._value2member_map_ else Code.INTERNAL
        self.replica_lost = replica_lost


# Failures raised by the engines, Ray or asyncio rather than by us, most specific first.
_FOREIGN_CODES: tuple[tuple[type[BaseException], Code], ...] = (
    (InvalidImage, Code.INVALID_ARGUMENT),
    (serve_exceptions.BackPressureError, Code.RESOURCE_EXHAUSTED),
    (serve_exceptions.RequestCancelledError, Code.CANCELLED),
    (serve_exceptions.DeploymentUnavailableError, Code.UNAVAILABLE),
    (ray_exceptions.ActorDiedError, Code.UNAVAILABLE),
    (ray_exceptions.ActorUnavailableError, Code.UNAVAILABLE),
    (ray_exceptions.RayActorError, Code.UNAVAILABLE),
    (asyncio.TimeoutError, Code.DEADLINE_EXCEEDED),
    (asyncio.CancelledError, Code.CANCELLED),
)


# A stage replica that went away mid-call (its process killed, its node lost): the call's
# requests may run again elsewhere. A deployment that is unavailable as a whole is not this.
_REPLICA_LOST = (
    ray_exceptions.ActorDiedError,
    ray_exceptions.ActorUnavailableError,
    ray_exceptions.RayActorError,
    asyncio.CancelledError,
)


def _causes(exc: BaseException | None, depth: int = 5):
    for _ in range(depth):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__


def replica_lost(exc: BaseException) -> bool:
    """True when `exc` (or what caused it: a chained call wraps its upstream's death) says
    that a stage replica stopped while running the call. A CancelledError counts: Serve
    cancels the calls of a replica it stops, and their callers get it bare (a caller tells
    its own cancellation apart first: `cancelled_itself`)."""
    return any(
        isinstance(seen, _REPLICA_LOST) or getattr(seen, "replica_lost", False) is True
        for seen in _causes(exc)
    )


def cancelled_itself() -> bool:
    """Whether the running task was asked to cancel (not only a call it awaited). Python
    3.10 cannot tell: yes."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return cancelling is None or cancelling() > 0


def code_for(exc: BaseException) -> Code:
    """The gRPC status code that says what went wrong; INTERNAL for anything unexpected.

    Follows `__cause__`: Serve wraps an upstream replica's death (ActorDiedError) in a plain
    RayServeException when a chained call loses its input."""
    for seen in _causes(exc):
        if isinstance(seen, RaystreamError):
            return seen.code
        for kind, code in _FOREIGN_CODES:
            if isinstance(seen, kind):
                return code
    return Code.INTERNAL


MAX_MESSAGE_CHARS = 1024  # what an error message may carry back to a client or into a log


M = TypeVar("M", bound=Message)


def parsed_or_none(message: type[M]) -> Callable[[bytes], M | None]:
    """A gRPC request deserializer that gives None for bytes that are not a `message`, for
    the handler to answer INVALID_ARGUMENT: one that raised would end the call, or the whole
    stream, with gRPC's UNKNOWN."""

    def parse(data: bytes) -> M | None:
        try:
            return message.FromString(data)
        except DecodeError:
            return None

    return parse


def clip(text: str, limit: int = 80) -> str:
    """`text` cut to `limit` characters: client-given strings that messages and logs echo."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


_OWN_MESSAGES = (RaystreamError, InvalidImage)  # written for clients: passed on as they are


def message_for(exc: BaseException) -> str:
    """A one-line message for clients: our own messages as written, others by type; never
    longer than MAX_MESSAGE_CHARS."""
    if isinstance(exc, _OWN_MESSAGES):
        return clip(str(exc), MAX_MESSAGE_CHARS)
    cause = getattr(exc, "cause", None)  # RayTaskError wraps the replica's exception
    if isinstance(cause, _OWN_MESSAGES):
        return clip(str(cause), MAX_MESSAGE_CHARS)
    text = str(exc).strip().splitlines()
    return clip(f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": "), MAX_MESSAGE_CHARS)
