"""Extractive-QA windows: a question and a long context as overlapping ``[CLS] question [SEP] chunk [SEP]``
windows with each context token's character span, and the limits on them (``doc_stride``, window count).
The span search over the windows' logits is :mod:`relserve.models.qa_spans`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .prefix import LIKELY_CHARS_PER_TOKEN, _Backend, leading_tokens
from .text import Offset


@dataclass(frozen=True)
class QAWindow:
    """One ``[CLS] question [SEP] context_chunk [SEP]`` window of a QA request.

    ``context_offsets[i]`` is the (start, end) character span in the context of token i, or None for
    question and special tokens. ``question_truncated`` says the question was cut to fit.

    ``context_words[i]``: the index of the tokenizer's word (its pre-tokenizer's split of the context, what
    transformers' ``enc.word_ids()`` gives; see :meth:`.prefix._Backend.tokenize_words_batch`) that context token i
    belongs to, None for question and special tokens; the same word has the same index in every window. The
    whole field is None when the backend does not say where its words are.
    """

    input_ids: list[int]
    token_type_ids: list[int]
    context_offsets: list[Offset | None]
    question_truncated: bool = False
    context_words: list[int | None] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


def build_qa_windows(backend: _Backend, cls_token_id: int, sep_token_id: int, question: str, context: str,
                     max_seq_len: int, doc_stride: int, *, max_windows: int | None = None,
                     clamp_stride: bool = False) -> list[QAWindow]:
    """Split ``context`` into overlapping windows ``[CLS] question [SEP] chunk [SEP]``.

    Every window is at most ``max_seq_len`` tokens. The question is cut to at most
    ``(max_seq_len - 3) // 2`` tokens; the rest, ``room = max_seq_len - 3 - question tokens``, is each
    window's context room. Consecutive chunks overlap by ``doc_stride`` context tokens (the HF
    pipeline's ``doc_stride``; same windows as transformers with ``truncation="only_second"``,
    ``stride=doc_stride``, ``return_overflowing_tokens=True``), so each window starts
    ``room - doc_stride`` tokens after the previous one.

    ``doc_stride`` may be at most ``room // 2`` (every window advances by at least half a window: a
    context of n tokens makes at most about ``2 n / room`` windows). A larger value raises
    :class:`DocStrideTooLarge`, or, with ``clamp_stride`` (for a configured default rather than a value
    the caller chose), is lowered to ``room // 2``.

    ``max_windows``: the window count is known from the context's token count before any window is
    built; only as much of the context is tokenized as it takes to prove it needs more than
    ``max_windows`` windows (:func:`leading_tokens`), and then :class:`TooManyWindows` is raised.

    Raises:
        ValueError: ``max_seq_len`` < 5 or ``doc_stride`` < 0; :class:`DocStrideTooLarge`;
            :class:`TooManyWindows`.
    """
    if max_seq_len < 5:
        raise ValueError(f"max_seq_len={max_seq_len} is too small for a QA window (minimum 5)")
    if doc_stride < 0:
        raise ValueError(f"doc_stride={doc_stride} must be >= 0")
    max_q = (max_seq_len - 3) // 2
    (lead_q,) = leading_tokens(backend, [question], [max_q + 1])
    q = lead_q.ids[:max_q]
    question_truncated = len(lead_q.ids) > max_q
    room = max_seq_len - 3 - len(q)  # context tokens per window
    stride = doc_stride
    if stride > room // 2:
        if not clamp_stride:
            raise DocStrideTooLarge(doc_stride, room // 2, room, max_seq_len, len(q))
        stride = room // 2
    step = room - stride
    need = math.inf if max_windows is None else room + (max_windows - 1) * step + 1
    if max_windows is not None and len(context) > need * LIKELY_CHARS_PER_TOKEN:
        # probably over the limit: count with ids only first (about 3x cheaper than with offsets)
        (count,) = leading_tokens(backend, [context], [need])
        if qa_window_count(len(count.ids), room, step) > max_windows:
            raise TooManyWindows(len(count.ids), count.complete, max_windows, room, step)
    (lead_c,) = leading_tokens(backend, [context], [need], offsets=True, words=True)
    c_ids, c_offs, c_words = lead_c.ids, lead_c.offsets, lead_c.words
    if max_windows is not None and qa_window_count(len(c_ids), room, step) > max_windows:
        raise TooManyWindows(len(c_ids), lead_c.complete, max_windows, room, step)
    head = [cls_token_id, *q, sep_token_id]
    windows = []
    start = 0
    while True:
        end = min(start + room, len(c_ids))
        ids = head + c_ids[start:end] + [sep_token_id]
        types = [0] * len(head) + [1] * (end - start + 1)
        offsets: list[Offset | None] = [None] * len(head) + list(c_offs[start:end]) + [None]
        words = None if c_words is None else [None] * len(head) + list(c_words[start:end]) + [None]
        windows.append(QAWindow(ids, types, offsets, question_truncated, words))
        if end >= len(c_ids):
            break
        start += step
    return windows


def qa_window_count(context_tokens: int, room: int, step: int) -> int:
    """Windows :func:`build_qa_windows` makes of ``context_tokens`` tokens (``room`` per window, each
    starting ``step`` after the previous one)."""
    if context_tokens <= room:
        return 1
    return 1 + -(-(context_tokens - room) // step)


class DocStrideTooLarge(ValueError):
    """``doc_stride`` over half the window's context room (the message names the limit and how it is computed)."""

    def __init__(self, doc_stride: int, limit: int, room: int, max_seq_len: int, question_tokens: int) -> None:
        self.doc_stride, self.limit = doc_stride, limit
        super().__init__(
            f"doc_stride {doc_stride} is over the limit of {limit} tokens for this question: the overlap between "
            f"windows may be at most half of a window's context room, {room} tokens (max_seq_len {max_seq_len} - "
            f"3 special tokens - {question_tokens} question tokens), so that each window advances by at least "
            f"half a window"
        )


class TooManyWindows(ValueError):
    """The context needs more windows than allowed; ``tokens`` is its token count (a lower bound unless
    ``exact``) and ``windows`` the windows that many tokens make."""

    def __init__(self, tokens: int, exact: bool, limit: int, room: int, step: int) -> None:
        self.tokens, self.exact, self.limit = tokens, exact, limit
        self.windows = qa_window_count(tokens, room, step)
        what = f"{tokens} tokens" if exact else f"at least {tokens} tokens"
        more = f"{self.windows} windows" if exact else f"more than {limit} windows"
        super().__init__(
            f"the context has {what}: {more} of {room} context tokens, each starting {step} tokens after the "
            f"previous one; the limit is {limit} windows"
        )
