"""HTTP floods against a real server: what idle, slow and large-body HTTP clients cost the gRPC port.

    python -m relserve.loadtest.bench.http_flood                       # about a minute
    python -m relserve.loadtest.bench.http_flood --nofile 1024 --connections 1500 --duration 6 --json out.json

Starts ``relserve serve`` with the sentiment default model and ``--http-port`` on free loopback ports, its
open-files limit set to ``--nofile`` (soft and hard, as a container's ``ulimit -n``) so that the flood can
outnumber the process's descriptors. Each phase lasts ``--duration`` seconds, while a probe process
(:class:`.hostile.HealthProbe`) calls ``grpc.health.v1 Check`` every ``--probe-interval`` seconds and a thread
of this process calls Classify (one short text) back to back:

* ``baseline``   — nothing else;
* ``idle-flood`` — ``--connections`` HTTP connections that send nothing; each one the server closes is opened
  again (a hostile client keeps the pressure up);
* ``slow-flood`` — as many connections, each sending one byte of a never-ending request head every second;
* ``large-body`` — ``--body-clients`` clients posting ``--body-bytes`` of JSON (a list of one-character texts,
  refused as too many texts) to ``/v1/classify`` back to back.

Prints, per phase: gRPC health p50 / p99 / max and failed probes, Classify successes / calls, the flood's
connections opened and seen closed by the server, the large-body replies by status, and the server's
threads and open descriptors at the phase's end (``/proc``); last, the log lines the server wrote about
accept errors and refused connections. Loopback only; every phase is bounded in time and connections.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import selectors
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc
from relserve.service.frontends.http_guard import raise_open_files_limit

from . import harness
from .hostile import HealthProbe
from ..serverproc import ServerProcess

REPO = Path(__file__).resolve().parents[2]
PHASES = ("baseline", "idle-flood", "slow-flood", "large-body")
# the server's own command, run after setting its descriptor limit (a container's ulimit -n)
_LIMITED = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n})); "
            "sys.argv = ['relserve', *sys.argv[1:]]; runpy.run_module('relserve.service.main', run_name='__main__')")


class _LimitedServer(ServerProcess):
    """``relserve serve`` with RLIMIT_NOFILE ``nofile`` (soft and hard)."""

    def __init__(self, args: list[str], nofile: int, **kw: Any) -> None:
        super().__init__(args, **kw)
        self.nofile = nofile

    def command(self) -> list[str]:
        cmd = super().command()  # [python, -m, relserve.service.main, serve, ...]
        return [cmd[0], "-c", _LIMITED.format(n=self.nofile), *cmd[3:]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Flood:
    """``count`` connections to ``port`` kept open for the phase (reopened when the server closes one); with
    ``trickle``, each sends one more byte of a request head every second."""

    def __init__(self, port: int, count: int, trickle: bool) -> None:
        self.port, self.count, self.trickle = port, count, trickle
        self.opened = self.closed_by_server = self.connect_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Flood":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)

    def _open(self, sel: selectors.BaseSelector) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
        except OSError:
            self.connect_errors += 1
            return
        sock.setblocking(False)
        if self.trickle:
            sock.send(b"GET /v2/health/live HTTP/1.1\r\n")
        sel.register(sock, selectors.EVENT_READ)
        self.opened += 1

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        last_trickle = time.monotonic()
        try:
            while not self._stop.is_set():
                while len(sel.get_map()) < self.count and not self._stop.is_set():
                    before = self.connect_errors
                    self._open(sel)
                    if self.connect_errors > before:
                        break  # the backlog is full: try again on the next round
                for key, _ in sel.select(timeout=0.05):
                    sock = key.fileobj
                    try:
                        gone = not sock.recv(4096)  # type: ignore[union-attr]
                    except BlockingIOError:
                        gone = False
                    except OSError:
                        gone = True
                    if gone:
                        sel.unregister(sock)
                        sock.close()  # type: ignore[union-attr]
                        self.closed_by_server += 1
                if self.trickle and time.monotonic() - last_trickle >= 1.0:
                    last_trickle = time.monotonic()
                    for key in list(sel.get_map().values()):
                        try:
                            key.fileobj.send(b"X")  # type: ignore[union-attr]
                        except OSError:
                            pass
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            sel.close()


class LargeBodies:
    """``clients`` threads posting ``body`` to ``/v1/classify`` back to back; replies counted by status."""

    def __init__(self, port: int, clients: int, body: bytes) -> None:
        self.port, self.body = port, body
        self.statuses: collections.Counter = collections.Counter()
        self.seconds: list[float] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> "LargeBodies":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self) -> None:
        while not self._stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            t0 = time.monotonic()
            try:
                conn.request("POST", "/v1/classify", self.body, {"Content-Type": "application/json"})
                reply = conn.getresponse()
                reply.read()
                self.statuses[reply.status] += 1
            except OSError as exc:
                self.statuses[type(exc).__name__] += 1
            finally:
                conn.close()
            self.seconds.append(time.monotonic() - t0)


class Classifier:
    """Classify calls back to back on the gRPC port (one short text, 5 s deadline): successes and calls."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.ok = self.calls = 0
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Classifier":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)
        self.channel.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.calls += 1
            try:
                self.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=["a good film"]), timeout=5)
                self.ok += 1
            except grpc.RpcError:
                pass
            self.latencies.append(time.monotonic() - t0)
            time.sleep(0.01)


