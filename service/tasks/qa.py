"""Extractive question answering end to end: the Answer request validated once, its defaults resolved
(:func:`validate_answer`, :func:`validate_for`), the window estimate reserved in the batcher, the windows
built (``Tokenizer.qa_windows``), the batcher, and the answers searched (:func:`answer`, :func:`answer_all`).

The request is checked once, before any tokenizing. Span search, SQuAD 2.0 null score and answer scores are
:mod:`relserve.models.qa_spans` (the one search, also used by the QA trainer's evaluation); a model output
it cannot search is INTERNAL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from relserve.models import qa_spans
from relserve.models.tokenization import DocStrideTooLarge, TooManyWindows, qa_window_count
from relserve.service.errors import Internal, InvalidArgument
from relserve.service.tasks.limits import check_request_size
from relserve.service.tasks.text import is_blank
from relserve.service.tasks.timings import Timings


MAX_TOP_K = 20  # answers per question
# Characters per token assumed when estimating a QA request's windows from its length, before tokenizing (for
# the queue reservation; prose runs about 4-5 per token with the default vocabularies).
QA_ESTIMATE_CHARS_PER_TOKEN = 4
MIN_QA_SEQ_LEN = 8  # the smallest window a request may ask for (the config key max_seq_len's lower bound)


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
    # the request's window in tokens (the pipeline's max_seq_len, at most the model's); None: the model's
    max_seq_len: int | None = None


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


def validate_for(runner: Any, question: object, context: object, *, top_k: int, max_answer_len: int,
                 doc_stride: int, allow_impossible: bool, null_threshold: float | None,
                 align_to_words: bool | None, max_seq_len: int | None = None) -> AnswerOptions:
    """:func:`validate_answer` against ``runner``'s limits and config defaults (``max_seq_len``,
    ``max_answer_len``, ``doc_stride``, ``max_request_chars``, ``align_to_words``); ``max_seq_len`` a smaller
    window for this request (``MIN_QA_SEQ_LEN``..the model's ``max_seq_len``; None: the model's).

    Raises:
        InvalidArgument: as :func:`validate_answer`, or ``max_seq_len`` out of range (naming the range).
    """
    cfg = runner.config
    if max_seq_len is not None and not MIN_QA_SEQ_LEN <= max_seq_len <= runner.max_seq_len:
        raise InvalidArgument(f"max_seq_len {max_seq_len} is out of range; allowed {MIN_QA_SEQ_LEN}..the "
                              f"{runner.max_seq_len} tokens of model {runner.name!r}'s window (its max_seq_len)")
    # a smaller window lowers the default answer length to it (an explicit longer one is refused)
    default_answer_len = min(cfg.max_answer_len, max_seq_len or cfg.max_answer_len)
    options = validate_answer(
        question, context, top_k=top_k, max_answer_len=max_answer_len, doc_stride=doc_stride,
        allow_impossible=allow_impossible, null_threshold=null_threshold,
        max_seq_len=max_seq_len or runner.max_seq_len,
        default_max_answer_len=default_answer_len, default_doc_stride=cfg.doc_stride,
        max_chars=cfg.max_request_chars, model=runner.name, align_to_words=align_to_words,
        default_align_to_words=cfg.align_to_words,
    )
    return options if max_seq_len is None else dataclasses.replace(options, max_seq_len=max_seq_len)


@dataclass
class AnswerItem:
    """One answer: its text, character offsets in the context (end exclusive), score, and whether it is the
    SQuAD 2.0 "no answer"."""

    text: str
    start: int
    end: int
    score: float
    is_impossible: bool = False


@dataclass
class AnswerResult:
    """A question's answers (best first), the windows its context took, and its timings."""

    answers: list[AnswerItem]
    num_windows: int
    timings: Timings = field(default_factory=Timings)


