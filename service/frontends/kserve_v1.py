"""KServe's v1 protocol (the "V1" data plane of KServe's model servers): a surface of :mod:`.http_transport`.

==================================== ====================================================================
``GET /``                            liveness ``{"status": "alive"}`` (what KServe's ``InferenceRESTClient``
                                     reads for v1's ``is_server_live``)
``GET /v1/models/{name}``            readiness: 200 ``{"name": name, "ready": true}``; a model not ready (or
                                     the server draining) 503 ``{"error": "Model with name X is not
                                     ready."}``; an unknown one 404 ``{"error": "Model with name X does not
                                     exist."}`` (KServe's ``model_ready``)
``POST /v1/models/{name}:predict``   ``{"instances": [...]}`` (or ``{"inputs": [...]}``, which KServe reads
                                     first) -> ``{"predictions": [...]}``, one prediction per instance
==================================== ====================================================================

The predictions are those of KServe's Hugging Face server (``huggingfaceserver``, kserve 0.21,
``encoder_model.py``) for its text tasks:

* sequence classification: an instance is a text; the prediction is, per the model's ``kserve_v1_predictions``
  key, ``label_id`` (the default, as huggingfaceserver without flags): the argmax label's index, an
  integer; ``probabilities`` (its ``--return_probabilities``): ``{"0": p0, "1": p1, ...}``, the softmax of
  the logits rounded to 4 decimals, keyed by label index; ``raw_logits`` (its ``--return_raw_logits``):
  ``{"0": logit0, ...}``;
* translation: an instance is a text; the prediction is the best translation, a string (huggingfaceserver's
  v1 shape for ``text2text_generation``, which 0.21 serves through its OpenAI routes only);
* question answering: huggingfaceserver serves no QA; relserve takes an instance ``{"question", "context"}``
  and predicts the best answer as transformers' QA pipeline writes it, ``{"answer", "score", "start",
  "end"}`` (character offsets, end exclusive), with the model's default options.

The numbers are relserve.v1's for the same inputs (the same tasks in :mod:`relserve.service.tasks`). Errors are
KServe's shape, ``{"error": message}``, with the status of the transport's table (400 bad input, 404 unknown
model, 429 queue full with ``Retry-After``, 503 not ready or draining, 504 past ``X-Request-Timeout``).
relserve's own ``GET /v1/models`` (ListModels) and ``/v1/classify|answer|translate`` stay beside these routes:
KServe's paths all have a model name after ``/v1/models/``. Liveness and readiness need no token unless
``auth_health``. No torch.
"""

from __future__ import annotations

import math
from typing import Any

import grpc
from aiohttp import web

from ..backends.base import TASK_CLASSIFICATION, TASK_QA, TASK_TRANSLATION
from ..errors import FailedPrecondition, InvalidArgument
from ..tasks import classify as classify_task
from ..tasks import qa
from ..tasks import translate as translate_task
from ..tasks.limits import check_request_size
from . import http_calls
from .http_transport import HTTP_STATUS, HttpTransport, json_response
from .oip_codec import describe

PROTOCOL = "kserve_v1"
_QA_FIELDS = ("question", "context")


def routes(core: HttpTransport) -> list[web.RouteDef]:
    """The KServe v1 routes, served on ``core`` (see the module docstring)."""
    api = _KServeV1(core)
    return [web.get("/", api.live), web.get("/v1/models/{name}", api.model_ready),
            web.post("/v1/models/{name}:predict", api.predict),
            web.route("*", "/v1/models/{name}:predict", http_calls.not_allowed(error, "POST"))]


def _model_path(path: str) -> bool:
    rest = path[len("/v1/models/"):] if path.startswith("/v1/models/") else ""
    return bool(rest) and "/" not in rest


def open_path(path: str) -> bool:
    """The probes (liveness, a model's readiness): open without a token unless ``auth_health``."""
    return path == "/" or (_model_path(path) and ":" not in path)


def refused_task(path: str) -> str | None:
    """The ``task`` label of a request to ``path`` refused for its token: ``_unknown_`` for this surface's
    paths (the task is the model's, and the request was not read), None for other surfaces' paths."""
    return "_unknown_" if path == "/" or _model_path(path) else None


def error(code: grpc.StatusCode, message: str, status: int | None = None, retry_after_s: float | None = None,
          cause: BaseException | None = None) -> web.Response:
    """KServe's error reply ``{"error": message}`` with the transport's status for ``code`` (or ``status``);
    ``Retry-After`` (whole seconds, rounded up) when a full queue gives ``retry_after_s``."""
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return json_response({"error": message}, status or HTTP_STATUS.get(code, 500), headers)


def instances_of(body: dict) -> list:
    """The request's instances: ``inputs`` when present (KServe's ``get_predict_input`` reads it first), else
    ``instances``.

    Raises:
        InvalidArgument: neither field, not a list, or empty.
    """
    key = "inputs" if "inputs" in body else "instances"
    value = body.get(key)
    if value is None:
        raise InvalidArgument('the request body needs "instances": a list with one instance per input')
    if not isinstance(value, list):
        raise InvalidArgument(f'"{key}" must be a list, got {describe(value)}')
    if not value:
        raise InvalidArgument(f'"{key}" is empty; send at least one instance')
    return value


