"""Opening ONNX Runtime sessions for a served model, shared by both ONNX backends: the providers for the
model's ``device``, the provider a session really got, and the native custom-op library with its fallback.

Providers: CUDA first when the model's device allows it (``auto`` / ``cuda[:N]``) and both ONNX Runtime and
torch see a CUDA device, else CPU. What the session really got is what ``ModelMeta.device`` says (e.g.
``CPUExecutionProvider``, ``CUDAExecutionProvider:0``), so ListModels and ``relserve_model_info`` show it.
Custom ops run as the graph's portable functions, or as native kernels when the library built by
``make onnx-native`` exists (``models/onnx/native/build/librelserve_onnx_ops.so``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import onnxruntime as ort
import torch

from relserve.models.onnx.runtime import native_library

from ..config import ModelConfig
from ..errors import ConfigError

log = logging.getLogger(__name__)
# ModelMeta.dtype_reason of both ONNX Runtime backends for dtype auto / float32 (``auto`` never leaves float32
# here; only an explicit ``dtype: int8`` runs the encoder backend's int8 graph)
ONNX_DTYPE_REASON = "the onnx backend runs float32 graphs only"

def select_providers(config: ModelConfig) -> list:
    """ONNX Runtime providers for a model's ``device``: CUDA first when allowed and usable, else CPU.

    ``dtype: int8`` runs on the CPU provider only (``device`` auto or cpu; validation refuses cuda).

    Raises:
        ConfigError: a dtype other than float32, auto or int8 (the exported graphs are float32; auto is float32
            here, :data:`ONNX_DTYPE_REASON`), or ``cuda[:N]`` was asked
            for but ONNX Runtime or torch sees no CUDA device.
    """
    if config.dtype not in ("auto", "float32", "int8"):
        raise ConfigError(f"model {config.name!r}: the onnx backend runs float32 graphs only (and int8 ones, dtype: "
                          f"int8), got dtype {config.dtype}; use backend torch for half precision")
    want = config.device
    if want == "cpu" or config.dtype == "int8":
        return ["CPUExecutionProvider"]
    cuda = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
    if want.startswith("cuda") and not cuda:
        why = ("torch sees no CUDA device (torch.cuda.is_available() is False)"
               if "CUDAExecutionProvider" in ort.get_available_providers()
               else f"this ONNX Runtime has no CUDAExecutionProvider (it has {ort.get_available_providers()})")
        raise ConfigError(f"model {config.name!r}: device {want!r} requested but {why}")
    if not cuda:
        return ["CPUExecutionProvider"]
    index = int(want.split(":", 1)[1]) if ":" in want else 0
    return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]


def provider_device(providers: list, provider: str) -> tuple[str, str]:
    """(torch device for tensors, the label ListModels shows) of the provider a session really got."""
    if provider == "CUDAExecutionProvider":
        index = str(providers[0][1]["device_id"])
        return "cuda:" + index, f"{provider}:{index}"
    return "cpu", provider


def open_with_native_fallback(name: str, open_fn: Callable[[str | None], Any]) -> tuple[Any, str | None]:
    """``open_fn(native_library())``; when the native library is present but fails to load, log it and open
    with the portable functions instead. Returns (what ``open_fn`` returned, the library used or None)."""
    lib = native_library()
    try:
        return open_fn(lib), lib
    except Exception as exc:
        if lib is None:
            raise
        log.warning("model %r: native custom-op library %s not usable (%s); using the portable functions",
                    name, lib, exc)
        return open_fn(None), None
