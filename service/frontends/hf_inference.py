"""The Hugging Face Inference API convention, per model at the base URL ``/models/{name}``: a surface of
:mod:`.http_transport`.

``huggingface_hub.InferenceClient(model="http://HOST:PORT/models/{name}")`` (huggingface_hub 2.4: its
``hf-inference`` provider posts to a URL model as it is) sends ``POST /models/{name}`` with
``{"inputs": ..., "parameters": {...}}`` (parameters the caller left unset are not sent); the model's task
picks the shape:

================== =========================================== ==========================================
task               request                                     reply (what the client parses)
================== =========================================== ==========================================
text_classification ``inputs``: a text (or a list of texts);   ``[[{"label", "score"}, ...]]``, one list
                   ``parameters``: ``top_k`` (>= 1; more than  per text, best first (the client reads the
                   the labels: all), ``function_to_apply``     first); all labels without ``top_k``
                   (``softmax`` | ``sigmoid`` | ``none``)
question_answering ``inputs``: ``{"question", "context"}``;     ``{"answer", "score", "start", "end"}``
                   ``parameters``: ``top_k`` (1..20),           (character offsets, end exclusive); a list
                   ``doc_stride``, ``max_answer_len`` (tokens), of them for ``top_k`` > 1
                   ``align_to_words``, ``handle_impossible_
                   answer`` (the SQuAD 2.0 null answer ``""``
                   at 0..0), ``max_seq_len`` (the window, 8..the
                   model's ``max_seq_len`` key),
                   ``max_question_len`` (accepted; relserve
                   bounds the question by the window)
zero_shot_         ``inputs``: a text (or a list of texts);    ``[{"label", "score"}, ...]``, every
classification     ``parameters``: ``candidate_labels`` (a      candidate label best first (a list of them
(a classification  list of labels, or one string of comma-      per text for a list of texts)
model, chosen by   separated labels, as the pipeline takes),
``candidate_       ``multi_label``, ``hypothesis_template``
labels``)          (one ``{}``)
token_             ``inputs``: a text (or a list of texts);    ``[{"entity_group", "score", "word",
classification     ``parameters``: ``aggregation_strategy``    "start", "end"}, ...]`` (strategy ``none``:
                   (``none`` | ``simple`` | ``first`` |        ``"entity"`` and the token ``"index"``
                   ``average`` | ``max``; default ``none``),   instead of ``entity_group``), character
                   ``ignore_labels`` (default ``["O"]``),      offsets, end exclusive; a list of them per
                   ``stride`` (tokens shared by windows)       text for a list of texts
translation        ``inputs``: a text (or a list of texts);    ``[{"translation_text"}, ...]``, one per text
                   ``parameters.generate_parameters``:
                   ``num_beams`` (the beam size),
                   ``max_new_tokens`` (tokens generated, the
                   final EOS included); ``truncation`` and
                   ``clean_up_tokenization_spaces`` accepted
                   (a source over ``max_source_tokens`` is
                   refused, not cut); ``src_lang`` /
                   ``tgt_lang`` refused (one pair per model)
================== =========================================== ==========================================

Unset parameters take the model's defaults, as relserve.v1 does; the numbers are relserve.v1's for the same
inputs. Errors are the API's shape, ``{"error": message}``, with the transport's status (400 bad input or
parameter, 404 unknown model, 429 queue full with ``Retry-After``, 503 not ready or draining, 504 past
``X-Request-Timeout``); an unknown parameter is 400 naming the ones served. No torch.
"""

from __future__ import annotations

import math
from typing import Any

import grpc
from aiohttp import web

from ..backends.base import TASK_CLASSIFICATION, TASK_QA, TASK_TOKEN_CLASSIFICATION, TASK_TRANSLATION
from ..errors import FailedPrecondition, InvalidArgument
from ..tasks import classify as classify_task
from ..tasks import qa, token_classification, zero_shot
from ..tasks import translate as translate_task
from . import http_calls
from .http_transport import HTTP_STATUS, HttpTransport, json_response
from .oip_codec import describe

PROTOCOL = "hf"
_BODY = ("inputs", "parameters", "options")
_CLASSIFY_PARAMETERS = ("top_k", "function_to_apply")
_QA_PARAMETERS = ("top_k", "doc_stride", "max_answer_len", "max_seq_len", "max_question_len", "align_to_words",
                  "handle_impossible_answer")
_TRANSLATE_PARAMETERS = ("generate_parameters", "truncation", "clean_up_tokenization_spaces", "src_lang", "tgt_lang")
_GENERATE_PARAMETERS = ("num_beams", "max_new_tokens")
_ZERO_SHOT_PARAMETERS = ("candidate_labels", "multi_label", "hypothesis_template")
_TOKEN_PARAMETERS = ("aggregation_strategy", "ignore_labels", "stride")
# transformers' TruncationStrategy values (the translation pipeline's ``truncation``)
_TRUNCATIONS = ("do_not_truncate", "longest_first", "only_first", "only_second")


