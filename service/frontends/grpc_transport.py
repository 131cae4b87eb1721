"""What both gRPC frontends (``grpc_v1``, ``kserve_v2_grpc``) share: registering a servicer with the tolerant
request deserializer (:func:`register`; repeated fields optionally counted on the wire before any parse,
:func:`counting_deserializer`), the handler wrapper (:func:`rpc`) that maps every exception to a
gRPC status through :func:`relserve.service.errors.to_status` and records the request metrics, the
retry-hint trailers (:func:`pushback_trailers`), stream writes with a timeout for readers that stopped
(:func:`write_message`), and the per-call limits of the whole port (:class:`CallGuard`: a cap on concurrent
calls, a deadline for the request message). No torch.

Retry hints: a :class:`~relserve.service.errors.ResourceExhausted` with ``retry_after_s`` (a full queue)
gets the ``grpc-retry-pushback-ms`` trailer (gRFC A6; clients' retryPolicy honours it); one without (a
request over a limit, which no retry helps) gets ``-1``, "do not retry".
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from typing import Any, Awaitable, Callable, Mapping

import grpc

from .. import metrics, tracing
from ..errors import InvalidArgument, to_status
from ..scheduling.pushback import NO_RETRY_PUSHBACK, PUSHBACK_TRAILER, pushback_ms
from .messages import MalformedRequest, check_message_size, refuse_malformed, tolerant_deserializer

log = logging.getLogger(__name__)


def register(servicer: Any, server: grpc.aio.Server, module: Any, service_name: str,
             entry_caps: Mapping[str, Mapping[str, int]] | None = None) -> None:
    """Register ``servicer``'s RPCs of service ``service_name`` (declared in the generated ``module``) on
    ``server``, each request decoded by :func:`~.messages.tolerant_deserializer` (what the generated
    ``add_*Servicer_to_server`` does, without grpc's own deserializer).

    ``entry_caps``: per request message name, repeated fields whose entries are counted on the wire before the
    message is parsed (:func:`counting_deserializer`), with the most entries any served model takes."""
    service = module.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for method in service.methods:
        request_type = getattr(module, method.input_type.name)
        response_type = getattr(module, method.output_type.name)
        caps = (entry_caps or {}).get(method.input_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=(counting_deserializer(request_type, caps) if caps
                                                           else tolerant_deserializer(request_type)),
                                     response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


class TooManyEntries:
    """Stands in for a request with more than ``counted`` entries in its repeated field ``field``, found by
    counting on the wire (:func:`count_entries`): never parsed. No served model takes more than ``limit``.
    Answered INVALID_ARGUMENT by :func:`rpc`."""

    __slots__ = ("field", "counted", "limit", "model", "key")

    def __init__(self, field: str, counted: int, limit: int, model: str, key: str = "max_request_texts") -> None:
        self.field, self.counted, self.limit, self.model, self.key = field, counted, limit, model, key

    def refusal(self) -> InvalidArgument:
        return InvalidArgument(f"the request has more than {self.counted} {self.field}; no model of this server "
                               f"takes more than {self.limit} per request ({self.key}); split the request")


# The wire count refuses only past this many entries (or the largest model limit, if higher): a request just over
# its model's limit parses cheaply and is refused by its task with the exact count.
WIRE_COUNT_MIN = 1024


# Top-level fields the wire count walks past before it leaves the verdict to the parser: a message padded with
# unknown fields costs the walk no more than a legitimate one.
COUNT_WALK_SLACK = 64


def counting_deserializer(message_type: type,
                          caps: Mapping[str, int | tuple[int, str]]) -> Callable[[bytes], Any]:
    """:func:`~.messages.tolerant_deserializer` behind a count of ``caps``' repeated fields on the wire (``caps``:
    the most entries any served model takes, or ``(that, its config key)`` where the key is not
    ``max_request_texts``): bytes with more than ``max(cap, WIRE_COUNT_MIN)`` entries in one of
    them give a :class:`TooManyEntries`, unparsed.

    Why: parsing is what a refused request cost. 1M one-character texts (3 MB on the wire) parse in 80-100 ms on
    the event loop into about 40 MB; counted here, the walk stops after ``WIRE_COUNT_MIN + 1`` entries."""
    parse = tolerant_deserializer(message_type)
    fields = {message_type.DESCRIPTOR.fields_by_name[name].number: (name, *(cap if isinstance(cap, tuple) else
                                                                           (cap, "max_request_texts")))
              for name, cap in caps.items()}
    counts = {number: max(cap, WIRE_COUNT_MIN) for number, (_name, cap, _key) in fields.items()}
    budget = sum(counts.values()) + COUNT_WALK_SLACK

    def deserialize(data: bytes) -> Any:
        over = count_entries(data, counts, budget)
        if over is not None:
            number, model = over
            name, limit, key = fields[number]
            return TooManyEntries(name, counts[number], limit, model, key)
        return parse(data)

    return deserialize


def count_entries(data: bytes, caps: Mapping[int, int], budget: int) -> tuple[int, str] | None:
    """Walk the top-level fields of protobuf wire bytes ``data``, counting the entries of each field number in
    ``caps``; ``(field number, model)`` as soon as one has more than its cap (``model``: field 1's string so far,
    relserve.v1's model name). None when none has, and also when the bytes are not plain wire format or the walk
    passed ``budget`` fields: the parser decides then."""
    counts = dict.fromkeys(caps, 0)
    model = ""
    pos, end, walked = 0, len(data), 0
    try:
        while pos < end:
            walked += 1
            if walked > budget:
                return None
            tag, pos = _varint(data, pos)
            number, wire_type = tag >> 3, tag & 7
            if wire_type == 2:
                length, pos = _varint(data, pos)
                if number == 1 and length <= 256:
                    model = data[pos:pos + length].decode("utf-8", "replace")
                pos += length
                if number in counts:
                    counts[number] += 1
                    if counts[number] > caps[number]:
                        return number, model
            elif wire_type == 0:
                _value, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            else:  # groups or a bad wire type: the parser's call
                return None
    except IndexError:  # truncated: the parser's call
        return None
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The base-128 varint at ``data[pos]`` and the position after it (IndexError when truncated)."""
    byte = data[pos]
    if byte < 0x80:
        return byte, pos + 1
    value, shift = byte & 0x7F, 7
    while True:
        pos += 1
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos + 1
        shift += 7
        if shift > 63:
            raise IndexError("varint longer than 10 bytes")


class CallGuard(grpc.aio.ServerInterceptor):
    """What every call of a grpc.aio server passes before its handler (the first interceptor of the server).

    * At most ``max_calls`` calls at once (``max_concurrent_rpcs``; None: no cap), counted from the handler's
      start to its end; a call over the cap is answered RESOURCE_EXHAUSTED at once, its request never read.
      Methods starting with one of ``exempt`` (health probes) are neither counted nor refused: a probe must
      answer while the server is full.
    * A call with one request message (every relserve.v1, KServe v2 and health RPC) must have sent it within
      ``read_timeout`` seconds (``request_read_timeout``; None: no limit), or it ends DEADLINE_EXCEEDED. Such
      handlers are served as client-streaming ones that read the message themselves: grpc's own unary path waits
      for it without a limit, so calls whose message never comes were kept until the connection closed.

    ``on_refused(method, code)`` is told of each call refused here (the server counts it in
    ``relserve_requests_total``). Synchronous handlers (run in grpc's thread pool) pass unchanged.
    """

    def __init__(self, *, max_calls: int | None = None, read_timeout: float | None = None,
                 exempt: tuple[str, ...] = (),
                 on_refused: Callable[[str, grpc.StatusCode], None] | None = None) -> None:
        self.max_calls = max_calls
        self.read_timeout = read_timeout
        self.exempt = exempt
        self.on_refused = on_refused
        self.running = 0  # counted calls whose handler runs now

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler
        method = details.method
        counted = self.max_calls is not None and not method.startswith(self.exempt)
        if handler.request_streaming:
            if not counted:
                return handler
            make = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
                    else grpc.stream_unary_rpc_method_handler)
            return make(self._guarded(behavior, method, counted, read=False),
                        request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
        make = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
                else grpc.stream_unary_rpc_method_handler)
        return make(self._guarded(behavior, method, counted, read=True),
                    request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    def _guarded(self, behavior: Callable, method: str, counted: bool, read: bool) -> Callable:
        """``behavior`` (of a unary-request handler when ``read``: it gets the message read here) behind the cap."""
        if inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext):
                if not await self._enter(context, method, counted):
                    return
                try:
                    if read:
                        request = await self._read(request, context, method)
                        if request is None:
                            return
                    async for reply in behavior(request, context):
                        yield reply
                finally:
                    self._leave(counted)

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if not await self._enter(context, method, counted):
                return None
            try:
                if read:
                    request = await self._read(request, context, method)
                    if request is None:
                        return None
                return await behavior(request, context)
            finally:
                self._leave(counted)

        return call

    async def _enter(self, context: grpc.aio.ServicerContext, method: str, counted: bool) -> bool:
        """Count the call in, or answer it RESOURCE_EXHAUSTED when the cap is reached (no await between the
        check and the count: they are one step of the event loop).

        Raises:
            grpc.aio.AbortError: the call was refused (grpc ends it with the refusal's status).
        """
        if not counted:
            return True
        if self.running >= self.max_calls:
            await self._refuse(context, method, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the server is serving its maximum of {self.max_calls} concurrent calls "
                               f"(max_concurrent_rpcs); retry later")
            return False
        self.running += 1
        return True

    def _leave(self, counted: bool) -> None:
        if counted:
            self.running -= 1

    async def _read(self, requests: Any, context: grpc.aio.ServicerContext, method: str) -> Any:
        """The call's one request message (decoded by the handler's deserializer), or None when the call was
        answered here instead (its message late).

        Raises:
            asyncio.CancelledError: the request stream ended without a message (grpc ends the call quietly).
            grpc.aio.AbortError: the message was late (grpc ends the call DEADLINE_EXCEEDED).
        """
        request = None
        try:
            async with asyncio.timeout(self.read_timeout):
                request = await context.read()
        except TimeoutError:
            pass
        if request is None:  # refused after the except block: see _refuse
            await self._refuse(context, method, grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"the request message did not arrive within {self.read_timeout:g} s of the call's "
                               f"start (request_read_timeout)")
            return None
        if request is grpc.aio.EOF:
            # No message: grpc core refused it (over max_receive_message_length, answered RESOURCE_EXHAUSTED by
            # core itself) or the client left. Ended as grpc's own unary path ends it: silently.
            raise asyncio.CancelledError()
        return request

    async def _refuse(self, context: grpc.aio.ServicerContext, method: str, status: grpc.StatusCode,
                      details: str) -> None:
        """End the call with ``status`` and ``details`` (counted first, so that a client reading /metrics right
        after the refusal finds it). An abort, as the rpc wrapper's: the reply is trailers-only, which a
        client's retry policy may retry (a status after a message frame, as set_code with a handler returning
        None sends, commits the call), and never from inside an except block (the exception would chain)."""
        if self.on_refused is not None:
            self.on_refused(method, status)
        await context.abort(status, details)


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
            call = tracing.begin_grpc(handler.__name__, self.protocol, context)  # None: nothing to trace or log
            recorded = False
            failure: tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]] | None = None

            def record() -> None:
                nonlocal recorded
                if recorded:
                    return
                recorded = True
                if scope.inflight:
                    metrics.inflight(scope.model, -1)
                metrics.observe_request(scope.model, scope.task, code, time.monotonic() - t0, protocol=self.protocol)

            try:
                if isinstance(request, MalformedRequest):
                    raise refuse_malformed(request)
                if isinstance(request, TooManyEntries):
                    if request.model in getattr(getattr(self, "registry", None), "runners", ()):
                        scope.model = request.model  # counted under the model it named
                    raise request.refusal()
                reply = await handler(self, request, context, scope)
                if reply is not None:
                    check_message_size(reply, self.max_send_message_length, "reply")
                return reply
            except asyncio.CancelledError:
                # grpc cancels the handler both when the client cancels and when the deadline passes.
                code = (grpc.StatusCode.DEADLINE_EXCEEDED if _expired(context) else grpc.StatusCode.CANCELLED).name
                raise
            except StreamStalled as exc:
                # The client stopped reading: its final status would queue behind the unread messages, so the
                # handler ends now (its work and buffers freed) and the status follows in the background.
                code = grpc.StatusCode.DEADLINE_EXCEEDED.name
                record()
                _send_status_later(context, grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
                raise asyncio.CancelledError() from None
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
                failure = (status, details, pushback_trailers(exc, status))
                # Recorded before the status leaves: a client that reads /metrics right after its error must
                # find it counted.
                record()
            finally:
                record()
                if call is not None:
                    call.end(scope.model, code)
            # Aborted here, after the except block, with the request dropped: raised inside it, abort's
            # exception would chain the domain error, whose traceback holds the handler's frames and the parsed
            # request, in a reference cycle until the garbage collector ran (a flood of refused 1M-text requests
            # held 1.6 GB so). abort, not set_code: its reply is trailers-only, which a client's retry policy
            # may still retry (a reply with a message frame commits the call).
            request = None  # noqa: F841 - the frame must not keep the refused request alive
            status, details, trailers = failure
            await context.abort(status, details, trailing_metadata=trailers)

        wrapper.task = task  # the metrics label, also for calls refused before the handler runs (auth)
        return wrapper

    return decorate


class CallEnded(Exception):
    """A stream message could not be sent because the call is already over (the client cancelled or its
    connection went); raised by :func:`write_message`, counted CANCELLED by the handler wrapper."""


class StreamStalled(Exception):
    """A stream message waited longer than the stream write timeout to be sent: the client stopped reading (its
    flow-control window is full). Raised by :func:`write_message`; the handler wrapper ends the call
    DEADLINE_EXCEEDED."""


async def write_message(context: grpc.aio.ServicerContext, message: Any, limit: int,
                        timeout: float | None = None) -> None:
    """Send one message of a server stream, of at most ``limit`` bytes (``max_send_message_length``), waiting at
    most ``timeout`` seconds (``stream_write_timeout``; None: no limit) for the client to take it.

    Raises:
        StreamStalled: the message was not taken within ``timeout``: a reader that stopped consuming would
            otherwise hold the stream, its handler and the work behind it until its deadline.
        ResourceExhausted: the message is over ``limit`` (:func:`~.messages.check_message_size`), checked
            first, since grpc's refusal of an oversized write looks like that of a write to an ended call.
        CallEnded: grpc refused the write (``grpc.aio.InternalError``, in practice its ``ExecuteBatchError``):
            the call has ended on the wire. This can happen before ``context.cancelled()`` turns True, because
            the write's failure and the cancel notification reach the server separately.
    """
    check_message_size(message, limit, "stream message")
    try:
        async with asyncio.timeout(timeout):
            await context.write(message)
    except TimeoutError:
        raise StreamStalled(f"the client read no stream message for {timeout:g} s (stream_write_timeout); the "
                            f"stream was ended") from None
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


_background: set[asyncio.Task] = set()  # status sends under way (a task needs a reference until it is done)


def _send_status_later(context: grpc.aio.ServicerContext, status: grpc.StatusCode, details: str) -> None:
    """Send the call's final status without waiting for it: it leaves once the client has read what is queued
    before it, or never (the call then ends with the client's deadline or connection)."""

    async def send() -> None:
        try:
            await context.abort(status, details)
        except (Exception, asyncio.CancelledError):  # AbortError once sent; grpc's error if the call ended first
            pass

    task = asyncio.get_running_loop().create_task(send())
    _background.add(task)
    task.add_done_callback(_background.discard)
