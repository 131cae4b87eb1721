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
