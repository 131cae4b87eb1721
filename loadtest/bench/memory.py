"""Resident memory of the default server (the server process and its worker processes) after warm-up and after a
short mixed load, with where it goes per process.

    python -m relserve.loadtest.bench.memory                              # the default server, 60 s of mix
    python -m relserve.loadtest.bench.memory --load-s 20 --clients 4       # shorter
    python -m relserve.loadtest.bench.memory --server-args "--model sentiment=defaults/sentiment"

``relserve serve`` (``--server-args``; default: no flags, the built-in default models) runs as a child process
on free loopback ports. Once it serves, every process of its tree (the server and its descendants) is read from
``/proc/<pid>/smaps_rollup``: RSS (what ``top`` shows; a page shared by two processes counts in both), PSS (each
shared page divided among the processes that map it: PSS summed over the tree is what the tree costs the
machine), and PSS split into anonymous memory (heap, tensors, arenas) and file-backed pages (shared libraries:
torch's ``libtorch_cpu.so`` alone maps 325 MB, a few MB of it resident; memory-mapped weights), with each
process's own peak RSS since it started (``VmHWM``: loading and the dtype gate included). Then ``--clients``
closed-loop clients send ``relserve loadtest``'s ``mix`` scenario (classify 0.6, qa 0.3, translate 0.1 over the
models the server lists) for ``--load-s`` seconds, and the tree is read again; the peak of the summed PSS and RSS
over the run is sampled every ``--sample-s``. Targets (issue "less memory per model"): at most 1.2 GB after
warm-up and 1.5 GB after the load, summed PSS (GB = 10^9 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import harness
from ..serverproc import ServerProcess

GB = 1e9
MB = 1e6
TARGET_WARM_GB = 1.2
TARGET_LOADED_GB = 1.5
_FIELD = re.compile(rb"^(\w+):\s+(\d+) kB", re.M)
_HWM = re.compile(rb"^VmHWM:\s+(\d+) kB", re.M)


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants now (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(harness.child_pids(p))
    return out


def process_memory(pid: int) -> dict[str, Any] | None:
    """One process's memory in bytes, from ``/proc/<pid>/smaps_rollup``: ``rss``, ``pss``, ``pss_anon``,
    ``pss_file`` (file-backed PSS: libraries, mapped weights), ``uss`` (private pages); ``peak_rss``, the
    largest RSS it has had since it started (``VmHWM`` of ``/proc/<pid>/status``: loading and the dtype gate
    included); and its command line's role (``server`` / ``worker`` / the module it runs). None when the
    process is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            fields = {k.decode(): int(v) * 1024 for k, v in _FIELD.findall(f.read())}
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/status", "rb") as f:
            hwm = _HWM.search(f.read())
    except OSError:
        return None
    if "Pss" not in fields:
        return None
    pss_anon = fields.get("Pss_Anon", 0) + fields.get("Pss_Shmem", 0)
    return {"pid": pid, "role": _role(cmd), "rss": fields.get("Rss", 0), "pss": fields["Pss"],
            "pss_anon": pss_anon, "pss_file": fields.get("Pss_File", fields["Pss"] - pss_anon),
            "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
            "peak_rss": int(hwm.group(1)) * 1024 if hwm else 0}


def _role(cmd: str) -> str:
    if "relserve.service.main" in cmd or " serve " in f" {cmd} ":
        return "server"
    m = re.search(r"-m (\S+)", cmd)
    if m:
        return m.group(1).rsplit(".", 1)[-1]
    if "resource_tracker" in cmd:
        return "tracker"  # multiprocessing's resource tracker, started with the first worker
    if "multiprocessing" in cmd or "spawn_main" in cmd:
        return "worker"
    return cmd.split(" ", 1)[0].rsplit("/", 1)[-1] or "?"


def snapshot(pid: int) -> dict[str, Any]:
    """Every process of ``pid``'s tree (:func:`process_memory`) and their sums (``total_*``)."""
    procs = [m for m in (process_memory(p) for p in tree(pid)) if m is not None]
    out: dict[str, Any] = {"processes": procs}
    for key in ("rss", "pss", "pss_anon", "pss_file", "uss", "peak_rss"):
        out[f"total_{key}"] = sum(p[key] for p in procs)
    return out


def fmt(snap: dict[str, Any]) -> str:
    """Totals and one line per process, MB."""
    lines = [f"total PSS {snap['total_pss'] / MB:.0f} MB (anonymous {snap['total_pss_anon'] / MB:.0f}, file-backed "
             f"{snap['total_pss_file'] / MB:.0f}), total RSS {snap['total_rss'] / MB:.0f} MB (the processes' own "
             f"peaks summed: {snap['total_peak_rss'] / MB:.0f} MB), "
             f"{len(snap['processes'])} processes"]
    for p in snap["processes"]:
        lines.append(f"    {p['role']:<12} pid {p['pid']:<7} RSS {p['rss'] / MB:6.0f}  PSS {p['pss'] / MB:6.0f}  "
                     f"(anon {p['pss_anon'] / MB:5.0f}, file {p['pss_file'] / MB:5.0f})  USS {p['uss'] / MB:6.0f}  "
                     f"peak RSS {p['peak_rss'] / MB:6.0f}")
    return "\n".join(lines)


