"""Cold start: seconds from ``relserve serve``'s process start to each model's ready and to SERVING health, for a
server that runs the ``dtype: auto`` agreement gate, one whose caches are empty (a fresh clone: the defaults'
shipped decisions apply, nothing else is cached) and one started again on the same cache, printed side by side.

    python -m relserve.loadtest.bench.cold_start [--modes gate,cold,warm] [--runs 1] [--model NAME=DIR[,k=v]]...

Modes (each run in a fresh process, its own temporary ``XDG_CACHE_HOME``, so no mode sees the user's cache):

* ``gate``: ``load_cache: false`` on every model: the gate runs at every start (the old behaviour);
* ``cold``: an empty cache; decisions shipped beside a checkpoint (``dtype_decision.json``) are used;
* ``warm``: the ``cold`` run's cache, reused by a second start.

Per model, the time of its ``model 'NAME': ready in`` log line (the server logs each load phase with its time:
service/backends/progress.py), and ``SERVING``: the first ``grpc.health.v1`` check of the server that answers
SERVING (polled every 50 ms). The machine's load average (1 min) is printed before and after each run: the
figures only mean something on a quiet machine. Models default to the built-in ones (``defaults/``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from . import harness

READY = re.compile(r"model '([^']+)': ready in ")
MODES = ("gate", "cold", "warm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(models: list[dict[str, Any]], gate_cache: bool, path: Path) -> Path:
    entries = [{**m, "load_cache": gate_cache} for m in models]
    path.write_text(yaml.safe_dump({"host": "127.0.0.1", "log_level": "INFO", "models": entries}))
    return path


def _serving(port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def start_once(config: Path, cache_home: Path, timeout: float, log_path: Path) -> dict[str, float]:
    """One server start: ``{model: seconds to its ready line, "SERVING": seconds to SERVING health}``, from
    just before the process was spawned. The server is stopped with SIGTERM afterwards.

    Raises:
        RuntimeError: the server exited or did not serve within ``timeout`` (its log's tail in the message).
    """
    port = _free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "relserve.service.main", "serve", "--config", str(config), "--port", str(port),
           "--metrics-port", "-1"]
    out: dict[str, float] = {}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def read() -> None:
        with open(log_path, "w", buffering=1) as log:  # line by line: a stuck start can be read meanwhile
            for line in proc.stderr:  # type: ignore[union-attr]
                log.write(line)
                m = READY.search(line)
                if m:
                    out[m.group(1)] = time.monotonic() - t0

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                break
            if _serving(port):
                out["SERVING"] = time.monotonic() - t0
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    if "SERVING" not in out:
        raise RuntimeError(f"the server did not serve within {timeout:.0f} s (exit {proc.returncode}); log tail:\n"
                           + log_path.read_text()[-3000:])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("cold_start", __doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--runs", type=int, default=1, help="starts per mode (the median is printed)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR[,key=value...]",
                    help="models to start (repeatable; default: the built-in models)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    harness.add_common_args(ap, json="file")
    args = ap.parse_args(argv)
    from relserve.service.config import load_config

    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes) or ("warm" in modes and "cold" not in modes):
        ap.error(f"--modes: of {', '.join(MODES)}; warm needs cold (it reuses cold's cache)")
    models = [{"name": m.name, "path": str(m.path)} for m in load_config(model_specs=args.model).models]
    print(f"cold start of {', '.join(m['name'] for m in models)} on {harness.cpu_name()}, {os.cpu_count()} CPUs; "
          f"modes {', '.join(modes)}, {args.runs} run(s) each")
    figures: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    loads: dict[str, list[str]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="relserve-cold-") as tmp:
        root = Path(tmp)
        for run in range(args.runs):
            cold_home = root / f"cache-{run}"
            for mode in modes:
                home = root / f"gate-{run}" if mode == "gate" else cold_home
                cfg = _config(models, mode != "gate", root / f"{mode}.yaml")
                before = os.getloadavg()[0]
                result = start_once(cfg, home, args.timeout, root / f"{mode}-{run}.log")
                loads[mode].append(f"{before:.2f}->{os.getloadavg()[0]:.2f}")
                for key, seconds in result.items():
                    figures[mode].setdefault(key, []).append(seconds)
                print(f"run {run + 1} {mode}: " + ", ".join(f"{k} {v:.2f} s" for k, v in result.items())
                      + f" (load average {loads[mode][-1]})", flush=True)
    medians = {mode: {k: statistics.median(v) for k, v in f.items()} for mode, f in figures.items()}
    order = [m["name"] for m in models] + ["SERVING"]
    table = {mode: {k: medians[mode].get(k) for k in order} for mode in modes}
    print()
    for line in harness.side_by_side_table("seconds from process start", table):
        print(line)
    print("load average (1 min) before->after each run: " + "; ".join(f"{m} {' '.join(v)}" for m, v in loads.items()))
    if args.json:
        harness.write_json(args.json, {"modes": modes, "median_seconds": table, "runs": figures, "load_average": loads,
                                       "cpu": harness.cpu_name(), "cpus": os.cpu_count()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
