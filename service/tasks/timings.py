"""Per-request timings every task reports with its result (assembled from the scheduler's units)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class Timings:
    """Per-request timings, assembled from its units (they travel with each unit)."""

    tokenization_s: float = 0.0
    queue_s: float = 0.0       # longest wait of any of its units
    inference_s: float = 0.0   # longest batch any of its units ran in
    units: int = 0

    def add_units(self, units: Sequence[Any]) -> None:
        """Count ``units`` (the batcher's, with ``queue_s`` and ``inference_s``) into these timings."""
        self.units += len(units)
        for u in units:
            self.queue_s = max(self.queue_s, u.queue_s)
            self.inference_s = max(self.inference_s, u.inference_s)