def routes(core: HttpTransport) -> list[web.RouteDef]:
    """``POST /models/{name}``, served on ``core`` (see the module docstring)."""
    api = _HfInference(core)
    return [web.post("/models/{name}", api.infer),
            web.route("*", "/models/{name}", http_calls.not_allowed(error, "POST"))]  # other methods: 405 here


def refused_task(path: str) -> str | None:
    """The ``task`` label of a request to ``path`` refused for its token: ``_unknown_`` for this surface's
    path (the task is the model's), None for other surfaces' paths."""
    rest = path[len("/models/"):] if path.startswith("/models/") else ""
    return "_unknown_" if rest and "/" not in rest else None


def error(code: grpc.StatusCode, message: str, status: int | None = None, retry_after_s: float | None = None,
          cause: BaseException | None = None) -> web.Response:
    """The API's error reply ``{"error": message}`` with the transport's status for ``code`` (or ``status``);
    ``Retry-After`` (whole seconds, rounded up) when a full queue gives ``retry_after_s``."""
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return json_response({"error": message}, status or HTTP_STATUS.get(code, 500), headers)


class _HfInference:
    """The handler of :func:`routes`, on the transport ``core``."""

    def __init__(self, core: HttpTransport) -> None:
        self.core = core

    async def infer(self, request: web.Request) -> web.Response:
        """``POST /models/{name}``: the model's task decides how ``inputs`` and ``parameters`` are read."""
        return await http_calls.serve(self.core, request, protocol=PROTOCOL, name=request.match_info["name"],
                                      handle=self._infer, error=error, operation=_operation)

    async def _infer(self, runner: Any, body: dict, deadline: float | None) -> Any:
        http_calls.obj(body, "the request body", _BODY)  # "options" (use_cache, wait_for_model): nothing to do
        if "inputs" not in body:
            raise InvalidArgument('the request body needs "inputs"')
        inputs = body["inputs"]
        operation = _OPERATIONS.get(_operation(runner, body) or runner.task)
        if operation is None:
            raise FailedPrecondition(f"model {runner.name!r} is a {runner.task} model, which this API does not serve")
        allowed, handler = operation
        parameters = http_calls.obj(body.get("parameters"), "parameters", allowed)
        return await handler(runner, inputs, parameters, deadline)


def _operation(runner: Any, body: Any) -> str | None:
    """The task a request body asks of ``runner``: zero-shot classification when a classification model's
    ``parameters`` carry ``candidate_labels`` (what ``InferenceClient.zero_shot_classification`` sends), else
    None (the model's own task)."""
    parameters = body.get("parameters") if isinstance(body, dict) else None
    if runner.task == TASK_CLASSIFICATION and isinstance(parameters, dict) and "candidate_labels" in parameters:
        return zero_shot.TASK_ZERO_SHOT
    return None


def _texts(inputs: Any) -> list[str]:
    """``inputs``: a text or a non-empty list of texts."""
    if isinstance(inputs, str):
        return [http_calls.text(inputs, "inputs")]
    if isinstance(inputs, list):
        return http_calls.texts(inputs, "inputs")
    raise InvalidArgument(f"inputs must be a text or a list of texts, got {describe(inputs)}")


def _optional(parameters: dict, key: str, check: Any, *args: Any, where: str = "parameters", **kw: Any) -> Any:
    """``parameters[key]`` checked by ``check`` (naming ``where.key``), or None when absent or null."""
    value = parameters.get(key)
    return None if value is None else check(value, f"{where}.{key}", *args, **kw)


async def _classify(runner: Any, inputs: Any, parameters: dict, deadline: float | None) -> list:
    texts = _texts(inputs)
    labels = runner.info().labels
    top_k = _optional(parameters, "top_k", http_calls.integer, minimum=1)
    # the pipeline slices the sorted scores: a top_k over the label count gives them all
    k = 0 if top_k is None or (labels and top_k >= len(labels)) else top_k
    function = _optional(parameters, "function_to_apply", http_calls.text)
    function = classify_task.validate_function(function)
    config = runner.config
    texts, _ = classify_task.validate_classify(texts, None, k, len(labels), runner.name,
                                               max_texts=config.max_request_texts, max_chars=config.max_request_chars)
    items, _timings = await classify_task.classify(runner, texts, None, k, deadline, function_to_apply=function)
    return [[{"label": label, "score": score} for label, score in item.labels] for item in items]