def mixed_load(srv: ServerProcess, seconds: float, clients: int, out_dir: Path, seed: int = 0) -> dict[str, Any]:
    """``relserve loadtest run --scenario mix`` against ``srv`` for ``seconds`` with ``clients`` closed-loop
    clients (a child process: its memory is not the server's); returns its summary numbers."""
    cmd = [sys.executable, "-m", "relserve.loadtest", "run", "--target", srv.target, "--scenario", "mix",
           "--concurrency", str(clients), "--duration", str(seconds), "--seed", str(seed), "--out", str(out_dir),
           "--name", "memory-mix", "--no-plots", "--no-progress", "--timeout", "120"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 600)
    result: dict[str, Any] = {"rc": proc.returncode, "seconds": time.monotonic() - t0}
    path = out_dir / "memory-mix.json"
    if path.is_file():
        data = json.loads(path.read_text())
        for key in ("requests", "successes", "errors", "throughput_rps"):
            if key in data:
                result[key] = data[key]
    if proc.returncode != 0:
        result["stderr_tail"] = (proc.stderr or proc.stdout)[-2000:]
    return result


def measure(server_args: list[str], load_s: float, clients: int, sample_s: float = 0.5,
            start_timeout: float = 900.0, log=print) -> dict[str, Any]:
    """Start the server, snapshot after warm-up (it serves once every model has warmed), run the mixed load while
    sampling the peak, snapshot after it. Returns ``{"warm", "loaded", "peak_pss", "peak_rss", "load", ...}``."""
    import tempfile

    res: dict[str, Any] = {"server_args": server_args, "loadavg_before": os.getloadavg()}
    with ServerProcess([*server_args, "--drain-timeout", "5"], start_timeout=start_timeout) as srv, \
            tempfile.TemporaryDirectory(prefix="relserve-bench-memory-") as tmp:
        time.sleep(1.0)  # the worker processes' last warm-up replies are in; let their threads settle
        res["warm"] = snapshot(srv.pid)
        log(f"after warm-up: {fmt(res['warm'])}")
        peak = {"pss": res["warm"]["total_pss"], "rss": res["warm"]["total_rss"]}
        stop = threading.Event()

        def sampler() -> None:
            while not stop.wait(sample_s):
                s = snapshot(srv.pid)
                peak["pss"], peak["rss"] = max(peak["pss"], s["total_pss"]), max(peak["rss"], s["total_rss"])

        if load_s > 0:
            t = threading.Thread(target=sampler, daemon=True)
            t.start()
            res["load"] = mixed_load(srv, load_s, clients, Path(tmp))
            stop.set()
            t.join()
            time.sleep(1.0)
            res["loaded"] = snapshot(srv.pid)
            log(f"after {load_s:g} s of mixed load ({clients} clients; {_load_line(res['load'])}): "
                f"{fmt(res['loaded'])}")
        res["peak_pss"], res["peak_rss"] = peak["pss"], peak["rss"]
    res["loadavg_after"] = os.getloadavg()
    return res


def _load_line(load: dict[str, Any]) -> str:
    if load.get("rc"):
        return f"loadtest exited {load['rc']}: {load.get('stderr_tail', '')[-300:]}"
    parts = [f"{k} {load[k]:.1f}" if isinstance(load[k], float) else f"{k} {load[k]}"
             for k in ("successes", "errors", "throughput_rps") if k in load]
    return ", ".join(parts) or "no summary"


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The memory targets this run measured (summed PSS, GB): name, measured, limit, PASS / MISS."""
    rows = []
    for key, limit, name in (("warm", TARGET_WARM_GB, "memory after warm-up (server + workers, PSS GB)"),
                             ("loaded", TARGET_LOADED_GB, "memory after the mixed load (server + workers, PSS GB)")):
        if key in res:
            v = res[key]["total_pss"] / GB
            rows.append({"target": name, "measured": v, "threshold": limit,
                         "verdict": "PASS" if v <= limit else "MISS"})
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = harness.parser("memory", __doc__.split("\n\n")[0])
    ap.add_argument("--server-args", default="", help="`relserve serve` flags, one string (default: none)")
    ap.add_argument("--load-s", type=float, default=60.0, help="seconds of mixed load (0: warm-up only)")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients of the mixed load")
    ap.add_argument("--sample-s", type=float, default=0.5, help="seconds between peak samples")
    harness.add_common_args(ap, json="file")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(f"CPU {harness.cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; server "
          f"`relserve serve {args.server_args}`", flush=True)
    res = measure(args.server_args.split(), args.load_s, args.clients, args.sample_s)
    print(f"peak over the run: PSS {res['peak_pss'] / MB:.0f} MB, RSS {res['peak_rss'] / MB:.0f} MB; load average "
          f"{res['loadavg_before'][0]:.2f} -> {res['loadavg_after'][0]:.2f}")
    for t in targets(res):
        print(f"  {t['target']:<60} {t['measured']:6.3f} <= {t['threshold']:.2f}  {t['verdict']}")
    if args.json:
        harness.write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
