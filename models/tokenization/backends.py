"""The tokenizer backends: ids and character offsets of a text, no special tokens (:class:`.prefix._Backend`).

* :class:`_TokenizersBackend`: a ``tokenizer.json`` (Hugging Face ``tokenizers`` library) as it is, or DeBERTa
  v1's byte-level BPE built from ``vocab.json`` + ``merges.txt``; offsets are the library's, exact into the
  original text.
* ``spm.model`` (Google ``sentencepiece`` library; the hub layout of deberta-v3 and mdeberta), in one of two
  ways (``load_tokenizer(spm_normalization=...)``):

  - :class:`_SpmNativeBackend` (``"spm"``, the default): the model's own normaliser (``nmt_nfkc`` for those
    models: NFKC, whitespace runs collapsed, zero-width and control characters dropped) runs inside
    sentencepiece, as sentencepiece's ``encode`` and transformers 4's sentencepiece-backed
    ``DebertaV2Tokenizer`` (what most hub fine-tunes were trained with) apply it; ``do_lower_case``
    lower-cases first and ``split_by_punct`` encodes the pieces between punctuation characters one by one, as
    transformers 4 did. sentencepiece reports each piece's span in the original text, so offsets stay exact
    where normalisation changes lengths.
  - :class:`_SentencePieceBackend` (``"transformers5"``): the text pipeline transformers 5
    ``DebertaV2Tokenizer`` builds for such a directory (``tokenization_deberta_v2.py``; :mod:`.spm_normalize`):
    optional lower-casing (``do_lower_case``), ``Replace(r"\\s{2,}|[\\n\\r\\t]", " ")``, NFC, strip right,
    ``Punctuation`` isolated with ``split_by_punct``, Metaspace ``▁`` with a prefix ``▁`` unless the text
    (segment) already starts with a space. The model's own normaliser spec is switched to ``identity`` so the
    pipeline above is the only normalisation, and character offsets are computed here: sentencepiece
    (``return_type="proto"``; 0.2.3 removed "immutable_proto") reports UTF-8 byte offsets into the normalised
    text, which are mapped back to Python ``str`` indices of the caller's original text.

Each backend sets its ``cut_pattern`` (:mod:`.prefix`) for its pipeline.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from .prefix import SPACE_CUT, WORD_CUT, WordTokens, _Backend, _cut_pattern_for, _spm_splits_words
from .spm_normalize import _deberta_v2_normalize, _punct_segments
from .text import Offset


def _read_json(path: str) -> dict:
    """The JSON object in ``path``, or ``{}`` when there is no such file."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


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
