"""Tokenizers for DeBERTa-style encoders, with character offsets.

`load_tokenizer(dir)` reads one of two serialisations of a SentencePiece-style Unigram tokenizer:

* ``tokenizer.json`` (Hugging Face ``tokenizers`` library): the file's normaliser, pre-tokenizer and
  Unigram model are used as they are; [CLS]/[SEP] ids come from its TemplateProcessing post-processor
  (falling back to the vocabulary).
* ``spm.model`` + ``tokenizer_config.json`` (Google ``sentencepiece`` library; the hub layout of deberta-v3 and
  mdeberta), in one of two ways (``load_tokenizer(spm_normalization=...)``, the per-model config key of that
  name; logged at load):

  - ``"spm"`` (default): the model's own normaliser (``nmt_nfkc`` for those models: NFKC, whitespace runs
    collapsed, zero-width and control characters dropped) runs inside sentencepiece, as sentencepiece's
    ``encode`` and transformers 4's sentencepiece-backed ``DebertaV2Tokenizer`` (what most hub fine-tunes were
    trained with) apply it; ``do_lower_case`` lower-cases first and ``split_by_punct`` encodes the pieces between
    punctuation characters one by one, as transformers 4 did (:class:`_SpmNativeBackend`). sentencepiece reports
    each piece's span in the original text, so offsets stay exact where normalisation changes lengths.
  - ``"transformers5"``: the text pipeline transformers 5 ``DebertaV2Tokenizer`` builds for such a directory
    (``tokenization_deberta_v2.py``): optional lower-casing (``do_lower_case``), ``Replace(r"\\s{2,}|[\\n\\r\\t]",
    " ")``, NFC, strip right, ``Punctuation`` isolated with ``split_by_punct``, Metaspace ``▁`` with a prefix
    ``▁`` unless the text (segment) already starts with a space. The model's own normaliser spec is switched
    to ``identity`` so the pipeline above is the only normalisation, and character offsets are computed
    here: sentencepiece (``return_type="proto"``; 0.2.3 removed "immutable_proto") reports UTF-8 byte offsets
    into the normalised text, which are mapped back to Python ``str`` indices of the caller's original text.

DeBERTa v1 checkpoints carry a GPT-2 byte-level BPE instead: its ``tokenizer.json`` goes through the first path,
``vocab.json`` + ``merges.txt`` (no tokenizer.json) are built into the same ``tokenizers`` pipeline as
transformers 5 ``DebertaTokenizer`` builds; offsets are the library's, exact into the original text.

Translation checkpoints carry two plain SentencePiece models instead (``source.spm``, ``target.spm``,
special ids ``pad=0 bos=1 eos=2 unk=3``): :class:`TranslationTokenizer` encodes a source as its pieces
followed by EOS and decodes target ids up to the first EOS; :func:`train_sentencepiece` makes such a model.

Both DeBERTa serialisations give the DeBERTa template ``[CLS] A [SEP]`` / ``[CLS] A [SEP] B [SEP]`` with token type ids
0 for ``[CLS] A [SEP]`` and 1 for ``B [SEP]``. :func:`train_unigram_tokenizer` is the one recipe that trains
such a ``tokenizer.json`` directory (the trainer's command line, the test fixtures and the load test use it).

Units: all lengths are in tokens including special tokens unless said otherwise; all offsets are Python
``str`` indices (code points), end exclusive.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

Offset = tuple[int, int]
# (ids, offsets, word index per token or None when the backend knows no words): _Backend.tokenize_words_batch
WordTokens = tuple[list[int], list[Offset], list[int | None] | None]

SOURCE_SPM = "source.spm"
TARGET_SPM = "target.spm"
SPECIAL_IDS = {"pad": 0, "bos": 1, "eos": 2, "unk": 3}


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or has the wrong special ids; the message names the file."""

# tokenizer configs without a real limit carry placeholders such as int(1e30) (C08)
_MAX_LENGTH_PLACEHOLDER = 1_000_000

# Unicode White_Space (what Rust's regex `\s` and `char::is_whitespace` match; Python's str.isspace also
# accepts U+001C..U+001F, which tokenizers does not)
_WHITE_SPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)

# What counts as "nothing there" in user text, one definition for every task: besides ``str.isspace()``
# characters, the zero-width ones that real text carries invisibly (XQuAD contexts have U+FEFF and
# U+200B): zero-width space/non-joiner/joiner, word joiner and the BOM. A text made only of these is blank
# (INVALID_ARGUMENT for classification and QA, "" for translation, C10), and answer spans never start or
# end on them (C07).
INVISIBLE = frozenset("\u200b\u200c\u200d\u2060\ufeff")


def is_blank_char(ch: str) -> bool:
    """True for whitespace and the zero-width characters of ``INVISIBLE``."""
    return ch.isspace() or ch in INVISIBLE


def is_blank(text: str) -> bool:
    """True when ``text`` has no character other than whitespace and zero-width characters.

    The same set as ``all(is_blank_char(ch) for ch in text)``, computed with C string methods (``isspace``,
    ``strip`` and ``replace`` share ``str.isspace``'s definition of whitespace), so a 4 MB text costs
    milliseconds rather than a Python loop over every character (the servicer calls this on the event loop).
    """
    if not text or text.isspace():
        return True
    if not (text[0].isspace() or text[0] in INVISIBLE):
        return False  # the usual case, without touching the rest of a long text
    rest = text.strip()  # non-empty: text.isspace() is False
    if not any(ch in rest for ch in INVISIBLE):
        return False  # rest starts with a character that is neither whitespace nor zero-width
    for ch in INVISIBLE:
        rest = rest.replace(ch, "")
    return not rest or rest.isspace()


