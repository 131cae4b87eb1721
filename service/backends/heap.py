"""Handing the heap that model loading freed back to the operating system.

Warm-up (full-length batches, the bfloat16 agreement gate, the cost model's probe batches) leaves glibc's
malloc holding hundreds of megabytes it has freed but not returned: a torch QA model of the defaults went from
333 MB resident after load to 912 MB after warm-up, and back to 507 MB after ``malloc_trim(0)``. The server
calls :func:`trim_heap` once every model is loaded (in its own process and in each worker process), and the torch
encoder backend after a batch that left the process holding more than ``heap_trim_mb`` (:class:`HeapBound`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` as a ctypes function, or None where the C library has none; looked up once
    (``find_library`` runs ldconfig, which costs more than the trim)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HELD_BLOCK_BYTES = 1 << 30  # blocks up to this size come from the heap (glibc accepts it on 64-bit)
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # free() never shrinks the heap itself (mallopt takes an int)


@functools.lru_cache(maxsize=1)
def keep_freed_blocks() -> bool:
    """Make glibc's malloc serve blocks of up to 1 GiB from the heap and keep what ``free`` returns there until
    :func:`trim_heap` (``mallopt(M_MMAP_THRESHOLD)`` and ``mallopt(M_TRIM_THRESHOLD)``), process-wide, once.
    Returns whether both were set; False where the C library is not glibc (nothing changes).

    Why: by default a block above the dynamic mmap threshold (at most 32 MiB) is mapped fresh on every ``malloc``
    and unmapped on ``free``, so each large activation of a long batch (the [B, n, T, 2T - 1] score products, the
    [B, n, T, T] bias) is page-faulted and zeroed again in every layer. Kept on the heap, the same 6 x 768
    classifier ran 8 x 384 tokens 1.2-1.4x faster (fp32 5.8-6.9 -> 8.3 seq/s, bf16 10.1-10.6 -> 13.3 on the
    2-core AMD EPYC, taking turns, no trim between batches). The torch encoder backend sets it in its own worker
    process only, and only with ``heap_trim_mb`` > 0: :class:`HeapBound` then trims that process once it is
    ``heap_trim_mb`` above its reference, so a batch whose activations exceed the slack is trimmed after it (and
    the next such batch faults its pages in again, as without this setting); smaller working sets are reused."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, HELD_BLOCK_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def trim_heap() -> bool:
    """glibc's ``malloc_trim(0)``: return the free memory at the top of the heap and in whole free pages to the
    OS. Returns whether memory was released; False where the C library is not glibc (nothing happens)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def _own_resident_bytes() -> int | None:
    """This process's resident set size in bytes (Linux /proc/self/statm); None where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HeapBound:
    """Keeps a serving process from holding the heap its batches freed: after a batch, if the process is more
    than ``slack_mb`` MiB above its resident size after the last trim, :func:`trim_heap` (then that size is
    the new reference).

    Why: each new input shape leaves glibc's malloc holding what the batch freed (activations of another size
    do not fit the free chunks the last batch left, and the dynamic mmap threshold keeps big blocks on the
    heap). Measured with the default sentiment model in one process (float32, batches of 1-32 texts of
    3-512 tokens): +835 MB after 50 batches of new shapes, +2 MB with a trim after every batch; single texts of
    150 new lengths +174 MB, +4 MB trimmed. Neither torch's LRU_CACHE_CAPACITY=1 (+154 MB) nor
    MALLOC_ARENA_MAX=1 (+156) bound it. A trim costs tens of milliseconds (it hands pages back, which the
    next large batch faults in again), so it runs only once the slack is exceeded, not after every batch.

    Args:
        slack_mb: MiB above the reference that trigger a trim; 0 or less: never trim.
    """

    def __init__(self, slack_mb: int) -> None:
        self.slack_bytes = max(0, int(slack_mb)) << 20
        self.reference: int | None = None  # resident bytes after the last trim (None: none yet)
        self.trims = 0

    def after_batch(self) -> bool:
        """Trim when due (see the class docstring); returns whether it trimmed. Never raises."""
        if self.slack_bytes <= 0:
            return False
        rss = _own_resident_bytes()
        if rss is None:
            return False
        if self.reference is not None and rss - self.reference <= self.slack_bytes:
            return False
        trim_heap()
        self.trims += 1
        self.reference = _own_resident_bytes() or rss
        return True
