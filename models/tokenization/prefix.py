"""Bounded tokenization: tokenize only a prefix of a long text, cut where its tokens are the text's first ones.

A backend (:class:`_Backend`) declares in ``cut_pattern`` where its pipeline allows such a cut (``WORD_CUT``,
``SPACE_CUT``, or None: whole texts only; :func:`_cut_pattern_for` chooses it for a ``tokenizer.json``,
:func:`_spm_splits_words` tells whether a sentencepiece model qualifies). :func:`safe_cut` finds a cut near a
character budget and :func:`leading_tokens` grows the prefix until it yields the tokens wanted, so the work of
a 4 MiB text is bounded by the tokens a request can use rather than by its length.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from .text import _WHITE_SPACE, Offset

# (ids, offsets, word index per token or None when the backend knows no words): _Backend.tokenize_words_batch
WordTokens = tuple[list[int], list[Offset], list[int | None] | None]


class _Backend:
    """``tokenize_batch(texts, offsets)`` -> per text (ids, offsets or []), no special tokens; ``cut_pattern``:
    where a text may be cut with its prefix's tokens the text's first ones (None: nowhere)."""

    cut_pattern: re.Pattern | None = None

    def tokenize(self, text: str) -> tuple[list[int], list[Offset]]:
        return self.tokenize_batch([text], True)[0]

    def tokenize_batch(self, texts: Sequence[str], offsets: bool) -> list[tuple[list[int], list[Offset]]]:
        raise NotImplementedError

    def tokenize_words_batch(self, texts: Sequence[str]) -> list[WordTokens]:
        """Per text ``(ids, offsets, word ids)``: ``tokenize_batch(texts, True)`` plus the index of the word
        each token belongs to, words as the tokenizer's pre-tokenizer splits the text (transformers' fast
        tokenizers' ``enc.word_ids()``, which its question-answering pipeline's ``align_to_words`` maps
        through ``token_to_word`` / ``word_to_chars``). This default knows no words (None)."""
        return [(ids, offs, None) for ids, offs in self.tokenize_batch(texts, True)]


# A regex character class of Unicode White_Space (what the Rust normalisers and pre-tokenizers call whitespace).
_WS = "".join(f"\\u{ord(c):04x}" for c in sorted(_WHITE_SPACE))
# Where a text may be cut so that the tokens of text[:k] are the first tokens of text (k = match start): a
# whitespace character that follows a non-whitespace one and that the pipeline turns into a word boundary.
# DeBERTa's pipelines (Replace(r"\s{2,}|[\n\r\t]", " ") before a Metaspace split, or a pre-tokenizer that
# splits at any whitespace): a space, tab or line break, or a run of two or more whitespace characters.
WORD_CUT = re.compile(f"(?<=[^{_WS}])(?:[ \\t\\n\\r]|[{_WS}]{{2}})")
# Pipelines that split only at " " (Metaspace without the whitespace-run replacement, sentencepiece):
SPACE_CUT = re.compile(f"(?<=[^{_WS}]) ")

INITIAL_CHARS_PER_TOKEN = 6  # first prefix guess; most text has fewer characters per token
LIKELY_CHARS_PER_TOKEN = 4  # prose with the default vocabularies: about 4-5 characters per token
MIN_PREFIX_CHARS = 256


@dataclass(frozen=True)
class Leading:
    """The first tokens of a text (see :func:`leading_tokens`); ``complete``: they are all of its tokens."""

    ids: list[int]
    offsets: list[Offset]
    complete: bool
    chars: int  # characters of the text that were tokenized (the prefix length)
    words: list[int | None] | None = None  # word index per token (leading_tokens(words=True)), None: unknown


_SCAN_CHUNK = 1 << 16  # characters per regex call in safe_cut: other threads get the GIL between calls


def safe_cut(text: str, limit: int, pattern: re.Pattern | None) -> int:
    """End ``k`` of a prefix ``text[:k]`` whose tokens are the text's first tokens: the last cut of ``pattern``
    at or before ``limit``, else the first one after it, else (or with no pattern) ``len(text)``.

    The regex runs over windows of at most ``_SCAN_CHUNK`` characters (growing from 256 backwards), so a
    text without any cut, megabytes long, never holds the GIL for more than a few milliseconds at a time.
    """
    n = len(text)
    if limit >= n or pattern is None:
        return n
    hi, size = limit, 256  # look for a cut starting in [lo, hi], right to left
    while hi >= 1:
        lo = max(1, hi - size)
        last = None
        for m in pattern.finditer(text, lo, min(n, hi + 2)):
            if m.start() <= hi:
                last = m.start()
        if last is not None:
            return last
        hi, size = lo - 1, min(size * 16, _SCAN_CHUNK)
    for start in range(limit + 1, n, _SCAN_CHUNK):
        m = pattern.search(text, start, min(n, start + _SCAN_CHUNK + 1))
        if m:
            return m.start()
    return n


def leading_tokens(backend: "_Backend", texts: Sequence[str], need: Sequence[float],
                   offsets: bool = False, words: bool = False) -> list[Leading]:
    """Tokenize just enough of each text to have ``need[i]`` tokens of it (``math.inf``: the whole text).

    Each round tokenizes, in one backend call, a prefix of every text still short of tokens, cut at
    ``backend.cut_pattern`` (:func:`safe_cut`) at a character budget that starts at ``need x
    INITIAL_CHARS_PER_TOKEN`` and grows at least twofold per round (towards the size the tokens seen so far
    predict), so a text costs at most about twice its final prefix. A text stops at the first prefix with
    ``need`` tokens, or when the prefix is the whole text. The tokens of such a prefix are exactly the first
    tokens of the whole text (the cut pattern's guarantee; see :meth:`Tokenizer.batch_encode`).

    ``words``: offsets and each token's word index too (:meth:`_Backend.tokenize_words_batch`; a backend
    without that method gives ``Leading.words`` None). The cut is at whitespace, where every pre-tokenizer
    that allows cuts splits words, so the prefix's words are the text's first words.
    """
    limits = [len(t) if n == math.inf else min(len(t), max(MIN_PREFIX_CHARS, int(n) * INITIAL_CHARS_PER_TOKEN))
              for t, n in zip(texts, need)]
    results: list[Leading | None] = [None] * len(texts)
    pending = list(range(len(texts)))
    while pending:
        cuts = [safe_cut(texts[i], limits[i], backend.cut_pattern) for i in pending]
        prefixes = [texts[i][:k] for i, k in zip(pending, cuts)]
        with_words = getattr(backend, "tokenize_words_batch", None) if words else None
        if with_words is not None:
            toks = with_words(prefixes)
        else:
            toks = [(ids, offs, None) for ids, offs in backend.tokenize_batch(prefixes, offsets or words)]
        still = []
        for i, k, (ids, offs, word_ids) in zip(pending, cuts, toks):
            complete = k >= len(texts[i])
            if complete or len(ids) >= need[i]:
                results[i] = Leading(ids, offs, complete, k, word_ids)
                continue
            predicted = int(k * need[i] / max(1, len(ids)) * 1.25) if need[i] != math.inf else len(texts[i])
            limits[i] = max(2 * limits[i], k + 1, predicted)
            still.append(i)
        pending = still
    return [r for r in results if r is not None]


def _cut_pattern_for(spec: dict) -> re.Pattern | None:
    """The cut pattern that is exact for a ``tokenizer.json`` pipeline, or None (whole texts are tokenized).

    Exact when the pre-tokenizer splits words at whitespace (Metaspace with ``split``, WhitespaceSplit,
    Whitespace, BertPreTokenizer, ByteLevel, or a Sequence holding one: the other pre-tokenizers only split
    further), every normaliser acts character by character or only rewrites whitespace runs to a space, and
    no added token contains whitespace. ``WORD_CUT`` needs the whitespace-run replacement (or a
    pre-tokenizer that splits at any whitespace); bare Metaspace gets ``SPACE_CUT``.
    """
    if any(any(ch.isspace() for ch in t.get("content", "")) for t in spec.get("added_tokens") or []):
        return None
    norm = spec.get("normalizer")
    norms = _flatten(norm, "normalizers")
    local = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents", "BertNormalizer", "Prepend",
             "Precompiled", "Nmt"}
    collapses = False
    for n in norms:
        kind = n.get("type")
        if kind == "Replace":
            pattern = n.get("pattern") or {}
            regex, string, content = pattern.get("Regex"), pattern.get("String"), n.get("content", "")
            if regex in _WHITESPACE_RUN_REGEXES and content == " ":
                collapses = collapses or regex == r"\s{2,}|[\n\r\t]"
            elif string is not None and not any(ch.isspace() for ch in string + content) and string:
                pass  # a literal without whitespace cannot match across a cut made at whitespace
            else:
                return None
        elif kind not in local:
            return None
    pres = _flatten(spec.get("pre_tokenizer"), "pretokenizers")
    any_ws = {"WhitespaceSplit", "Whitespace", "BertPreTokenizer", "ByteLevel"}
    if any(p.get("type") in any_ws and p.get("use_regex", True) for p in pres):
        return WORD_CUT
    if any(p.get("type") == "Metaspace" and p.get("split", True) for p in pres):
        return WORD_CUT if collapses else SPACE_CUT
    return None


_WHITESPACE_RUN_REGEXES = (r"\s{2,}|[\n\r\t]", " {2,}", r"\s{2,}", r"\s+", " +")


def _flatten(node: dict | None, key: str) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [x for child in node.get(key) or [] for x in _flatten(child, key)]
    return [node]


def _spm_splits_words(proto) -> bool:
    """A sentencepiece model whose pieces never span a word boundary (``split_by_whitespace``, ``\u2581`` only as
    a piece's first character): its segmentation of a text is the segmentations of its words."""
    t = proto.trainer_spec
    if not t.split_by_whitespace or t.treat_whitespace_as_suffix:
        return False
    return all("\u2581" not in p.piece[1:] for p in proto.pieces)
