"""Which backend serves a model: the factory over the four backends (torch / ONNX Runtime x encoder /
translation). The contracts they follow live in :mod:`.base`.

Nothing here imports torch or onnxruntime: a backend module (and with it torch) is imported only when
:func:`create_backend` / :func:`create_translation_backend` is asked for it.

ONNX Runtime is optional (the ``relserve[onnx]`` / ``relserve[onnx-gpu]`` extras bring onnx, onnxscript and
onnxruntime / onnxruntime-gpu): without it ``backend: auto`` is torch, and ``backend: onnx`` (or ``relserve
export``) fails at model load with a ConfigError naming the extras (:func:`require_onnx`) instead of an
ImportError from deep inside a backend.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

from ..config import ModelConfig
from ..errors import ConfigError
from .base import TASK_TRANSLATION, Backend, StepBackend

TRANSLATION_MODEL_TYPES = ("rnnsearch",)
# What the onnx extras install and the ONNX backends / export import (graph building, export, sessions).
ONNX_MODULES = ("onnxruntime", "onnx", "onnxscript")
ONNX_INSTALL_HINT = "pip install 'relserve[onnx]' (CPU) or 'relserve[onnx-gpu]' (CUDA; never both)"


def missing_onnx_modules() -> list[str]:
    """The modules of :data:`ONNX_MODULES` that cannot be imported here (found without importing them)."""
    missing = []
    for name in ONNX_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses the name counts as not installed
            found = False
        if not found:
            missing.append(name)
    return missing


def require_onnx(what: str) -> None:
    """Fail early and clearly when ONNX Runtime (the onnx extra) is not installed.

    Args:
        what: who needs it, for the message (e.g. ``"model 'x': backend onnx"``).

    Raises:
        ConfigError: ``<what> needs ONNX Runtime (not installed: ...): pip install 'relserve[onnx]' ...``.
    """
    missing = missing_onnx_modules()
    if missing:
        raise ConfigError(f"{what} needs ONNX Runtime (not installed: {', '.join(missing)}): {ONNX_INSTALL_HINT}")


def resolved_backend(config: ModelConfig) -> str:
    """``torch`` or ``onnx``: ``auto`` is ONNX Runtime when the onnx extra is installed and the dtype is float32 or
    auto (which the onnx backend serves as float32), else torch. (``dtype: int8`` needs ``backend: onnx`` spelled
    out: config validation refuses it with auto.)"""
    if config.backend != "auto":
        return config.backend
    return "onnx" if config.dtype in ("auto", "float32") and not missing_onnx_modules() else "torch"


def checkpoint_task(path: str | Path) -> str | None:
    """``TASK_TRANSLATION`` when ``<path>/config.json`` says ``model_type`` "rnnsearch"; None otherwise (the
    encoder checkpoints decide their task from ``architectures`` when loaded). Reads JSON only, no torch."""
    cfg = Path(path) / "config.json"
    try:
        model_type = json.loads(cfg.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return TASK_TRANSLATION if model_type in TRANSLATION_MODEL_TYPES else None


# backend: the in-process encoder backend class, as (module under relserve.service.backends, class name)
ENCODER_BACKENDS = {"onnx": ("onnx_encoder", "OnnxBackend"), "torch": ("torch_encoder", "TorchBackend")}


def create_backend(config: ModelConfig) -> Backend:
    """The encoder backend named by the model's config (imports its module, and so torch, only here); unless
    ``worker_process`` is false, a :class:`.worker.WorkerBackend`, which builds that backend in a child process
    (the child is handed the class by name, :data:`ENCODER_BACKENDS`).

    Raises:
        ConfigError: unknown backend, or backend onnx without ONNX Runtime installed.
    """
    backend = resolved_backend(config)
    if backend not in ENCODER_BACKENDS:
        raise ConfigError(f"model {config.name!r}: backend {config.backend!r} is not available")
    if backend == "onnx":
        require_onnx(f"model {config.name!r}: backend onnx")
    module, cls = ENCODER_BACKENDS[backend]
    if config.worker_process is not False:  # unset (None) or true: encoder models compute in a worker process
        if config.instances > 1:
            from .worker_pool import WorkerPool

            return WorkerPool(config, f"{__name__}.{module}", cls)
        from .worker import WorkerBackend

        return WorkerBackend(config, f"{__name__}.{module}", cls)
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(config)


def create_translation_backend(config: ModelConfig) -> StepBackend:
    """The translation (step) backend named by the model's config (imports its module only here). With
    ``worker_process`` true the runtime runs it in decode worker processes
    (``relserve.service.scheduling.decode_workers``), each of which builds it with this function.

    Raises:
        ConfigError: unknown backend, backend onnx without ONNX Runtime installed, or dtype int8 (encoder models
            only).
    """
    if config.dtype == "int8":
        raise ConfigError(f"model {config.name!r}: dtype int8 is for encoder models (classification, QA); it is not "
                          f"offered for translation checkpoints (their BiGRU encoder graph is one ONNX GRU node, "
                          f"which ONNX Runtime's dynamic quantization leaves in float32; int8 quantization and its "
                          f"agreement gate are implemented for the encoder graphs only); use dtype float32 or auto")
    if config.instances > 1:
        raise ConfigError(f"model {config.name!r}: instances {config.instances} is for encoder models "
                          f"(classification, QA); a translation model's decode loops are decode_instances (with "
                          f"worker_process: true); use instances: 1")
    backend = resolved_backend(config)
    if backend == "onnx":
        require_onnx(f"model {config.name!r}: backend onnx")
        from .onnx_translation import OnnxTranslationBackend

        return OnnxTranslationBackend(config)
    if backend == "torch":
        from .torch_translation import TorchTranslationBackend

        return TorchTranslationBackend(config)
    raise ConfigError(f"model {config.name!r}: backend {config.backend!r} cannot serve translation models")
