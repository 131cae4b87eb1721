"""Devices and dtypes for the backends that hold torch tensors (both torch backends; the ONNX Runtime
backends bind torch tensors too): one reading of ``device: auto|cpu|cuda[:N]`` and one memory report."""

from __future__ import annotations

import torch

from ..errors import ConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# torch's intra-op thread count before any backend changed it (its default: one per core, or OMP_NUM_THREADS)
DEFAULT_THREADS = torch.get_num_threads()


def use_threads(configured: int) -> None:
    """Give the calling thread ``configured`` torch intra-op threads (0: :data:`DEFAULT_THREADS`); the
    backends pass the model's ``torch_intra_op_threads``, else their call budget's ``threads()``.

    OpenMP keeps the thread count per calling thread, so each model's backend thread can have its own; but
    ``torch.set_num_threads`` also sets the default that threads adopt on their first torch op, so a backend
    calls this at the start of every call (a no-op once its thread has the count).
    """
    n = configured or DEFAULT_THREADS
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def resolve_device(model: str, device: str) -> str:
    """``auto`` -> ``cuda:0`` when CUDA is available, else ``cpu``; ``cuda`` -> ``cuda:0``.

    Raises:
        ConfigError: CUDA requested but not available (or the index is out of range).
    """
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"model {model!r}: device {device!r} requested but CUDA is not available")
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"model {model!r}: device {device!r} does not exist ({torch.cuda.device_count()} CUDA devices)"
            )
        return f"cuda:{index}"
    return device


def cuda_memory_stats(device: str) -> dict[str, tuple[int, int, int]]:
    """``{device: (allocated, reserved, peak) bytes}`` of torch's CUDA allocator; {} for a CPU device."""
    if not device.startswith("cuda"):
        return {}
    dev = torch.device(device)
    return {device: (int(torch.cuda.memory_allocated(dev)), int(torch.cuda.memory_reserved(dev)),
                     int(torch.cuda.max_memory_allocated(dev)))}


def release_cuda_cache(device: str) -> None:
    """Return cached CUDA blocks to the driver after a model is dropped (no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
