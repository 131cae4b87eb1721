"""text-embeddings-inference's routes, per model at the base URL ``/models/{name}``: a surface of
:mod:`.http_transport`.

Field names and shapes are TEI's (``router/src/http/types.rs`` and ``docs/openapi.json`` of
huggingface/text-embeddings-inference 1.9):

================================ ==============================================================================
``POST {base}/predict``          ``{"inputs", "truncate"?, "truncation_direction"?, "raw_scores"?}``; ``inputs``
                                 a text, a pair ``[text, text]``, or a batch of single texts and pairs
                                 ``[[text], [text, text], ...]`` -> ``[{"score", "label"}, ...]`` for every
                                 label, best first (a list of them per batch entry). ``raw_scores`` false: the
                                 softmax of the logits (a one-label model: the sigmoid), as TEI; true: the
                                 logits. ``truncate`` false (TEI's default without ``--auto-truncate``): an
                                 input over ``max_input_length`` tokens is 422; true: cut on the right
                                 (``truncation_direction`` ``Right``; ``Left`` is refused), longest first for
                                 a pair. A classification model only.
``POST {base}/tokenize``         ``{"inputs": text | [text, ...], "add_special_tokens"?: true,
                                 "prompt_name"?: null}`` -> ``[[{"id", "text", "special", "start", "stop"},
                                 ...], ...]`` (one list per text, also for one text); ``start`` / ``stop`` are
                                 UTF-8 byte offsets, null for the special tokens, whose ``text`` is the token
                                 itself. A classification or QA model.
``GET {base}/info``              ``{"model_id", "model_sha": null, "model_dtype", "served_model_name",
                                 "model_type": {"classifier": {"id2label", "label2id"}},
                                 "max_concurrent_requests", "max_input_length", "max_batch_tokens",
                                 "max_batch_requests", "max_client_batch_size", "auto_truncate": false,
                                 "tokenization_workers", "version", "sha": null, "docker_label": null}``, from the
                                 model's config (``max_queue_size``, the effective ``max_seq_len``,
                                 ``max_batch_tokens``, ``max_batch_size``, ``max_request_texts``; the
                                 tokenization threads per model). A classification model only.
``POST {base}/rerank``           ``{"query", "texts", "raw_scores"?: false, "return_text"?: false,
                                 "truncate"?: false, "truncation_direction"?: "Right"}`` -> ``[{"index",
                                 "score", "text"?}, ...]`` best first: each (query, text) pair scored by a
                                 classification model (a one-label cross-encoder's sigmoid; ``raw_scores``: its
                                 logit); ``text`` only with ``return_text``. ``texts`` 1..``max_rerank_texts``
                                 (model config; empty: ``Empty``); ``truncate`` as ``/predict``.
================================ ==============================================================================

Errors are TEI's ``{"error": message, "error_type": kind}`` with TEI's status for the kind: ``Validation``
422 (bad input, over a limit; a body that is not a JSON object too), ``Empty`` 400 (no inputs),
``Overloaded`` 429 (a full queue, with ``Retry-After``), ``Unhealthy`` 503 (not ready, draining),
``Backend`` 424 (a model of another task, a model failure); an unknown model is 404, a request past
``X-Request-Timeout`` 504, a body over the limit 413 (each ``Validation`` or ``Backend``). Scores are
relserve.v1's for the same inputs and function. No torch.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import grpc
from aiohttp import web

from ..backends.base import TASK_CLASSIFICATION
from ..errors import FailedPrecondition, InvalidArgument, shown
from ..runner import TOKENIZATION_THREADS
from ..tasks import classify as classify_task
from ..tasks import rerank as rerank_task
from ..tasks import tokens as tokens_task
from ..tasks.limits import check_request_size
from . import http_calls
from .http_transport import HttpTransport, json_response
from .oip_codec import describe, server_metadata

PROTOCOL = "tei"
# the routes under a model's base URL: (method, path after the base, handler name of _Tei)
ROUTES = (("POST", "predict", "predict"), ("POST", "tokenize", "tokenize"), ("GET", "info", "info"),
          ("POST", "rerank", "rerank"))
_PREDICT_FIELDS = ("inputs", "truncate", "truncation_direction", "raw_scores")
_TOKENIZE_FIELDS = ("inputs", "add_special_tokens", "prompt_name")
_RERANK_FIELDS = ("query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction")


class Empty(InvalidArgument):
    """No inputs at all (TEI's ``Empty`` error type: 400)."""


# grpc code -> (HTTP status, TEI error_type)
_KINDS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (422, "Validation"),
    grpc.StatusCode.OUT_OF_RANGE: (422, "Validation"),
    grpc.StatusCode.NOT_FOUND: (404, "Validation"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "Overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "Unhealthy"),
    grpc.StatusCode.FAILED_PRECONDITION: (424, "Backend"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "Backend"),
    grpc.StatusCode.CANCELLED: (499, "Backend"),
    grpc.StatusCode.UNIMPLEMENTED: (415, "Validation"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "Validation"),
}


def routes(core: HttpTransport) -> list[web.RouteDef]:
    """TEI's routes under each model's base URL, served on ``core`` (see the module docstring)."""
    api = _Tei(core)
    out = []
    for method, path, handler in ROUTES:  # each path: its method, then a 405 in TEI's shape for the others
        out += [web.route(method, "/models/{name}/" + path, getattr(api, handler)),
                web.route("*", "/models/{name}/" + path, http_calls.not_allowed(error, method))]
    return out


def refused_task(path: str) -> str | None:
    """The ``task`` label of a request to ``path`` refused for its token: ``_unknown_`` for this surface's
    paths, None for other surfaces' paths."""
    head, _, route = path.rpartition("/")
    return "_unknown_" if head.startswith("/models/") and head.count("/") == 2 and route in {
        r for _, r, _ in ROUTES} else None


def error(code: grpc.StatusCode, message: str, status: int | None = None, retry_after_s: float | None = None,
          cause: BaseException | None = None) -> web.Response:
    """TEI's error reply ``{"error": message, "error_type": kind}`` with TEI's status for the kind (or
    ``status``: the transport's 413 / 415); ``Retry-After`` when a full queue gives ``retry_after_s``."""
    kind_status, kind = (400, "Empty") if isinstance(cause, Empty) else _KINDS.get(code, (424, "Backend"))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_s is None:
        kind_status, kind = 422, "Validation"  # over a size limit (the body's too): no retry helps
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return json_response({"error": message, "error_type": kind}, status or kind_status, headers)


def _sequences(inputs: Any) -> tuple[list[tuple[str, str | None]], bool]:
    """TEI's ``PredictInput``: ``([(text, pair or None), ...], is_batch)``.

    Raises:
        Empty: ``inputs`` is an empty list.
        InvalidArgument: anything else that is not a text, a pair or a batch of them.
    """
    expected = "a string, a pair of strings [string, string] or a batch of mixed strings and pairs " \
               "[[string], [string, string], ...]"
    if isinstance(inputs, str):
        return [(http_calls.text(inputs, "inputs"), None)], False
    if not isinstance(inputs, list):
        raise InvalidArgument(f"inputs must be {expected}, got {describe(inputs)}")
    if not inputs:
        raise Empty("`inputs` cannot be empty")
    if isinstance(inputs[0], str):  # one input: a text, or a pair
        if len(inputs) > 2:
            raise InvalidArgument(f"inputs has {len(inputs)} strings; expected {expected}")
        parts = [http_calls.text(v, f"inputs[{i}]") for i, v in enumerate(inputs)]
        return [(parts[0], parts[1] if len(parts) == 2 else None)], False
    out = []
    for i, entry in enumerate(inputs):
        if not isinstance(entry, list) or not 1 <= len(entry) <= 2:
            raise InvalidArgument(f"inputs[{i}] must be [string] or [string, string] in a batch, got "
                                  f"{describe(entry)}{'' if not isinstance(entry, list) else f' of {len(entry)}'}")
        parts = [http_calls.text(v, f"inputs[{i}][{j}]") for j, v in enumerate(entry)]
        out.append((parts[0], parts[1] if len(parts) == 2 else None))
    return out, True


def _direction(direction: Any) -> None:
    """TEI's ``truncation_direction``: only ``Right`` is served.

    Raises:
        InvalidArgument: any other value.
    """
    if direction is not None and direction not in ("Right", "right"):
        raise InvalidArgument(f"truncation_direction {shown(str(direction))} is not served; relserve truncates on "
                              f"the right (Right), longest first for a pair")


class _Tei:
    """The handlers of :data:`ROUTES`, on the transport ``core``."""

    def __init__(self, core: HttpTransport) -> None:
        self.core = core

    async def predict(self, request: web.Request) -> web.Response:
        """``POST {base}/predict``."""
        return await http_calls.serve(self.core, request, protocol=PROTOCOL, name=request.match_info["name"],
                                      handle=self._predict, error=error)

    async def tokenize(self, request: web.Request) -> web.Response:
        """``POST {base}/tokenize``."""
        return await http_calls.serve(self.core, request, protocol=PROTOCOL, name=request.match_info["name"],
                                      handle=self._tokenize, error=error)

    async def info(self, request: web.Request) -> web.Response:
        """``GET {base}/info``."""
        return await http_calls.serve(self.core, request, protocol=PROTOCOL, name=request.match_info["name"],
                                      handle=self._info, error=error, read_body=False)

    async def rerank(self, request: web.Request) -> web.Response:
        """``POST {base}/rerank``."""
        return await http_calls.serve(self.core, request, protocol=PROTOCOL, name=request.match_info["name"],
                                      handle=self._rerank, error=error,
                                      operation=lambda runner, body: rerank_task.TASK_RERANK)

    async def _rerank(self, runner: Any, body: dict, deadline: float | None) -> list:
        http_calls.obj(body, "the request body", _RERANK_FIELDS)
        if runner.task != TASK_CLASSIFICATION:
            raise FailedPrecondition("model is not a re-ranker model")
        query = http_calls.text(body.get("query"), "query")
        texts = body.get("texts")
        if not isinstance(texts, list):
            raise InvalidArgument(f"texts must be a list of strings, got {describe(texts)}")
        if not texts:
            raise Empty("`texts` cannot be empty")
        texts = http_calls.strings(texts, "texts")
        flags = {key: False if body.get(key) is None else http_calls.boolean(body[key], key)
                 for key in ("raw_scores", "return_text", "truncate")}
        _direction(body.get("truncation_direction"))
        validated = rerank_task.validate_rerank(runner, query, texts, 0, **flags)
        items, _timings = await rerank_task.rerank(runner, validated, deadline)
        return [{"index": item.index, "score": item.score, **({"text": item.text} if flags["return_text"] else {})}
                for item in items]

    async def _predict(self, runner: Any, body: dict, deadline: float | None) -> list:
        http_calls.obj(body, "the request body", _PREDICT_FIELDS)
        if runner.task != TASK_CLASSIFICATION:
            raise FailedPrecondition("Model is not a classifier model")
        sequences, batch = _sequences(body.get("inputs"))
        truncate = body.get("truncate")
        truncate = False if truncate is None else http_calls.boolean(truncate, "truncate")
        _direction(body.get("truncation_direction"))
        raw_scores = body.get("raw_scores")
        raw_scores = False if raw_scores is None else http_calls.boolean(raw_scores, "raw_scores")
        labels = runner.info().labels
        config = runner.config
        if len(sequences) > config.max_request_texts:
            raise InvalidArgument(f"batch size {len(sequences)} > maximum allowed batch size "
                                  f"{config.max_request_texts} (max_request_texts of model {runner.name!r})")
        check_request_size(runner.name, len(sequences), sum(len(a) + len(b or "") for a, b in sequences),
                           config.max_request_texts, config.max_request_chars)
        # TEI: softmax over several labels, the sigmoid of a single one; raw_scores: the logits
        function = "none" if raw_scores else ("softmax" if len(labels) != 1 else "sigmoid")
        singles = [i for i, (_, pair) in enumerate(sequences) if pair is None]
        pairs = [i for i, (_, pair) in enumerate(sequences) if pair is not None]

        async def run(indices: list[int], with_pairs: bool) -> list:
            if not indices:
                return []
            texts = [sequences[i][0] for i in indices]
            text_pairs = [sequences[i][1] for i in indices] if with_pairs else None
            texts, text_pairs = classify_task.validate_classify(texts, text_pairs, 0, len(labels), runner.name)
            items, _ = await classify_task.classify(runner, texts, text_pairs, 0, deadline, function_to_apply=function)
            return items

        single_items, pair_items = await asyncio.gather(run(singles, False), run(pairs, True))
        items: list[Any] = [None] * len(sequences)
        for i, item in zip(singles, single_items):
            items[i] = item
        for i, item in zip(pairs, pair_items):
            items[i] = item
        if not truncate:
            limit = classify_task.effective_max_length(runner.meta.tokenizer, runner.max_seq_len)
            over = [i for i, item in enumerate(items) if item.truncated]
            if over:
                raise InvalidArgument(f"`inputs` must have less than {limit} tokens. Given: more in input {over[0]} "
                                      f"(send \"truncate\": true to cut it)")
        out = [[{"score": score, "label": label} for label, score in item.labels] for item in items]
        return out if batch else out[0]

    async def _tokenize(self, runner: Any, body: dict, deadline: float | None) -> list:
        http_calls.obj(body, "the request body", _TOKENIZE_FIELDS)
        inputs = body.get("inputs")
        if isinstance(inputs, str):
            texts = [http_calls.text(inputs, "inputs")]
        elif isinstance(inputs, list):
            if not inputs:
                raise Empty("`inputs` cannot be empty")
            texts = [http_calls.text(v, f"inputs[{i}]") for i, v in enumerate(inputs)]
        else:
            raise InvalidArgument(f"inputs must be a string or a list of strings, got {describe(inputs)}")
        special = body.get("add_special_tokens")
        special = True if special is None else http_calls.boolean(special, "add_special_tokens")
        if body.get("prompt_name") is not None:
            raise InvalidArgument(f"prompt_name is not served: model {runner.name!r} has no prompts")
        config = runner.config
        if len(texts) > config.max_request_texts:
            raise InvalidArgument(f"batch size {len(texts)} > maximum allowed batch size {config.max_request_texts} "
                                  f"(max_request_texts of model {runner.name!r})")
        texts = tokens_task.validate_tokenize(texts, runner.name, max_texts=config.max_request_texts,
                                                max_chars=config.max_request_chars)
        lists = await tokens_task.tokenize(runner, texts, special, utf8_offsets=True)
        return [[{"id": t.id, "text": t.text, "special": t.special, "start": t.start, "stop": t.end} for t in tokens]
                for tokens in lists]

    async def _info(self, runner: Any, body: Any, deadline: float | None) -> dict:
        if runner.task != TASK_CLASSIFICATION:
            raise FailedPrecondition("Model is not a classifier model")
        info = runner.info()
        config = runner.config
        id2label = {str(i): label for i, label in enumerate(info.labels)}
        label2id: dict[str, int] = {}
        for i, label in enumerate(info.labels):
            label2id.setdefault(label, i)
        return {
            "model_id": runner.name, "model_sha": None, "model_dtype": info.dtype, "served_model_name": runner.name,
            "model_type": {"classifier": {"id2label": id2label, "label2id": label2id}},
            "max_concurrent_requests": config.max_queue_size,
            "max_input_length": classify_task.effective_max_length(runner.meta.tokenizer, runner.max_seq_len),
            "max_batch_tokens": config.max_batch_tokens, "max_batch_requests": info.max_batch_size,
            "max_client_batch_size": config.max_request_texts, "auto_truncate": False,
            "tokenization_workers": TOKENIZATION_THREADS, "version": server_metadata().version,
            "sha": None, "docker_label": None,
        }
