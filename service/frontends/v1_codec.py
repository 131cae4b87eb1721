"""relserve.v1 messages <-> the task core: each request message decoded into its task's validated request, the
task called, its result encoded as the response message. The gRPC servicer (``grpc_v1``) sends the messages
as protobuf bytes; the HTTP routes (``http``) in protobuf's JSON mapping. No torch.
"""

from __future__ import annotations

from typing import Any, Sequence

from relserve.models.decode_types import DecodeOptions

from .._proto import inference_pb2
from ..registry import ModelRegistry
from ..tasks import classify as classify_task
from ..tasks import qa, rerank as rerank_task, token_classification, translate as translate_task
from ..tasks import zero_shot
from ..tasks.translate import StreamEvent, TranslationItem
from .oip_codec import loaded_versions


# Runner.state -> the state name of ModelInfo.state (the KServe v2 repository index's names, Triton's)
_STATES = {"created": "LOADING", "loading": "LOADING", "warming": "LOADING", "ready": "READY",
           "closed": "UNLOADING", "failed": "UNAVAILABLE"}


def model_state(runner: Any) -> str:
    """``READY`` while ``runner`` computes; ``LOADING`` before; ``UNAVAILABLE`` when it failed or its worker is
    being replaced; ``UNLOADING`` once closed."""
    if runner.state == "ready" and not runner.ready:
        return "UNAVAILABLE"
    return _STATES.get(runner.state, "UNAVAILABLE")


def list_models(registry: ModelRegistry) -> Any:
    """``ListModelsResponse``: one row per loaded version of every served model, sorted by name then version."""
    out = inference_pb2.ListModelsResponse()
    for name in registry.names():
        loaded = registry.loaded(name)
        for version in loaded_versions(registry, name):
            runner = loaded[version]
            info = runner.info()
            out.models.add(
                name=info.name, task=info.task, family=info.family, backend=info.backend, device=info.device,
                dtype=info.dtype, max_seq_len=info.max_seq_len, labels=list(info.labels),
                max_batch_size=info.max_batch_size, function_to_apply=classify_task.model_default_function(runner),
                dtype_reason=info.dtype_reason, version=version, state=model_state(runner),
            )
    return out


async def classify(runner: Any, request: Any, deadline: float | None) -> Any:
    """A ``ClassifyRequest`` on ``runner`` -> ``ClassifyResponse``."""
    # the message's own repeated fields: counted before any text is copied (validate_classify returns the lists)
    texts, pairs = classify_task.validate_classify(
        request.texts, request.text_pairs, int(request.top_k), len(runner.info().labels), runner.name,
        max_texts=runner.config.max_request_texts, max_chars=runner.config.max_request_chars)
    function = classify_task.validate_function(request.function_to_apply)
    items, _timings = await classify_task.classify(runner, texts, pairs, int(request.top_k), deadline,
                                                   function_to_apply=function)
    reply = inference_pb2.ClassifyResponse()
    for item in items:
        r = reply.results.add(truncated=item.truncated, num_tokens=item.num_tokens)
        for label, score in item.labels:
            r.labels.add(label=label, score=score)
    return reply


async def answer(runner: Any, request: Any, deadline: float | None) -> Any:
    """An ``AnswerRequest`` on ``runner`` -> ``AnswerResponse``."""
    question, text = request.question, request.context  # each access decodes the UTF-8 again: once only
    options = qa.validate_for(
        runner, question, text, top_k=int(request.top_k), max_answer_len=int(request.max_answer_len),
        doc_stride=int(request.doc_stride), allow_impossible=request.allow_impossible,
        null_threshold=request.null_threshold if request.HasField("null_threshold") else None,
        align_to_words=request.align_to_words if request.HasField("align_to_words") else None,
    )
    result = await qa.answer(runner, question, text, options, deadline)
    reply = inference_pb2.AnswerResponse(num_windows=result.num_windows)
    for a in result.answers:
        reply.answers.add(text=a.text, start=a.start, end=a.end, score=a.score, is_impossible=a.is_impossible)
    return reply


