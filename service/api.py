"""The relserve.v1.Inference servicer (grpc.aio): validate, call the model runner, build the reply.

Requests are decoded by :func:`add_to_server`'s handlers: bytes that are not a valid message of the RPC's
request type (e.g. invalid UTF-8 in a string field) become a :class:`MalformedRequest`, which the wrapper
answers with INVALID_ARGUMENT and counts like any other status (grpc's own deserializer would end the call
with UNKNOWN and a traceback, uncounted). Each request is validated once, before any tokenizing, by its task's ``validate_*`` in
:mod:`relserve.service.tasks` (against the runner's limits); the runner gets the checked values. Errors are
mapped in one place, :func:`_rpc`, using the table in :mod:`relserve.service.errors`; the handlers only
raise domain exceptions; a full queue's RESOURCE_EXHAUSTED also gets the ``grpc-retry-pushback-ms`` trailer
(gRFC A6) from the exception's ``retry_after_s`` (:mod:`relserve.service.pushback`). Request metrics (count by
code, duration, in-flight; the time to a RESOURCE_EXHAUSTED refusal) are recorded there too. No torch here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from . import metrics
from ._proto import inference_pb2, inference_pb2_grpc
from .backends.base import TASK_CLASSIFICATION, TASK_QA, TASK_TRANSLATION
from .errors import InvalidArgument, ResourceExhausted, to_status
from .pushback import NO_RETRY_PUSHBACK, PUSHBACK_TRAILER, pushback_ms
from .registry import ModelRegistry
from .tasks import classify, qa, translate
from .tasks.translate import TranslationItem

log = logging.getLogger(__name__)

SERVICE_NAME = "relserve.v1.Inference"


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
        now = time.monotonic()
        if now < self.next_at:
            self.suppressed += 1
            return
        log.warning("undecodable %s (%d bytes): %s (%d more since the last report)", request.type_name,
                    request.size, request.error, self.suppressed)
        self.next_at, self.suppressed = now + self.interval_s, 0


_malformed_log = _MalformedLog()


def _tolerant_deserializer(message_type: type) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return MalformedRequest(message_type.DESCRIPTOR.full_name, len(data), str(exc)[:200])

    return deserialize


def add_to_server(servicer: "InferenceServicer", server: grpc.aio.Server) -> None:
    """Register ``servicer``'s RPCs of ``relserve.v1.Inference`` on ``server`` (what the generated
    ``add_InferenceServicer_to_server`` does, with the tolerant request deserializer above)."""
    service = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    handlers = {}
    for method in service.methods:
        request_type = getattr(inference_pb2, method.input_type.name)
        response_type = getattr(inference_pb2, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=_tolerant_deserializer(request_type),
                                     response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


class _Scope:
    """What the error/metrics wrapper needs to know about a request once the handler knows it."""

    __slots__ = ("model", "inflight", "task")

    def __init__(self, task: str = "") -> None:
        self.model = metrics.UNKNOWN_MODEL
        self.inflight = False
        self.task = task  # the metrics label; a handler serving several tasks (KServe v2 ModelInfer) sets it


def _rpc(task: str) -> Callable:
    """Wrap a handler: map exceptions to status codes (one table), record metrics, never crash the server."""

    def decorate(handler: Callable[..., Awaitable[Any]]) -> Callable:
        @functools.wraps(handler)
        async def wrapper(self: "InferenceServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0 = time.monotonic()
            scope = _Scope(task)
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
                    _malformed_log.note(request)
                    raise InvalidArgument(f"the request is not a valid {request.type_name} message "
                                          f"({request.size} bytes): {request.error}")
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
                retry_after_s = getattr(exc, "retry_after_s", None)
                if retry_after_s is not None:  # a full queue: when to retry (gRFC A6; clients' retryPolicy honours it)
                    context.set_trailing_metadata(((PUSHBACK_TRAILER, pushback_ms(retry_after_s)),))
                elif status == grpc.StatusCode.RESOURCE_EXHAUSTED:  # over a limit: retrying cannot help
                    context.set_trailing_metadata(((PUSHBACK_TRAILER, NO_RETRY_PUSHBACK),))
                # Recorded before the status leaves: a client that reads /metrics right after its error must
                # find it counted (abort sends the status, then the finally would run later).
                record()
                await context.abort(status, details)
            finally:
                record()

        wrapper.task = task  # the metrics label, also for calls refused before the handler runs (auth)
        return wrapper

    return decorate


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
            f"or shorter texts, ask for fewer hypotheses or alignments, or raise the limit in the server config"
        )


class CallEnded(Exception):
    """A stream message could not be sent because the call is already over (the client cancelled or its
    connection went); raised by :func:`write_message`, counted CANCELLED by the handler wrapper."""


async def write_message(context: grpc.aio.ServicerContext, message: Any, limit: int) -> None:
    """Send one message of a server stream, of at most ``limit`` bytes (``max_send_message_length``).

    Raises:
        ResourceExhausted: the message is over ``limit`` (:func:`check_message_size`), checked first, since
            grpc's refusal of an oversized write looks like that of a write to an ended call.
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
    """Whether the client cancelled the call (not its deadline passing); contexts without ``cancelled`` (the
    HTTP adapter) never are."""
    cancelled = getattr(context, "cancelled", None)
    return bool(cancelled is not None and cancelled()) and not _expired(context)


