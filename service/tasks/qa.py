"""Extractive question answering: the Answer request validated once, its defaults resolved.

The request is checked once, here (:func:`validate_answer`), before any tokenizing. Span search, SQuAD 2.0
null score and answer scores are :mod:`relserve.models.qa_spans` (the one search, also used by the QA
trainer's evaluation); the runner reports a model output it cannot search as INTERNAL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from relserve.service.errors import InvalidArgument
from relserve.service.tasks.limits import check_request_size
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
    # doc_stride is the config's default (the request sent 0): lowered to the question's limit rather than
    # refused (Tokenizer.qa_windows(clamp_stride=True))
    stride_is_default: bool = False
    # spans widened to whole words (relserve.models.qa_spans.word_span), the pipeline's align_to_words
    align_to_words: bool = True


def validate_answer(question: object, context: object, *, top_k: int, max_answer_len: int, doc_stride: int,
                    allow_impossible: bool, null_threshold: float | None, max_seq_len: int,
                    default_max_answer_len: int, default_doc_stride: int, max_chars: int | None = None,
                    model: str = "", align_to_words: bool | None = None,
                    default_align_to_words: bool = True) -> AnswerOptions:
    """Check an Answer request against the model's ``max_seq_len`` and resolve its defaults (0 = default:
    ``top_k`` 1, ``max_answer_len`` / ``doc_stride`` the model's config; ``null_threshold`` None = 0.0;
    ``align_to_words`` None = the model's ``align_to_words`` config, ``default_align_to_words``).

    ``doc_stride`` is the overlap in tokens between consecutive windows. A client's value must be at most
    half a window's context room: ``(max_seq_len - 4) // 2`` here (a one-token question); the exact limit
    for the request's question, ``(max_seq_len - 3 - question tokens) // 2``, is checked when the windows
    are built (``Tokenizer.qa_windows``). The default instead is lowered to that limit for a long question
    (``stride_is_default``). ``max_chars`` (``max_request_chars``) bounds question + context together.

    Raises:
        InvalidArgument: a blank question or context, too many characters, or an option out of range
            (naming it and the range).
    """
    for what, value in (("question", question), ("context", context)):
        if not isinstance(value, str):
            raise InvalidArgument(f"{what} must be a string, got {type(value).__name__}")
    check_request_size(model, 1, len(question) + len(context), None, max_chars)  # type: ignore[arg-type]
    for what, value in (("question", question), ("context", context)):
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
    stride_limit = (max_seq_len - 4) // 2
    if doc_stride and not 1 <= doc_stride <= stride_limit:
        raise InvalidArgument(
            f"doc_stride {doc_stride} is over the limit of {stride_limit} tokens: the overlap between windows may "
            f"be at most half a window's context room ((max_seq_len {max_seq_len} - 3 special tokens - question "
            f"tokens) // 2; {stride_limit} for a one-token question), so that each window advances by at least "
            f"half a window (0 = default {default_doc_stride})")
    threshold = 0.0 if null_threshold is None else float(null_threshold)
    if math.isnan(threshold):
        raise InvalidArgument("null_threshold is NaN; send a number (or +inf to always answer)")
    words = default_align_to_words if align_to_words is None else bool(align_to_words)
    return AnswerOptions(k, length, stride, bool(allow_impossible), threshold, stride_is_default=not doc_stride,
                         align_to_words=words)
