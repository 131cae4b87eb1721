"""Graph-vs-torch agreement with a tolerance that scales with the output: ``|diff| <= atol + rtol * |ref|``.

Every parity check (the export report of :mod:`relserve.models.onnx.export` and
:mod:`relserve.models.onnx.export_rnnsearch`, the server's load-time self-check in
``service/backends/onnx_encoder.py`` / ``onnx_translation.py``) goes through :class:`Agreement`, so they all
accept and report the same way (the rule of ``numpy.isclose``, with ``ref`` the torch output). A fixed
absolute tolerance alone refuses correct graphs whose outputs are large: a classifier with logits near 40 differs
from torch by ~6e-4 in float32 (1.5e-5 relative) only because ONNX Runtime sums in another order.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["Agreement"]


class Agreement:
    """Running worst case of ``|got - ref|`` over any number of array pairs, against ``atol + rtol * |ref|``.

    ``max_abs_diff`` is the largest ``|got - ref|``; ``max_scaled_diff`` the largest
    ``|got - ref| / (atol + rtol * |ref|)``: at most 1.0 passes. Comparisons run in float64 so the check adds no
    rounding of its own. NaN anywhere makes both NaN and fails (``nan <= 1`` is false).
    """

    def __init__(self, atol: float, rtol: float) -> None:
        if not (atol >= 0 and rtol >= 0 and atol + rtol > 0):
            raise ValueError(f"need atol >= 0, rtol >= 0 and one of them > 0, got atol={atol} rtol={rtol}")
        self.atol, self.rtol = float(atol), float(rtol)
        self.max_abs_diff = 0.0
        self.max_scaled_diff = 0.0

    def add(self, got: Any, ref: Any) -> "Agreement":
        """Fold one pair (same shape; ``ref`` is the torch output) into the worst case; returns ``self``."""
        got = np.asarray(got, dtype=np.float64)
        ref = np.asarray(ref, dtype=np.float64)
        if got.size == 0:
            return self
        diff = np.abs(got - ref)
        bound = self.atol + self.rtol * np.abs(ref)
        with np.errstate(divide="ignore", invalid="ignore"):  # bound is 0 only where atol == 0 and ref == 0
            scaled = np.where(diff == 0, 0.0, diff / bound)
        self.max_abs_diff = _worst(self.max_abs_diff, float(np.max(diff)))
        self.max_scaled_diff = _worst(self.max_scaled_diff, float(np.max(scaled)))
        return self

    def merge(self, other: "Agreement") -> "Agreement":
        """Fold another Agreement's worst case (same atol / rtol) into this one; returns ``self``."""
        self.max_abs_diff = _worst(self.max_abs_diff, other.max_abs_diff)
        self.max_scaled_diff = _worst(self.max_scaled_diff, other.max_scaled_diff)
        return self

    @property
    def passed(self) -> bool:
        return bool(self.max_scaled_diff <= 1.0)

    def as_dict(self) -> dict[str, float]:
        """The report fields: ``atol``, ``rtol``, ``max_abs_diff``, ``max_scaled_diff``."""
        return {"atol": self.atol, "rtol": self.rtol, "max_abs_diff": self.max_abs_diff,
                "max_scaled_diff": self.max_scaled_diff}

    def describe(self) -> str:
        """``max |diff| 6.1e-04, max |diff|/(atol + rtol*|ref|) 0.13 (atol 0.0001, rtol 0.0001)``."""
        return (f"max |diff| {self.max_abs_diff:.3g}, max |diff|/(atol + rtol*|ref|) {self.max_scaled_diff:.3g} "
                f"(atol {self.atol:g}, rtol {self.rtol:g})")


def _worst(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)
