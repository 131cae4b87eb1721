"""Turn :class:`~relserve.loadtest.generator.Records` into numbers (JSON, CSV) and PNG plots (matplotlib, Agg).

Latency percentiles are over successful requests (errors are counted by status code name, with their own
latency percentiles); throughput is successes per second of run time (run start to last completion);
``error_rate`` is errors / requests. :func:`flat_metrics` gives the same numbers under one flat set of names
(:data:`METRICS`), which the CSV columns and ``--fail-if`` thresholds share.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .generator import Records

PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p95", 95.0), ("p99", 99.0), ("p99.9", 99.9))

# The flat metric names (CSV columns after the identifying ones; --fail-if operands), with what each means.
METRICS: dict[str, str] = {
    "requests": "requests recorded (successes + errors)",
    "successes": "requests answered OK",
    "errors": "requests that failed (any status but OK, or CLIENT_OVERLOAD)",
    "error_rate": "errors / requests (0 when no requests)",
    "duration_s": "seconds from the run start to the last answer",
    "throughput_rps": "successes per second of duration_s",
    "completed_rps": "requests (OK or not) per second of duration_s",
    "mean_ms": "mean latency of successes, ms",
    "min_ms": "lowest latency of successes, ms",
    **{f"{k}_ms": f"{q:g}th percentile latency of successes, ms" for k, q in PERCENTILES},
    "max_ms": "highest latency of successes, ms",
}


def latency_stats(latencies_s: Sequence[float]) -> dict[str, float | None]:
    """mean/min/max and p50/p90/p95/p99/p99.9 in milliseconds (None when there are no samples); percentiles
    by numpy's default linear interpolation."""
    keys = ["mean", "min", "max"] + [k for k, _ in PERCENTILES]
    if len(latencies_s) == 0:
        return {k: None for k in keys}
    a = np.asarray(latencies_s, dtype=np.float64) * 1e3
    out = {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}
    for key, q in PERCENTILES:
        out[key] = float(np.percentile(a, q))
    return out


def summarize(records: Records) -> dict[str, Any]:
    """Counts, throughput and latency percentiles (overall and per request kind)."""
    codes = Counter(records.codes)
    ok_lat = [lat for lat, c in zip(records.latencies, records.codes) if c == "OK"]
    successes = codes.get("OK", 0)
    errors = {c: n for c, n in sorted(codes.items()) if c != "OK"}
    elapsed = records.elapsed
    out: dict[str, Any] = {
        "requests": len(records),
        "successes": successes,
        "errors": sum(errors.values()),
        "error_rate": _rate(sum(errors.values()), len(records)),
        "errors_by_code": errors,
        "duration_s": elapsed,
        "throughput_rps": successes / elapsed if elapsed > 0 else 0.0,
        "completed_rps": len(records) / elapsed if elapsed > 0 else 0.0,
        "latency_ms": latency_stats(ok_lat),
        "error_latency_ms": latency_stats([lat for lat, c in zip(records.latencies, records.codes) if c != "OK"]),
        "by_kind": {},
    }
    for kind in sorted(set(records.kinds)):
        idx = [i for i, k in enumerate(records.kinds) if k == kind]
        kc = Counter(records.codes[i] for i in idx)
        k_errors = len(idx) - kc.get("OK", 0)
        out["by_kind"][kind] = {
            "requests": len(idx),
            "successes": kc.get("OK", 0),
            "errors": k_errors,
            "error_rate": _rate(k_errors, len(idx)),
            "errors_by_code": {c: n for c, n in sorted(kc.items()) if c != "OK"},
            "throughput_rps": kc.get("OK", 0) / elapsed if elapsed > 0 else 0.0,
            "completed_rps": len(idx) / elapsed if elapsed > 0 else 0.0,
            "latency_ms": latency_stats([records.latencies[i] for i in idx if records.codes[i] == "OK"]),
        }
    return out


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def flat_metrics(summary: dict[str, Any], duration_s: float | None = None) -> dict[str, float | int | None]:
    """The :data:`METRICS` of one summary (:func:`summarize`'s output, one of its ``by_kind`` entries, or a
    sweep step), in that order; latency values are None when there were no successes.

    ``duration_s`` fills in the run duration for the parts of a summary that do not carry it (``by_kind``).
    """
    lat = summary["latency_ms"]
    requests = summary["requests"]
    errors = summary.get("errors", requests - summary["successes"])
    duration = summary.get("duration_s", duration_s)
    out: dict[str, float | int | None] = {
        "requests": requests,
        "successes": summary["successes"],
        "errors": errors,
        "error_rate": summary.get("error_rate", _rate(errors, requests)),
        "duration_s": duration,
        "throughput_rps": summary["throughput_rps"],
        "completed_rps": summary.get("completed_rps", requests / duration if duration else 0.0),
    }
    for key in ("mean", "min", *(k for k, _ in PERCENTILES), "max"):
        out[f"{key}_ms"] = lat[key]
    assert list(out) == list(METRICS)  # one list of names: CSV columns, --fail-if and this stay in step
    return out


