"""Translation checkpoints: an RNNsearch model (BiGRU or DeBERTa-style encoder) with its two SentencePiece
tokenizers, in a Hugging Face-like directory.

Layout of a checkpoint directory::

    config.json        RNNSearchConfig fields, model_type "rnnsearch", encoder_type "bigru" | "deberta";
                       for "deberta" also "encoder_config" (a deberta-v2 config dict, relserve.models.config);
                       "source_tokenizer" / "target_tokenizer" name the SentencePiece files
    model.safetensors  weights (state-dict names of ``RNNSearch``: ``encoder.*``, ``decoder.*``); any float
                       dtype (the defaults are stored as float16), cast to the requested dtype on load
    source.spm         SentencePiece model for the source language
    target.spm         SentencePiece model for the target language

Both SentencePiece models use ``pad=0 bos=1 eos=2 unk=3`` (``SPECIAL_IDS``), the same ids as
``RNNSearchConfig``'s ``pad_token_id``/``bos_token_id``/``eos_token_id``. A source is encoded as its pieces
followed by EOS (``TranslationTokenizer.encode_source``); the decoder starts from BOS and stops at EOS.

API::

    build_translation_model(config, encoder_config=None) -> RNNSearch
    save_translation_checkpoint(model, tokenizer, out_dir, dtype=None) -> str
    load_translation_checkpoint(path, device="cpu", dtype=torch.float32)
        -> (RNNSearch in eval mode, RNNSearchConfig, TranslationTokenizer)
    train_sentencepiece(texts, model_path, vocab_size, ...) -> str
    TranslationTokenizer(source_model, target_model) / .from_dir(path)

Errors: ``TranslationCheckpointError`` (a ``CheckpointError``, hence ``ValueError``) naming file and problem.
"""

from __future__ import annotations

import io
import os
from typing import Any, Iterable

import torch
from torch import Tensor, nn

from .checkpoint import CheckpointError
from .config import CONFIG_NAME, DebertaConfig, read_checkpoint_config, write_config
from .deberta import DebertaModel
from .rnnsearch import MODEL_TYPE, RNNSearch, RNNSearchConfig

SAFETENSORS_NAME = "model.safetensors"
SOURCE_SPM = "source.spm"
TARGET_SPM = "target.spm"
SPECIAL_IDS = {"pad": 0, "bos": 1, "eos": 2, "unk": 3}
TRANSLATION_ENCODER_TYPES = ("bigru", "deberta")

__all__ = [
    "TranslationCheckpointError",
    "TranslationTokenizer",
    "DebertaAnnotationEncoder",
    "build_translation_model",
    "encoder_kind",
    "save_translation_checkpoint",
    "load_translation_checkpoint",
    "train_sentencepiece",
]


class TranslationCheckpointError(CheckpointError):
    """A translation checkpoint directory cannot be loaded or written; the message names file and problem."""


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
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
        raise TranslationCheckpointError(f"{path}: missing (SentencePiece model)")
    proc = spm.SentencePieceProcessor()
    try:
        proc.Load(path)
    except Exception as e:  # sentencepiece raises OSError/RuntimeError depending on the failure
        raise TranslationCheckpointError(f"{path}: cannot read SentencePiece model: {e}") from e
    got = {"pad": proc.pad_id(), "bos": proc.bos_id(), "eos": proc.eos_id(), "unk": proc.unk_id()}
    if got != SPECIAL_IDS:
        raise TranslationCheckpointError(f"{path}: special ids {got}, expected {SPECIAL_IDS}")
    return proc


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


# ---------------------------------------------------------------------------------------------------------
# Model construction
# ---------------------------------------------------------------------------------------------------------


