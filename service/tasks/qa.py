"""Extractive question answering: stride windows in, character-offset answer spans out.

Span search, SQuAD 2.0 null score and answer scores: :mod:`relserve.models.qa_spans` (the one search,
also used by the QA trainer's evaluation); this module checks the request's options first and reports a
malformed model output as INTERNAL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from relserve.models import qa_spans
from relserve.models.qa_spans import AnswerSpan
from relserve.models.tokenization import QAWindow
from relserve.service.errors import Internal, InvalidArgument
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


def validate_options(top_k: int, max_answer_len: int, null_threshold: float) -> None:
    """The span search's own preconditions (:func:`best_answers` checks them for direct callers); a request's
    options are checked once, by :func:`validate_answer`, before any tokenizing.

    Raises:
        InvalidArgument: ``top_k`` or ``max_answer_len`` below 1, or a NaN ``null_threshold``.
    """
    if top_k < 1:
        raise InvalidArgument(f"top_k={top_k} must be >= 1")
    if max_answer_len < 1:
        raise InvalidArgument(f"max_answer_len={max_answer_len} must be >= 1 token")
    if math.isnan(null_threshold):
        raise InvalidArgument("null_threshold must be a number, got NaN")


def best_answers(
    windows: Sequence[QAWindow],
    start_logits: Sequence[np.ndarray],
    end_logits: Sequence[np.ndarray],
    context: str,
    top_k: int = 1,
    max_answer_len: int = 30,
    allow_impossible: bool = False,
    null_threshold: float = 0.0,
    n_best: int = 20,
) -> list[AnswerSpan]:
    """The ``top_k`` best answers for one (question, context): :func:`relserve.models.qa_spans.best_answers`.

    Raises:
        InvalidArgument: ``top_k`` or ``max_answer_len`` below 1, or a NaN ``null_threshold``.
        Internal: the windows and logits do not fit together or a logit is not finite.
    """
    validate_options(top_k, max_answer_len, null_threshold)
    try:
        return qa_spans.best_answers(
            windows, start_logits, end_logits, context, top_k=top_k, max_answer_len=max_answer_len,
            allow_impossible=allow_impossible, null_threshold=null_threshold, n_best=n_best,
        )
    except ValueError as e:
        raise Internal(str(e)) from None
