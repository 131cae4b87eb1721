"""``Tokenizer``: a DeBERTa tokenizer backend plus the template ``[CLS] A [SEP] (B [SEP])``.

Token type ids are 0 for ``[CLS] A [SEP]`` and 1 for ``B [SEP]``. ``encode`` / ``batch_encode`` truncate
longest-first as the ``tokenizers`` library does, tokenizing only a bounded prefix of a long text
(:mod:`.prefix`); ``qa_windows`` splits a QA context into overlapping windows (:mod:`.qa_windows`).
Build one with :func:`.loading.load_tokenizer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from .prefix import Leading, _Backend, leading_tokens
from .qa_windows import QAWindow, build_qa_windows
from .text import Offset


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
    cls_token: str = "[CLS]"  # the template's special tokens as strings (TEI's /tokenize shows them)
    sep_token: str = "[SEP]"

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
        """Split ``context`` into overlapping windows ``[CLS] question [SEP] chunk [SEP]`` of at most
        ``max_seq_len`` tokens, with exact character offsets: :func:`.qa_windows.build_qa_windows` states the
        window layout, the ``doc_stride`` limit (:class:`DocStrideTooLarge`, or lowered with ``clamp_stride``)
        and the ``max_windows`` limit (:class:`TooManyWindows`)."""
        return build_qa_windows(self.backend, self.cls_token_id, self.sep_token_id, question, context,
                                max_seq_len, doc_stride, max_windows=max_windows, clamp_stride=clamp_stride)


def _order_known(a: "Leading", b: "Leading", budget: int) -> bool:
    """Whether LongestFirst's result is decided by what is known of the two segments' lengths: it is unless both
    are over ``budget`` (then the longer full length gets the odd token) and their order is unknown."""
    if len(a.ids) <= budget or len(b.ids) <= budget or (a.complete and b.complete):
        return True
    if a.complete != b.complete:  # the incomplete one has at least len(ids) tokens
        longer_incomplete, other = (b, a) if a.complete else (a, b)
        return len(longer_incomplete.ids) > len(other.ids)
    return False


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
