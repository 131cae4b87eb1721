"""Devices and dtypes for the backends that hold torch tensors (both torch backends; the ONNX Runtime
backends bind torch tensors too): one reading of ``device: auto|cpu|cuda[:N]`` and one memory report."""

from __future__ import annotations

import os

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


# torch's CPU kernel caches keyed by input shape, and the sizes that keep them from growing with every new shape
# while one forward's kernels stay cached for the layers after the first (see bound_kernel_caches)
KERNEL_CACHE_ENV = {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


def bound_kernel_caches() -> dict[str, str]:
    """Cap torch's per-shape CPU kernel caches in this process: ideep's (``LRU_CACHE_CAPACITY``) and oneDNN's
    primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), each unless the environment already sets it. Both are
    read when the first such kernel is created, so this must run before the first bfloat16 / oneDNN op of the
    process (a backend's ``load``); later it changes nothing. Returns the variables it set.

    Why: with their default capacities (1024 entries each) every new [batch, length] shape keeps its kernels:
    the default sentiment model in bfloat16, batches of 1-16 texts of 3-512 random tokens with the heap trimmed
    after each, grew +382 MB over 200 batches and was still growing. The caps hold 64 entries each: enough for
    every kernel of one forward, so layers 2..L reuse what layer 1 created for this batch's shape (+12 MB over the
    same batches, flat after the first 50, and 19 % faster than with no cache at all; a cache of 1 / 0 entries
    created every layer's kernels anew: +0 MB, but served short sentences at 123 instead of 146 req/s).
    Measured on the 2-core AMD EPYC, 2026-12-07 (docs/performance.md#cpu_openvino)."""
    set_now = {k: v for k, v in KERNEL_CACHE_ENV.items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now
