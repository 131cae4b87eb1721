"""Token classification post-processing (numpy only): per-token scores into entities, with the semantics of
transformers' ``TokenClassificationPipeline`` (its ``postprocess``, ``gather_pre_entities``, ``aggregate*``,
``group_entities`` and ``aggregate_overlapping_entities``), written here from that description:

* scores: a softmax over each token's logits, in float32;
* ``none``: one entity per token, labelled by its argmax (``entity``, ``index``);
* ``simple``: argmax per token, then adjacent tokens grouped (:func:`group_entities`);
* ``first`` / ``average`` / ``max``: tokens fused into words first (:func:`aggregate_words`: the first token's
  label, the label of the averaged scores, or the label of the token with the highest score), then grouped;
* grouping: a token/word joins the previous group when its tag (the label without a ``B-`` / ``I-`` prefix)
  equals the group's and it is not a ``B-``; a group's score is the mean of its members' scores and its label
  the first member's tag;
* a token starts a new word unless it is a subword: the pipeline's heuristic for tokenizers without a
  continuing-subword prefix (DeBERTa's Unigram and byte-level BPE): it starts after position 0 and neither it
  nor the character before it is a space (``" "``); the unknown token always starts a word;
* ``ignore_labels`` drop entities by label (``entity`` for ``none``, the group label otherwise), per window,
  before windows are merged;
* texts longer than a window run as overlapping windows (:func:`window_starts`, the ``tokenizers`` library's
  overflow with a stride); the entities of all windows are merged by :func:`merge_overlapping`: sorted by
  start, and of two that overlap the longer one stays (equal lengths: the higher score); with ``none`` (which the
  pipeline does not window) a token that two windows report is kept once (:func:`merge_overlapping_tokens`).

Where relserve differs, by design: an entity's ``start`` / ``end`` are trimmed of whitespace and zero-width
characters (the tokenizer offsets of a word-initial ``▁`` piece include the space before it), an entity that is
only such characters is dropped, and its text is the exact substring ``text[start:end]`` rather than decoded
tokens (:func:`finish`). Offsets are Python ``str`` indices (code points), end exclusive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .tokenization.text import is_blank_char

AGGREGATION_STRATEGIES = ("none", "simple", "first", "average", "max")


@dataclass
class TokenEntity:
    """One entity before it is trimmed: ``label`` (a model label for ``none``, else the group's tag), ``score``
    (probability), ``start`` / ``end`` character offsets (end exclusive), ``index`` (token position, ``none``
    only)."""

    label: str
    score: float
    start: int
    end: int
    index: int | None = None


@dataclass
class _Token:
    scores: np.ndarray  # Float32[num_labels], softmax probabilities
    start: int
    end: int
    index: int
    is_subword: bool


@dataclass
class _Labelled:
    label: str
    score: float
    start: int
    end: int
    index: int | None


def window_starts(n_tokens: int, room: int, stride: int) -> list[int]:
    """First token of each window over ``n_tokens`` tokens, windows of ``room`` tokens overlapping by ``stride``
    (the ``tokenizers`` library's overflowing tokens): 0, then every ``room - stride``, until a window reaches
    the last token. One window for a text of at most ``room`` tokens (or none at all).

    Raises:
        ValueError: ``room`` < 1 or ``stride`` not in ``0..room - 1``.
    """
    if room < 1 or not 0 <= stride < room:
        raise ValueError(f"windows of {room} tokens cannot overlap by {stride}")
    starts = [0]
    while starts[-1] + room < n_tokens:
        starts.append(starts[-1] + room - stride)
    return starts


def window_count(n_tokens: int, room: int, stride: int) -> int:
    """``len(window_starts(n_tokens, room, stride))`` without building the list."""
    if n_tokens <= room:
        return 1
    return 1 + -(-(n_tokens - room) // (room - stride))


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of ``Float[T, num_labels]`` logits, in float32 as the pipeline computes it."""
    x = np.asarray(logits, dtype=np.float32)
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def is_subword(text: str, start: int) -> bool:
    """The pipeline's word-boundary heuristic for tokenizers without a continuing-subword prefix: a token that
    starts at ``start`` continues the previous word unless it is the text's first or a space (``" "``) is at
    ``start - 1`` or ``start``."""
    return start > 0 and " " not in text[start - 1:start + 1]


def _tokens(text: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]], scores: np.ndarray,
            unk_token_id: int | None, first_index: int) -> list[_Token]:
    return [_Token(scores[i], int(s), int(e), first_index + i, False if ids[i] == unk_token_id else is_subword(text, s))
            for i, (s, e) in enumerate(offsets)]


def _word(tokens: list[_Token], strategy: str, labels: Sequence[str]) -> _Labelled:
    if strategy == "first":
        scores = tokens[0].scores
    elif strategy == "max":
        scores = max(tokens, key=lambda t: t.scores.max()).scores  # the first of equal maxima, as max() keeps
    elif strategy == "average":
        scores = np.nanmean(np.stack([t.scores for t in tokens]), axis=0)
    else:
        raise ValueError(f"aggregation strategy {strategy!r} does not fuse words")
    best = int(scores.argmax())
    return _Labelled(labels[best], float(scores[best]), tokens[0].start, tokens[-1].end, None)


