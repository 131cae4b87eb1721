"""Translation's tokenizer: two plain SentencePiece models, ``source.spm`` and ``target.spm``.

Special ids ``pad=0 bos=1 eos=2 unk=3`` (``SPECIAL_IDS``, checked at load). :class:`TranslationTokenizer`
encodes a source as its pieces followed by EOS (bounded by a token limit through :mod:`.prefix`) and decodes
target ids up to the first EOS. Such models are trained by
:func:`relserve.models.training.tokenizer.train_sentencepiece`.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from .prefix import SPACE_CUT, _Backend, _spm_splits_words, leading_tokens
from .text import Offset

SOURCE_SPM = "source.spm"
TARGET_SPM = "target.spm"
SPECIAL_IDS = {"pad": 0, "bos": 1, "eos": 2, "unk": 3}


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or has the wrong special ids; the message names the file."""


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