def _expired(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    if remaining is None:
        return None
    return time.monotonic() + max(0.0, remaining)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, registry: ModelRegistry, max_send_message_length: int = 4 * 1024 * 1024) -> None:
        self.registry = registry
        self.max_send_message_length = max_send_message_length

    def _enter(self, scope: _Scope, name: str, task: str):
        if name in self.registry.runners:
            scope.model = name
        runner = self.registry.get(name, task)
        metrics.inflight(scope.model, +1)
        scope.inflight = True
        return runner

    @_rpc("list_models")
    async def ListModels(self, request, context, scope):
        scope.model = ""
        out = inference_pb2.ListModelsResponse()
        for name in self.registry.names():
            info = self.registry.runners[name].info()
            out.models.add(
                name=info.name, task=info.task, family=info.family, backend=info.backend, device=info.device,
                dtype=info.dtype, max_seq_len=info.max_seq_len, labels=list(info.labels),
                max_batch_size=info.max_batch_size, function_to_apply=info.function_to_apply,
                dtype_reason=info.dtype_reason,
            )
        return out

    @_rpc(TASK_CLASSIFICATION)
    async def Classify(self, request, context, scope):
        runner = self._enter(scope, request.model, TASK_CLASSIFICATION)
        texts, pairs = classify.validate_classify(list(request.texts), list(request.text_pairs), int(request.top_k),
                                                  len(runner.info().labels), runner.name,
                                                  max_texts=runner.config.max_request_texts,
                                                  max_chars=runner.config.max_request_chars)
        function = classify.validate_function(request.function_to_apply)
        items, _timings = await runner.classify(texts, pairs, int(request.top_k), _deadline(context),
                                                function_to_apply=function)
        reply = inference_pb2.ClassifyResponse()
        for item in items:
            r = reply.results.add(truncated=item.truncated, num_tokens=item.num_tokens)
            for label, score in item.labels:
                r.labels.add(label=label, score=score)
        return reply

    @_rpc(TASK_QA)
    async def Answer(self, request, context, scope):
        runner = self._enter(scope, request.model, TASK_QA)
        question, text = request.question, request.context  # each access decodes the UTF-8 again: once only
        opts = qa.validate_answer(
            question, text, top_k=int(request.top_k), max_answer_len=int(request.max_answer_len),
            doc_stride=int(request.doc_stride), allow_impossible=request.allow_impossible,
            null_threshold=request.null_threshold if request.HasField("null_threshold") else None,
            max_seq_len=runner.max_seq_len, default_max_answer_len=runner.config.max_answer_len,
            default_doc_stride=runner.config.doc_stride, max_chars=runner.config.max_request_chars, model=runner.name,
            align_to_words=request.align_to_words if request.HasField("align_to_words") else None,
            default_align_to_words=runner.config.align_to_words,
        )
        result = await runner.answer(
            question, text, top_k=opts.top_k, max_answer_len=opts.max_answer_len,
            doc_stride=opts.doc_stride, allow_impossible=opts.allow_impossible, null_threshold=opts.null_threshold,
            deadline=_deadline(context), clamp_stride=opts.stride_is_default, align_to_words=opts.align_to_words,
        )
        reply = inference_pb2.AnswerResponse(num_windows=result.num_windows)
        for a in result.answers:
            reply.answers.add(text=a.text, start=a.start, end=a.end, score=a.score, is_impossible=a.is_impossible)
        return reply

    # ------------------------------------------------------------------ translation

    @staticmethod
    def _decode_options(runner, request, texts):
        return translate.validate_translate(texts, beam_size=int(request.beam_size), n_best=int(request.n_best),
                                            max_length=int(request.max_length),
                                            return_alignment=bool(request.return_alignment), config=runner.config)

    @_rpc(TASK_TRANSLATION)
    async def Translate(self, request, context, scope):
        runner = self._enter(scope, request.model, TASK_TRANSLATION)
        texts = list(request.texts)
        options = self._decode_options(runner, request, texts)
        items = await runner.translate(texts, options, _deadline(context))
        reply = inference_pb2.TranslateResponse()
        for item in items:
            _translation_result(reply.results.add(), item)
        return reply

    @_rpc(TASK_TRANSLATION)
    async def TranslateStream(self, request, context, scope):
        runner = self._enter(scope, request.model, TASK_TRANSLATION)
        options = self._decode_options(runner, request, [request.text])
        async for event in runner.translate_stream(request.text, options, _deadline(context)):
            msg = inference_pb2.TranslateStreamResponse(text=event.text, tokens=event.tokens, step=event.step,
                                                        final=event.final)
            if event.result is not None:
                _translation_result(msg.result, event.result)
            await write_message(context, msg, self.max_send_message_length)


def _translation_result(out, item: TranslationItem) -> None:
    out.num_source_tokens = item.num_source_tokens
    for h in item.hypotheses:
        hyp = out.hypotheses.add(text=h.text, score=h.score, log_prob=h.log_prob, tokens=h.output_pieces,
                                 token_ids=h.output_tokens, truncated=h.truncated)
        if h.alignment is not None:  # rows: one per token, EOS included; row-major target x source
            hyp.alignment.source_tokens.extend(item.source_pieces)
            hyp.alignment.target_tokens.extend(h.pieces)
            hyp.alignment.weights.extend(float(w) for row in h.alignment for w in row)
