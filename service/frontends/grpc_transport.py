"""What both gRPC frontends (``grpc_v1``, ``kserve_v2_grpc``) share: registering a servicer with the tolerant
request deserializer (:func:`register`), the handler wrapper (:func:`rpc`) that maps every exception to a
gRPC status through :func:`relserve.service.errors.to_status` and records the request metrics, the
retry-hint trailers (:func:`pushback_trailers`), and stream writes (:func:`write_message`). No torch.

Retry hints: a :class:`~relserve.service.errors.ResourceExhausted` with ``retry_after_s`` (a full queue)
gets the ``grpc-retry-pushback-ms`` trailer (gRFC A6; clients' retryPolicy honours it); one without (a
request over a limit, which no retry helps) gets ``-1``, "do not retry".
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Awaitable, Callable

import grpc

from .. import metrics
from ..errors import to_status
from ..scheduling.pushback import NO_RETRY_PUSHBACK, PUSHBACK_TRAILER, pushback_ms
from .messages import MalformedRequest, check_message_size, refuse_malformed, tolerant_deserializer

log = logging.getLogger(__name__)


def register(servicer: Any, server: grpc.aio.Server, module: Any, service_name: str) -> None:
    """Register ``servicer``'s RPCs of service ``service_name`` (declared in the generated ``module``) on
    ``server``, each request decoded by :func:`~.messages.tolerant_deserializer` (what the generated
    ``add_*Servicer_to_server`` does, without grpc's own deserializer)."""
    service = module.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for method in service.methods:
        request_type = getattr(module, method.input_type.name)
        response_type = getattr(module, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=tolerant_deserializer(request_type),
                                     response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def pushback_trailers(exc: BaseException, status: grpc.StatusCode) -> tuple[tuple[str, str], ...]:
    """The retry-hint trailers of an error answered with ``status``: the pushback of a full queue
    (``exc.retry_after_s``), "do not retry" for any other RESOURCE_EXHAUSTED, else none."""
    retry_after_s = getattr(exc, "retry_after_s", None)
    if retry_after_s is not None:
        return ((PUSHBACK_TRAILER, pushback_ms(retry_after_s)),)
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ((PUSHBACK_TRAILER, NO_RETRY_PUSHBACK),)
    return ()


class Scope:
    """What the error/metrics wrapper needs to know about a request once the handler knows it."""

    __slots__ = ("model", "inflight", "task")

    def __init__(self, task: str = "") -> None:
        self.model = metrics.UNKNOWN_MODEL
        self.inflight = False
        self.task = task  # the metrics label; a handler serving several tasks (KServe v2 ModelInfer) sets it

    def count_inflight(self) -> None:
        """The request now runs on its model: count it in flight under ``model`` until it ends."""
        metrics.inflight(self.model, +1)
        self.inflight = True


def rpc(task: str) -> Callable:
    """Wrap a handler ``(self, request, context, scope)``: map exceptions to status codes (one table), send the
    retry-hint trailers, record metrics, refuse replies over ``self.max_send_message_length``, never crash
    the server."""

    def decorate(handler: Callable[..., Awaitable[Any]]) -> Callable:
        @functools.wraps(handler)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0 = time.monotonic()
            scope = Scope(task)
            code = "OK"
            recorded = False

            def record() -> None:
                nonlocal recorded
                if recorded:
                    return
                recorded = True
                if scope.inflight:
                    metrics.inflight(scope.model, -1)
                metrics.observe_request(scope.model, scope.task, code, time.monotonic() - t0)

            try:
                if isinstance(request, MalformedRequest):
                    raise refuse_malformed(request)
                reply = await handler(self, request, context, scope)
                if reply is not None:
                    check_message_size(reply, self.max_send_message_length, "reply")
                return reply
            except asyncio.CancelledError:
                # grpc cancels the handler both when the client cancels and when the deadline passes.
                code = (grpc.StatusCode.DEADLINE_EXCEEDED if _expired(context) else grpc.StatusCode.CANCELLED).name
                raise
            except CallEnded:
                # The client left before grpc told the context so (cancelled() may still read False): no status
                # can reach it, so the call is counted as the client ended it, not as a server fault.
                code = (grpc.StatusCode.DEADLINE_EXCEEDED if _expired(context) else grpc.StatusCode.CANCELLED).name
                raise asyncio.CancelledError() from None
            except Exception as exc:
                if _cancelled_by_client(context):
                    # Whatever failed after the client cancelled (grpc's own errors on the ended call among them):
                    # the call ended CANCELLED, it is no server fault.
                    code = grpc.StatusCode.CANCELLED.name
                    raise asyncio.CancelledError() from None
                status, details = to_status(exc)
                code = status.name
                if status == grpc.StatusCode.INTERNAL:
                    log.exception("%s on model %r failed: %s", handler.__name__, scope.model, details)
                if _expired(context):
                    # The call already ended with DEADLINE_EXCEEDED; aborting a finished call only logs noise.
                    code = grpc.StatusCode.DEADLINE_EXCEEDED.name
                    raise asyncio.CancelledError() from None
                trailers = pushback_trailers(exc, status)
                if trailers:
                    context.set_trailing_metadata(trailers)
                # Recorded before the status leaves: a client that reads /metrics right after its error must
                # find it counted (abort sends the status, then the finally would run later).
                record()
                await context.abort(status, details)
            finally:
                record()

        wrapper.task = task  # the metrics label, also for calls refused before the handler runs (auth)
        return wrapper

    return decorate


class CallEnded(Exception):
    """A stream message could not be sent because the call is already over (the client cancelled or its
    connection went); raised by :func:`write_message`, counted CANCELLED by the handler wrapper."""


async def write_message(context: grpc.aio.ServicerContext, message: Any, limit: int) -> None:
    """Send one message of a server stream, of at most ``limit`` bytes (``max_send_message_length``).

    Raises:
        ResourceExhausted: the message is over ``limit`` (:func:`~.messages.check_message_size`), checked
            first, since grpc's refusal of an oversized write looks like that of a write to an ended call.
        CallEnded: grpc refused the write (``grpc.aio.InternalError``, in practice its ``ExecuteBatchError``):
            the call has ended on the wire. This can happen before ``context.cancelled()`` turns True, because
            the write's failure and the cancel notification reach the server separately.
    """
    check_message_size(message, limit, "stream message")
    try:
        await context.write(message)
    except grpc.aio.InternalError as exc:
        raise CallEnded(f"the call ended before a stream message could be sent: {exc}") from exc


def _cancelled_by_client(context: grpc.aio.ServicerContext) -> bool:
    """Whether the client cancelled the call (not its deadline passing); a context without ``cancelled``
    (a test's stand-in) never is."""
    cancelled = getattr(context, "cancelled", None)
    return bool(cancelled is not None and cancelled()) and not _expired(context)


def _expired(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline as a ``time.monotonic()`` value, or None without one."""
    remaining = context.time_remaining()
    if remaining is None:
        return None
    return time.monotonic() + max(0.0, remaining)