async def zero_shot_classify(runner: Any, request: Any, deadline: float | None) -> Any:
    """A ``ZeroShotClassifyRequest`` on ``runner`` (a classification model) -> ``ZeroShotClassifyResponse``."""
    # the repeated fields themselves: validate_zero_shot counts them before copying
    validated = zero_shot.validate_zero_shot(runner, request.texts, request.candidate_labels,
                                             request.hypothesis_template, bool(request.multi_label))
    items, _timings = await zero_shot.zero_shot(runner, validated, deadline)
    reply = inference_pb2.ZeroShotClassifyResponse()
    for item in items:
        r = reply.results.add(sequence=item.sequence, truncated=item.truncated, num_tokens=item.num_tokens)
        for label, score in zip(item.labels, item.scores):
            r.labels.add(label=label, score=score)
    return reply


async def classify_tokens(runner: Any, request: Any, deadline: float | None) -> Any:
    """A ``ClassifyTokensRequest`` on ``runner`` (a token-classification model) -> ``ClassifyTokensResponse``."""
    validated = token_classification.validate_token_classification(
        runner, request.texts, request.aggregation_strategy,
        ignore_labels=request.ignore_labels.labels if request.HasField("ignore_labels") else None,
        stride=int(request.stride) if request.HasField("stride") else None)
    items, _timings = await token_classification.classify_tokens(runner, validated, deadline)
    reply = inference_pb2.ClassifyTokensResponse()
    for item in items:
        r = reply.results.add(num_windows=item.num_windows, num_tokens=item.num_tokens)
        for e in item.entities:
            entity = r.entities.add(entity_group=e.entity_group or "", entity=e.entity or "", score=e.score,
                                    word=e.word, start=e.start, end=e.end)
            if e.index is not None:
                entity.index = e.index
    return reply


async def rerank(runner: Any, request: Any, deadline: float | None) -> Any:
    """A ``RerankRequest`` on ``runner`` (a classification model) -> ``RerankResponse``."""
    validated = rerank_task.validate_rerank(
        runner, request.query, request.texts, top_n=int(request.top_n), raw_scores=bool(request.raw_scores),
        return_text=bool(request.return_text), truncate=request.truncate if request.HasField("truncate") else True)
    items, _timings = await rerank_task.rerank(runner, validated, deadline)
    reply = inference_pb2.RerankResponse()
    for item in items:
        reply.results.add(index=item.index, score=item.score, text=item.text or "")
    return reply


def decode_options(runner: Any, request: Any, texts: Sequence[str]) -> DecodeOptions:
    """The validated decoding options of a ``TranslateRequest`` / ``TranslateStreamRequest`` (``texts``: its
    texts, the message's repeated field itself: counted before any is read)."""
    return translate_task.validate_translate(texts, beam_size=int(request.beam_size), n_best=int(request.n_best),
                                             max_length=int(request.max_length),
                                             return_alignment=bool(request.return_alignment), config=runner.config)


async def translate(runner: Any, request: Any, deadline: float | None) -> Any:
    """A ``TranslateRequest`` on ``runner`` -> ``TranslateResponse``."""
    options = decode_options(runner, request, request.texts)  # counted on the message before any copy
    items = await translate_task.translate(runner, list(request.texts), options, deadline)
    reply = inference_pb2.TranslateResponse()
    for item in items:
        translation_result(reply.results.add(), item)
    return reply


def stream_message(event: StreamEvent) -> Any:
    """One ``TranslateStreamResponse`` of a stream (:func:`relserve.service.tasks.translate.translate_stream`)."""
    msg = inference_pb2.TranslateStreamResponse(text=event.text, tokens=event.tokens, step=event.step,
                                                final=event.final)
    if event.result is not None:
        translation_result(msg.result, event.result)
    return msg


def translation_result(out: Any, item: TranslationItem) -> None:
    """Fill a ``TranslationResult`` message from one text's :class:`TranslationItem`."""
    out.num_source_tokens = item.num_source_tokens
    for h in item.hypotheses:
        hyp = out.hypotheses.add(text=h.text, score=h.score, log_prob=h.log_prob, tokens=h.output_pieces,
                                 token_ids=h.output_tokens, truncated=h.truncated)
        if h.alignment is not None:  # rows: one per token, EOS included; row-major target x source
            hyp.alignment.source_tokens.extend(item.source_pieces)
            hyp.alignment.target_tokens.extend(h.pieces)
            hyp.alignment.weights.extend(float(w) for row in h.alignment for w in row)