CSV_ID_COLUMNS = ("command", "scenario", "kind", "model", "mode", "rate", "concurrency")
CSV_COLUMNS = CSV_ID_COLUMNS + tuple(METRICS)


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """One line per row under the header :data:`CSV_COLUMNS`; None is written as an empty field, floats as
    Python's shortest round-trip repr (the same digits as the JSON)."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="raise")
        w.writeheader()
        for row in rows:
            w.writerow({k: "" if row.get(k) is None else row[k] for k in CSV_COLUMNS})
    return path


def timeline(records: Records, bin_s: float = 1.0) -> dict[str, list[float]]:
    """Per time bin (by completion time): successes/s, errors/s, p50 and p99 latency (ms) of successes."""
    if not len(records):
        return {"t": [], "ok_rps": [], "err_rps": [], "p50_ms": [], "p99_ms": []}
    ends = np.asarray(records.starts) + np.asarray(records.latencies)
    lat = np.asarray(records.latencies) * 1e3
    ok = np.asarray([c == "OK" for c in records.codes])
    nbins = max(1, int(math.ceil(float(ends.max()) / bin_s)))
    idx = np.minimum((ends / bin_s).astype(int), nbins - 1)
    t, ok_rps, err_rps, p50, p99 = [], [], [], [], []
    for b in range(nbins):
        sel = idx == b
        width = min(bin_s, float(ends.max()) - b * bin_s) if b == nbins - 1 else bin_s
        width = max(width, 1e-3)
        t.append((b + 0.5) * bin_s)
        ok_rps.append(float((sel & ok).sum()) / width)
        err_rps.append(float((sel & ~ok).sum()) / width)
        good = lat[sel & ok]
        p50.append(float(np.percentile(good, 50)) if good.size else float("nan"))
        p99.append(float(np.percentile(good, 99)) if good.size else float("nan"))
    return {"t": t, "ok_rps": ok_rps, "err_rps": err_rps, "p50_ms": p50, "p99_ms": p99}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency(records: Records, path: Path, title: str) -> Path:
    """Histogram (log-spaced bins) and CDF of successful request latency, percentiles marked."""
    plt = _plt()
    lat = np.asarray([x for x, c in zip(records.latencies, records.codes) if c == "OK"]) * 1e3
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    if lat.size:
        lo, hi = max(lat.min(), 1e-3), max(lat.max(), lat.min() * 1.01 + 1e-3)
        bins = np.logspace(math.log10(lo), math.log10(hi), 50)
        ax1.hist(lat, bins=bins, color="#4878a8")
        ax1.set_xscale("log")
        xs = np.sort(lat)
        ax2.plot(xs, np.arange(1, xs.size + 1) / xs.size, color="#4878a8")
        ax2.set_xscale("log")
        for (key, q), color in zip(PERCENTILES, ("#2a2", "#c80", "#e60", "#c22", "#808"), strict=True):
            v = float(np.percentile(lat, q))
            for ax in (ax1, ax2):
                ax.axvline(v, color=color, linestyle="--", linewidth=1, label=f"{key} {v:.1f} ms")
        ax2.legend(loc="lower right", fontsize=8)
    ax1.set_xlabel("latency (ms)")
    ax1.set_ylabel("requests")
    ax1.set_title("latency histogram (successes)")
    ax2.set_xlabel("latency (ms)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title("latency CDF")
    ax2.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_timeline(records: Records, path: Path, title: str, rss: Sequence[tuple[float, float]] = ()) -> Path:
    """Throughput (successes and errors per second) and p50/p99 latency per second; RSS when sampled."""
    plt = _plt()
    tl = timeline(records)
    rows = 3 if rss else 2
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.4 * rows + 0.6), dpi=80, sharex=True)
    ax1, ax2 = axes[0], axes[1]
    ax1.plot(tl["t"], tl["ok_rps"], label="OK/s", color="#4878a8")
    if any(tl["err_rps"]):
        ax1.plot(tl["t"], tl["err_rps"], label="errors/s", color="#c22")
    ax1.set_ylabel("requests / s")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.grid(True, alpha=0.3)
    ax2.plot(tl["t"], tl["p50_ms"], label="p50", color="#2a2", marker=".")
    ax2.plot(tl["t"], tl["p99_ms"], label="p99", color="#c22", marker=".")
    ax2.set_ylabel("latency (ms)")
    ax2.legend(loc="upper right", fontsize=8)
    ax2.grid(True, alpha=0.3)
    if rss:
        ax3 = axes[2]
        ax3.plot([t for t, _ in rss], [b / 2**20 for _, b in rss], color="#808", marker=".")
        ax3.set_ylabel("server RSS (MiB)")
        ax3.grid(True, alpha=0.3)
    axes[-1].set_xlabel("time since start (s)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(steps: Sequence[dict[str, Any]], slo_ms: float, path: Path, title: str) -> Path:
    """p99 latency and achieved throughput against the offered rate, SLO marked."""
    plt = _plt()
    rates = [s["rate"] for s in steps]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    ax1.plot(rates, [s["latency_ms"]["p99"] or float("nan") for s in steps], marker="o", label="p99")
    ax1.plot(rates, [s["latency_ms"]["p50"] or float("nan") for s in steps], marker=".", label="p50")
    ax1.axhline(slo_ms, color="#c22", linestyle="--", label=f"SLO {slo_ms:g} ms")
    ax1.set_xlabel("offered rate (req/s)")
    ax1.set_ylabel("latency (ms)")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax1.grid(True, which="both", alpha=0.3)
    ax2.plot(rates, [s["throughput_rps"] for s in steps], marker="o")
    ax2.plot(rates, rates, color="#999", linestyle=":", label="offered")
    ax2.set_xlabel("offered rate (req/s)")
    ax2.set_ylabel("successes / s")
    ax2.legend(fontsize=8)
    ax2.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_json(obj: Any, path: Path) -> Path:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_jsonable) + "\n", encoding="utf-8")
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
