"""Scrape the server's Prometheus ``/metrics`` (prometheus_client's text parser) and summarise a run window.

A :class:`Snapshot` is a flat ``{(sample name, sorted labels): value}`` map. :func:`window_summary` turns two
snapshots (before / after a run) into server-side numbers per model: requests by code, mean queue time,
mean batch size, mean inference time per batch, real / padding tokens and the padding ratio
``padding / (real + padding)`` from ``relserve_tokens_total{kind}``, the mean per-call padding efficiency
(``relserve_batch_padding_efficiency``) and tokenization time per request, plus process RSS before and after.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Snapshot:
    values: dict[Key, float] = field(default_factory=dict)

    def get(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``."""
        total = 0.0
        for (n, lab), v in self.values.items():
            if n == name and all(dict(lab).get(k) == val for k, val in labels.items()):
                total += v
        return total

    def label_values(self, name: str, label: str) -> set[str]:
        return {dict(lab)[label] for (n, lab) in self.values if n == name and label in dict(lab)}

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.values)


def parse(text: str) -> Snapshot:
    snap = Snapshot()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            snap.values[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return snap


def scrape(url: str, timeout: float = 5.0) -> Snapshot:
    """GET ``url`` and parse it.

    Raises:
        OSError: the endpoint could not be reached.
    """
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse(resp.read().decode("utf-8"))


def histogram_quantile(before: Snapshot, after: Snapshot, name: str, q: float, **labels: str) -> float | None:
    """The ``q`` quantile of histogram ``name`` over the window between two scrapes, as Prometheus'
    ``histogram_quantile`` computes it: linear within the bucket holding the rank (from 0 for the first
    bucket); the largest finite bound when the rank falls in +Inf. None when nothing was observed.
    Samples whose labels include ``labels`` are summed (e.g. over ``task``)."""
    bucket = f"{name}_bucket"
    bounds = sorted((float(le), le) for le in after.label_values(bucket, "le"))
    counts = [(bound, after.get(bucket, le=le, **labels) - before.get(bucket, le=le, **labels)) for bound, le in bounds]
    if not counts or counts[-1][1] <= 0:
        return None
    rank = q * counts[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in counts:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, cumulative
    return lower


def rss_bytes(snap: Snapshot) -> float | None:
    """The server's resident memory: its process plus the worker processes of ``worker_process`` models."""
    if not snap.has("process_resident_memory_bytes"):
        return None
    return snap.get("process_resident_memory_bytes") + snap.get("relserve_worker_resident_memory_bytes")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _model_window(before: Snapshot, after: Snapshot, model: str) -> dict[str, Any]:
    def d(name: str, **labels: str) -> float:
        return after.get(name, model=model, **labels) - before.get(name, model=model, **labels)

    codes = sorted(after.label_values("relserve_requests_total", "code"))
    by_code = {c: int(round(d("relserve_requests_total", code=c))) for c in codes}
    by_code = {c: n for c, n in by_code.items() if n}
    real = d("relserve_tokens_total", kind="real")
    pad = d("relserve_tokens_total", kind="padding")
    batches = d("relserve_batch_size_count")
    queue_n = d("relserve_queue_duration_seconds_count")
    req_n = d("relserve_request_duration_seconds_count")
    out = {
        "requests_by_code": by_code,
        "requests": sum(by_code.values()),
        "batches": int(round(batches)),
        "sequences": int(round(d("relserve_batch_size_sum"))),
        "mean_batch_size": _ratio(d("relserve_batch_size_sum"), batches),
        "mean_queue_ms": _ms(_ratio(d("relserve_queue_duration_seconds_sum"), queue_n)),
        "mean_inference_ms_per_batch": _ms(_ratio(d("relserve_inference_duration_seconds_sum"),
                                                  d("relserve_inference_duration_seconds_count"))),
        "mean_request_ms": _ms(_ratio(d("relserve_request_duration_seconds_sum"), req_n)),
        "real_tokens": int(round(real)),
        "padding_tokens": int(round(pad)),
        "padding_ratio": _ratio(pad, real + pad),
        "padding_efficiency": _ratio(real, real + pad),
        # mean over backend calls of real tokens / tokens the attention core sees (dense layers may see fewer)
        "batch_padding_efficiency": _ratio(d("relserve_batch_padding_efficiency_sum"),
                                           d("relserve_batch_padding_efficiency_count")),
        "mean_tokenization_ms": _ms(_ratio(d("relserve_tokenization_duration_seconds_sum"),
                                           d("relserve_tokenization_duration_seconds_count"))),
    }
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def window_summary(before: Snapshot, after: Snapshot, models: list[str] | None = None) -> dict[str, Any]:
    """Server-side numbers for the window between two scrapes (see the module docstring)."""
    names = sorted(after.label_values("relserve_requests_total", "model")
                   | after.label_values("relserve_batch_size_count", "model"))
    if models:
        names = [m for m in names if m in models]
    per_model = {m: _model_window(before, after, m) for m in names}
    per_model = {m: v for m, v in per_model.items() if v["requests"] or v["batches"]}
    real = sum(v["real_tokens"] for v in per_model.values())
    pad = sum(v["padding_tokens"] for v in per_model.values())
    rss0, rss1 = rss_bytes(before), rss_bytes(after)
    return {
        "models": per_model,
        "real_tokens": real,
        "padding_tokens": pad,
        "padding_ratio": _ratio(pad, real + pad),
        "rss_bytes_start": rss0,
        "rss_bytes_end": rss1,
        "rss_growth_bytes": (rss1 - rss0) if rss0 is not None and rss1 is not None else None,
    }
