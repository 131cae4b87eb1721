"""Extractive-QA span search: stride windows' start/end logits in, character-offset answer spans out.

The one search the server runs (``relserve.service.tasks.qa``) and the QA trainer evaluates with
(``relserve.models.training.qa``), so a model card's EM/F1 are the server's numbers. Pure numpy.

Span search (per window, over the start/end logits of that window):

* only context tokens may start or end a span — question and special tokens have no
  ``context_offsets``; tokens whose text is only whitespace / zero-width characters are not used as a
  start or end either (they could only produce a span that trims to a neighbour's or to nothing);
* ``start <= end`` and ``end - start + 1 <= max_answer_len`` tokens. The search is exact: every
  pair in the band ``end - max_answer_len < start <= end`` is scored (``O(T * max_answer_len)``), then
  the best ``n_best`` pairs per window are kept;
* a span's characters are ``context[offsets[start][0]:offsets[end][1]]`` with leading/trailing whitespace
  and zero-width characters trimmed; a span that becomes empty is dropped; identical character
  spans found in several windows are merged, keeping the best score;
* with ``align_to_words`` (the server's default, as transformers' question-answering pipeline) the span is
  then widened to whole words (:func:`token_word_span`): from the first character of the start token's word
  to the last of the end token's word, then trimmed again, so an answer never ends mid-word ("of Ger" ->
  "of Germany." with Metaspace words). Words are the tokenizer's own (``QAWindow.context_words``, the
  pre-tokenizer's splits: the pipeline's ``enc.word_to_chars(enc.token_to_word(t))``), so where the
  tokenizer splits off punctuation (GPT-2 byte-level BPE, ``split_by_punct``) "Berlin," widens to
  "Berlin" only; a window without word ids (a backend that does not report them) falls back to
  whitespace-delimited words (:func:`word_span`). Spans that widen to the same words are merged, keeping
  the best score (the pipeline would list them twice). A context without spaces (Chinese, Japanese) is
  one word (Metaspace; one letter run for byte-level BPE): there the pipeline's convention returns the
  whole run, and ``align_to_words=False`` is the useful setting.

No answer (SQuAD 2.0, Rajpurkar et al. 2018; the reference script's null score): the null score of a
window is ``start_logit[CLS] + end_logit[CLS]`` (CLS = token 0); the request's null score is the minimum
over windows. When ``allow_impossible`` and ``null_score - best_span_score > null_threshold``, the first
answer is the no-answer result (``text=""``, ``start=end=0``, ``is_impossible=True``).
``null_threshold=inf`` always returns the best real span.

Scores: a softmax over the candidate set — the merged spans kept from all windows plus, when
``allow_impossible``, the null candidate — of the raw ``start_logit + end_logit`` sums. They are
comparable within one answer list, not calibrated across requests.

Inputs that cannot come from a working model (window and logit counts that disagree, too few or
non-finite logits) and options out of range (``top_k`` or ``max_answer_len`` below 1, a NaN
``null_threshold``) raise ``ValueError``; the server checks a request's options before any tokenizing
(``relserve.service.tasks.qa.validate_answer``), so there this only guards direct callers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .tokenization import QAWindow, is_blank_char


@dataclass(frozen=True)
class AnswerSpan:
    """One answer: ``text == context[start:end]`` (Python str indices, end exclusive); ``score`` in [0, 1]."""

    text: str
    start: int
    end: int
    score: float
    is_impossible: bool = False


@dataclass(frozen=True)
class SpanSearch:
    """Result of :func:`search_spans` for one (question, context).

    ``spans``: distinct ``(raw score, char start, char end)`` best first (ties: earlier span first), the
    raw score being ``start_logit + end_logit``; ``null_score``: the SQuAD 2.0 null score (min over windows).
    """

    spans: list[tuple[float, int, int]]
    null_score: float


def _is_word_break(context: str, i: int) -> bool:
    """Is ``context[i]`` a word boundary for a Metaspace tokenizer without punctuation splitting (the fallback
    of :func:`word_span`)? DeBERTa v2/v3's normalizer turns a space, tab or
    line break, and any run of two or more whitespace characters, into one space, where the Metaspace
    pre-tokenizer splits words (``word_ids``); a lone other whitespace character (e.g. U+00A0) stays inside
    its word, as do zero-width characters."""
    ch = context[i]
    if ch in " \t\n\r":
        return True
    if not ch.isspace():
        return False
    return (i > 0 and context[i - 1].isspace()) or (i + 1 < len(context) and context[i + 1].isspace())


def word_span(context: str, start: int, end: int) -> tuple[int, int]:
    """Widen a non-empty ``[start, end)`` to whole words: left to the start of the word holding ``start``,
    right to the end of the word holding ``end - 1``, then trimmed (:func:`trim_span`).

    The fallback of :func:`token_word_span` for windows without word ids: words as a Metaspace pre-tokenizer
    without punctuation splitting cuts them (:func:`_is_word_break`). Cost: the length of the two words.
    """
    while start > 0 and not _is_word_break(context, start - 1):
        start -= 1
    while end < len(context) and not _is_word_break(context, end):
        end += 1
    return trim_span(context, start, end)


def token_word_span(window: QAWindow, context: str, i: int, j: int) -> tuple[int, int] | None:
    """``[start, end)`` of the words of tokens ``i`` (start) and ``j`` (end) of ``window``, trimmed; None
    when the window carries no word ids (``context_words``).

    transformers' question-answering pipeline's ``align_to_words``: ``enc.word_to_chars(enc.token_to_word(i),
    sequence_index=1)[0]`` to ``...(j)[1]``, where ``word_to_chars`` spans the word's tokens in this window's
    encoding (first token's start to last token's end). A context token without a word id is a word of its own.
    Cost: the two words' lengths in tokens.
    """
    words = getattr(window, "context_words", None)
    if words is None:
        return None
    offs = window.context_offsets
    a, b = i, j
    if words[i] is not None:
        while a > 0 and words[a - 1] == words[i] and offs[a - 1] is not None:
            a -= 1
    if words[j] is not None:
        while b + 1 < len(words) and words[b + 1] == words[j] and offs[b + 1] is not None:
            b += 1
    return trim_span(context, offs[a][0], offs[b][1])  # type: ignore[index]


def trim_span(context: str, start: int, end: int) -> tuple[int, int]:
    """Shrink ``[start, end)`` past leading/trailing whitespace and zero-width characters."""
    while start < end and is_blank_char(context[start]):
        start += 1
    while end > start and is_blank_char(context[end - 1]):
        end -= 1
    return start, end


def window_candidates(
    window: QAWindow,
    start: np.ndarray,
    end: np.ndarray,
    context: str,
    max_answer_len: int,
    n_best: int,
    align_to_words: bool = False,
) -> list[tuple[float, int, int]]:
    """Best ``(score, char_start, char_end)`` spans of one window, at most ``n_best`` distinct ones.

    ``start`` / ``end``: Float[T] logits of the window's T tokens; ``align_to_words``: spans widened to
    whole words (:func:`token_word_span`, else :func:`word_span`) before they are told apart.
    """
    t = len(window.input_ids)
    offs = window.context_offsets
    usable = np.zeros(t, dtype=bool)
    trimmed: list[tuple[int, int] | None] = [None] * t
    for i, o in enumerate(offs[:t]):
        if o is None:
            continue
        s, e = trim_span(context, o[0], o[1])
        if e > s:
            usable[i] = True
            trimmed[i] = (s, e)
    idx = np.flatnonzero(usable)
    if idx.size == 0:
        return []
    # band[k, j] = start[j - k] + end[j] for k = 0..L-1 (span of k + 1 tokens ending at token j)
    L = min(max_answer_len, t)
    s_masked = np.where(usable, start[:t], -np.inf)
    e_masked = np.where(usable, end[:t], -np.inf)
    band = np.full((L, t), -np.inf)
    for k in range(L):
        band[k, k:] = s_masked[: t - k] + e_masked[k:]
    flat = band.ravel()
    finite = np.flatnonzero(np.isfinite(flat))
    if finite.size == 0:
        return []
    want = min(finite.size, n_best * 2)  # spare room for spans merged by trimming
    top = finite[np.argpartition(-flat[finite], want - 1)[:want]] if want < finite.size else finite
    top = top[np.argsort(-flat[top], kind="stable")]
    out: list[tuple[float, int, int]] = []
    seen: set[tuple[int, int]] = set()
    for f in top:
        k, j = divmod(int(f), t)
        i = j - k
        cs, ce = trimmed[i][0], trimmed[j][1]  # type: ignore[index]
        if align_to_words:
            cs, ce = token_word_span(window, context, i, j) or word_span(context, cs, ce)
        if (cs, ce) in seen:
            continue
        seen.add((cs, ce))
        out.append((float(flat[f]), cs, ce))
        if len(out) >= n_best:
            break
    return out


def search_spans(
    windows: Sequence[QAWindow],
    start_logits: Sequence[np.ndarray],
    end_logits: Sequence[np.ndarray],
    context: str,
    max_answer_len: int = 30,
    n_best: int = 20,
    align_to_words: bool = False,
) -> SpanSearch:
    """Merged candidate spans of all windows and the null score (see the module doc), unnormalised;
    ``align_to_words`` as :func:`window_candidates`.

    ``start_logits[w]`` / ``end_logits[w]`` have one value per token of ``windows[w]`` (longer arrays
    are cut to the window length).

    Raises:
        ValueError: no windows, window and logit counts differ, a window has too few logits, or a logit
            is not finite.
    """
    if not (len(windows) == len(start_logits) == len(end_logits)) or not windows:
        raise ValueError(
            f"QA post-processing got {len(windows)} windows, {len(start_logits)} start and "
            f"{len(end_logits)} end logit arrays; expected the same non-zero number"
        )
    spans: dict[tuple[int, int], float] = {}
    null_score = math.inf
    for w, s, e in zip(windows, start_logits, end_logits):
        s = np.asarray(s, dtype=np.float64).reshape(-1)
        e = np.asarray(e, dtype=np.float64).reshape(-1)
        t = len(w.input_ids)
        if s.size < t or e.size < t:
            raise ValueError(f"QA logits have {s.size}/{e.size} values for a window of {t} tokens")
        s, e = s[:t], e[:t]
        if not (np.all(np.isfinite(s)) and np.all(np.isfinite(e))):
            raise ValueError("the model returned non-finite QA logits")
        null_score = min(null_score, float(s[0] + e[0]))
        for score, cs, ce in window_candidates(w, s, e, context, max_answer_len, n_best, align_to_words):
            if score > spans.get((cs, ce), -math.inf):
                spans[(cs, ce)] = score
    ranked = sorted(spans.items(), key=lambda kv: (-kv[1], kv[0]))
    return SpanSearch([(sc, cs, ce) for (cs, ce), sc in ranked], null_score)


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
    align_to_words: bool = False,
) -> list[AnswerSpan]:
    """The ``top_k`` best answers for one (question, context) from its windows' logits (see module doc);
    ``align_to_words``: whole-word spans (:func:`token_word_span`; the server passes the model's or request's
    setting, default on; direct callers such as the QA trainer's evaluation get token-exact spans).

    When no context token can form a span the no-answer result is returned.

    Raises:
        ValueError: as :func:`search_spans`; ``top_k`` or ``max_answer_len`` below 1; a NaN ``null_threshold``.
    """
    if top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if max_answer_len < 1:
        raise ValueError(f"max_answer_len={max_answer_len} must be >= 1 token")
    if math.isnan(null_threshold):
        raise ValueError("null_threshold must be a number, got NaN")
    found = search_spans(windows, start_logits, end_logits, context, max_answer_len, n_best, align_to_words)
    ranked, null_score = found.spans, found.null_score
    raw = [sc for sc, _, _ in ranked]
    if allow_impossible or not ranked:
        raw.append(null_score)
    m = max(raw)
    ex = np.exp(np.asarray(raw) - m)
    probs = ex / ex.sum()
    answers = [AnswerSpan(context[cs:ce], cs, ce, float(p), False) for (_, cs, ce), p in zip(ranked, probs)]
    if not ranked:
        return [AnswerSpan("", 0, 0, 1.0, True)]
    if allow_impossible and null_score - ranked[0][0] > null_threshold:
        return [AnswerSpan("", 0, 0, float(probs[-1]), True), *answers[: top_k - 1]]
    return answers[:top_k]
