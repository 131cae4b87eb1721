"""``--fail-if`` thresholds: ``METRIC OP NUMBER`` over the report's flat metrics (:data:`report.METRICS`).

``p99_ms>200`` means "the run fails if its p99 latency is above 200 ms"; operators ``>``, ``>=``, ``<``, ``<=``.
A latency threshold on a run without a single success counts as violated (there is no latency to show it
holds).
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .report import METRICS

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
}
_EXPR = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(>=|<=|>|<)\s*(\S+)\s*$")


@dataclass(frozen=True)
class Threshold:
    """Fail when ``metric op value`` holds."""

    metric: str
    op: str
    value: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"

    def violated_by(self, metrics: Mapping[str, float | int | None]) -> bool:
        """True when the run fails this threshold (a missing value, e.g. no successes, fails it too)."""
        v = metrics.get(self.metric)
        return v is None or _OPS[self.op](float(v), self.value)


def parse(expr: str) -> Threshold:
    """``"p99_ms>200"`` -> :class:`Threshold`.

    Raises:
        ValueError: not ``METRIC OP NUMBER``, an unknown metric or operator, or a value that is not a finite
            number; the message lists the metric names.
    """
    m = _EXPR.match(expr)
    names = ", ".join(METRICS)
    if not m:
        raise ValueError(f"--fail-if {expr!r} is not METRIC OP NUMBER (OP one of > >= < <=, e.g. p99_ms>200); "
                         f"metrics: {names}")
    metric, op, raw = m.groups()
    if metric not in METRICS:
        raise ValueError(f"--fail-if {expr!r}: unknown metric {metric!r}; metrics: {names}")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"--fail-if {expr!r}: {raw!r} is not a finite number; metrics: {names}")
    return Threshold(metric, op, value)


def violations(thresholds: Sequence[Threshold], metrics: Mapping[str, float | int | None]) -> list[str]:
    """One line per violated threshold, naming it and the measured value, e.g.
    ``"p99_ms>200 (p99_ms = 312.4)"``; empty when the run passes them all."""
    out = []
    for t in thresholds:
        if t.violated_by(metrics):
            v = metrics.get(t.metric)
            shown = "n/a, no successful requests" if v is None else f"{v:g}"
            out.append(f"{t} ({t.metric} = {shown})")
    return out
