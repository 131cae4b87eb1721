"""The relserve.v1.Inference servicer (grpc.aio): validate, call the model runner, build the reply.

Errors are mapped in one place, :func:`_rpc`, using the table in :mod:`relserve.service.errors`; the
handlers only raise domain exceptions. Request metrics (count by code, duration, in-flight) are recorded
there too. No torch here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from typing import Any, Awaitable, Callable

import grpc

from . import metrics
from ._proto import inference_pb2, inference_pb2_grpc
from .backends import TASK_CLASSIFICATION, TASK_QA, TASK_TRANSLATION
from .errors import InvalidArgument, ResourceExhausted, to_status
from .runner import ModelRegistry
from .tasks.text import is_blank

log = logging.getLogger(__name__)

SERVICE_NAME = "relserve.v1.Inference"
MAX_QA_TOP_K = 20


class _Scope:
    """What the error/metrics wrapper needs to know about a request once the handler knows it."""

    __slots__ = ("model", "inflight")

    def __init__(self) -> None:
        self.model = metrics.UNKNOWN_MODEL
        self.inflight = False


def _rpc(task: str) -> Callable:
    """Wrap a handler: map exceptions to status codes (one table), record metrics, never crash the server."""

    def decorate(handler: Callable[..., Awaitable[Any]]) -> Callable:
        @functools.wraps(handler)
        async def wrapper(self: "InferenceServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0 = time.monotonic()
            scope = _Scope()
            code = "OK"
            try:
                reply = await handler(self, request, context, scope)
                if reply is not None and reply.ByteSize() > self.max_send_message_length:
                    raise ResourceExhausted(
                        f"the reply is {reply.ByteSize()} bytes, over the server's max_send_message_length of "
                        f"{self.max_send_message_length} bytes; send fewer texts, ask for fewer hypotheses or "
                        f"alignments, or raise the limit in the server config"
                    )
                return reply
            except asyncio.CancelledError:
                # grpc cancels the handler both when the client cancels and when the deadline passes.
                code = (grpc.StatusCode.DEADLINE_EXCEEDED if _expired(context) else grpc.StatusCode.CANCELLED).name
                raise
            except Exception as exc:
                status, details = to_status(exc)
                code = status.name
                if status == grpc.StatusCode.INTERNAL:
                    log.exception("%s on model %r failed: %s", handler.__name__, scope.model, details)
                if _expired(context):
                    # The call already ended with DEADLINE_EXCEEDED; aborting a finished call only logs noise.
                    code = grpc.StatusCode.DEADLINE_EXCEEDED.name
                    raise asyncio.CancelledError() from None
                await context.abort(status, details)
            finally:
                if scope.inflight:
                    metrics.inflight(scope.model, -1)
                metrics.observe_request(scope.model, task, code, time.monotonic() - t0)

        return wrapper

    return decorate


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
                max_batch_size=info.max_batch_size,
            )
        return out

    @_rpc(TASK_CLASSIFICATION)
    async def Classify(self, request, context, scope):
        runner = self._enter(scope, request.model, TASK_CLASSIFICATION)
        texts = list(request.texts)
        pairs = list(request.text_pairs)
        if not texts:
            raise InvalidArgument("texts is empty; send at least one text")
        for i, t in enumerate(texts):
            if is_blank(t):
                raise InvalidArgument(f"texts[{i}] is empty or only whitespace; send at least one non-space character")
        if pairs:
            if len(pairs) != len(texts):
                raise InvalidArgument(
                    f"text_pairs has {len(pairs)} entries but texts has {len(texts)}; send one pair per text or none"
                )
            for i, p in enumerate(pairs):
                if is_blank(p):
                    raise InvalidArgument(f"text_pairs[{i}] is empty or only whitespace")
        num_labels = len(runner.info().labels)
        if num_labels and request.top_k > num_labels:
            raise InvalidArgument(
                f"top_k {request.top_k} exceeds the {num_labels} labels of model {runner.name!r}; "
                f"use 0 for all labels"
            )
        items, _timings = await runner.classify(texts, pairs or None, int(request.top_k), _deadline(context))
        reply = inference_pb2.ClassifyResponse()
        for item in items:
            r = reply.results.add(truncated=item.truncated, num_tokens=item.num_tokens)
            for label, score in item.labels:
                r.labels.add(label=label, score=score)
        return reply

    @_rpc(TASK_QA)
    async def Answer(self, request, context, scope):
        runner = self._enter(scope, request.model, TASK_QA)
        if is_blank(request.question):
            raise InvalidArgument("question is empty or only whitespace")
        if is_blank(request.context):
            raise InvalidArgument("context is empty or only whitespace")
        max_seq_len = runner.max_seq_len
        top_k = request.top_k or 1
        if top_k > MAX_QA_TOP_K:
            raise InvalidArgument(f"top_k {request.top_k} is too large; the limit is {MAX_QA_TOP_K} answers")
        max_answer_len = request.max_answer_len or runner.config.max_answer_len
        if max_answer_len > max_seq_len:
            raise InvalidArgument(
                f"max_answer_len {max_answer_len} must be between 1 and max_seq_len {max_seq_len} tokens"
            )
        doc_stride = request.doc_stride or runner.config.doc_stride
        if doc_stride >= max_seq_len:
            raise InvalidArgument(
                f"doc_stride {doc_stride} must be smaller than max_seq_len {max_seq_len} tokens"
            )
        null_threshold = request.null_threshold if request.HasField("null_threshold") else 0.0
        if math.isnan(null_threshold):
            raise InvalidArgument("null_threshold is NaN; send a number (or +inf to always answer)")
        result = await runner.answer(
            request.question, request.context, top_k=top_k, max_answer_len=max_answer_len,
            doc_stride=doc_stride, allow_impossible=request.allow_impossible, null_threshold=null_threshold,
            deadline=_deadline(context),
        )
        reply = inference_pb2.AnswerResponse(num_windows=result.num_windows)
        for a in result.answers:
            reply.answers.add(text=a.text, start=a.start, end=a.end, score=a.score, is_impossible=a.is_impossible)
        return reply

    # ------------------------------------------------------------------ translation

    def _translation_request(self, runner, request):
        return runner.request(int(request.beam_size), int(request.n_best), int(request.max_length),
                              bool(request.return_alignment))

    @_rpc(TASK_TRANSLATION)
    async def Translate(self, request, context, scope):
        runner = self._enter(scope, request.model, TASK_TRANSLATION)
        texts = list(request.texts)
        if not texts:
            raise InvalidArgument("texts is empty; send at least one text")
        req = self._translation_request(runner, request)
        items = await runner.translate(texts, req, _deadline(context))
        reply = inference_pb2.TranslateResponse()
        for item in items:
            _translation_result(reply.results.add(), item)
        return reply

    @_rpc(TASK_TRANSLATION)
    async def TranslateStream(self, request, context, scope):
        runner = self._enter(scope, request.model, TASK_TRANSLATION)
        req = self._translation_request(runner, request)
        async for event in runner.translate_stream(request.text, req, _deadline(context)):
            msg = inference_pb2.TranslateStreamResponse(text=event.text, tokens=event.tokens, step=event.step,
                                                        final=event.final)
            if event.result is not None:
                _translation_result(msg.result, event.result)
            await context.write(msg)


def _translation_result(out, item) -> None:
    out.num_source_tokens = item.num_source_tokens
    for h in item.hypotheses:
        hyp = out.hypotheses.add(text=h.text, score=h.score, log_prob=h.log_prob, tokens=h.tokens,
                                 token_ids=h.token_ids, truncated=h.truncated)
        if h.alignment is not None:
            hyp.alignment.source_tokens.extend(h.alignment.source_tokens)
            hyp.alignment.target_tokens.extend(h.alignment.target_tokens)
            hyp.alignment.weights.extend(h.alignment.weights)