def _proc_counts(pid: int) -> dict[str, int]:
    """The server's threads and open descriptors now."""
    try:
        return {"threads": len(os.listdir(f"/proc/{pid}/task")), "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except OSError:
        return {}


def run_phase(name: str, srv: ServerProcess, http_port: int, args: Any) -> dict[str, Any]:
    """One phase (``PHASES``) of ``args.duration`` seconds; its figures."""
    out: dict[str, Any] = {"phase": name}
    body = json.dumps({"model": "sentiment", "texts": ["a"] * max(1, (args.body_bytes - 40) // 4)},
                      separators=(",", ":")).encode()  # 4 bytes a text
    with HealthProbe(srv.target, args.probe_interval) as probe, Classifier(srv.target) as classify:
        load: Any = None
        if name in ("idle-flood", "slow-flood"):
            load = Flood(http_port, args.connections, trickle=name == "slow-flood")
        elif name == "large-body":
            load = LargeBodies(http_port, args.body_clients, body)
        if load is not None:
            load.__enter__()
        try:
            time.sleep(args.duration)
            out["server"] = _proc_counts(srv.pid)
        finally:
            if load is not None:
                load.__exit__(None, None, None)
    out["health"] = probe.summary()
    out["classify"] = {"ok": classify.ok, "calls": classify.calls,
                       "p50_s": statistics.median(classify.latencies) if classify.latencies else None}
    if isinstance(load, Flood):
        out["flood"] = {"connections": args.connections, "opened": load.opened,
                        "closed_by_server": load.closed_by_server, "connect_errors": load.connect_errors}
    elif isinstance(load, LargeBodies):
        out["large_body"] = {"bytes": len(body), "statuses": {str(k): v for k, v in load.statuses.items()},
                             "p50_s": statistics.median(load.seconds) if load.seconds else None}
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _print(r: dict[str, Any]) -> None:
    h, c = r["health"], r["classify"]
    line = (f"{r['phase']:11s} health p50 {_ms(h['p50_s']):>9s} p99 {_ms(h['p99_s']):>9s} max {_ms(h['max_s']):>9s} "
            f"({h['probes']} probes, {h['failures']} failed)  Classify {c['ok']}/{c['calls']} ok, "
            f"p50 {_ms(c['p50_s'])}")
    if "flood" in r:
        f = r["flood"]
        line += (f"  flood: {f['opened']} opened, {f['closed_by_server']} closed by the server, "
                 f"{f['connect_errors']} connect errors")
    if "large_body" in r:
        b = r["large_body"]
        line += f"  bodies of {b['bytes']} B: {b['statuses']}, p50 {_ms(b['p50_s'])}"
    if r.get("server"):
        line += f"  server: {r['server'].get('threads')} threads, {r['server'].get('fds')} fds"
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("http_flood", __doc__.split("\n")[0])
    ap.add_argument("--only", choices=PHASES, action="append", help="run only these phases (default: all)")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per phase (default 8)")
    ap.add_argument("--connections", type=int, default=1500, help="flood connections (default 1500)")
    ap.add_argument("--nofile", type=int, default=1024,
                    help="the server's RLIMIT_NOFILE, soft and hard (default 1024: the flood outnumbers it)")
    ap.add_argument("--body-clients", type=int, default=2, help="large-body clients (default 2)")
    ap.add_argument("--body-bytes", type=int, default=4_000_000, help="bytes per large body (default 4000000)")
    ap.add_argument("--probe-interval", type=float, default=0.010, help="seconds between health Checks (0.01)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra `relserve serve` argument (repeatable), e.g. --server-arg=--http-port ...")
    harness.add_common_args(ap, threads=1, threads_help="OMP_NUM_THREADS of the server (default 1)", json="file")
    args = ap.parse_args(argv)
    phases = args.only or list(PHASES)
    _, soft, _ = raise_open_files_limit()  # this process holds the flood's sockets
    if soft < args.connections + 256:
        ap.error(f"this process may open {soft} files; --connections {args.connections} needs more")
    http_port = _free_port()
    server_args = ["--model", f"sentiment={REPO / 'defaults' / 'sentiment'}", "--http-port", str(http_port),
                   "--http-host", "127.0.0.1", "--drain-timeout", "2", *args.server_arg]
    print(f"{harness.cpu_name()}; server RLIMIT_NOFILE {args.nofile}; {args.connections} flood connections; "
          f"{args.duration:g} s per phase", flush=True)
    results = []
    with _LimitedServer(server_args, args.nofile, env={"OMP_NUM_THREADS": str(args.threads)},
                        start_timeout=300) as srv:
        for name in phases:
            result = run_phase(name, srv, http_port, args)
            results.append(result)
            _print(result)
            time.sleep(1.0)  # the flood's connections are gone before the next phase
        log_lines = [line for line in srv.log_text().splitlines()
                     if "accept" in line or "refused a connection" in line or "open-files" in line
                     or "open files" in line]
    print(f"server log lines about descriptors, accept errors and refusals: {len(log_lines)}")
    for line in log_lines[:12]:
        print("  " + line[:240])
    harness.emit_json(args, results, {"cpu": harness.cpu_name(), "nofile": args.nofile, "results": results,
                                      "log_lines": log_lines})
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