def aggregate_words(tokens: list[_Token], strategy: str, labels: Sequence[str]) -> list[_Labelled]:
    """Fuse each word's tokens (a token and the subwords after it) into one labelled word (``first``,
    ``average`` or ``max``); the first token always opens a word."""
    words: list[_Labelled] = []
    group: list[_Token] = []
    for t in tokens:
        if group and not t.is_subword:
            words.append(_word(group, strategy, labels))
            group = []
        group.append(t)
    if group:
        words.append(_word(group, strategy, labels))
    return words


def _tag(label: str) -> tuple[str, str]:
    """``(B | I, tag)`` of a label; a label without a B-/I- prefix continues (I) a group of the same tag."""
    if label.startswith("B-"):
        return "B", label[2:]
    if label.startswith("I-"):
        return "I", label[2:]
    return "I", label


def _group(members: list[_Labelled]) -> TokenEntity:
    score = float(np.nanmean(np.asarray([m.score for m in members], dtype=np.float32)))
    return TokenEntity(members[0].label.split("-", 1)[-1], score, members[0].start, members[-1].end)


def group_entities(items: list[_Labelled]) -> list[TokenEntity]:
    """Adjacent tokens / words of the same tag grouped into entities (a ``B-`` starts a new one)."""
    groups: list[TokenEntity] = []
    current: list[_Labelled] = []
    for it in items:
        if current:
            bi, tag = _tag(it.label)
            if tag == _tag(current[-1].label)[1] and bi != "B":
                current.append(it)
                continue
            groups.append(_group(current))
        current = [it]
    if current:
        groups.append(_group(current))
    return groups


def window_entities(text: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]], logits: np.ndarray,
                    labels: Sequence[str], strategy: str, ignore_labels: Sequence[str],
                    unk_token_id: int | None = None, first_index: int = 1) -> list[TokenEntity]:
    """The entities of one window (the pipeline's per-chunk post-processing), untrimmed.

    Args:
        text: the whole original text.
        ids, offsets: the window's content tokens (no special tokens) and their character offsets in ``text``.
        logits: ``Float[len(ids), num_labels]``, the model's logits of those tokens.
        labels: label names in id order (``num_labels`` of them).
        strategy: one of :data:`AGGREGATION_STRATEGIES`.
        ignore_labels: entities with these labels are dropped.
        unk_token_id: the tokenizer's unknown token, which always starts a word.
        first_index: the token position of ``ids[0]`` (``none``'s ``index``; 1 after ``[CLS]``).

    Raises:
        ValueError: an unknown strategy, or logits that do not fit the tokens or the labels.
    """
    if strategy not in AGGREGATION_STRATEGIES:
        raise ValueError(f"unknown aggregation strategy {strategy!r}; one of {', '.join(AGGREGATION_STRATEGIES)}")
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape != (len(ids), len(labels)) or len(offsets) != len(ids):
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not fit {len(ids)} tokens x {len(labels)} labels")
    tokens = _tokens(text, ids, offsets, softmax(logits), unk_token_id, first_index)
    if strategy in ("none", "simple"):
        per_token = []
        for t in tokens:
            best = int(t.scores.argmax())
            per_token.append(_Labelled(labels[best], float(t.scores[best]), t.start, t.end, t.index))
        if strategy == "none":
            entities = [TokenEntity(p.label, p.score, p.start, p.end, p.index) for p in per_token]
        else:
            entities = group_entities(per_token)
    else:
        entities = group_entities(aggregate_words(tokens, strategy, labels))
    ignored = set(ignore_labels)
    return [e for e in entities if e.label not in ignored]


def merge_overlapping(entities: list[TokenEntity]) -> list[TokenEntity]:
    """Entities of overlapping windows merged: sorted by start (stable), and where one starts inside the one
    kept before it, the longer of the two stays (equal lengths: the higher score; ties: the earlier)."""
    if not entities:
        return []
    ordered = sorted(entities, key=lambda e: e.start)
    merged: list[TokenEntity] = []
    prev = ordered[0]
    for e in ordered:
        if prev.start <= e.start < prev.end:
            longer = e.end - e.start > prev.end - prev.start
            if longer or (e.end - e.start == prev.end - prev.start and e.score > prev.score):
                prev = e
        else:
            merged.append(prev)
            prev = e
    merged.append(prev)
    return merged


def merge_overlapping_tokens(entities: list[TokenEntity]) -> list[TokenEntity]:
    """``none``'s entities of overlapping windows merged: a token reported by two windows (same ``index``) is kept
    once, with the higher score (ties: the earlier window), in token order. (Span overlap, as
    :func:`merge_overlapping` uses, would also merge the distinct byte-level tokens of one character.)"""
    best: dict[int | None, TokenEntity] = {}
    for e in entities:
        kept = best.get(e.index)
        if kept is None or e.score > kept.score:
            best[e.index] = e
    return sorted(best.values(), key=lambda e: -1 if e.index is None else e.index)


def finish(text: str, entities: list[TokenEntity]) -> list[TokenEntity]:
    """Each entity's offsets trimmed of whitespace and zero-width characters at both ends; entities with
    nothing else are dropped. Then ``text[e.start:e.end]`` is the entity's text."""
    out = []
    for e in entities:
        s, t = max(0, e.start), min(len(text), e.end)
        while s < t and is_blank_char(text[s]):
            s += 1
        while t > s and is_blank_char(text[t - 1]):
            t -= 1
        if s < t:
            out.append(TokenEntity(e.label, e.score, s, t, e.index))
    return out