def estimated_windows(runner: Any, question: str, context: str, doc_stride: int,
                      max_seq_len: int | None = None) -> int:
    """The windows a QA request will need, from its lengths alone (``QA_ESTIMATE_CHARS_PER_TOKEN``), at
    most ``max_qa_windows``: what :func:`answer` reserves before tokenizing (windows of ``max_seq_len``
    tokens; None: the model's)."""
    max_seq_len = max_seq_len or runner.max_seq_len
    max_q = (max_seq_len - 3) // 2
    room = max_seq_len - 3 - min(max_q, max(1, len(question) // QA_ESTIMATE_CHARS_PER_TOKEN))
    step = room - min(doc_stride, room // 2)
    tokens = len(context) // QA_ESTIMATE_CHARS_PER_TOKEN
    return min(runner.config.max_qa_windows, qa_window_count(tokens, room, step))


def _windows(tokenizer: Any, question: str, context: str, max_seq_len: int, doc_stride: int, *,
             max_windows: int | None, clamp_stride: bool) -> list[Any]:
    return tokenizer.qa_windows(question, context, max_seq_len, doc_stride, max_windows=max_windows,
                                clamp_stride=clamp_stride)


async def answer(runner: Any, question: str, context: str, options: AnswerOptions,
                 deadline: float | None) -> AnswerResult:
    """Answer a validated question over ``context`` on ``runner`` (a ready QA model): stride windows of
    ``max_seq_len`` overlapping by ``options.doc_stride`` tokens (the config's default lowered for a long
    question when ``stride_is_default``); spans widened to whole words with ``align_to_words``.

    Bounded work: the window count is estimated from the context's length and reserved in the batcher
    before tokenizing (a full queue refuses at no cost); the tokenizer then tokenizes only as much of the
    context as it takes to prove it needs more than ``max_qa_windows`` windows, before building any.

    Raises:
        InvalidArgument: ``doc_stride`` over this question's limit, or more than ``max_qa_windows`` windows
            (each naming the limit).
        Internal: non-finite logits, or logits that do not fit the windows.
        RelserveError: from the batcher (queue full, deadline, shutting down, model failure).
    """
    batcher = runner.check_ready()
    timings = Timings()
    limit = runner.config.max_qa_windows
    seq_len = options.max_seq_len or runner.max_seq_len
    with batcher.reserve(estimated_windows(runner, question, context, options.doc_stride, seq_len),
                         deadline) as reservation:
        try:
            windows, timings.tokenization_s = await runner.tokenize(
                _windows, runner.meta.tokenizer, question, context, seq_len, options.doc_stride,
                max_windows=limit, clamp_stride=options.stride_is_default,
            )
        except TooManyWindows as exc:
            raise InvalidArgument(f"context too long for model {runner.name!r} (max_qa_windows {limit}): {exc}; "
                                  f"send a shorter context") from None
        except DocStrideTooLarge as exc:
            raise InvalidArgument(f"{exc}; send a doc_stride of at most {exc.limit} (0 = the model's "
                                  f"default)") from None
        except ValueError as exc:  # the tokenizer's other range checks
            raise InvalidArgument(str(exc)) from None
        units = batcher.submit([(len(w.input_ids), w) for w in windows], deadline, reservation)
    units = await batcher.wait(units, deadline)
    timings.add_units(units)
    logits = [unit.result for unit in units]
    for start, end in logits:
        if not (np.all(np.isfinite(start)) and np.all(np.isfinite(end))):
            raise Internal(f"model {runner.name!r} returned non-finite start/end logits")
    try:
        raw = qa_spans.best_answers(
            windows, [s for s, _ in logits], [e for _, e in logits], context,
            top_k=options.top_k, max_answer_len=options.max_answer_len,
            allow_impossible=options.allow_impossible, null_threshold=options.null_threshold,
            align_to_words=options.align_to_words,
        )
    except ValueError as e:  # logits that do not fit the windows: a model bug, not the client's
        raise Internal(str(e)) from None
    return AnswerResult([AnswerItem(text=str(a.text), start=int(a.start), end=int(a.end), score=float(a.score),
                                    is_impossible=bool(a.is_impossible)) for a in raw], len(windows), timings)


async def answer_all(runner: Any, questions: Sequence[tuple[str, str, AnswerOptions]],
                     deadline: float | None) -> list[AnswerResult]:
    """:func:`answer` for each ``(question, context, options)`` concurrently; on the first failure the others
    are cancelled (their queue places are freed) and it is raised."""
    tasks = [asyncio.ensure_future(answer(runner, q, c, o, deadline)) for q, c, o in questions]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
