"""Checkpoint directories of both model families: ``config.json``, safetensors weights, tokenizer files.

DeBERTa v1/v2/v3 (Hugging Face layout; :func:`load_checkpoint`, :func:`save_checkpoint`). A directory holds
``config.json`` (model_type ``deberta-v2``, or ``deberta`` for v1), weights in ``model.safetensors`` or
``pytorch_model.bin``, and tokenizer files. What is served is exactly ``SUPPORTED_ARCHITECTURES`` per model_type
(:func:`supported_summary`): ``DebertaV2ForSequenceClassification`` / ``DebertaV2ForQuestionAnswering`` /
``DebertaV2ForTokenClassification`` and ``DebertaForSequenceClassification`` / ``DebertaForQuestionAnswering`` /
``DebertaForTokenClassification``. Weights load by name into our own modules
(:mod:`relserve.models.deberta`, v1 attention :mod:`relserve.models.deberta_v1`), whose parameter names equal
the HF keys. Key handling mirrors what
transformers itself accepts:

* legacy ``LayerNorm.gamma`` / ``LayerNorm.beta`` names are renamed to ``weight`` / ``bias``;
* a bare base-model state dict (``embeddings.*``, ``encoder.*``) gets the ``deberta.`` prefix, after which
  the head weights are reported missing (a base model cannot serve a task);
* keys transformers ignores are dropped: the non-persistent ``deberta.embeddings.position_ids`` buffer,
  ``position_embeddings`` when the config has no absolute positions (v3 checkpoints carry one), and
  pre-training heads (``lm_predictions.*``, ``mask_predictions.*``, ``lm_head.*``, ``cls.*``).

Anything else that does not match (missing keys, unexpected keys, wrong shapes) raises ``CheckpointError``
naming the file and the keys. Both families' weights go through the one strict load,
:func:`load_state_dict_strict`.

RNNsearch translation (:func:`load_translation_checkpoint`, :func:`save_translation_checkpoint`)::

    config.json        RNNSearchConfig fields, model_type "rnnsearch", encoder_type "bigru" | "deberta";
                       for "deberta" also "encoder_config" (a deberta-v2 config dict);
                       "source_tokenizer" / "target_tokenizer" name the SentencePiece files
    model.safetensors  weights (state-dict names of ``RNNSearch``: ``encoder.*``, ``decoder.*``); any float
                       dtype (the defaults are stored as float16), cast to the requested dtype on load
    source.spm         SentencePiece model for the source language
    target.spm         SentencePiece model for the target language

Both SentencePiece models use ``pad=0 bos=1 eos=2 unk=3``, the same ids as ``RNNSearchConfig``'s
``pad_token_id``/``bos_token_id``/``eos_token_id``. Errors: ``TranslationCheckpointError`` (a
``CheckpointError``, hence ``ValueError``) naming file and problem; the weights report is the DeBERTa one.

:func:`checkpoint_hash` is the sha256 of a directory's config and weights (the ONNX graph cache key and the
provenance recorded in exported graphs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .architectures import ARCHITECTURES, DEFAULT_MODEL_TYPE, model_type_problem, served_architecture, supported_summary
from .deberta import (
    DebertaConfig,
    DebertaForQuestionAnswering,
    DebertaForSequenceClassification,
    DebertaForTokenClassification,
)
from .deberta_v1 import (
    DebertaV1Config,
    DebertaV1ForQuestionAnswering,
    DebertaV1ForSequenceClassification,
    DebertaV1ForTokenClassification,
)
from .rnnsearch import MODEL_TYPE as RNNSEARCH_MODEL_TYPE
from .rnnsearch import RNNSearch, RNNSearchConfig, build_translation_model, encoder_kind
from . import tokenization
from .tokenization import SOURCE_SPM, TARGET_SPM, TokenizerError, TranslationTokenizer

CONFIG_NAME = "config.json"

SAFETENSORS_NAME = "model.safetensors"
PYTORCH_NAME = "pytorch_model.bin"

# Tokenizer files copied by save_checkpoint (whatever of these exist in tokenizer_dir).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "spm.model",
    "added_tokens.json",
    "vocab.json",  # DeBERTa v1 byte-level BPE
    "merges.txt",
)

TRANSLATION_ENCODER_TYPES = ("bigru", "deberta")

# config.json model_type -> (config class, {architecture: (task, model class)}), from the name table
# (models/architectures.py) and the head class of each task
_HEADS: dict[str, tuple[type[DebertaConfig], dict[str, type[nn.Module]]]] = {
    "deberta-v2": (DebertaConfig, {"classification": DebertaForSequenceClassification,
                                   "question-answering": DebertaForQuestionAnswering,
                                   "token-classification": DebertaForTokenClassification}),
    "deberta": (DebertaV1Config, {"classification": DebertaV1ForSequenceClassification,
                                  "question-answering": DebertaV1ForQuestionAnswering,
                                  "token-classification": DebertaV1ForTokenClassification}),
}
_FAMILIES: dict[str, tuple[type[DebertaConfig], dict[str, tuple[str, type[nn.Module]]]]] = {
    mt: (_HEADS[mt][0], {arch: (task, _HEADS[mt][1][task]) for arch, task in archs.items()})
    for mt, archs in ARCHITECTURES.items()
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
SUPPORTED_ARCHITECTURES = tuple(a for _, archs in _FAMILIES.values() for a in archs)

_IGNORED_KEY_PATTERNS = (
    re.compile(r"^(deberta\.)?embeddings\.position_ids$"),
    re.compile(r"^(lm_predictions|mask_predictions|lm_head|cls)\."),
)


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded; the message names the file and the problem."""


