"""relserve.v1 over HTTP/JSON: a surface of :mod:`.http_transport`.

=========================================== =================================================================
``GET /v1/models``                          relserve.v1 ListModels
``POST /v1/classify`` / ``/v1/answer`` /    the relserve.v1 request message (``model`` included) in
``/v1/translate`` /                         protobuf's canonical JSON mapping -> the response message in it
``/v1/zero-shot-classify`` /                (ZeroShotClassify, ClassifyTokens, Rerank for the last three)
``/v1/classify-tokens`` / ``/v1/rerank``
=========================================== =================================================================

JSON mapping: :func:`google.protobuf.json_format.ParseDict` (so both ``topK`` and ``top_k`` are accepted; an
unknown field is 400) and ``MessageToDict`` with protobuf's canonical lowerCamelCase names (``numTokens``,
``isImpossible``), every field printed, also when it holds its default. ``modelVersion`` / ``model_version``
addresses a loaded version, as on gRPC. The routes decode and encode through
:mod:`.v1_codec` (the gRPC frontend's codec), so validation, limits, error messages and the
``relserve_requests_total`` / duration / in-flight metrics are the gRPC path's. A full queue's 429 has
``Retry-After`` after the gRPC pushback trailer's rounding to whole milliseconds. A client gone while sending
the body is CANCELLED (499, unsent), counted on the route's task. No torch here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import grpc
from aiohttp import web
from google.protobuf import json_format

from .. import metrics
from .._proto import inference_pb2
from ..backends.base import TASK_CLASSIFICATION, TASK_QA, TASK_TOKEN_CLASSIFICATION, TASK_TRANSLATION
from ..errors import Cancelled, InvalidArgument
from ..scheduling.pushback import pushback_ms
from ..tasks.rerank import TASK_RERANK
from ..tasks.zero_shot import TASK_ZERO_SHOT
from . import v1_codec
from .http_transport import Counted, Deadline, HttpTransport, deadline_response, error_response, json_response
from .http_calls import counted_failure
from .json_codec import CountRefused
from .messages import MalformedRequest, check_message_size, refuse_malformed

log = logging.getLogger(__name__)

PROTOCOL = "http_v1"  # the metrics label (service/metrics.py PROTOCOLS)

# relserve.v1 routes: path -> (task, request type, the RPC's name in log lines, codec call)
_ROUTES = {
    "/v1/classify": (TASK_CLASSIFICATION, inference_pb2.ClassifyRequest, "Classify", v1_codec.classify),
    "/v1/answer": (TASK_QA, inference_pb2.AnswerRequest, "Answer", v1_codec.answer),
    "/v1/translate": (TASK_TRANSLATION, inference_pb2.TranslateRequest, "Translate", v1_codec.translate),
    "/v1/zero-shot-classify": (TASK_ZERO_SHOT, inference_pb2.ZeroShotClassifyRequest, "ZeroShotClassify",
                               v1_codec.zero_shot_classify),
    "/v1/classify-tokens": (TASK_TOKEN_CLASSIFICATION, inference_pb2.ClassifyTokensRequest, "ClassifyTokens",
                            v1_codec.classify_tokens),
    "/v1/rerank": (TASK_RERANK, inference_pb2.RerankRequest, "Rerank", v1_codec.rerank),
}
# the routes whose task validation refuses a model of another task itself (INVALID_ARGUMENT naming it), as
# relserve.v1's servicer; zero-shot and rerank run on classification models under their own task label
_OWN_TASK_CHECK = (TASK_ZERO_SHOT, TASK_TOKEN_CLASSIFICATION, TASK_RERANK)
# per task, the arrays of a /v1 body counted before protobuf's mapping copies them (HttpTransport.counted_loads)
_COUNTED = {TASK_CLASSIFICATION: (("texts",), ("textPairs", "text_pairs")), TASK_TRANSLATION: (("texts",),),
            TASK_TOKEN_CLASSIFICATION: (("texts",),),
            TASK_ZERO_SHOT: (("texts",), ("candidateLabels", "candidate_labels")), TASK_RERANK: (("texts",),)}
# the config key bounding an array where it is not max_request_texts (the gRPC port's wire count names the same)
_COUNT_KEYS = {TASK_ZERO_SHOT: {"candidateLabels": "max_candidate_labels", "candidate_labels": "max_candidate_labels"},
               TASK_RERANK: {"texts": "max_rerank_texts"}}
_TASK_OF_PATH = {**{path: route[0] for path, route in _ROUTES.items()}, "/v1/models": "list_models"}


def routes(core: HttpTransport) -> list[web.RouteDef]:
    """The /v1 routes, served on ``core`` (see the module docstring)."""
    api = _V1(core)
    return [web.get("/v1/models", api.list_models), *(web.post(path, api.task) for path in _ROUTES)]


def refused_task(path: str) -> str | None:
    """The metrics ``task`` label of a request to ``path`` refused for its token: the route's task."""
    return _TASK_OF_PATH.get(path)


