"""What every micro-benchmark of :mod:`relserve.loadtest.bench` shares: its command line, timing with repeats,
side-by-side ratios and JSON output.

* :func:`parser` and :func:`add_common_args`: ``python -m relserve.loadtest.bench.<name>`` with the common
  arguments ``--threads``, ``--repeats``, ``--warmup`` and ``--json`` (each benchmark passes its own defaults and
  help, so its flags stay what they were; ``--json`` is either ``--json FILE`` or a plain switch that prints);
  :func:`fill_defaults`: the defaults of arguments that differ between ``--quick`` and a full run;
* :func:`child_pids`: a server's worker processes, for the benchmarks that measure them;
* :func:`time_call`, :func:`median_seconds`, :func:`interleaved` and :func:`medians`: untimed warm-up calls,
  then ``repeats`` timed ones; side by side, every round runs each path once, the order rotating per round, so
  drift in the machine's load hits every path alike;
* :func:`ratio` and :func:`fmt_ratio`: ``a / b`` guarded against a zero or missing denominator, printed ``1.23x``;
  :func:`side_by_side_table`: figures of several variants in columns, with their ratios to the first;
* :func:`json_line`, :func:`emit_json` and :func:`write_json`: one JSON line per result on stdout, or the whole
  summary in a file.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

PROG = "python -m relserve.loadtest.bench"

_UNSET: Any = object()


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """The argument parser of benchmark ``name`` (its module under :mod:`relserve.loadtest.bench`)."""
    return argparse.ArgumentParser(prog=f"{PROG}.{name}", description=description)


def add_common_args(ap: argparse.ArgumentParser, *, threads: Any = _UNSET, threads_help: str | None = None,
                    repeats: Any = _UNSET, repeats_help: str | None = None, warmup: Any = _UNSET,
                    warmup_help: str | None = None, json: str | None = None, json_help: str | None = None) -> None:
    """Add the common arguments a benchmark takes: each one whose default is given (``None`` is a default), with
    that default and help. ``json="file"`` adds ``--json FILE``, ``json="print"`` a switch (see :func:`emit_json`)."""
    if threads is not _UNSET:
        ap.add_argument("--threads", type=int, default=threads, help=threads_help)
    if repeats is not _UNSET:
        ap.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    if warmup is not _UNSET:
        ap.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    if json == "file":
        ap.add_argument("--json", metavar="FILE", help=json_help or "also write the summary here")
    elif json == "print":
        ap.add_argument("--json", action="store_true", help=json_help or "also print the results as JSON lines")
    elif json is not None:
        raise ValueError(f"json must be 'file', 'print' or None, not {json!r}")


def fill_defaults(args: argparse.Namespace, *, quick: Mapping[str, Any],
                  full: Mapping[str, Any]) -> argparse.Namespace:
    """Give each argument in ``quick`` / ``full`` (those of ``--quick`` or of a full run, as ``args.quick`` says)
    that was left ``None`` on the command line its value there; a value given on the command line stays.
    Returns ``args``, changed in place."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for the figures a benchmark prints: they hold for that CPU only."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid`` now, sorted (Linux ``/proc/<pid>/task/*/children``: every thread's list,
    since the server starts its workers from several threads). A thread or process that ends meanwhile adds
    none; a process that is gone has none."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return sorted(out)


def time_call(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes (wall clock)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (allocations, kernel choice)."""
    for _ in range(warmup):
        fn()
    return statistics.median(time_call(fn) for _ in range(repeats))


def interleaved(paths: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 0) -> dict[str, list[float]]:
    """Seconds of each path in ``repeats`` rounds that run every path once, after ``warmup`` untimed rounds.

    Round r starts at path r mod len(paths) (with two paths: the order alternates), so a change in the machine's
    load during the run falls on every path alike."""
    names = list(paths)
    for _ in range(warmup):
        for name in names:
            paths[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            times[name].append(time_call(paths[name]))
    return times


def medians(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The median of each path's samples."""
    return {name: statistics.median(v) for name, v in samples.items()}


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing or ``den`` is zero."""
    if num is None or not den:
        return None
    return num / den


def fmt_ratio(value: float | None, digits: int = 2) -> str:
    """A side-by-side ratio as printed: ``1.23x``; ``-`` when there is none."""
    return "-" if value is None else f"{value:.{digits}f}x"


def side_by_side_table(title: str, figures: Mapping[str, Mapping[str, float]], key_width: int = 34) -> list[str]:
    """The lines of a side-by-side table: ``figures`` is variant -> figure name -> value (the first variant's
    figure names make the rows); one column per variant, then each later variant's ratio to the first
    (``-`` where a value or the first one is missing or zero)."""
    labels = list(figures)
    if not labels:
        return []
    first = figures[labels[0]]
    heads = labels + [f"{label}/{labels[0]}" for label in labels[1:]]
    w = max(12, *(len(h) for h in heads)) + 2
    lines = [f"{title:{key_width}s}" + "".join(f"{h:>{w}s}" for h in heads)]
    for key in first:
        row = [figures[label].get(key) for label in labels]
        lines.append(f"{key:{key_width}s}" + "".join(f"{v:{w}.2f}" if v is not None else f"{'-':>{w}s}" for v in row)
                     + "".join(f"{r:{w}.2f}" if (r := ratio(v, row[0])) is not None else f"{'-':>{w}s}"
                               for v in row[1:]))
    return lines


def json_line(result: Any) -> str:
    """One result as one line of JSON (values JSON cannot hold are written as strings)."""
    return json.dumps(result, default=str)


def write_json(path: str | Path, summary: Any) -> Path:
    """Write ``summary`` to ``path`` as indented JSON; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def emit_json(args: argparse.Namespace, results: Sequence[Any], summary: Any = None) -> None:
    """Report as ``--json`` asks: a file name writes ``summary`` (``{"results": results}`` when None) there, the
    switch prints one JSON line per result, absent does nothing."""
    target = getattr(args, "json", None)
    if not target:
        return
    if target is True:
        for result in results:
            print(json_line(result), flush=True)
    else:
        write_json(target, {"results": list(results)} if summary is None else summary)
