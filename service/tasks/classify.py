"""Sequence classification end to end: the request validated once (:func:`validate_classify`,
:func:`validate_function`), admission, tokenization, the batcher, and (label, score) pairs out
(:func:`classify`, which every frontend calls and whose :class:`ClassifyItem` list every frontend encodes).

Scores as transformers' ``TextClassificationPipeline`` computes them (its ``postprocess``): a per-request
``function_to_apply`` (``softmax`` | ``sigmoid`` | ``none``), else the model's default picked the pipeline's
way (:func:`default_function`): no function for ``problem_type == "regression"``; an independent sigmoid
per label for ``"multi_label_classification"`` or a one-label model (DeBERTa-v3 cross-encoder rerankers are
saved with ``num_labels=1`` and no ``problem_type``; TEI's rerank does the same); a softmax otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from relserve.models.label_scores import FUNCTIONS, apply_function, default_function
from relserve.models.tokenization import Encoding, Tokenizer
from relserve.service.backends.base import TASK_CLASSIFICATION
from relserve.service.errors import Internal, InvalidArgument
from relserve.service.tasks.limits import check_request_size, check_text_count, count_chars
from relserve.service.tasks.text import is_blank
from relserve.service.tasks.timings import Timings


def validate_function(function_to_apply: object) -> str | None:
    """Check ``ClassifyRequest.function_to_apply``: ``""`` -> None (the model's default), else one of
    :data:`FUNCTIONS`, case-insensitive like the pipeline's ``ClassificationFunction[name.upper()]``.

    Raises:
        InvalidArgument: any other value, naming the field and the allowed values.
    """
    if not function_to_apply:
        return None
    name = str(function_to_apply).lower()
    if name not in FUNCTIONS:
        raise InvalidArgument(f"function_to_apply {function_to_apply!r} is not one of {', '.join(FUNCTIONS)} "
                              f"(or empty for the model's default)")
    return name


def _check_text(text: object, what: str) -> None:
    if not isinstance(text, str):
        raise InvalidArgument(f"{what} must be a string, got {type(text).__name__}")
    if is_blank(text):
        raise InvalidArgument(f"{what} is empty or only whitespace; send at least one non-space character")


def _pair_count_mismatch(texts: Sequence[str], text_pairs: Sequence[str]) -> InvalidArgument:
    return InvalidArgument(f"text_pairs has {len(text_pairs)} entries but texts has {len(texts)}; send one pair per "
                           f"text or none")


def validate_classify(texts: Sequence[str], text_pairs: Sequence[str] | None, top_k: int, num_labels: int,
                      model: str, *, max_texts: int | None = None,
                      max_chars: int | None = None) -> tuple[list[str], list[str] | None]:
    """Check a Classify request: at least one text and at most ``max_texts`` (the model's
    ``max_request_texts``), at most ``max_chars`` characters in all texts and pairs together
    (``max_request_chars``), none blank (zero-width characters count as blank), at most one pair per text,
    ``top_k`` in ``0..num_labels`` (0 = all labels; unchecked above when the model has no labels, e.g.
    regression). The counts are checked first, on the sequences as given (a wire message's repeated fields:
    ``len()`` reads no text), then the characters, reading at most ``max_texts`` texts and as many pairs; only an
    accepted request is copied into lists.

    Returns:
        ``(texts, text_pairs or None)`` as lists.

    Raises:
        InvalidArgument: naming the field, the index of the bad entry, and the limit (its config key).
    """
    if not texts:
        raise InvalidArgument("texts is empty; send at least one text")
    check_text_count(model, len(texts), max_texts)
    if text_pairs and len(text_pairs) > len(texts):  # refused before any pair is read (there may be millions)
        raise _pair_count_mismatch(texts, text_pairs)
    check_request_size(model, len(texts), count_chars(texts, text_pairs), max_texts, max_chars)
    for i, t in enumerate(texts):
        _check_text(t, f"texts[{i}]")
    if text_pairs:
        if len(text_pairs) != len(texts):
            raise _pair_count_mismatch(texts, text_pairs)
        for i, p in enumerate(text_pairs):
            _check_text(p, f"text_pairs[{i}]")
    if top_k < 0 or (num_labels and top_k > num_labels):
        upper = f"the {num_labels} labels of model {model!r}" if num_labels else "the model's labels"
        raise InvalidArgument(f"top_k {top_k} is out of range for {upper}; use 0 for all labels or 1.."
                              f"{num_labels or 'num_labels'}")
    return list(texts), (list(text_pairs) if text_pairs else None)


def effective_max_length(tokenizer: Tokenizer, max_seq_len: int) -> int:
    """The server's limit, lowered to the tokenizer's ``model_max_length`` when that is a real limit."""
    if max_seq_len < 3:
        raise InvalidArgument(f"max_seq_len {max_seq_len} is too small; a text needs at least 3 tokens")
    if tokenizer.model_max_length is not None:
        return min(max_seq_len, tokenizer.model_max_length)
    return max_seq_len


def preprocess(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    text_pairs: Sequence[str] | None,
    max_seq_len: int,
) -> list[Encoding]:
    """Encode each text (with its pair) as ``[CLS] a [SEP] (b [SEP])``, at most ``max_seq_len`` tokens.

    Over-long inputs are truncated longest-first and flagged in ``Encoding.truncated`` (never a
    shape error, whatever ``model_max_length`` says); only a prefix of a long text is tokenized, with the
    same result (:meth:`relserve.models.tokenization.Tokenizer.batch_encode`). ``text_pairs`` empty or None
    means no pairs. The request was checked by :func:`validate_classify`.

    Raises:
        InvalidArgument: ``max_seq_len`` too small for a text (3 tokens) or a pair (5 tokens).
    """
    text_pairs = text_pairs or None
    limit = effective_max_length(tokenizer, max_seq_len)
    if text_pairs is not None and limit < 5:
        raise InvalidArgument(f"max_seq_len {limit} is too small; a text pair needs at least 5 tokens")
    return tokenizer.batch_encode(list(texts), list(text_pairs) if text_pairs else None, max_length=limit)


def _label(id2label: Mapping, i: int) -> str:
    if i in id2label:
        return str(id2label[i])
    if str(i) in id2label:
        return str(id2label[str(i)])
    return f"LABEL_{i}"


def postprocess(
    logits: np.ndarray,
    id2label: Mapping[int | str, str] | None,
    problem_type: str | None,
    top_k: int,
    function_to_apply: str | None = None,
) -> list[tuple[str, float]]:
    """Turn one item's ``logits`` (shape ``[num_labels]``) into ``(label, score)`` pairs, best first.

    ``function_to_apply``: one of :data:`FUNCTIONS` (checked by :func:`validate_function`), None for
    :func:`default_function` of ``problem_type`` and the logit count. ``top_k`` 0 returns all labels
    (checked by :func:`validate_classify`). Ties keep label order (the pipeline's stable sort). Labels
    missing from ``id2label`` are called ``LABEL_<i>`` as in transformers.

    Raises:
        Internal: no logits, or a non-finite one.
    """
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise Internal("the model returned no logits")
    if not np.all(np.isfinite(x)):
        raise Internal(f"the model returned non-finite logits {x.tolist()}")
    id2label = id2label or {}
    function = function_to_apply or default_function(problem_type, x.size)
    if function not in FUNCTIONS:
        raise Internal(f"unknown function_to_apply {function!r} reached postprocess")
    scores = apply_function(x, function)
    order = np.argsort(-scores, kind="stable")
    if top_k:
        order = order[:top_k]
    return [(_label(id2label, int(i)), float(scores[i])) for i in order]


@dataclass
class ClassifyItem:
    """One text's result: ``(label, score)`` pairs best first, whether it was truncated, its token count."""

    labels: list[tuple[str, float]]
    truncated: bool
    num_tokens: int


def model_default_function(runner: Any) -> str:
    """The scores' default function of a loaded classification model (:func:`default_function`), "" for a
    model of another task or not loaded yet (relserve.v1 ListModels' ``function_to_apply``)."""
    m = runner.meta
    return default_function(m.problem_type, len(m.labels)) if m and m.task == TASK_CLASSIFICATION else ""


async def run_encoded(runner: Any, n_units: int, deadline: float | None, encode: Callable[..., list[Encoding]],
                      *args: Any) -> tuple[list[Encoding], list[Any], Timings]:
    """One request's sequences through ``runner``'s batcher: ``n_units`` places reserved first (a full queue
    refuses the request, RESOURCE_EXHAUSTED, before any tokenizing), then ``encode(*args)`` in the model's
    tokenization threads (it must return ``n_units`` encodings; whatever it raises, e.g. InvalidArgument for an
    input found too long, releases the places and reaches the caller with no model work done), then one unit per
    encoding, all submitted as one request (the fairness cap counts them together), and waited for.

    Returns:
        ``(encodings, units, timings)``: the units in the encodings' order, each ``unit.result`` the backend's
        output for that sequence (a classification head: ``Float[num_labels]`` logits).

    Raises:
        Unavailable: the model is not ready.
        Internal: ``encode`` returned another number of encodings.
        RelserveError: from ``encode`` or the batcher (queue full, deadline, shutting down, model failure).
    """
    batcher = runner.check_ready()
    timings = Timings()
    with batcher.reserve(n_units, deadline) as reservation:
        encodings, timings.tokenization_s = await runner.tokenize(encode, *args)
        if len(encodings) != n_units:
            raise Internal(f"the request's encoder returned {len(encodings)} sequences for {n_units} places")
        units = batcher.submit([(len(e.input_ids), e) for e in encodings], deadline, reservation)
    units = await batcher.wait(units, deadline)
    timings.add_units(units)
    return encodings, units, timings


async def classify(runner: Any, texts: Sequence[str], pairs: Sequence[str] | None, top_k: int,
                   deadline: float | None,
                   function_to_apply: str | None = None) -> tuple[list[ClassifyItem], Timings]:
    """Classify validated texts (and pairs) on ``runner`` (a ready encoder model,
    ``relserve.service.runner.ModelRunner``): one item per text, in order; ``function_to_apply`` (checked by
    :func:`validate_function`; None: the model's default) turns logits into scores.

    Admission before work: the request's places (one per text) are reserved in the batcher before any
    tokenizing, so a full queue refuses it (RESOURCE_EXHAUSTED) at no tokenizing cost; the reservation
    is released on any error or cancellation.

    Raises:
        Unavailable: the model is not ready.
        InvalidArgument: ``max_seq_len`` too small for a text or pair (:func:`preprocess`).
        RelserveError: from the batcher (queue full, deadline, shutting down, model failure).
    """
    runner.check_ready()
    meta = runner.meta
    encodings, units, timings = await run_encoded(
        runner, len(texts), deadline, preprocess, meta.tokenizer, list(texts), list(pairs) if pairs else None,
        runner.max_seq_len,
    )
    id2label = {i: label for i, label in enumerate(meta.labels)}
    items = []
    for enc, unit in zip(encodings, units):
        items.append(ClassifyItem(
            labels=postprocess(unit.result, id2label, meta.problem_type, top_k, function_to_apply),
            truncated=bool(getattr(enc, "truncated", False)),
            num_tokens=len(enc.input_ids),
        ))
    return items, timings
