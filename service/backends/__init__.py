"""The backend contract: everything above it (runner, batcher, API) is the same for every backend.

A backend owns one model instance: ``load()`` reads the checkpoint and returns :class:`ModelMeta`,
``warmup()`` runs a throw-away batch, ``run(batch)`` computes one batch and returns one result *or one
Exception* per item, in order. ``run`` is called from the model's executor thread, never on the event loop.

Items are tokenizer Encodings / QA windows (anything with ``input_ids`` and ``token_type_ids``). Results
are numpy arrays per item: classification ``float32[num_labels]`` logits; QA a pair
``(start float32[T_i], end float32[T_i])`` unpadded to the item's own length ``T_i``.

This package does not import torch; :func:`create_backend` imports a backend module only when asked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

from ..config import ModelConfig
from ..errors import ConfigError

TASK_CLASSIFICATION = "classification"
TASK_QA = "question-answering"
TASK_TRANSLATION = "translation"
TRANSLATION_MODEL_TYPES = ("rnnsearch",)


@dataclass(frozen=True)
class ModelMeta:
    """What the server needs to know about a loaded model (ListModels, validation, metrics)."""

    task: str                       # TASK_CLASSIFICATION | TASK_QA
    family: str                     # e.g. "deberta-v2"
    backend: str                    # e.g. "torch"
    device: str                     # e.g. "cpu", "cuda:0"
    dtype: str                      # "float32" | "float16" | "bfloat16"
    tokenizer: Any                  # relserve.models.tokenization.Tokenizer (or a test fake)
    labels: tuple[str, ...] = ()    # classification labels in id order
    problem_type: str | None = None  # "multi_label_classification" -> sigmoid scores
    max_positions: int | None = None  # the model's own limit (max_position_embeddings), None if unbounded
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    name: str             # "torch", "onnxruntime", ...
    is_padded: bool       # pads a batch to its longest member (the batcher counts padded tokens)
    max_batch_size: int | None  # the backend's own cap (None: whatever the config says)

    def load(self) -> ModelMeta: ...

    def warmup(self) -> None: ...

    def run(self, batch: Sequence[Any]) -> list[Any]: ...

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        """``{device: (allocated, reserved, peak) bytes}`` for accelerators; {} on CPU."""
        ...

    def close(self) -> None: ...


def resolved_backend(config: ModelConfig) -> str:
    """``torch`` or ``onnx``: ``auto`` is ONNX Runtime when ``onnxruntime`` is installed and the dtype is float32."""
    if config.backend != "auto":
        return config.backend
    import importlib.util

    return "onnx" if config.dtype == "float32" and importlib.util.find_spec("onnxruntime") else "torch"


def create_backend(config: ModelConfig) -> Backend:
    """The backend named by the model's config (imports its module, and so torch, only here).

    ``auto`` is ONNX Runtime when ``onnxruntime`` is installed and the dtype is float32, else torch.

    Raises:
        ConfigError: unknown backend.
    """
    backend = resolved_backend(config)
    if backend == "onnx":
        from .onnx_backend import OnnxBackend

        return OnnxBackend(config)
    if backend == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(config)
    raise ConfigError(f"model {config.name!r}: backend {config.backend!r} is not available")


def checkpoint_task(path: str | Path) -> str | None:
    """``TASK_TRANSLATION`` when ``<path>/config.json`` says ``model_type`` "rnnsearch"; None otherwise (the
    encoder checkpoints decide their task from ``architectures`` when loaded). Reads JSON only, no torch."""
    cfg = Path(path) / "config.json"
    try:
        model_type = json.loads(cfg.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return TASK_TRANSLATION if model_type in TRANSLATION_MODEL_TYPES else None


def create_translation_backend(config: ModelConfig):
    """The translation (step) backend named by the model's config; see ``relserve.service.decode_loop``.

    Raises:
        ConfigError: unknown backend.
    """
    backend = resolved_backend(config)
    if backend == "onnx":
        from .translation_onnx import OnnxTranslationBackend

        return OnnxTranslationBackend(config)
    if backend == "torch":
        from .translation_torch import TorchTranslationBackend

        return TorchTranslationBackend(config)
    raise ConfigError(f"model {config.name!r}: backend {config.backend!r} cannot serve translation models")
