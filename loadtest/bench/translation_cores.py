"""Translation on every core: the in-process decode loop (``worker_process: false``) against decode worker
processes (``worker_process: true``), side by side in one run, at saturation.

    python -m relserve.loadtest.bench.translation_cores                         # defaults/translate-de-en
    python -m relserve.loadtest.bench.translation_cores --duration 8 --warmup 2 --repeats 1   # short
    python -m relserve.loadtest.bench.translation_cores --decode-instances 1,2 --json

Each mode is a ``relserve serve`` process of its own (``loadtest/serverproc.py``) serving the one model, both up
at once and idle while the other is measured; the load generator is this process: ``--clients`` closed-loop
callers (64) sending one short sentence per ``Translate`` call (beam ``--beam-size``, 5; n_best 1), drawn
seeded from the Tatoeba dev split (``../shared/data/translation/tatoeba_de_en_dev.jsonl``; in a fresh clone
the committed sample ``loadtest/data/tatoeba_de_en_dev.jsonl``). The modes take turns in ``--repeats``
slices (ABBA...) so that a change in background load falls on both. Per mode: sentences/s over the counted
seconds, p50/p99, errors, the CPU the server's processes used (the server and its decode workers, from
/proc, over the slice) in cores, and their resident memory after it. Then the ratio worker / in-process with
PASS/MISS against the target (>= 1.5x, 0 errors, p99 no worse) and the load average of the machine, since on
shared cores every figure moves with what else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Callable

from . import harness
from ..serverproc import ServerProcess
from .translation import DEFAULT_MODEL, EVERYDAY, REPO, _percentile, _saturate, pooled

SHARED_TATOEBA = REPO.parent / "shared" / "data" / "translation" / "tatoeba_de_en_dev.jsonl"
TARGET_RATIO = 1.5


def load_short_sentences(path: Path | None, limit: int) -> tuple[list[str], Path]:
    """The first ``limit`` sources of ``path``, else of the shared Tatoeba dev split, else of the committed
    sample."""
    for p in ([path] if path else [SHARED_TATOEBA, EVERYDAY]):
        if p is not None and p.is_file():
            rows = [json.loads(line)["source"] for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
            if rows:
                return rows[:limit], p
    raise SystemExit(f"no sentences: neither {SHARED_TATOEBA} nor {EVERYDAY} exists")


def _tree_sum(pid: int, read: Callable[[int], float]) -> float:
    """``read(p)`` summed over process ``pid`` and its descendants now; a process that ends meanwhile (its /proc
    files unreadable or cut short) counts nothing, and neither do its children."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += read(p)
        except (OSError, IndexError, ValueError):
            continue
        todo.extend(harness.child_pids(p))
    return total


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_bytes(pid: int) -> float:
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its descendants now (Linux /proc)."""
    return _tree_sum(pid, _cpu_s)


def tree_rss_mb(pid: int) -> float:
    """Resident MiB of process ``pid`` and its descendants now (Linux /proc statm)."""
    return _tree_sum(pid, _rss_bytes) / (1 << 20)


def _merge(slices: list[dict]) -> dict:
    seconds, latencies, errors = pooled(slices)
    return {"sentences_per_s": sum(r["completed"] for r in slices) / seconds,
            "p50_s": _percentile(latencies, 50), "p99_s": _percentile(latencies, 99), "errors": errors,
            "server_cores": sum(r["cpu_s"] for r in slices) / sum(r["wall_s"] for r in slices),
            "slice_rate": [round(r["completed"] / r["seconds"], 1) for r in slices],
            "server_rss_mb": max(r["rss_mb"] for r in slices)}


def run(args) -> dict:
    sentences, source = load_short_sentences(args.data, args.sentences)
    model = args.model or DEFAULT_MODEL
    common = f"beam_size={args.beam_size},max_queue_size=100000"
    modes = {"in-process": f"worker_process=false,{common}"}
    for n in args.decode_instances:
        modes[f"workers x{n or 'cores'}"] = f"worker_process=true,decode_instances={n},{common}"
    print(f"model {model}; {len(sentences)} sentences from {source}; {args.clients} clients, beam {args.beam_size}; "
          f"{args.repeats} x ({args.warmup:g} s warm-up + {args.duration:g} s counted) per mode", flush=True)
    servers: dict[str, ServerProcess] = {}
    slices: dict[str, list[dict]] = {m: [] for m in modes}
    load_before = os.getloadavg()
    try:
        for name, spec in modes.items():
            servers[name] = ServerProcess(["--model", f"mt={model},{spec}", *args.server_args.split()],
                                          start_timeout=600).start()
        order = list(modes)
        for rep in range(args.repeats):
            for name in (order if rep % 2 == 0 else order[::-1]):
                srv = servers[name]
                cpu0, t0 = tree_cpu_s(srv.pid), time.monotonic()
                r = asyncio.run(_saturate(srv.port, sentences, args.clients, args.duration, args.warmup,
                                          args.beam_size, 1, args.seed + rep, args.timeout))
                r["cpu_s"], r["wall_s"] = tree_cpu_s(srv.pid) - cpu0, time.monotonic() - t0
                r["rss_mb"] = tree_rss_mb(srv.pid)
                slices[name].append(r)
    finally:
        for name, srv in servers.items():
            if any(r["errors"] for r in slices[name]):  # why: what the calls heard, and the server's own log
                print(f"{name}: " + "; ".join(f"{k}: {v}" for r in slices[name] for k, v in r["error_details"].items()))
                warned = [line for line in srv.log_text().splitlines() if " WARNING " in line or " ERROR " in line]
                print(f"{name}: the server's warnings ({len(warned)}):\n  " + "\n  ".join(warned[:12]), flush=True)
            srv.close()
    load_after = os.getloadavg()
    out = {"modes": {name: _merge(s) for name, s in slices.items()}, "cpu_count": os.cpu_count(),
           "loadavg_before": load_before, "loadavg_after": load_after, "sentences": str(source)}
    base = out["modes"]["in-process"]
    print(f"{'mode':<16} {'sent/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'cores':>6} {'RSS MiB':>8}  errors  slices")
    for name, r in out["modes"].items():
        print(f"{name:<16} {r['sentences_per_s']:8.1f} {r['p50_s'] * 1000:8.0f} {r['p99_s'] * 1000:8.0f} "
              f"{r['server_cores']:6.2f} {r['server_rss_mb']:8.0f}  {r['errors'] or '-'}  {r['slice_rate']}")
    out["ratios"] = {}
    for name, r in out["modes"].items():
        if name == "in-process":
            continue
        ratio = r["sentences_per_s"] / max(base["sentences_per_s"], 1e-9)
        ok = ratio >= TARGET_RATIO and not r["errors"] and r["p99_s"] <= base["p99_s"]
        out["ratios"][name] = ratio
        print(f"{name} / in-process: x{ratio:.2f} sentences/s, p99 x{r['p99_s'] / base['p99_s']:.2f}, "
              f"{sum(r['errors'].values())} errors -> {'PASS' if ok else 'MISS'} (target >= {TARGET_RATIO}x, "
              f"0 errors, p99 no worse)")
    print(f"load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
          f"{'/'.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help=f"RNNsearch checkpoint dir (default {DEFAULT_MODEL})")
    ap.add_argument("--data", type=Path, help="JSON lines with 'source' (default: shared Tatoeba dev, else sample)")
    ap.add_argument("--sentences", type=int, default=2000, help="how many of the file's sentences are drawn from")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--beam-size", type=int, default=5)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds counted per slice")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds per slice before counting starts")
    ap.add_argument("--repeats", type=int, default=2, help="slices per mode (the modes take turns)")
    ap.add_argument("--decode-instances", type=lambda v: [int(x) for x in v.split(",")], default=[0],
                    help="decode_instances of the worker modes, comma-separated (0: one per core)")
    ap.add_argument("--server-args", default="", help="more `relserve serve` flags for both servers, one string")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="per-call deadline, seconds")
    ap.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
