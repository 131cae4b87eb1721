"""Handing the heap that model loading freed back to the operating system.

Warm-up (full-length batches, the bfloat16 agreement gate, the cost model's probe batches) leaves glibc's
malloc holding hundreds of megabytes it has freed but not returned: a torch QA model of the defaults went from
333 MB resident after load to 912 MB after warm-up, and back to 507 MB after ``malloc_trim(0)``. The server
calls :func:`trim_heap` once every model is loaded (in its own process and in each worker process).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def trim_heap() -> bool:
    """glibc's ``malloc_trim(0)``: return the free memory at the top of the heap and in whole free pages to the
    OS. Returns whether memory was released; False where the C library is not glibc (nothing happens)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