async def _answer(runner: Any, inputs: Any, parameters: dict, deadline: float | None) -> Any:
    fields = http_calls.obj(inputs, "inputs", ("question", "context"))
    question = http_calls.text(fields.get("question"), "inputs.question")
    context = http_calls.text(fields.get("context"), "inputs.context")
    top_k = _optional(parameters, "top_k", http_calls.integer, minimum=1, maximum=qa.MAX_TOP_K)
    max_seq_len = _optional(parameters, "max_seq_len", http_calls.integer, minimum=1)
    _optional(parameters, "max_question_len", http_calls.integer, minimum=1)
    impossible = _optional(parameters, "handle_impossible_answer", http_calls.boolean)
    options = qa.validate_for(
        runner, question, context, top_k=top_k or 1,
        max_answer_len=_optional(parameters, "max_answer_len", http_calls.integer, minimum=1) or 0,
        doc_stride=_optional(parameters, "doc_stride", http_calls.integer, minimum=1) or 0,
        allow_impossible=bool(impossible), null_threshold=None,
        align_to_words=_optional(parameters, "align_to_words", http_calls.boolean), max_seq_len=max_seq_len)
    result = await qa.answer(runner, question, context, options, deadline)
    answers = [{"answer": a.text, "score": a.score, "start": a.start, "end": a.end} for a in result.answers]
    return answers if top_k is not None and top_k > 1 else answers[0]


async def _translate(runner: Any, inputs: Any, parameters: dict, deadline: float | None) -> list:
    texts = _texts(inputs)
    for key in ("src_lang", "tgt_lang"):
        if parameters.get(key) is not None:
            raise InvalidArgument(f"parameters.{key} is not served: model {runner.name!r} translates one language "
                                  f"pair; leave it out")
    truncation = _optional(parameters, "truncation", http_calls.text)
    if truncation is not None and truncation not in _TRUNCATIONS:
        raise InvalidArgument(f"parameters.truncation {truncation!r} is not one of {', '.join(_TRUNCATIONS)}")
    _optional(parameters, "clean_up_tokenization_spaces", http_calls.boolean)
    generate = http_calls.obj(parameters.get("generate_parameters"), "parameters.generate_parameters",
                              _GENERATE_PARAMETERS)
    beams = _optional(generate, "num_beams", http_calls.integer, minimum=1, where="parameters.generate_parameters")
    max_new_tokens = _optional(generate, "max_new_tokens", http_calls.integer, minimum=1,
                               where="parameters.generate_parameters")
    options = translate_task.validate_translate(texts, beam_size=beams or 0, n_best=0, max_length=max_new_tokens or 0,
                                                return_alignment=False, config=runner.config)
    items = await translate_task.translate(runner, texts, options, deadline)
    return [{"translation_text": item.hypotheses[0].text} for item in items]


async def _zero_shot(runner: Any, inputs: Any, parameters: dict, deadline: float | None) -> list:
    texts = _texts(inputs)
    labels = parameters.get("candidate_labels")
    if isinstance(labels, str):  # the pipeline's form: comma-separated labels
        labels = [label.strip() for label in labels.split(",") if label.strip()]
    else:
        labels = http_calls.strings(labels, "parameters.candidate_labels")
    multi_label = _optional(parameters, "multi_label", http_calls.boolean)
    template = _optional(parameters, "hypothesis_template", http_calls.text)
    request = zero_shot.validate_zero_shot(runner, texts, labels, template, bool(multi_label))
    items, _timings = await zero_shot.zero_shot(runner, request, deadline)
    out = [[{"label": label, "score": score} for label, score in zip(item.labels, item.scores)] for item in items]
    return out if isinstance(inputs, list) else out[0]


async def _classify_tokens(runner: Any, inputs: Any, parameters: dict, deadline: float | None) -> list:
    texts = _texts(inputs)
    strategy = _optional(parameters, "aggregation_strategy", http_calls.text)
    ignore = _optional(parameters, "ignore_labels", http_calls.strings)
    stride = _optional(parameters, "stride", http_calls.integer, minimum=0)
    request = token_classification.validate_token_classification(runner, texts, strategy, ignore, stride)
    items, _timings = await token_classification.classify_tokens(runner, request, deadline)
    out = [[_entity(e) for e in item.entities] for item in items]
    return out if isinstance(inputs, list) else out[0]


def _entity(e: Any) -> dict:
    """One entity as the token-classification pipeline prints it."""
    if e.entity_group is not None:
        return {"entity_group": e.entity_group, "score": e.score, "word": e.word, "start": e.start, "end": e.end}
    return {"entity": e.entity, "score": e.score, "index": e.index, "word": e.word, "start": e.start, "end": e.end}


# per operation (a model's task, or zero-shot on a classification model): the parameters it takes and its handler
_OPERATIONS = {
    zero_shot.TASK_ZERO_SHOT: (_ZERO_SHOT_PARAMETERS, _zero_shot),
    TASK_CLASSIFICATION: (_CLASSIFY_PARAMETERS, _classify),
    TASK_TOKEN_CLASSIFICATION: (_TOKEN_PARAMETERS, _classify_tokens),
    TASK_QA: (_QA_PARAMETERS, _answer),
    TASK_TRANSLATION: (_TRANSLATE_PARAMETERS, _translate),
}