class TranslationCheckpointError(CheckpointError):
    """A translation checkpoint directory cannot be loaded or written; the message names file and problem."""


# ---------------------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------------------


def config_path(path: str | os.PathLike) -> str:
    """``<path>/config.json``, or ``path`` itself if it is a file."""
    p = os.fspath(path)
    return os.path.join(p, CONFIG_NAME) if os.path.isdir(p) else p


def read_config(path: str | os.PathLike) -> tuple[str, Any]:
    """Parse ``<path>/config.json`` (or ``path`` itself if it is a file); returns (the file's path, the JSON)."""
    p = config_path(path)
    with open(p, encoding="utf-8") as f:
        return p, json.load(f)


def read_checkpoint_config(path: str | os.PathLike, error: type[Exception]) -> tuple[str, Any]:
    """Parse a checkpoint directory's ``config.json``; returns (the file's path, the JSON).

    Raises:
        error: ``path`` is not a directory, the file is missing, or it is not readable JSON (the message
            names the file and the problem).
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isdir(path):
        raise error(f"{path}: not a directory")
    if not os.path.isfile(cfg_path):
        raise error(f"{cfg_path}: missing")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            return cfg_path, json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{cfg_path}: cannot read JSON: {e}") from e


def write_config(d: dict[str, Any], out_dir: str | os.PathLike, ensure_ascii: bool = True) -> str:
    """Write ``d`` as ``<out_dir>/config.json`` (2-space indent, sorted keys, final newline); returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    p = os.path.join(os.fspath(out_dir), CONFIG_NAME)
    with open(p, "w", encoding="utf-8") as f:
        json.dump(d, f, indent=2, sort_keys=True, ensure_ascii=ensure_ascii)
        f.write("\n")
    return p


# ---------------------------------------------------------------------------------------------------------
# DeBERTa (Hugging Face layout)
# ---------------------------------------------------------------------------------------------------------



@dataclass
class LoadedCheckpoint:
    model: nn.Module  # eval mode, on the requested device/dtype
    config: DebertaConfig
    task: str  # "classification" | "question-answering" | "token-classification"
    tokenizer: Any  # relserve.models.tokenization.Tokenizer, or None when load_tokenizer=False
    path: str


def _model_type(raw: dict, where: str) -> str:
    model_type = raw.get("model_type") or DEFAULT_MODEL_TYPE
    problem = model_type_problem(model_type)
    if problem:
        raise CheckpointError(f"{where}: {problem}")
    return model_type


def _architecture(architectures: list[str] | None, model_type: str, where: str) -> str:
    """The first of ``architectures`` served for ``model_type``; the refusal lists exactly what is."""
    arch, problem = served_architecture(architectures, model_type)
    if problem:
        raise CheckpointError(f"{where}: {problem}")
    return arch


def task_for_architectures(architectures: list[str] | None, where: str = CONFIG_NAME,
                           model_type: str | None = "deberta-v2") -> str:
    """``architectures`` from config.json -> ``"classification"`` | ``"question-answering"`` |
    ``"token-classification"``.

    ``model_type`` is config.json's (None: "deberta-v2"); only that family's architectures are accepted.

    Raises:
        CheckpointError: unknown model_type, no architectures, or none served (the message lists, per
            model_type, exactly the architectures that are).
    """
    mt = _model_type({"model_type": model_type}, where)
    return _FAMILIES[mt][1][_architecture(architectures, mt, where)][0]


