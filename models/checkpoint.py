"""Load and save Hugging Face-style DeBERTa-v2/v3 checkpoint directories.

A directory holds ``config.json`` (model_type ``deberta-v2``), weights in ``model.safetensors`` or
``pytorch_model.bin``, and tokenizer files. Weights load by name into our own modules
(:mod:`relserve.models.deberta`), whose parameter names equal the HF keys. Key handling mirrors what
transformers itself accepts:

* legacy ``LayerNorm.gamma`` / ``LayerNorm.beta`` names are renamed to ``weight`` / ``bias``;
* a bare base-model state dict (``embeddings.*``, ``encoder.*``) gets the ``deberta.`` prefix, after which
  the head weights are reported missing (a base model cannot serve a task);
* keys transformers ignores are dropped: the non-persistent ``deberta.embeddings.position_ids`` buffer,
  ``position_embeddings`` when the config has no absolute positions (v3 checkpoints carry one), and
  pre-training heads (``lm_predictions.*``, ``mask_predictions.*``, ``lm_head.*``, ``cls.*``).

Anything else that does not match (missing keys, unexpected keys, wrong shapes) raises ``CheckpointError``
naming the file and the keys.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .config import CONFIG_NAME, DebertaConfig, read_checkpoint_config, write_config
from .deberta import DebertaForQuestionAnswering, DebertaForSequenceClassification

SAFETENSORS_NAME = "model.safetensors"
PYTORCH_NAME = "pytorch_model.bin"

# Tokenizer files copied by save_checkpoint (whatever of these exist in tokenizer_dir).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "spm.model",
    "added_tokens.json",
)

_TASK_BY_SUFFIX = {
    "ForSequenceClassification": "classification",
    "ForQuestionAnswering": "question-answering",
}
_MODEL_BY_TASK: dict[str, type[nn.Module]] = {
    "classification": DebertaForSequenceClassification,
    "question-answering": DebertaForQuestionAnswering,
}
SUPPORTED_ARCHITECTURES = (
    "DebertaV2ForSequenceClassification",
    "DebertaV2ForQuestionAnswering",
    "DebertaForSequenceClassification",
    "DebertaForQuestionAnswering",
)

_IGNORED_KEY_PATTERNS = (
    re.compile(r"^(deberta\.)?embeddings\.position_ids$"),
    re.compile(r"^(lm_predictions|mask_predictions|lm_head|cls)\."),
)


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded; the message names the file and the problem."""


@dataclass
class LoadedCheckpoint:
    model: nn.Module  # eval mode, on the requested device/dtype
    config: DebertaConfig
    task: str  # "classification" | "question-answering"
    tokenizer: Any  # relserve.models.tokenization.Tokenizer, or None when load_tokenizer=False
    path: str


def task_for_architectures(architectures: list[str] | None, where: str = CONFIG_NAME) -> str:
    """``architectures`` from config.json -> ``"classification"`` | ``"question-answering"``."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not architectures:
        raise CheckpointError(f"{where}: no 'architectures' entry; cannot tell the task (supported: {supported})")
    for arch in architectures:
        if arch.startswith("Deberta"):
            for suffix, task in _TASK_BY_SUFFIX.items():
                if arch.endswith(suffix):
                    return task
    raise CheckpointError(f"{where}: unsupported architectures {architectures}; supported: {supported}")


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


def load_weights(model: nn.Module, sd: dict[str, torch.Tensor], config: DebertaConfig, source: str) -> None:
    """Strict by-name load with clear errors (missing / unexpected / shape mismatch)."""
    own = model.state_dict()
    sd = normalise_state_dict(sd, set(own), config)
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:10]}{' ...' if len(missing) > 10 else ''} ({len(missing)} in all)")
    if unexpected:
        problems.append(
            f"unexpected keys {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''} ({len(unexpected)} in all;"
            " does config.json match the weights?)"
        )
    bad_shapes = [
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)
    ]
    if bad_shapes:
        problems.append("shape mismatch " + "; ".join(bad_shapes[:5]))
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
    model.load_state_dict({k: v for k, v in sd.items()}, strict=True)


def load_checkpoint(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    load_tokenizer: bool = True,
) -> LoadedCheckpoint:
    """Load an HF-style checkpoint directory into our model, in eval mode on ``device``/``dtype``."""
    path = os.fspath(path)
    cfg_path, raw = read_checkpoint_config(path, CheckpointError)
    model_type = raw.get("model_type")
    if model_type == "deberta":
        raise CheckpointError(
            f"{cfg_path}: model_type 'deberta' (DeBERTa v1) is not supported; only 'deberta-v2' (v2/v3) checkpoints"
        )
    if model_type not in (None, "deberta-v2"):
        raise CheckpointError(f"{cfg_path}: model_type {model_type!r} is not supported (expected 'deberta-v2')")
    task = task_for_architectures(raw.get("architectures"), cfg_path)
    try:
        config = DebertaConfig.from_dict(raw)
        model = _MODEL_BY_TASK[task](config)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e
    sd, source = _read_state_dict(path)
    load_weights(model, sd, config, source)
    model = model.to(device=device, dtype=dtype).eval()
    tokenizer = None
    if load_tokenizer:
        from .tokenization import load_tokenizer as _load_tokenizer

        tokenizer = _load_tokenizer(path)
        if tokenizer.vocab_size > config.vocab_size:
            # ids past the embedding table would fail whole batches at run time, other clients' requests too
            raise CheckpointError(
                f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{config.vocab_size}; ids >= {config.vocab_size} have no embedding (wrong tokenizer for these "
                f"weights?)")
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
