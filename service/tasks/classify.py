"""Sequence classification: the request validated once, tokenization in, (label, score) pairs out.

Scores as transformers' ``TextClassificationPipeline`` computes them (its ``postprocess``): a per-request
``function_to_apply`` (``softmax`` | ``sigmoid`` | ``none``), else the model's default picked the pipeline's
way (:func:`default_function`): no function for ``problem_type == "regression"``; an independent sigmoid
per label for ``"multi_label_classification"`` or a one-label model (DeBERTa-v3 cross-encoder rerankers are
saved with ``num_labels=1`` and no ``problem_type``; TEI's rerank does the same); a softmax otherwise.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from relserve.models.tokenization import Encoding, Tokenizer
from relserve.service.errors import Internal, InvalidArgument
from relserve.service.tasks.limits import check_request_size
from relserve.service.tasks.text import is_blank


FUNCTIONS = ("softmax", "sigmoid", "none")  # ClassifyRequest.function_to_apply, as the pipeline's


def default_function(problem_type: str | None, num_labels: int) -> str:
    """The function the transformers text-classification pipeline applies when none is asked for:
    ``"none"`` for regression, ``"sigmoid"`` for multi-label or one-label models, else ``"softmax"``
    (the pipeline's order of checks; a model with no labels at all gets ``"none"``, as its fallback)."""
    if problem_type == "regression":
        return "none"
    if problem_type == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    if problem_type == "single_label_classification" or num_labels > 1:
        return "softmax"
    return "none"


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


def validate_classify(texts: Sequence[str], text_pairs: Sequence[str] | None, top_k: int, num_labels: int,
                      model: str, *, max_texts: int | None = None,
                      max_chars: int | None = None) -> tuple[list[str], list[str] | None]:
    """Check a Classify request: at least one text and at most ``max_texts`` (the model's
    ``max_request_texts``), at most ``max_chars`` characters in all texts and pairs together
    (``max_request_chars``), none blank (zero-width characters count as blank), at most one pair per text,
    ``top_k`` in ``0..num_labels`` (0 = all labels; unchecked above when the model has no labels, e.g.
    regression). The size limits are checked first, in O(number of texts).

    Returns:
        ``(texts, text_pairs or None)`` as lists.

    Raises:
        InvalidArgument: naming the field, the index of the bad entry, and the limit (its config key).
    """
    if not texts:
        raise InvalidArgument("texts is empty; send at least one text")
    check_request_size(model, len(texts), sum(map(len, texts)) + sum(map(len, text_pairs or ())),
                       max_texts, max_chars)
    for i, t in enumerate(texts):
        _check_text(t, f"texts[{i}]")
    if text_pairs:
        if len(text_pairs) != len(texts):
            raise InvalidArgument(
                f"text_pairs has {len(text_pairs)} entries but texts has {len(texts)}; send one pair per text "
                f"or none"
            )
        for i, p in enumerate(text_pairs):
            _check_text(p, f"text_pairs[{i}]")
    if top_k < 0 or (num_labels and top_k > num_labels):
        upper = f"the {num_labels} labels of model {model!r}" if num_labels else "the model's labels"
        raise InvalidArgument(f"top_k {top_k} is out of range for {upper}; use 0 for all labels or 1.."
                              f"{num_labels or 'num_labels'}")
    return list(texts), (list(text_pairs) if text_pairs else None)


def effective_max_length(tokenizer: Tokenizer, max_seq_len: int) -> int:
    """The server's limit, lowered to the tokenizer's ``model_max_length`` when that is a real limit (C08)."""
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

    Over-long inputs are truncated longest-first and flagged in ``Encoding.truncated`` (C08: never a
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
    if function == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-x))
    elif function == "none":
        scores = x
    elif function == "softmax":
        e = np.exp(x - x.max())
        scores = e / e.sum()
    else:
        raise Internal(f"unknown function_to_apply {function!r} reached postprocess")
    order = np.argsort(-scores, kind="stable")
    if top_k:
        order = order[:top_k]
    return [(_label(id2label, int(i)), float(scores[i])) for i in order]