@dataclass(frozen=True)
class Encoding:
    """One model input: ``[CLS] A [SEP] (B [SEP])``.

    ``truncated`` is True when tokens of A or B were dropped to fit ``max_length``.
    """

    input_ids: list[int]
    token_type_ids: list[int]
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class QAWindow:
    """One ``[CLS] question [SEP] context_chunk [SEP]`` window of a QA request.

    ``context_offsets[i]`` is the (start, end) character span in the context of token i, or None for
    question and special tokens. ``question_truncated`` says the question was cut to fit.

    ``context_words[i]``: the index of the tokenizer's word (its pre-tokenizer's split of the context, what
    transformers' ``enc.word_ids()`` gives; see :meth:`_Backend.tokenize_words_batch`) that context token i
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


@dataclass
class Tokenizer:
    """A Unigram tokenizer plus the DeBERTa template; see the module docstring.

    Use `load_tokenizer` to build one. ``_tokenize(text)`` of the backend returns the ids and character
    offsets of ``text`` without special tokens.
    """

    backend: "_Backend"
    cls_token_id: int
    sep_token_id: int
    pad_token_id: int
    unk_token_id: int | None
    model_max_length: int | None
    source: str
    vocab_size: int = 0
    special_token_ids: frozenset[int] = field(default_factory=frozenset)

    # ---- raw tokenization -------------------------------------------------------------------------

    def tokenize(self, text: str) -> tuple[list[int], list[Offset]]:
        """Ids and (start, end) character offsets of ``text``, no special tokens, no truncation."""
        return self.backend.tokenize(text)

    def num_tokens(self, text: str, pair: str | None = None) -> int:
        """Length in tokens of the untruncated encoding, special tokens included."""
        n = len(self.tokenize(text)[0]) + 2
        if pair is not None:
            n += len(self.tokenize(pair)[0]) + 1
        return n

    def leading_tokens(self, texts: Sequence[str], need: Sequence[float], offsets: bool = False) -> list["Leading"]:
        """The first tokens of each text, tokenizing only as much of it as it takes (see :func:`leading_tokens`).

        ``need[i]`` tokens are wanted from ``texts[i]`` (``math.inf``: all of them). Returns one
        :class:`Leading` per text: the ids (and offsets when asked) of a prefix that yields at least
        ``need[i]`` tokens, or of the whole text (``complete``). Either way they are exactly the first tokens
        of the whole text's tokenization.
        """
        return leading_tokens(self.backend, texts, need, offsets)

    # ---- model inputs -----------------------------------------------------------------------------

    def encode(self, text: str, pair: str | None = None, max_length: int | None = None) -> Encoding:
        """``[CLS] text [SEP] (pair [SEP])`` with longest-first truncation to ``max_length`` tokens.

        ``max_length`` None means ``model_max_length`` (no truncation if that is None too). Truncation
        follows the ``tokenizers`` LongestFirst strategy (as transformers with ``truncation=True``). Only a
        prefix of a long text is tokenized (:meth:`batch_encode`); the result is the full text's.
        """
        return self.batch_encode([text], None if pair is None else [pair], max_length)[0]

    def batch_encode(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        max_length: int | None = None,
    ) -> list[Encoding]:
        """`encode` for each text (and its pair), with work bounded by ``max_length`` rather than by the text.

        With a ``max_length`` (``budget = max_length - 2``, or ``- 3`` for pairs), each text is tokenized
        through :func:`leading_tokens`: only a prefix cut at a word boundary, grown geometrically until it
        yields ``budget + 1`` tokens (enough to know the text is over budget) or is the whole text. A 4 MiB
        text of prose costs about what a 512-token text costs, and ``input_ids`` and ``truncated`` are
        exactly those of tokenizing the whole text and then truncating:

        * why the prefix gives the same tokens: the pre-tokenizer splits the normalised text into words at
          whitespace (Metaspace ``\u2581`` in DeBERTa's pipeline) and the model segments each word on its
          own, so the tokens of ``text[:k]``, cut right before a whitespace run that follows a non-space
          character, are the first tokens of ``text``; normalisation (NFKC/NFC, the whitespace-run
          replacement, strip right) acts the same on the prefix because no character's normal form ends
          in whitespace and whitespace composes with nothing. :func:`_cut_pattern_for` enables cuts only
          for pipelines where this holds; other tokenizers tokenize whole texts;
        * a text with no whitespace (one long "word", e.g. Chinese without spaces) has no safe cut: the
          prefix grows to the next whitespace after the wanted size, or to the whole text. Its cost is
          then bounded by the request's character limit (the server's ``max_request_chars``), not by
          ``max_length``;
        * pairs: LongestFirst keeps ``min(n, budget + 1)``-capped lengths except for one case: when both
          segments are over the budget and the budget is odd, the longer one keeps the extra token, so the
          exact order of the two full lengths matters; then both segments are tokenized whole (bounded as
          above).
        """
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(pairs)} pairs")
        if max_length is None:
            max_length = self.model_max_length
        texts = list(texts)
        n_special = 3 if pairs is not None else 2
        if max_length is not None and max_length < n_special + (2 if pairs is not None else 1):
            raise ValueError(f"max_length={max_length} leaves no room for text tokens")
        budget = None if max_length is None else max_length - n_special
        need = math.inf if budget is None else budget + 1
        if pairs is None:
            out = []
            for lead in self.leading_tokens(texts, [need] * len(texts)):
                a, truncated = lead.ids, False
                if budget is not None and (len(a) > budget or not lead.complete):
                    a, truncated = a[:budget], True
                out.append(self._template(a, None, truncated))
            return out
        segments = self.leading_tokens(texts + list(pairs), [need] * (2 * len(texts)))
        firsts, seconds = segments[: len(texts)], segments[len(texts):]
        if budget is None:  # no truncation: whole texts
            return [self._template(a.ids, b.ids, False) for a, b in zip(firsts, seconds)]
        exact = [i for i, (a, b) in enumerate(zip(firsts, seconds))
                 if budget % 2 and not _order_known(a, b, budget)]  # both over budget: the order decides
        if exact:
            whole = self.leading_tokens([texts[i] for i in exact] + [pairs[i] for i in exact],
                                        [math.inf] * (2 * len(exact)))
            for j, i in enumerate(exact):
                firsts[i], seconds[i] = whole[j], whole[len(exact) + j]
        out = []
        for a, b in zip(firsts, seconds):
            # an incomplete prefix has budget + 1 tokens, standing for any longer length (see the docstring)
            n1, n2 = _longest_first(len(a.ids), len(b.ids), budget)
            truncated = n1 < len(a.ids) or n2 < len(b.ids)
            out.append(self._template(a.ids[:n1], b.ids[:n2], truncated))
        return out

    def _template(self, a: list[int], b: list[int] | None, truncated: bool) -> Encoding:
        ids = [self.cls_token_id, *a, self.sep_token_id]
        types = [0] * len(ids)
        if b is not None:
            ids += [*b, self.sep_token_id]
            types += [1] * (len(b) + 1)
        return Encoding(ids, types, truncated)

    def qa_windows(self, question: str, context: str, max_seq_len: int, doc_stride: int, *,
                   max_windows: int | None = None, clamp_stride: bool = False) -> list[QAWindow]:
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
        (lead_q,) = self.leading_tokens([question], [max_q + 1])
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
            (count,) = self.leading_tokens([context], [need])
            if qa_window_count(len(count.ids), room, step) > max_windows:
                raise TooManyWindows(len(count.ids), count.complete, max_windows, room, step)
        (lead_c,) = leading_tokens(self.backend, [context], [need], offsets=True, words=True)
        c_ids, c_offs, c_words = lead_c.ids, lead_c.offsets, lead_c.words
        if max_windows is not None and qa_window_count(len(c_ids), room, step) > max_windows:
            raise TooManyWindows(len(c_ids), lead_c.complete, max_windows, room, step)
        head = [self.cls_token_id, *q, self.sep_token_id]
        windows = []
        start = 0
        while True:
            end = min(start + room, len(c_ids))
            ids = head + c_ids[start:end] + [self.sep_token_id]
            types = [0] * len(head) + [1] * (end - start + 1)
            offsets: list[Offset | None] = [None] * len(head) + list(c_offs[start:end]) + [None]
            words = None if c_words is None else [None] * len(head) + list(c_words[start:end]) + [None]
            windows.append(QAWindow(ids, types, offsets, question_truncated, words))
            if end >= len(c_ids):
                break
            start += step
        return windows


def _order_known(a: "Leading", b: "Leading", budget: int) -> bool:
    """Whether LongestFirst's result is decided by what is known of the two segments' lengths: it is unless both
    are over ``budget`` (then the longer full length gets the odd token) and their order is unknown."""
    if len(a.ids) <= budget or len(b.ids) <= budget or (a.complete and b.complete):
        return True
    if a.complete != b.complete:  # the incomplete one has at least len(ids) tokens
        longer_incomplete, other = (b, a) if a.complete else (a, b)
        return len(longer_incomplete.ids) > len(other.ids)
    return False


def qa_window_count(context_tokens: int, room: int, step: int) -> int:
    """Windows :meth:`Tokenizer.qa_windows` makes of ``context_tokens`` tokens (``room`` per window, each
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


def _longest_first(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """Kept lengths of a pair under the ``tokenizers`` LongestFirst strategy (utils/truncation.rs)."""
    if n1 + n2 <= budget:
        return n1, n2
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    if n1 > budget:
        n2 = n1
    else:
        n2 = max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    if swap:
        n1, n2 = n2, n1
    return n1, n2


# ---- bounded tokenization: whitespace-cut prefixes -------------------------------------------------------

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


# ---- backends ------------------------------------------------------------------------------------


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


class _TokenizersBackend(_Backend):
    """``tokenizer.json`` through the ``tokenizers`` library (offsets are char offsets of the input).

    Always ``encode_batch`` (``encode_batch_fast`` when no offsets are wanted): unlike ``encode``, they release
    the GIL while the Rust code runs (measured on 4 MB of prose: ``encode`` held it for 3.7 s, ``encode_batch``
    let other threads run every few ms), so a long tokenization in a worker thread does not stall the event
    loop. What still holds the GIL is turning the result into Python lists, proportional to the tokens
    returned: bounded by the prefix, or for a text with no safe cut by the request's character limit.
    """

    def __init__(self, path: str, spec: dict | None = None, tok=None):
        from tokenizers import Tokenizer as HFTokenizer

        self.tok = HFTokenizer.from_file(path) if tok is None else tok  # tok: already built (vocab.json + merges)
        self.tok.no_truncation()
        self.tok.no_padding()
        self.cut_pattern = _cut_pattern_for(spec if spec is not None else _read_json(path))

    def tokenize_batch(self, texts: Sequence[str], offsets: bool) -> list[tuple[list[int], list[Offset]]]:
        return [(ids, offs) for ids, offs, _ in self._encode(texts, offsets, False)]

    def tokenize_words_batch(self, texts: Sequence[str]) -> list[WordTokens]:
        """The library's own word ids (``Encoding.word_ids``: one per pre-tokenizer split, so a ByteLevel or
        ``Punctuation`` pre-tokenizer makes "Berlin," two words), exactly what transformers' fast tokenizer on
        the same pipeline reports."""
        return self._encode(texts, True, True)

    def _encode(self, texts: Sequence[str], offsets: bool, words: bool):
        # ids only: encode_batch_fast skips offset tracking (3x faster on long texts, and its result is freed
        # at once instead of holding the GIL for ~15 ms per 700k tokens while the offsets and strings are freed)
        encode = self.tok.encode_batch if offsets else getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        out = []
        for text, enc in zip(texts, encode(list(texts), add_special_tokens=False)):
            if not offsets:
                out.append((enc.ids, [], None))
                continue
            offs = [tuple(o) for o in enc.offsets]
            # A lone Metaspace "▁" that stands for the prepended dummy space is reported over the first
            # real character (which the next token also covers); make it zero-width, as the spm backend does.
            for i, (tok, (s, e)) in enumerate(zip(enc.tokens, offs)):
                if tok == "▁" and e > s and not text[s:e].isspace():
                    offs[i] = (s, s)
            out.append((enc.ids, offs, list(enc.word_ids) if words else None))
        return out


class _SentencePieceBackend(_Backend):
    """``spm.model`` through the ``sentencepiece`` library, normalised like transformers 5 DebertaV2
    (``spm_normalization: transformers5``).

    ``split_by_punct``: transformers 5's ``Punctuation(behavior="isolated")`` pre-tokenizer in front of
    Metaspace: every punctuation character (:func:`_is_punct`) of the normalised text is a segment of its own,
    and each segment gets its own prefix ``▁`` unless it starts with a space.
    """

    def __init__(self, path: str, do_lower_case: bool, split_by_punct: bool = False):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        with open(path, "rb") as f:
            proto.ParseFromString(f.read())
        self.proto = proto
        self.model_normalizer = proto.normalizer_spec.name  # what the file declares (logged at load)
        # our own normalisation (below) replaces the model's normaliser, as transformers 5 does
        ns = proto.normalizer_spec
        ns.name = "identity"
        ns.precompiled_charsmap = b""
        ns.add_dummy_prefix = False
        ns.remove_extra_whitespaces = False
        ns.escape_whitespaces = True
        proto.denormalizer_spec.Clear()
        self.sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self.do_lower_case = do_lower_case
        self.split_by_punct = split_by_punct
        self.cut_pattern = WORD_CUT if _spm_splits_words(proto) else None

    def tokenize_batch(self, texts: Sequence[str], offsets: bool) -> list[tuple[list[int], list[Offset]]]:
        return [self._tokenize(t)[:2] for t in texts]

    def tokenize_words_batch(self, texts: Sequence[str]) -> list[WordTokens]:
        """Word ids as transformers 5's fast ``DebertaV2Tokenizer`` gives them: one word per ``Punctuation`` split
        (with ``split_by_punct``) and per Metaspace split inside it (at each space of the normalised text,
        the space going with the word after it), so "Berlin," is two words with ``split_by_punct``, one
        without."""
        return [self._tokenize(t) for t in texts]

    def _tokenize(self, text: str) -> tuple[list[int], list[Offset], list[int | None]]:
        norm, spans = _deberta_v2_normalize(text, self.do_lower_case)
        segments = _punct_segments(norm) if self.split_by_punct else [(0, len(norm))]
        ids: list[int] = []
        offsets: list[Offset] = []
        words: list[int | None] = []
        word = -1
        for a, b in segments:
            seg_ids, seg_offs, seg_starts = self._tokenize_segment(norm[a:b], spans[a:b])
            ids += seg_ids
            offsets += seg_offs
            for k, starts in enumerate(seg_starts):
                word += starts or k == 0  # a segment always starts a word
                words.append(word)
        return ids, offsets, words

    def _tokenize_segment(self, norm: str, spans: list[Offset]) -> tuple[list[int], list[Offset], list[bool]]:
        """Ids, offsets and, per piece, whether it starts a Metaspace word (begins at a space of ``norm``)."""
        if not norm:
            return [], [], []
        if norm[0] != " ":  # Metaspace prepend_scheme="always": a zero-width prefix space at the first char
            s0 = spans[0][0]
            norm, spans = " " + norm, [(s0, s0), *spans]
        pieces = self.sp.encode(norm, return_type="proto").pieces
        # UTF-8 byte offset -> index into norm
        byte_to_char = []
        for i, ch in enumerate(norm):
            byte_to_char.extend([i] * len(ch.encode("utf-8")))
        byte_to_char.append(len(norm))
        ids, offsets, starts = [], [], []
        for p in pieces:
            b, e = p.begin, p.end
            if e <= b:
                continue
            c0, c1 = byte_to_char[b], byte_to_char[e - 1]
            ids.append(p.id)
            starts.append(norm[c0] == " ")
            start = spans[c0][0]
            # a piece that starts with the (zero-width) prefix space starts at the next real char
            if c0 == 0 and spans[0][0] == spans[0][1] and c1 > 0:
                start = spans[1][0]
            offsets.append((start, spans[c1][1]))
        return ids, offsets, starts


def _deberta_v2_normalize(text: str, lower: bool) -> tuple[str, list[Offset]]:
    """transformers 5 DebertaV2 normaliser with alignment.

    Returns the normalised string and, per normalised char, the (start, end) span of original chars it
    comes from. Steps: Lowercase (optional, per char), Replace(``\\s{2,}|[\\n\\r\\t]`` -> " "), NFC,
    Strip(right).
    """
    chars: list[str] = []
    spans: list[Offset] = []
    for i, ch in enumerate(text):
        out = ch.lower() if lower else ch
        for o in out:
            chars.append(o)
            spans.append((i, i + 1))
    # whitespace runs of >= 2, or a single \n \r \t, become one space spanning the run
    c2: list[str] = []
    s2: list[Offset] = []
    i, n = 0, len(chars)
    while i < n:
        if chars[i] in _WHITE_SPACE:
            j = i
            while j < n and chars[j] in _WHITE_SPACE:
                j += 1
            if j - i >= 2 or chars[i] in "\n\r\t":
                c2.append(" ")
                s2.append((spans[i][0], spans[j - 1][1]))
            else:
                c2.append(chars[i])
                s2.append(spans[i])
            i = j
        else:
            c2.append(chars[i])
            s2.append(spans[i])
            i += 1
    joined = "".join(c2)
    if not unicodedata.is_normalized("NFC", joined):
        c2, s2 = _nfc_aligned(c2, s2)
    while c2 and c2[-1] in _WHITE_SPACE:
        c2.pop()
        s2.pop()
    return "".join(c2), s2


def _nfc_aligned(chars: list[str], spans: list[Offset]) -> tuple[list[str], list[Offset]]:
    """NFC per cluster (a starter plus following combining marks / Hangul V,T jamo), keeping alignment."""
    out_c: list[str] = []
    out_s: list[Offset] = []
    i, n = 0, len(chars)
    while i < n:
        j = i + 1
        while j < n and (unicodedata.combining(chars[j]) or "\u1160" <= chars[j] <= "\u11ff"):
            j += 1
        composed = unicodedata.normalize("NFC", "".join(chars[i:j]))
        span = (spans[i][0], spans[j - 1][1])
        if len(composed) == j - i:
            out_c.extend(composed)
            out_s.extend(spans[i:j])
        else:
            out_c.extend(composed)
            out_s.extend([span] * len(composed))
        i = j
    return out_c, out_s


def _is_punct(ch: str) -> bool:
    """Punctuation as both DeBERTa-v2 tokenizers define it for ``split_by_punct``: ASCII ``!``-``/``,
    ``:``-``@``, ``[``-`````, ``{``-``~``, or a Unicode ``P*`` category (transformers 4 ``_is_punctuation``,
    and the ``tokenizers`` ``Punctuation`` pre-tokenizer transformers 5 uses)."""
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _punct_segments(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of the pieces of ``text`` cut around every punctuation character, each punctuation
    character a piece of its own, no empty pieces (transformers 4 ``_run_split_on_punc``, ``Punctuation``
    ``isolated``)."""
    out: list[tuple[int, int]] = []
    start = 0
    for i, ch in enumerate(text):
        if _is_punct(ch):
            if start < i:
                out.append((start, i))
            out.append((i, i + 1))
            start = i + 1
    if start < len(text):
        out.append((start, len(text)))
    return out


class _SpmNativeBackend(_Backend):
    """``spm.model`` with its own normaliser (``spm_normalization: spm``, the default): what sentencepiece's
    ``encode`` and transformers 4's (slow, sentencepiece-backed) ``DebertaV2Tokenizer`` give.

    transformers 4 ``DebertaV2Tokenizer._tokenize``: ``text.lower()`` when ``do_lower_case``; with
    ``split_by_punct`` the text is cut around every punctuation character (:func:`_punct_segments`, on the
    original, not the normalised, text) and each piece is encoded on its own (so each gets the model's dummy
    prefix); then ``spm.encode``. The model's normaliser (``nmt_nfkc`` for DeBERTa-v3 / mDeBERTa: NFKC,
    whitespace runs collapsed, control and zero-width characters removed, dummy prefix) runs inside
    sentencepiece, which reports each piece's span in its input (``return_type="offset_mapping"``: code point
    offsets), so offsets point into the caller's text even where normalisation changes lengths (a ligature
    that becomes two letters, a full-width letter, a removed ZWSP). A piece that stands for no input character
    (the dummy prefix ``▁``, the second letter of an expanded ligature) gets a zero-width offset.
    """

    def __init__(self, path: str, do_lower_case: bool, split_by_punct: bool = False):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        with open(path, "rb") as f:
            data = f.read()
        proto = pb.ModelProto()
        proto.ParseFromString(data)
        self.proto = proto
        self.model_normalizer = proto.normalizer_spec.name
        self.sp = spm.SentencePieceProcessor(model_proto=data)
        self.do_lower_case = do_lower_case
        self.split_by_punct = split_by_punct
        # Cut only before a plain space after a non-space character: the model's normaliser maps characters
        # (and multi-character compositions, which a space never joins) one by one and collapses whitespace
        # runs, so text[:k] normalises to a prefix of the text's normal form ending at a word boundary; the
        # pieces of such a model never span one (tests: every cut's tokens are the whole text's first tokens).
        self.cut_pattern = SPACE_CUT if _spm_splits_words(proto) else None
        # ids of the pieces that begin with the word-boundary mark "▁" (a new whitespace word starts there)
        self._word_start_ids = frozenset(i for i, p in enumerate(proto.pieces) if p.piece.startswith("\u2581"))

    def tokenize_batch(self, texts: Sequence[str], offsets: bool) -> list[tuple[list[int], list[Offset]]]:
        return [(ids, offs) for ids, offs, _ in self._encode(texts, offsets, False)]

    def tokenize_words_batch(self, texts: Sequence[str]) -> list[WordTokens]:
        """Word ids as the fast tokenizer transformers converts such a model into (``DebertaV2Converter``:
        ``Punctuation`` isolated with ``split_by_punct``, then Metaspace) gives them, on this backend's pieces:
        a word starts at each piece the model begins with "▁" (after a whitespace run in the normalised text)
        and at each punctuation segment, so with ``split_by_punct`` "Berlin," is two words, without it one.
        (transformers 4's slow tokenizer has no word ids; its pipeline's fast default is that converter.)"""
        return self._encode(texts, True, True)

    def _encode(self, texts: Sequence[str], offsets: bool, words: bool):
        lowered = [self._lower(t) for t in texts] if self.do_lower_case else [(t, None) for t in texts]
        # one batched sentencepiece call over every text's segments
        segs: list[list[tuple[int, int]]] = []
        inputs: list[str] = []
        for t, _ in lowered:
            cut = _punct_segments(t) if self.split_by_punct else ([(0, len(t))] if t else [])
            segs.append(cut)
            inputs.extend(t[a:b] for a, b in cut)
        if offsets:
            encoded = self.sp.encode(inputs, return_type="offset_mapping") if inputs else []
        else:
            encoded = self.sp.encode(inputs, out_type=int) if inputs else []
        out = []
        k = 0
        starts = self._word_start_ids
        for (t, pos), cut in zip(lowered, segs):
            ids: list[int] = []
            offs: list[Offset] = []
            word_ids: list[int | None] = []
            word = -1
            for a, _ in cut:
                enc = encoded[k]
                k += 1
                if not offsets:
                    ids += enc
                    continue
                if words:
                    for n, i in enumerate(enc["ids"]):
                        word += n == 0 or i in starts  # each segment starts a word
                        word_ids.append(word)
                ids += enc["ids"]
                for s, e in enc["offsets"]:
                    s, e = a + s, a + e
                    if pos is not None:  # lower-casing changed lengths: back to the caller's characters
                        s, e = (pos[s], pos[s]) if e <= s else (pos[s], pos[e - 1] + 1)
                    offs.append((s, e))
            out.append((ids, offs, word_ids if words else None))
        return out

    @staticmethod
    def _lower(text: str) -> tuple[str, list[int] | None]:
        """``text.lower()`` (as transformers 4) and, when that changes the length (``İ`` -> ``i̇``), the index
        in ``text`` of each lowered character's source (plus ``len(text)`` at the end); else None."""
        low = text.lower()
        if len(low) == len(text):
            return low, None
        pos = [i for i, ch in enumerate(text) for _ in ch.lower()]
        pos.append(len(text))
        return low, pos


