"""Extractive question answering: the Answer request validated once, its defaults resolved.

The request is checked once, here (:func:`validate_answer`), before any tokenizing. Span search, SQuAD 2.0
null score and answer scores are :mod:`relserve.models.qa_spans` (the one search, also used by the QA
trainer's evaluation); the runner reports a model output it cannot search as INTERNAL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from relserve.service.errors import InvalidArgument
from relserve.service.tasks.text import is_blank


MAX_TOP_K = 20  # answers per question


@dataclass(frozen=True)
class AnswerOptions:
    """A QA request's options with the defaults resolved (``doc_stride`` and ``max_answer_len`` in tokens)."""

    top_k: int
    max_answer_len: int
    doc_stride: int
    allow_impossible: bool
    null_threshold: float


def validate_answer(question: object, context: object, *, top_k: int, max_answer_len: int, doc_stride: int,
                    allow_impossible: bool, null_threshold: float | None, max_seq_len: int,
                    default_max_answer_len: int, default_doc_stride: int) -> AnswerOptions:
    """Check an Answer request against the model's ``max_seq_len`` and resolve its defaults (0 = default:
    ``top_k`` 1, ``max_answer_len`` / ``doc_stride`` the model's config; ``null_threshold`` None = 0.0).

    Raises:
        InvalidArgument: a blank question or context, or an option out of range (naming it and the range).
    """
    for what, value in (("question", question), ("context", context)):
        if not isinstance(value, str):
            raise InvalidArgument(f"{what} must be a string, got {type(value).__name__}")
        if is_blank(value):
            raise InvalidArgument(f"{what} is empty or only whitespace; send at least one non-space character")
    k = top_k or 1
    if not 1 <= k <= MAX_TOP_K:
        raise InvalidArgument(f"top_k {top_k} is out of range; the limit is {MAX_TOP_K} answers (0 = 1)")
    length = max_answer_len or default_max_answer_len
    if not 1 <= length <= max_seq_len:
        raise InvalidArgument(f"max_answer_len {length} is out of range; allowed 1..max_seq_len {max_seq_len} "
                              f"tokens (0 = default {default_max_answer_len})")
    stride = doc_stride or default_doc_stride
    if not 1 <= stride < max_seq_len:
        raise InvalidArgument(f"doc_stride {stride} is out of range; allowed 1..{max_seq_len - 1}, below "
                              f"max_seq_len {max_seq_len} tokens (0 = default {default_doc_stride})")
    threshold = 0.0 if null_threshold is None else float(null_threshold)
    if math.isnan(threshold):
        raise InvalidArgument("null_threshold is NaN; send a number (or +inf to always answer)")
    return AnswerOptions(k, length, stride, bool(allow_impossible), threshold)
