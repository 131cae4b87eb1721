"""ONNX Runtime IO binding over torch tensors: inputs and outputs stay where torch put them.

:func:`run_bound` binds every input and every (pre-allocated) output of a session by device pointer, so a
graph on the CUDA execution provider reads and writes torch's CUDA memory with no host round trip, and on the
CPU provider writes straight into torch tensors (no copy of the outputs). The same code runs on both, so
the CPU tests exercise the binding path the CUDA provider uses.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch import Tensor

_ELEMENT_TYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
}

__all__ = ["run_bound"]


def _where(t: Tensor) -> tuple[str, int]:
    if t.device.type == "cuda":
        return "cuda", int(t.device.index or 0)
    if t.device.type == "cpu":
        return "cpu", 0
    raise ValueError(f"ONNX Runtime binding: unsupported device {t.device}")


def run_bound(session, inputs: Mapping[str, Tensor], outputs: Mapping[str, Tensor]) -> None:
    """Run ``session`` with every input and output bound to a torch tensor's memory (shapes and dtypes must
    be exactly the graph's; outputs are written in place).

    Raises:
        ValueError: a tensor of an unsupported dtype or device.
        onnxruntime's errors for a shape or type the graph does not accept.
    """
    io = session.io_binding()
    keep = []  # contiguous copies must outlive the run
    for name, t in inputs.items():
        t = t.contiguous()
        keep.append(t)
        kind, index = _where(t)
        if t.dtype not in _ELEMENT_TYPES:
            raise ValueError(f"input {name!r}: dtype {t.dtype} cannot be bound")
        io.bind_input(name, kind, index, _ELEMENT_TYPES[t.dtype], tuple(t.shape), t.data_ptr())
    for name, t in outputs.items():
        if not t.is_contiguous():
            raise ValueError(f"output {name!r} must be contiguous")
        kind, index = _where(t)
        if t.dtype not in _ELEMENT_TYPES:
            raise ValueError(f"output {name!r}: dtype {t.dtype} cannot be bound")
        io.bind_output(name, kind, index, _ELEMENT_TYPES[t.dtype], tuple(t.shape), t.data_ptr())
    session.run_with_iobinding(io)
    if any(_where(t)[0] == "cuda" for t in outputs.values()):
        io.synchronize_outputs()