# ---- loading -------------------------------------------------------------------------------------


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_str(v, default: str) -> str:
    if v is None:
        return default
    if isinstance(v, dict):  # AddedToken serialisation
        return v.get("content", default)
    return str(v)


def _max_length(cfg: dict) -> int | None:
    v = cfg.get("model_max_length")
    if v is None:
        return None
    v = int(v)
    return None if v >= _MAX_LENGTH_PLACEHOLDER or v <= 0 else v


SPM_NORMALIZATIONS = ("spm", "transformers5")  # load_tokenizer(spm_normalization=...), the model key of that name


def _log_spm_normalization(path: str, mode: str, normalizer: str, lower: bool, punct: bool) -> None:
    """One INFO line at load: which normalisation an ``spm.model`` tokenizer applies, and why."""
    name = normalizer or "(unnamed)"
    if mode == "spm":
        what = (f"the model's own normaliser {name!r}, as sentencepiece and transformers 4 apply it "
                f"(spm_normalization: spm, the default)")
    else:
        what = (f"transformers 5's pipeline (whitespace runs -> ' ', NFC, strip right) instead of the model's own "
                f"normaliser {name!r}, because spm_normalization is transformers5")
    logging.getLogger(__name__).info("%s: tokenizing with %s; do_lower_case=%s split_by_punct=%s",
                                     path, what, lower, punct)