def _read_state_dict(path: str) -> tuple[dict[str, torch.Tensor], str]:
    st = os.path.join(path, SAFETENSORS_NAME)
    pt = os.path.join(path, PYTORCH_NAME)
    if os.path.isfile(st):
        from safetensors.torch import load_file

        try:
            return load_file(st, device="cpu"), st
        except Exception as e:  # corrupt / truncated file
            raise CheckpointError(f"{st}: cannot read safetensors file: {e}") from e
    if os.path.isfile(pt):
        try:
            sd = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{pt}: cannot read PyTorch weights (weights_only=True): {e}") from e
        if not isinstance(sd, dict):
            raise CheckpointError(f"{pt}: expected a state dict, got {type(sd).__name__}")
        return sd, pt
    if os.path.isfile(os.path.join(path, SAFETENSORS_NAME + ".index.json")) or os.path.isfile(
        os.path.join(path, PYTORCH_NAME + ".index.json")
    ):
        raise CheckpointError(f"{path}: sharded checkpoints are not supported; save as a single file")
    raise CheckpointError(f"{path}: no weights file ({SAFETENSORS_NAME} or {PYTORCH_NAME})")


def normalise_state_dict(
    sd: dict[str, torch.Tensor], expected: set[str], config: DebertaConfig
) -> dict[str, torch.Tensor]:
    """Apply the HF key conventions described in the module docstring; returns a new dict."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        out[k] = v
    if not any(k.startswith("deberta.") for k in out) and any(
        k.startswith(("embeddings.", "encoder.")) for k in out
    ):
        out = {(f"deberta.{k}" if k.startswith(("embeddings.", "encoder.")) else k): v for k, v in out.items()}
    for k in list(out):
        if k in expected:
            continue
        if any(p.search(k) for p in _IGNORED_KEY_PATTERNS):
            del out[k]
        elif "position_embeddings" in k and not config.position_biased_input:
            del out[k]
    return out


def _more(items: list[str]) -> str:
    """`` (+N)`` when ``items`` has N > 0 entries past the five an error message names."""
    return f" (+{len(items) - 5})" if len(items) > 5 else ""


def load_state_dict_strict(
    model: nn.Module, sd: dict[str, torch.Tensor], source: str, error: type[CheckpointError] = CheckpointError
) -> None:
    """Load ``sd`` into ``model`` by name, every key and shape matching, each tensor cast to the model's dtype.

    Both families load through here (after any key renaming, as :func:`normalise_state_dict` does for DeBERTa).

    Raises:
        error: the message is ``"<source>: "`` followed by what is wrong, each part naming the first five keys
            and ``(+N)`` more: ``missing keys [...]``, ``unexpected keys [...] (does config.json match the
            weights?)``, ``shape mismatch <key>: checkpoint (..) vs model (..); ...``.
    """
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    bad_shapes = [
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(v.shape)}"
        for k, v in own.items()
        if k in sd and tuple(sd[k].shape) != tuple(v.shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:5]}{_more(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:5]}{_more(unexpected)} (does config.json match the weights?)")
    if bad_shapes:
        problems.append("shape mismatch " + "; ".join(bad_shapes[:5]) + _more(bad_shapes))
    if problems:
        raise error(f"{source}: " + "; ".join(problems))
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()}, strict=True)


def check_tokenizer_fits(tokenizer: tokenization.Tokenizer, vocab_size: int, cfg_path: str) -> None:
    """Refuse a tokenizer that can emit an id the model's embedding table (``vocab_size`` rows) lacks.

    Such an id fails the whole batch at run time (``IndexError: index out of range in self`` from the
    embedding lookup, warm-up included), so other clients' requests too. Both the tokenizer's size (its ids are
    ``0 .. size - 1``) and the ids of its special tokens count: a ``tokenizer.json`` post-processor can name
    ``[CLS]``/``[SEP]`` ids outside the vocabulary, and every request carries those.

    Raises:
        CheckpointError: naming the tokenizer file, ``cfg_path``, the tokenizer's size or offending special
            token id, and ``vocab_size``.
    """
    where = f"{tokenizer.source} and {cfg_path}"
    if tokenizer.vocab_size > vocab_size:
        raise CheckpointError(
            f"{where}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab_size}; "
            f"ids >= {vocab_size} have no embedding (wrong tokenizer for these weights?)")
    specials = {"cls_token_id": tokenizer.cls_token_id, "sep_token_id": tokenizer.sep_token_id,
                "pad_token_id": tokenizer.pad_token_id, "unk_token_id": tokenizer.unk_token_id}
    specials.update((f"special token id {i}", i) for i in tokenizer.special_token_ids)
    over = {k: i for k, i in specials.items() if i is not None and not 0 <= i < vocab_size}
    if over:
        worst = max(over.values())
        raise CheckpointError(
            f"{where}: the tokenizer ({tokenizer.vocab_size} tokens) emits special token id(s) up to {worst} "
            f"({', '.join(sorted(k for k, i in over.items() if i == worst))}) but the model's vocab_size is "
            f"{vocab_size}; ids >= {vocab_size} have no embedding (wrong tokenizer for these weights?)")


def load_checkpoint(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    load_tokenizer: bool = True,
    spm_normalization: str = "spm",
) -> LoadedCheckpoint:
    """Load an HF-style checkpoint directory into our model, in eval mode on ``device``/``dtype``.

    ``spm_normalization``: passed to :func:`tokenization.load_tokenizer` (an ``spm.model``-only tokenizer:
    ``"spm"`` applies the model's own normaliser, ``"transformers5"`` drops it as transformers 5 does).
    """
    path = os.fspath(path)
    cfg_path, raw = read_checkpoint_config(path, CheckpointError)
    model_type = _model_type(raw, cfg_path)
    config_cls, archs = _FAMILIES[model_type]
    task, model_cls = archs[_architecture(raw.get("architectures"), model_type, cfg_path)]
    try:
        config = config_cls.from_dict(raw)
        model = model_cls(config)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e
    sd, source = _read_state_dict(path)
    load_state_dict_strict(model, normalise_state_dict(sd, set(model.state_dict()), config), source)
    model = model.to(device=device, dtype=dtype).eval()
    tokenizer = None
    if load_tokenizer:
        tokenizer = tokenization.load_tokenizer(path, spm_normalization=spm_normalization)
        check_tokenizer_fits(tokenizer, int(config.vocab_size), cfg_path)
    return LoadedCheckpoint(model=model, config=config, task=task, tokenizer=tokenizer, path=path)


def save_checkpoint(
    model: nn.Module,
    config: DebertaConfig,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
) -> str:
    """Write an HF-loadable directory: config.json (with ``architectures``), model.safetensors, and the
    tokenizer files found in ``tokenizer_dir`` (if given). Returns ``out_dir``."""
    from safetensors.torch import save_file

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    arch = getattr(model, "hf_architecture", None)
    if arch is None:
        raise CheckpointError(f"save_checkpoint: {type(model).__name__} has no task head to save")
    d = config.to_dict()
    d["architectures"] = [arch]
    write_config(d, out_dir)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(out_dir, SAFETENSORS_NAME), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        copied = 0
        for name in TOKENIZER_FILES:
            src = os.path.join(os.fspath(tokenizer_dir), name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, name))
                copied += 1
        if not copied:
            raise CheckpointError(f"{tokenizer_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return out_dir


# ---------------------------------------------------------------------------------------------------------
# RNNsearch translation
# ---------------------------------------------------------------------------------------------------------


def _config_json(model: RNNSearch) -> dict[str, Any]:
    try:
        kind = encoder_kind(model)
    except ValueError as e:
        raise TranslationCheckpointError(str(e)) from e
    d = model.config.to_dict()
    d["encoder_type"] = kind
    if kind == "deberta":
        enc = model.encoder.config.to_dict()
        enc["model_type"] = "deberta-v2"
        d["encoder_config"] = enc
    d["source_tokenizer"] = SOURCE_SPM
    d["target_tokenizer"] = TARGET_SPM
    d["model_type"] = RNNSEARCH_MODEL_TYPE
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
    if raw.get("model_type") != RNNSEARCH_MODEL_TYPE:
        raise TranslationCheckpointError(
            f"{cfg_path}: model_type {raw.get('model_type')!r} is not a translation model (expected {RNNSEARCH_MODEL_TYPE!r})"
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
    try:
        tokenizer = TranslationTokenizer(
            os.path.join(path, raw.get("source_tokenizer", SOURCE_SPM)),
            os.path.join(path, raw.get("target_tokenizer", TARGET_SPM)),
        )
    except TokenizerError as e:
        raise TranslationCheckpointError(str(e)) from e
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
    load_state_dict_strict(model, sd, st, TranslationCheckpointError)
    model = model.to(device=device, dtype=dtype).eval()
    return model, config, tokenizer


# ---------------------------------------------------------------------------------------------------------
# Provenance
# ---------------------------------------------------------------------------------------------------------


def checkpoint_hash(path: str | os.PathLike, export_version: str) -> str:
    """sha256 (hex) over ``config.json``, the weights file and an export format version.

    The ONNX graph cache is keyed by it and every exported graph records it, so a graph is never used with
    other weights; ``export_version`` is the exporter's layout version (bumping it invalidates old graphs)."""
    h = hashlib.sha256(f"relserve-onnx-export-v{export_version}\n".encode())
    p = Path(path)
    for name in (CONFIG_NAME, SAFETENSORS_NAME, PYTORCH_NAME):
        f = p / name
        if f.is_file():
            h.update(name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def is_translation_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``<path>/config.json`` says ``model_type`` "rnnsearch"."""
    try:
        return read_config(path)[1].get("model_type") == RNNSEARCH_MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False
