"""Domain exceptions and the one table that gives each its status code.

Anything below the frontends raises one of these; each transport turns them into its wire form from
:func:`to_status` (the code and message) and the error's fields: the gRPC frontends
(``frontends/grpc_transport.py``: the status, and the ``grpc-retry-pushback-ms`` trailer from
``ResourceExhausted.retry_after_s``) and the HTTP routes (``frontends/http_transport.py``: ``HTTP_STATUS`` of the code,
and ``Retry-After``). An exception that is not a :class:`RelserveError` is a bug: it becomes INTERNAL for
that request only and the server keeps serving.

Every message says what was wrong and, where there is one, what the limit is.
"""

from __future__ import annotations

import grpc


def shown(value: str, limit: int = 64) -> str:
    """``repr(value)``, cut to ``limit`` characters and marked when longer: client input quoted in a status
    message stays small (a message echoing a 20,000-character model name would itself overflow the
    metadata limit and turn NOT_FOUND into RESOURCE_EXHAUSTED)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


class RelserveError(Exception):
    """Base of the domain exceptions; the message is sent to the client as the status details."""


class InvalidArgument(RelserveError):
    """Bad or empty input, or a field value out of range."""


class NotFound(RelserveError):
    """Unknown model (the message lists the loaded ones)."""


class FailedPrecondition(RelserveError):
    """The model exists but cannot do what was asked (e.g. Answer on a classification model)."""


class ResourceExhausted(RelserveError):
    """Queue full, or a request larger than a configured limit.

    Args:
        message: what was exhausted and the limit.
        retry_after_s: for a full queue, seconds after which a retry could be taken (the retry hint every
            transport sends: gRPC's ``grpc-retry-pushback-ms`` trailer, HTTP's ``Retry-After``; see
            ``service/scheduling/pushback.py``); None for a request that no retry would help (over a size limit).
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(RelserveError):
    """The request's deadline passed before its work was computed."""


class Unavailable(RelserveError):
    """The server is draining, or the model is not loaded and warmed up yet."""


class Cancelled(RelserveError):
    """The client cancelled the request."""


class Internal(RelserveError):
    """A failure that is not the client's fault (a backend error, a non-finite model output)."""


class ConfigError(ValueError):
    """Invalid server configuration (raised at start-up, never sent over the wire)."""


# The one table. Order matters only for subclasses (first match wins); keep the most specific first.
STATUS_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (Cancelled, grpc.StatusCode.CANCELLED),
    (Internal, grpc.StatusCode.INTERNAL),
)


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception to ``(status code, details)``.

    Domain exceptions keep their message. Anything else is unexpected: INTERNAL, with the exception
    type in the details so the log line and the client's error can be matched up.
    """
    for exc_type, code in STATUS_CODES:
        if isinstance(exc, exc_type):
            return code, str(exc) or exc_type.__name__
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}: {exc})"


def code_name(code: grpc.StatusCode) -> str:
    """The status code as used in metric labels, e.g. ``"NOT_FOUND"``."""
    return code.name