BPE_VOCAB, BPE_MERGES = "vocab.json", "merges.txt"


def _byte_level_bpe_backend(vocab_path: str, merges_path: str, cfg: dict,
                            specials: Sequence[str]) -> tuple["_TokenizersBackend", dict]:
    """DeBERTa v1's GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``, built as transformers 5
    ``DebertaTokenizer`` builds it (``tokenization_deberta.py``): BPE without subword prefix or unknown token,
    no normaliser, ``ByteLevel(add_prefix_space)`` pre-tokenizer (``add_prefix_space`` from
    tokenizer_config.json, default false), ByteLevel decoder, the special tokens as added special tokens.
    Returns the backend and its serialised spec (for the cut pattern)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    try:
        bpe = models.BPE.from_file(vocab_path, merges_path, dropout=None, unk_token=None,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    except Exception as e:  # the Rust side reports unreadable / malformed files as plain exceptions
        raise ValueError(f"{vocab_path} / {merges_path}: cannot read the BPE vocabulary: {e}") from e
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(cfg.get("add_prefix_space", False)))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(specials)])
    spec = json.loads(tok.to_str())
    return _TokenizersBackend(vocab_path, spec, tok=tok), spec


def load_tokenizer(directory: str | os.PathLike, spm_normalization: str = "spm", log_choice: bool = True) -> Tokenizer:
    """Load ``tokenizer.json`` (preferred), ``spm.model`` or ``vocab.json`` + ``merges.txt`` (DeBERTa v1's
    byte-level BPE, :func:`_byte_level_bpe_backend`) from a checkpoint/tokenizer directory.

    ``tokenizer_config.json`` (optional with tokenizer.json) supplies special token strings,
    ``do_lower_case`` and ``split_by_punct`` (spm only) and ``model_max_length`` (None when absent or a
    placeholder >= 1e6, C08). Raises FileNotFoundError when neither file is present.

    ``spm_normalization`` (one of ``SPM_NORMALIZATIONS``; only for an ``spm.model`` without
    ``tokenizer.json``): ``"spm"`` applies the model's own normaliser as sentencepiece and transformers 4
    do (:class:`_SpmNativeBackend`; what hub fine-tunes of deberta-v3 / mdeberta were trained with);
    ``"transformers5"`` reproduces transformers 5, which drops it (:class:`_SentencePieceBackend`). The
    choice and its reason are logged at INFO (unless ``log_choice`` is false: a second load of the same
    directory, e.g. the server's copy of a worker process's tokenizer). Raises ValueError for another value.
    """
    if spm_normalization not in SPM_NORMALIZATIONS:
        raise ValueError(f"spm_normalization {spm_normalization!r}: expected one of {list(SPM_NORMALIZATIONS)}")
    directory = os.fspath(directory)
    cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
    smap = _read_json(os.path.join(directory, "special_tokens_map.json"))

    def tok_name(key: str, default: str) -> str:
        return _token_str(cfg.get(key, smap.get(key)), default)

    names = {k: tok_name(f"{k}_token", f"[{k.upper()}]") for k in ("cls", "sep", "pad", "unk", "mask")}
    json_path = os.path.join(directory, "tokenizer.json")
    spm_path = os.path.join(directory, "spm.model")
    vocab_path, merges_path = os.path.join(directory, BPE_VOCAB), os.path.join(directory, BPE_MERGES)
    bpe = (not os.path.isfile(json_path) and not os.path.isfile(spm_path)
           and os.path.isfile(vocab_path) and os.path.isfile(merges_path))
    if os.path.isfile(json_path) or bpe:
        if bpe:
            backend, spec = _byte_level_bpe_backend(vocab_path, merges_path, cfg, list(names.values()))
        else:
            spec = _read_json(json_path)
            backend = _TokenizersBackend(json_path, spec)
        tok = backend.tok
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        ids = {k: tok.token_to_id(v) for k, v in names.items()}
        post = spec.get("post_processor") or {}
        if post.get("type") == "TemplateProcessing":
            st = post.get("special_tokens", {})
            for k in ("cls", "sep"):
                if names[k] in st and st[names[k]].get("ids"):
                    ids[k] = st[names[k]]["ids"][0]
        source = vocab_path if bpe else json_path
        specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        special_ids = frozenset(tok.token_to_id(s) for s in specials if tok.token_to_id(s) is not None)
    elif os.path.isfile(spm_path):
        lower, punct = bool(cfg.get("do_lower_case", False)), bool(cfg.get("split_by_punct", False))
        spm_backend = _SpmNativeBackend if spm_normalization == "spm" else _SentencePieceBackend
        backend = spm_backend(spm_path, lower, punct)
        if log_choice:
            _log_spm_normalization(spm_path, spm_normalization, backend.model_normalizer, lower, punct)
        sp = backend.sp
        vocab_size = sp.get_piece_size()

        def piece_id(piece: str) -> int | None:
            i = sp.piece_to_id(piece)
            return None if i == sp.unk_id() and piece != sp.id_to_piece(sp.unk_id()) else i

        ids = {k: piece_id(v) for k, v in names.items()}
        source = spm_path
        special_ids = frozenset(i for i in range(vocab_size) if sp.is_control(i) or sp.is_unknown(i))
    else:
        raise FileNotFoundError(f"{directory}: neither tokenizer.json nor spm.model found (nor DeBERTa v1's "
                                f"vocab.json + merges.txt)")
    for k in ("cls", "sep"):
        if ids[k] is None:
            raise ValueError(f"{source}: special token {names[k]!r} ({k}_token) is not in the vocabulary")
    return Tokenizer(
        backend=backend,
        cls_token_id=ids["cls"],
        sep_token_id=ids["sep"],
        pad_token_id=ids["pad"] if ids["pad"] is not None else 0,
        unk_token_id=ids["unk"],
        model_max_length=_max_length(cfg),
        source=source,
        vocab_size=vocab_size,
        special_token_ids=special_ids,
    )


# ---------------------------------------------------------------------------------------------------------
# Training a DeBERTa-style Unigram tokenizer.json
# ---------------------------------------------------------------------------------------------------------

# DeBERTa-v3's special tokens, in id order: [PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3 [MASK]=4
UNIGRAM_SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")
# what tokenizer_config.json / special_tokens_map.json name them (DeBERTa-v3's convention: BOS = CLS, EOS = SEP)
SPECIAL_TOKENS_MAP = {"bos_token": "[CLS]", "eos_token": "[SEP]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                      "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]"}
UNICODE_FORMS = ("NFKC", "NFC")


def train_unigram_tokenizer(
    lines: Iterable[str],
    out_dir: str | os.PathLike,
    vocab_size: int = 8000,
    model_max_length: int = 512,
    unicode_form: str = "NFKC",
    max_piece_length: int = 16,
) -> Path:
    """Train a SentencePiece-style Unigram tokenizer on ``lines`` and write a tokenizer directory.

    The directory holds ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` and
    loads with :func:`load_tokenizer` and with transformers' ``AutoTokenizer.from_pretrained``. Pipeline:
    whitespace runs and single ``\\n \\r \\t`` -> one space, Unicode normalisation, strip right; Metaspace
    ``▁`` pre-tokenizer (prefix space always); Unigram model (``tokenizers`` ``UnigramTrainer``, pieces of
    at most ``max_piece_length`` characters); DeBERTa template ``[CLS] A [SEP] (B [SEP])`` with type ids
    0/1; special ids as in DeBERTa-v3 (``UNIGRAM_SPECIAL_TOKENS``).

    ``unicode_form``:

    * ``"NFKC"`` (relserve's own tokenizers): NFKC before the whitespace step, so compatibility characters
      (ligatures, full-width letters) fold first. ``tokenizer_class`` is ``PreTrainedTokenizerFast`` on
      purpose: transformers 5 rebuilds a ``DebertaV2Tokenizer`` from the vocabulary alone (NFC, its own
      normaliser), which would drop the NFKC step; the generic class uses ``tokenizer.json`` as written.
    * ``"NFC"``: exactly the pipeline transformers 5 ``DebertaV2Tokenizer`` rebuilds (whitespace, NFC,
      strip right), declared as ``DebertaV2Tokenizer`` (``do_lower_case`` false), so transformers reads it
      with its DeBERTa tokenizer class (the test fixtures and random load-test checkpoints).

    Deterministic for a given ``lines`` and size: the ``tokenizers`` Unigram trainer sums floats in hash-map
    order (last-bit jitter between runs, and a different order among equal scores), so piece scores are
    rounded to 1e-8 and pieces after the specials are sorted by (score descending, piece) before saving;
    the same input gives the same bytes. Returns the directory's path.

    Raises:
        ValueError: ``unicode_form`` is not one of ``UNICODE_FORMS``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if unicode_form not in UNICODE_FORMS:
        raise ValueError(f"unicode_form {unicode_form!r}: expected one of {UNICODE_FORMS}")
    whitespace = normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " ")
    strip = normalizers.Strip(left=False, right=True)
    steps = [normalizers.NFKC(), whitespace] if unicode_form == "NFKC" else [whitespace, normalizers.NFC()]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([*steps, strip])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=list(UNIGRAM_SPECIAL_TOKENS),
        unk_token="[UNK]",
        max_piece_length=max_piece_length,
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    for i, t in enumerate(UNIGRAM_SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)],
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_canonical_unigram_json(tok.to_str()), encoding="utf-8")
    special_map = dict(SPECIAL_TOKENS_MAP)
    if unicode_form == "NFKC":
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    else:
        config = {"tokenizer_class": "DebertaV2Tokenizer", "do_lower_case": False}
    config.update({
        "model_max_length": model_max_length,
        "padding_side": "right",
        "truncation_side": "right",
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
        **special_map,
    })
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")
    return out


def _canonical_unigram_json(serialized: str) -> str:
    """Round scores and order pieces canonically (see :func:`train_unigram_tokenizer`); specials keep 0..4."""
    data = json.loads(serialized)
    vocab = [(p, round(float(sc), 8)) for p, sc in data["model"]["vocab"]]
    n = len(UNIGRAM_SPECIAL_TOKENS)
    assert tuple(p for p, _ in vocab[:n]) == UNIGRAM_SPECIAL_TOKENS
    rest = vocab[n:]
    # The trainer appends required single characters below every learned piece with scores that step
    # down in hash-map order; hand the same score values out in code point order instead.
    floor = min((sc for p, sc in rest if len(p) > 1), default=0.0)
    tail = [(p, sc) for p, sc in rest if len(p) == 1 and sc < floor]
    if tail:
        tail_scores = sorted((sc for _, sc in tail), reverse=True)
        tail_pieces = set(p for p, _ in tail)
        rest = [ps for ps in rest if ps[0] not in tail_pieces]
        rest += list(zip(sorted(tail_pieces), tail_scores))
    data["model"]["vocab"] = vocab[:n] + sorted(rest, key=lambda ps: (-ps[1], ps[0]))
    data["model"]["unk_id"] = UNIGRAM_SPECIAL_TOKENS.index("[UNK]")
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Translation: two plain SentencePiece models
# ---------------------------------------------------------------------------------------------------------


def train_sentencepiece(
    texts: Iterable[str],
    model_path: str | os.PathLike,
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    seed_sentencepiece_size: int = 200_000,
) -> str:
    """Train a SentencePiece model on ``texts`` and write it to ``model_path`` (a single ``.spm`` file).

    Special ids ``pad=0 bos=1 eos=2 unk=3``; one thread and no sentence sampling, so the same texts give
    the same model. Returns ``model_path``."""
    import sentencepiece as spm

    lines = [t.replace("\n", " ").strip() for t in texts]
    lines = [t for t in lines if t]
    if not lines:
        raise ValueError("train_sentencepiece: no text")
    model_path = os.fspath(model_path)
    os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        model_type=model_type,
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        pad_id=SPECIAL_IDS["pad"],
        bos_id=SPECIAL_IDS["bos"],
        eos_id=SPECIAL_IDS["eos"],
        unk_id=SPECIAL_IDS["unk"],
        pad_piece="<pad>",
        bos_piece="<s>",
        eos_piece="</s>",
        unk_piece="<unk>",
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        seed_sentencepiece_size=seed_sentencepiece_size,
        minloglevel=2,
    )
    with open(model_path, "wb") as f:
        f.write(buf.getvalue())
    return model_path


def _load_spm(path: str):
    import sentencepiece as spm

    if not os.path.isfile(path):
        raise TokenizerError(f"{path}: missing (SentencePiece model)")
    proc = spm.SentencePieceProcessor()
    try:
        proc.Load(path)
    except Exception as e:  # sentencepiece raises OSError/RuntimeError depending on the failure
        raise TokenizerError(f"{path}: cannot read SentencePiece model: {e}") from e
    got = {"pad": proc.pad_id(), "bos": proc.bos_id(), "eos": proc.eos_id(), "unk": proc.unk_id()}
    if got != SPECIAL_IDS:
        raise TokenizerError(f"{path}: special ids {got}, expected {SPECIAL_IDS}")
    return proc


class _SpmIds(_Backend):
    """Ids of a plain sentencepiece model as a :class:`_Backend` (no offsets), cut before spaces when its
    pieces never span a word boundary."""

    def __init__(self, proc) -> None:
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        proto.ParseFromString(proc.serialized_model_proto())
        self.proc = proc
        self.cut_pattern = SPACE_CUT if _spm_splits_words(proto) else None

    def tokenize_batch(self, texts: Sequence[str], offsets: bool) -> list[tuple[list[int], list[Offset]]]:
        return [(ids, []) for ids in self.proc.encode(list(texts), out_type=int)]


class TranslationTokenizer:
    """Source and target SentencePiece models (``source.spm``, ``target.spm``) of a translation checkpoint."""

    def __init__(self, source_model: str | os.PathLike, target_model: str | os.PathLike) -> None:
        self.source_path = os.fspath(source_model)
        self.target_path = os.fspath(target_model)
        self.source = _load_spm(self.source_path)
        self.target = _load_spm(self.target_path)
        self.pad_token_id = SPECIAL_IDS["pad"]
        self.bos_token_id = SPECIAL_IDS["bos"]
        self.eos_token_id = SPECIAL_IDS["eos"]
        self.unk_token_id = SPECIAL_IDS["unk"]
        self._source_backend: _SpmIds | None = None

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "TranslationTokenizer":
        path = os.fspath(path)
        return cls(os.path.join(path, SOURCE_SPM), os.path.join(path, TARGET_SPM))

    @property
    def source_vocab_size(self) -> int:
        return self.source.GetPieceSize()

    @property
    def target_vocab_size(self) -> int:
        return self.target.GetPieceSize()

    def encode_source(self, text: str, max_length: int | None = None) -> list[int]:
        """Source pieces + EOS (never empty: an empty text gives ``[eos]``). ``max_length`` counts the EOS."""
        ids = self.source.EncodeAsIds(text)
        if max_length is not None:
            ids = ids[: max(0, max_length - 1)]
        return ids + [self.eos_token_id]

    def encode_source_bounded(self, text: str, max_length: int) -> tuple[list[int], bool]:
        """Source pieces + EOS, tokenizing no more of ``text`` than it takes to tell whether it fits
        ``max_length`` tokens (EOS counted).

        Returns ``(ids, True)`` (exactly :meth:`encode_source`) when it fits, else ``(pieces, False)``: at
        least ``max_length`` of its first pieces, no EOS, so the text has more than ``max_length`` tokens.
        Only a prefix cut before a space is encoded (:func:`leading_tokens`; exact because the model's
        pieces never span a word boundary: sentencepiece ``split_by_whitespace``); a model without that
        property, or a text without spaces, is encoded whole.
        """
        (lead,) = leading_tokens(self._source_words, [text], [max_length])
        if lead.complete and len(lead.ids) < max_length:
            return lead.ids + [self.eos_token_id], True
        return lead.ids, False

    @property
    def _source_words(self) -> "_SpmIds":
        if self._source_backend is None:
            self._source_backend = _SpmIds(self.source)
        return self._source_backend

    def encode_target(self, text: str, max_length: int | None = None) -> list[int]:
        """Target pieces + EOS (what the decoder must produce; training labels)."""
        ids = self.target.EncodeAsIds(text)
        if max_length is not None:
            ids = ids[: max(0, max_length - 1)]
        return ids + [self.eos_token_id]

    def _strip(self, ids: Iterable[int]) -> list[int]:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_token_id:
                break
            if i in (self.pad_token_id, self.bos_token_id):
                continue
            out.append(i)
        return out

    def decode_target(self, ids: Iterable[int]) -> str:
        """Target ids -> text; stops at the first EOS, skips pad/bos."""
        return self.target.DecodeIds(self._strip(ids))

    def decode_source(self, ids: Iterable[int]) -> str:
        return self.source.DecodeIds(self._strip(ids))

    def source_pieces(self, ids: Iterable[int]) -> list[str]:
        """One piece string per id (EOS shows as ``</s>``), for alignment display."""
        return [self.source.IdToPiece(int(i)) for i in ids]

    def target_pieces(self, ids: Iterable[int]) -> list[str]:
        return [self.target.IdToPiece(int(i)) for i in ids]
