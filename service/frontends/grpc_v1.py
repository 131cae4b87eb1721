"""The relserve.v1.Inference servicer (grpc.aio): decode, call the task, encode the reply.

Requests are decoded tolerantly (:func:`.grpc_transport.register`): bytes that are not a valid message of the
RPC's request type (e.g. invalid UTF-8 in a string field) are answered INVALID_ARGUMENT and counted like any
other status. Each request is validated once, before any tokenizing, by its task (:mod:`.v1_codec` calls
:mod:`relserve.service.tasks`); errors are mapped in one place, :func:`.grpc_transport.rpc`, with a full
queue's retry hint as the ``grpc-retry-pushback-ms`` trailer (gRFC A6). Request metrics (count by code,
duration, in-flight; the time to a RESOURCE_EXHAUSTED refusal) are recorded there too. Stream messages go
out through :func:`.grpc_transport.write_message` (a reader that stops consuming ends its stream after
``stream_write_timeout``). A request's ``model_version`` picks a loaded version of its model (empty: the
version serving it; ``ModelRegistry.get``). No torch here.
"""

from __future__ import annotations

import contextlib

import grpc

from .._proto import inference_pb2, inference_pb2_grpc
from ..backends.base import TASK_CLASSIFICATION, TASK_QA, TASK_TOKEN_CLASSIFICATION, TASK_TRANSLATION
from ..registry import ModelRegistry
from ..tasks.rerank import TASK_RERANK
from ..tasks.zero_shot import TASK_ZERO_SHOT
from ..tasks import translate as translate_task
from . import v1_codec
from .grpc_transport import Scope, deadline, register, rpc, write_message

SERVICE_NAME = "relserve.v1.Inference"


def add_to_server(servicer: "InferenceServicer", server: grpc.aio.Server) -> None:
    """Register ``servicer``'s RPCs of ``relserve.v1.Inference`` on ``server``, decoded tolerantly; every
    repeated field of texts or labels counted on the wire first, against the most entries any served model
    takes (``max_request_texts``, ``max_candidate_labels``, ``max_rerank_texts``)."""
    def most(key: str) -> int | None:
        limits = [getattr(r.config, key) for r in servicer.registry.runners.values()
                  if getattr(getattr(r, "config", None), key, None) is not None]
        return max(limits) if limits else None

    cap = most("max_request_texts")
    caps = None
    if cap:
        caps = {"ClassifyRequest": {"texts": cap, "text_pairs": cap}, "TranslateRequest": {"texts": cap},
                "ClassifyTokensRequest": {"texts": cap},
                "ZeroShotClassifyRequest": {"texts": cap, "candidate_labels": (most("max_candidate_labels") or cap,
                                                                               "max_candidate_labels")},
                "RerankRequest": {"texts": (most("max_rerank_texts") or cap, "max_rerank_texts")}}
    register(servicer, server, inference_pb2, "Inference", caps)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """The relserve.v1 RPCs over ``registry``; replies (and stream messages) of at most
    ``max_send_message_length`` bytes."""

    protocol = "grpc_v1"  # the metrics label (service/metrics.py PROTOCOLS), read by the rpc wrapper

    def __init__(self, registry: ModelRegistry, max_send_message_length: int = 4 * 1024 * 1024,
                 stream_write_timeout: float | None = None) -> None:
        self.registry = registry
        self.max_send_message_length = max_send_message_length
        self.stream_write_timeout = stream_write_timeout  # seconds a stream message may wait for its reader

    def _enter(self, scope: Scope, name: str, task: str, version: str = ""):
        served = self.registry.runners.get(name)
        if served is not None:
            scope.model = name
        model_task = task
        if task in (TASK_ZERO_SHOT, TASK_RERANK, TASK_TOKEN_CLASSIFICATION) and served is not None:
            # the pipeline tasks' validation refuses a model of another task (INVALID_ARGUMENT naming it); the
            # scope keeps the operation's task label (zero-shot and rerank run on classification models)
            model_task = served.task or task
        runner = self.registry.get(name, model_task, version)
        scope.count_inflight()
        return runner

    @rpc("list_models")
    async def ListModels(self, request, context, scope):
        """Every served model and what it is."""
        scope.model = ""
        return v1_codec.list_models(self.registry)

    @rpc(TASK_CLASSIFICATION)
    async def Classify(self, request, context, scope):
        """Scores per text (:func:`.v1_codec.classify`)."""
        runner = self._enter(scope, request.model, TASK_CLASSIFICATION, request.model_version)
        return await v1_codec.classify(runner, request, deadline(context))

    @rpc(TASK_QA)
    async def Answer(self, request, context, scope):
        """Answers to one question (:func:`.v1_codec.answer`)."""
        runner = self._enter(scope, request.model, TASK_QA, request.model_version)
        return await v1_codec.answer(runner, request, deadline(context))

    @rpc(TASK_TRANSLATION)
    async def Translate(self, request, context, scope):
        """Hypotheses per text (:func:`.v1_codec.translate`)."""
        runner = self._enter(scope, request.model, TASK_TRANSLATION, request.model_version)
        return await v1_codec.translate(runner, request, deadline(context))

    @rpc(TASK_TRANSLATION)
    async def TranslateStream(self, request, context, scope):
        """The best live hypothesis after each decoder step, then the final result; a client that reads none of
        them for ``stream_write_timeout`` seconds gets the stream ended (its sequence leaves the decode loop)."""
        runner = self._enter(scope, request.model, TASK_TRANSLATION, request.model_version)
        options = v1_codec.decode_options(runner, request, [request.text])
        # closed here, not when collected: a stalled or failed write frees the sequence at once
        async with contextlib.aclosing(translate_task.translate_stream(runner, request.text, options,
                                                                       deadline(context))) as events:
            async for event in events:
                await write_message(context, v1_codec.stream_message(event), self.max_send_message_length,
                                    self.stream_write_timeout)

    @rpc(TASK_ZERO_SHOT)
    async def ZeroShotClassify(self, request, context, scope):
        """Candidate labels ranked per text (:func:`.v1_codec.zero_shot_classify`)."""
        runner = self._enter(scope, request.model, TASK_ZERO_SHOT, request.model_version)
        return await v1_codec.zero_shot_classify(runner, request, deadline(context))

    @rpc(TASK_TOKEN_CLASSIFICATION)
    async def ClassifyTokens(self, request, context, scope):
        """Entities per text (:func:`.v1_codec.classify_tokens`)."""
        runner = self._enter(scope, request.model, TASK_TOKEN_CLASSIFICATION, request.model_version)
        return await v1_codec.classify_tokens(runner, request, deadline(context))

    @rpc(TASK_RERANK)
    async def Rerank(self, request, context, scope):
        """Texts ranked by relevance to the query (:func:`.v1_codec.rerank`)."""
        runner = self._enter(scope, request.model, TASK_RERANK, request.model_version)
        return await v1_codec.rerank(runner, request, deadline(context))