def label_index(labels: tuple[str, ...]) -> dict[str, int]:
    """Label name -> index, as :func:`relserve.service.tasks.classify.postprocess` names them (``LABEL_<i>``
    where the checkpoint names none); the first index of a name given twice."""
    index: dict[str, int] = {}
    for i, label in enumerate(labels):
        index.setdefault(label, i)
    return index


def _index(index: dict[str, int], label: str) -> int:
    if label in index:
        return index[label]
    return int(label[len("LABEL_"):])  # the postprocess's name of a label the checkpoint does not name


class _KServeV1:
    """The handlers of :func:`routes`, on the transport ``core``."""

    def __init__(self, core: HttpTransport) -> None:
        self.core = core
        self.registry = core.registry

    async def live(self, request: web.Request) -> web.Response:
        return json_response({"status": "alive"})

    async def model_ready(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        runner = self.registry.runners.get(name)
        if runner is None:
            return error(grpc.StatusCode.NOT_FOUND, f"Model with name {name} does not exist.")
        if not runner.ready or self.registry.draining:
            return error(grpc.StatusCode.UNAVAILABLE, f"Model with name {name} is not ready.")
        return json_response({"name": name, "ready": True})

    async def predict(self, request: web.Request) -> web.Response:
        """``POST /v1/models/{name}:predict``."""
        return await http_calls.serve(self.core, request, protocol=PROTOCOL, name=request.match_info["name"],
                                      handle=self._predict, error=error)

    async def _predict(self, runner: Any, body: dict, deadline: float | None) -> dict:
        instances = instances_of(body)
        if runner.task == TASK_CLASSIFICATION:
            predictions = await _classify(runner, instances, deadline)
        elif runner.task == TASK_QA:
            predictions = await _answer(runner, instances, deadline)
        elif runner.task == TASK_TRANSLATION:
            predictions = await _translate(runner, instances, deadline)
        else:  # a task this surface does not speak yet
            raise FailedPrecondition(f"model {runner.name!r} is a {runner.task} model, which KServe v1 predict "
                                     f"does not serve")
        return {"predictions": predictions}


async def _classify(runner: Any, instances: list, deadline: float | None) -> list:
    texts = [http_calls.text(t, f"instances[{i}]") for i, t in enumerate(instances)]
    labels = runner.info().labels
    config = runner.config
    texts, _ = classify_task.validate_classify(texts, None, 0, len(labels), runner.name,
                                               max_texts=config.max_request_texts, max_chars=config.max_request_chars)
    kind = config.kserve_v1_predictions
    function = "softmax" if kind == "probabilities" else "none"
    items, _timings = await classify_task.classify(runner, texts, None, 0, deadline, function_to_apply=function)
    index = label_index(labels)
    if kind == "label_id":  # the best label's index (torch.argmax: the first of equal logits, as the stable sort)
        return [_index(index, item.labels[0][0]) for item in items]
    out = []
    for item in items:
        by_index = sorted((_index(index, label), score) for label, score in item.labels)
        if kind == "probabilities":  # huggingfaceserver: float(f"{p:.4f}")
            out.append({str(i): float(f"{score:.4f}") for i, score in by_index})
        else:
            out.append({str(i): score for i, score in by_index})
    return out


async def _answer(runner: Any, instances: list, deadline: float | None) -> list:
    pairs = []
    for i, instance in enumerate(instances):
        fields = http_calls.obj(instance, f"instances[{i}]", _QA_FIELDS)
        pairs.append((http_calls.text(fields.get("question"), f"instances[{i}].question"),
                      http_calls.text(fields.get("context"), f"instances[{i}].context")))
    config = runner.config
    check_request_size(runner.name, len(pairs), sum(len(q) + len(c) for q, c in pairs), config.max_request_texts,
                       config.max_request_chars)
    questions = [(q, c, qa.validate_for(runner, q, c, top_k=1, max_answer_len=0, doc_stride=0,
                                        allow_impossible=False, null_threshold=None, align_to_words=None))
                 for q, c in pairs]
    results = await qa.answer_all(runner, questions, deadline)
    out = []
    for result in results:
        best = result.answers[0]
        out.append({"answer": best.text, "score": best.score, "start": best.start, "end": best.end})
    return out


async def _translate(runner: Any, instances: list, deadline: float | None) -> list:
    texts = [http_calls.text(t, f"instances[{i}]") for i, t in enumerate(instances)]
    options = translate_task.validate_translate(texts, beam_size=0, n_best=0, max_length=0, return_alignment=False,
                                                config=runner.config)
    items = await translate_task.translate(runner, texts, options, deadline)
    return [item.hypotheses[0].text for item in items]

