"""Which backend serves a model: the factory over the four backends (torch / ONNX Runtime x encoder /
translation). The contracts they follow live in :mod:`.base`.

Nothing here imports torch or onnxruntime: a backend module (and with it torch) is imported only when
:func:`create_backend` / :func:`create_translation_backend` is asked for it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from ..config import ModelConfig
from ..errors import ConfigError
from .base import TASK_TRANSLATION, Backend, StepBackend

TRANSLATION_MODEL_TYPES = ("rnnsearch",)


def resolved_backend(config: ModelConfig) -> str:
    """``torch`` or ``onnx``: ``auto`` is ONNX Runtime when ``onnxruntime`` is installed and the dtype is float32."""
    if config.backend != "auto":
        return config.backend
    return "onnx" if config.dtype == "float32" and importlib.util.find_spec("onnxruntime") else "torch"


def checkpoint_task(path: str | Path) -> str | None:
    """``TASK_TRANSLATION`` when ``<path>/config.json`` says ``model_type`` "rnnsearch"; None otherwise (the
    encoder checkpoints decide their task from ``architectures`` when loaded). Reads JSON only, no torch."""
    cfg = Path(path) / "config.json"
    try:
        model_type = json.loads(cfg.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return TASK_TRANSLATION if model_type in TRANSLATION_MODEL_TYPES else None


def create_backend(config: ModelConfig) -> Backend:
    """The encoder backend named by the model's config (imports its module, and so torch, only here).

    Raises:
        ConfigError: unknown backend.
    """
    backend = resolved_backend(config)
    if backend == "onnx":
        from .onnx_encoder import OnnxBackend

        return OnnxBackend(config)
    if backend == "torch":
        from .torch_encoder import TorchBackend

        return TorchBackend(config)
    raise ConfigError(f"model {config.name!r}: backend {config.backend!r} is not available")


def create_translation_backend(config: ModelConfig) -> StepBackend:
    """The translation (step) backend named by the model's config (imports its module only here).

    Raises:
        ConfigError: unknown backend.
    """
    backend = resolved_backend(config)
    if backend == "onnx":
        from .onnx_translation import OnnxTranslationBackend

        return OnnxTranslationBackend(config)
    if backend == "torch":
        from .torch_translation import TorchTranslationBackend

        return TorchTranslationBackend(config)
    raise ConfigError(f"model {config.name!r}: backend {config.backend!r} cannot serve translation models")
