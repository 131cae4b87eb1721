"""Protobuf request and reply messages as every frontend sees them: a request whose bytes (or JSON) did not
decode (:class:`MalformedRequest`, logged at most once per interval, answered INVALID_ARGUMENT) and the
reply size limit (:func:`check_message_size`, ``max_send_message_length``). No torch.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from google.protobuf.message import DecodeError

from ..errors import InvalidArgument, ResourceExhausted, shown

log = logging.getLogger(__name__)

MALFORMED_LOG_INTERVAL_S = 10.0  # at most one log line per interval for undecodable requests


class MalformedRequest:
    """Stands in for a request whose bytes did not decode as the RPC's message type."""

    __slots__ = ("type_name", "size", "error")

    def __init__(self, type_name: str, size: int, error: str) -> None:
        self.type_name, self.size, self.error = type_name, size, error


class _MalformedLog:
    """Rate-limited logging of undecodable requests: one line per interval, with how many were dropped."""

    def __init__(self, interval_s: float = MALFORMED_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.next_at = 0.0
        self.suppressed = 0

    def note(self, request: MalformedRequest) -> None:
        """Log ``request`` unless a line went out within the interval (then count it for the next one)."""
        now = time.monotonic()
        if now < self.next_at:
            self.suppressed += 1
            return
        log.warning("undecodable %s (%d bytes): %s (%d more since the last report)", request.type_name,
                    request.size, request.error, self.suppressed)
        self.next_at, self.suppressed = now + self.interval_s, 0


_malformed_log = _MalformedLog()


def refuse_malformed(request: MalformedRequest) -> InvalidArgument:
    """Log ``request`` (rate-limited) and return the INVALID_ARGUMENT that answers it."""
    _malformed_log.note(request)
    return InvalidArgument(f"the request is not a valid {request.type_name} message ({request.size} bytes): "
                           f"{request.error}")


def tolerant_deserializer(message_type: type) -> Callable[[bytes], Any]:
    """A request deserializer that returns a :class:`MalformedRequest` for bytes that are not a valid
    ``message_type`` (e.g. invalid UTF-8 in a string field), where grpc's own would end the call with
    UNKNOWN and a traceback, uncounted."""

    def deserialize(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return MalformedRequest(message_type.DESCRIPTOR.full_name, len(data), str(exc)[:200])

    return deserialize


def check_message_size(message: Any, limit: int, what: str) -> None:
    """Refuse a reply (or one stream message) grpc would refuse to send: otherwise the client sees grpc's own
    RESOURCE_EXHAUSTED and the server a failed write it cannot tell from a client that left.

    Raises:
        ResourceExhausted: ``message`` serializes to more than ``limit`` bytes (``max_send_message_length``).
    """
    size = message.ByteSize()
    if size > limit:
        raise ResourceExhausted(
            f"the {what} is {size} bytes, over the server's max_send_message_length of {limit} bytes; send fewer "
            f"or shorter texts, ask for less per text (fewer hypotheses or alignments; entities: a coarser "
            f"aggregation_strategy or more ignore_labels), or raise the limit in the server config"
        )


def oneof_values(params: Any, what: str, choices: str) -> dict[str, Any]:
    """A protobuf ``map<string, P>`` whose ``P`` holds its value in the oneof ``parameter_choice`` (KServe v2's
    ``InferParameter``, Triton's ``ModelRepositoryParameter``) as plain Python values.

    Raises:
        InvalidArgument: an entry with no value set (names ``what`` and the key, and lists ``choices``).
    """
    out: dict[str, Any] = {}
    for key, p in params.items():
        kind = p.WhichOneof("parameter_choice")
        if kind is None:
            raise InvalidArgument(f"{what} {shown(key)} has no value; set one of {choices}")
        out[key] = getattr(p, kind)
    return out