class DebertaAnnotationEncoder(DebertaModel):
    """Our DeBERTa-style encoder as an RNNsearch encoder: ``(src_ids, src_mask) -> Float[B,S,hidden_size]``.

    Parameter names are those of ``DebertaModel`` (``embeddings.*``, ``encoder.*``), so inside ``RNNSearch``
    they read ``encoder.embeddings.*`` / ``encoder.encoder.*``."""

    def forward(self, src_ids: Tensor, src_mask: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(src_ids, src_mask)


def encoder_kind(model: RNNSearch) -> str:
    """``"deberta"`` or ``"bigru"``."""
    if isinstance(model.encoder, DebertaAnnotationEncoder):
        return "deberta"
    if model.config.encoder_type == "bigru":
        return "bigru"
    raise TranslationCheckpointError(f"unsupported encoder module {type(model.encoder).__name__}")


def build_translation_model(config: RNNSearchConfig, encoder_config: DebertaConfig | None = None) -> RNNSearch:
    """RNNsearch with the BiGRU encoder (``encoder_config`` None) or a DeBERTa-style encoder whose
    ``hidden_size`` must equal ``config.annotation_size`` and ``vocab_size`` ``config.src_vocab_size``."""
    if encoder_config is None:
        if config.encoder_type != "bigru":
            raise ValueError("an 'external' encoder needs encoder_config")
        return RNNSearch(config)
    if config.encoder_type != "external":
        raise ValueError("a DeBERTa encoder needs RNNSearchConfig(encoder_type='external')")
    if encoder_config.hidden_size != config.annotation_size:
        raise ValueError(
            f"encoder hidden_size {encoder_config.hidden_size} != annotation_size {config.annotation_size}"
        )
    if encoder_config.vocab_size != config.src_vocab_size:
        raise ValueError(f"encoder vocab_size {encoder_config.vocab_size} != src_vocab_size {config.src_vocab_size}")
    return RNNSearch(config, encoder=DebertaAnnotationEncoder(encoder_config))


def _config_json(model: RNNSearch) -> dict[str, Any]:
    kind = encoder_kind(model)
    d = model.config.to_dict()
    d["encoder_type"] = kind
    if kind == "deberta":
        enc = model.encoder.config.to_dict()
        enc["model_type"] = "deberta-v2"
        d["encoder_config"] = enc
    d["source_tokenizer"] = SOURCE_SPM
    d["target_tokenizer"] = TARGET_SPM
    d["model_type"] = MODEL_TYPE
    return d


def save_translation_checkpoint(
    model: RNNSearch,
    tokenizer: TranslationTokenizer,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    extra_config: dict[str, Any] | None = None,
) -> str:
    """Write ``config.json``, ``model.safetensors`` (floats cast to ``dtype`` if given, e.g. float16 to halve
    the size), ``source.spm`` and ``target.spm``. ``extra_config`` keys are added to config.json (kept in
    ``RNNSearchConfig.extra`` on load). Returns ``out_dir``."""
    from safetensors.torch import save_file

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    d = _config_json(model)
    for k, v in (extra_config or {}).items():
        d.setdefault(k, v)
    if dtype is not None:
        d["torch_dtype"] = str(dtype).replace("torch.", "")
    if model.config.src_vocab_size != tokenizer.source_vocab_size:
        raise TranslationCheckpointError(
            f"src_vocab_size {model.config.src_vocab_size} != source tokenizer size {tokenizer.source_vocab_size}"
        )
    if model.config.tgt_vocab_size != tokenizer.target_vocab_size:
        raise TranslationCheckpointError(
            f"tgt_vocab_size {model.config.tgt_vocab_size} != target tokenizer size {tokenizer.target_vocab_size}"
        )
    tensors = {}
    for k, v in model.state_dict().items():
        v = v.detach().to("cpu")
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        tensors[k] = v.contiguous()
    save_file(tensors, os.path.join(out_dir, SAFETENSORS_NAME), metadata={"format": "pt"})
    for src, name in ((tokenizer.source_path, SOURCE_SPM), (tokenizer.target_path, TARGET_SPM)):
        dst = os.path.join(out_dir, name)
        if os.path.abspath(src) != os.path.abspath(dst):
            with open(src, "rb") as fi, open(dst, "wb") as fo:
                fo.write(fi.read())
    write_config(d, out_dir, ensure_ascii=False)
    return out_dir


def read_translation_config(path: str | os.PathLike) -> tuple[RNNSearchConfig, DebertaConfig | None, dict]:
    """Parse ``<path>/config.json`` -> (RNNSearchConfig, DeBERTa encoder config or None, raw dict)."""
    cfg_path, raw = read_checkpoint_config(path, TranslationCheckpointError)
    if not isinstance(raw, dict):
        raise TranslationCheckpointError(f"{cfg_path}: expected a JSON object")
    if raw.get("model_type") != MODEL_TYPE:
        raise TranslationCheckpointError(
            f"{cfg_path}: model_type {raw.get('model_type')!r} is not a translation model (expected {MODEL_TYPE!r})"
        )
    d = dict(raw)
    kind = d.get("encoder_type", "bigru")
    if kind not in TRANSLATION_ENCODER_TYPES:
        raise TranslationCheckpointError(
            f"{cfg_path}: encoder_type {kind!r}: expected one of {TRANSLATION_ENCODER_TYPES}"
        )
    enc_raw = d.pop("encoder_config", None)
    for k in ("source_tokenizer", "target_tokenizer", "torch_dtype"):
        d.pop(k, None)
    enc_cfg = None
    try:
        if kind == "deberta":
            if not isinstance(enc_raw, dict):
                raise ValueError("encoder_type 'deberta' needs an 'encoder_config' object")
            enc_cfg = DebertaConfig.from_dict(enc_raw)
            d["encoder_type"] = "external"
        config = RNNSearchConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise TranslationCheckpointError(f"{cfg_path}: {e}") from e
    return config, enc_cfg, raw


def load_translation_checkpoint(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[RNNSearch, RNNSearchConfig, TranslationTokenizer]:
    """Load a translation checkpoint directory -> (model in eval mode on device/dtype, config, tokenizer).

    Raises ``TranslationCheckpointError`` for a missing/unreadable config, weights or tokenizer, a vocabulary
    size that disagrees with a tokenizer, and missing, unexpected or mis-shaped weights."""
    from safetensors.torch import load_file

    path = os.fspath(path)
    config, enc_cfg, raw = read_translation_config(path)
    tokenizer = TranslationTokenizer(
        os.path.join(path, raw.get("source_tokenizer", SOURCE_SPM)),
        os.path.join(path, raw.get("target_tokenizer", TARGET_SPM)),
    )
    cfg_path = os.path.join(path, CONFIG_NAME)
    if tokenizer.source_vocab_size != config.src_vocab_size:
        raise TranslationCheckpointError(
            f"{cfg_path}: src_vocab_size {config.src_vocab_size} but {tokenizer.source_path} has "
            f"{tokenizer.source_vocab_size} pieces"
        )
    if tokenizer.target_vocab_size != config.tgt_vocab_size:
        raise TranslationCheckpointError(
            f"{cfg_path}: tgt_vocab_size {config.tgt_vocab_size} but {tokenizer.target_path} has "
            f"{tokenizer.target_vocab_size} pieces"
        )
    try:
        model = build_translation_model(config, enc_cfg)
    except ValueError as e:
        raise TranslationCheckpointError(f"{cfg_path}: {e}") from e
    st = os.path.join(path, SAFETENSORS_NAME)
    if not os.path.isfile(st):
        raise TranslationCheckpointError(f"{st}: missing (weights are read from safetensors only)")
    try:
        sd = load_file(st)
    except Exception as e:  # safetensors raises SafetensorError / OSError
        raise TranslationCheckpointError(f"{st}: cannot read safetensors file: {e}") from e
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    bad = [f"{k}: {tuple(sd[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items() if k in sd and sd[k].shape != v.shape]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:5]}" + (f" (+{len(missing) - 5})" if len(missing) > 5 else ""))
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:5]}" + (f" (+{len(unexpected) - 5})" if len(unexpected) > 5 else ""))
    if bad:
        problems.append("shape mismatch " + "; ".join(bad[:5]))
    if problems:
        raise TranslationCheckpointError(f"{st}: " + "; ".join(problems))
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in sd.items()}, strict=True)
    model = model.to(device=device, dtype=dtype).eval()
    return model, config, tokenizer


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