def _retry_after(exc: BaseException) -> float | None:
    """The Retry-After seconds of a /v1 error: a full queue's ``retry_after_s`` in the whole milliseconds the
    gRPC frontend's pushback trailer carries; None for every other error (no header)."""
    retry_after_s = getattr(exc, "retry_after_s", None)
    return None if retry_after_s is None else int(pushback_ms(retry_after_s)) / 1000.0


class _V1:
    """The handlers of :func:`routes`, on the transport ``core``."""

    def __init__(self, core: HttpTransport) -> None:
        self.core = core
        self.registry = core.registry

    async def task(self, request: web.Request) -> web.Response:
        """``POST /v1/<route>`` (:data:`_ROUTES`): the relserve.v1 request message in protobuf's JSON mapping,
        through :mod:`.v1_codec` to the task."""
        task, request_type, rpc, call = _ROUTES[request.path]
        deadline = self.core.deadline(request)
        count = Counted(metrics.UNKNOWN_MODEL, task, protocol=PROTOCOL)
        try:
            raw = await self.core.read(request)
        except Cancelled:
            # counted here: the model is in the unread body, the task is the route's
            count.code = grpc.StatusCode.CANCELLED.name
            count.done()
            raise
        message: Any = request_type()
        try:
            # a large body's JSON and protobuf mapping run in the transport's decode thread, off the event loop
            await self.core.decode(raw, lambda data: json_format.ParseDict(
                self.core.counted_loads(data, _COUNTED.get(task, ()), task, _COUNT_KEYS.get(task)), message))
        except CountRefused as exc:  # answered and counted by _run, on its model, as the codec's count check
            message = exc
        except (InvalidArgument, json_format.ParseError) as exc:
            # answered (INVALID_ARGUMENT) and counted by _run, as undecodable gRPC bytes are
            message = MalformedRequest(f"{request_type.DESCRIPTOR.full_name} in protobuf's JSON mapping", len(raw),
                                       str(exc)[:500])
        return await self._run(task, rpc, message, deadline, call)

    async def list_models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: relserve.v1 ListModels."""
        return await self._run("list_models", "ListModels", inference_pb2.ListModelsRequest(),
                               self.core.deadline(request), None)

    async def _run(self, task: str, rpc: str, message: Any, deadline: float | None,
                   call: Callable[..., Awaitable[Any]] | None) -> web.Response:
        """Run one /v1 request (``call`` None: ListModels) as relserve.v1's gRPC frontend would: the same
        validation and messages, the reply size limit, and ``relserve_requests_total`` / duration / in-flight
        under the model (once known) and ``task``; counted as a running call for the drain."""
        count = Counted(metrics.UNKNOWN_MODEL, task, protocol=PROTOCOL)

        def expired() -> bool:
            return deadline is not None and deadline - time.monotonic() <= 0

        async def handle() -> web.Response:
            try:
                if isinstance(message, MalformedRequest):
                    raise refuse_malformed(message)
                if call is None:
                    count.model = ""
                    reply = v1_codec.list_models(self.registry)
                else:
                    if message.model in self.registry.runners:
                        count.model = message.model
                    if isinstance(message, CountRefused):  # as relserve.v1's count: before the model's lookup
                        raise message
                    served = self.registry.runners.get(message.model)
                    own = task in _OWN_TASK_CHECK and served is not None and served.task
                    runner = self.registry.get(message.model, served.task if own else task, message.model_version)
                    count.running()
                    reply = await call(runner, message, deadline)
                check_message_size(reply, self.core.max_reply, "reply")
            except asyncio.CancelledError:  # the deadline's timeout, or the server stopping
                count.code = (grpc.StatusCode.DEADLINE_EXCEEDED if expired() else grpc.StatusCode.CANCELLED).name
                raise
            except Exception as exc:
                status, details = counted_failure(count, exc, log, f"{rpc} on model {count.model!r}")
                if expired():  # answered as the deadline's 504 (HttpTransport.within)
                    count.code = grpc.StatusCode.DEADLINE_EXCEEDED.name
                    raise asyncio.CancelledError() from None
                return error_response(status, details, _retry_after(exc))
            finally:
                count.done()
            return json_response(json_format.MessageToDict(reply, always_print_fields_with_no_presence=True))

        try:
            return await self.core.within(deadline, handle())
        except Deadline:
            return deadline_response()
