"""Refused gRPC requests must not grow the server: a flood of relserve.v1 Classify calls of ``--texts`` one-character
texts each (1M: 3 MB on the wire), every one refused INVALID_ARGUMENT for ``max_request_texts``, from ``--clients``
closed-loop clients for ``--duration`` seconds, while a prober sends a grpc.health.v1 Check every
``--probe-interval`` seconds and another client a one-text Classify every 0.1 s, each on its own connection.

    python -m relserve.loadtest.bench.grpc_flood                          # 6 clients x 12 s, the sentiment model
    python -m relserve.loadtest.bench.grpc_flood --clients 12 --duration 20
    python -m relserve.loadtest.bench.grpc_flood --target 127.0.0.1:50051 --pid 1234 --model sentiment

Without ``--target`` it starts ``relserve serve`` with ``--server-args`` (default: the ``sentiment`` model of
``defaults/``) on free loopback ports and stops it after. Printed: the server process's RSS (``/proc/<pid>/status``,
sampled every 50 ms) before the flood, its peak during it and 2 s after it, and the growth over the start (the
target: within 300 MB); the refused calls by status; health Check and Classify latency p50 / p99 / max
and their failures. The clients run in this process, one thread and one connection each, sending the same
serialized request bytes (no per-call encoding), so what grows is the server. Only against 127.0.0.1.
"""

from __future__ import annotations

import shlex
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from . import harness
from ..serverproc import ServerProcess

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SERVER_ARGS = f"--model sentiment={REPO / 'defaults' / 'sentiment'}"
TARGET_GROWTH_MB = 300.0  # RSS during 12 s of refused 1M-text requests from 6 clients
SAMPLE_S = 0.05
SETTLE_S = 2.0
CLASSIFY_INTERVAL_S = 0.1  # between the probing Classify calls
SHORT_TEXT = "a short sentence to classify"


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` in MB (``VmRSS`` of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class RssSampler(threading.Thread):
    """Samples :func:`rss_mb` of ``pid`` every :data:`SAMPLE_S` seconds until :meth:`stop`; ``peak`` is the largest."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = rss_mb(pid)
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(SAMPLE_S):
            self.peak = max(self.peak, rss_mb(self.pid))

    def stop(self) -> None:
        self._done.set()
        self.join()


def _channel(target: str) -> Any:
    import grpc

    # one connection per channel (no subchannel sharing between the clients' channels)
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1),
                                                  ("grpc.max_send_message_length", 64 * 1024 * 1024)])


def flood_request(model: str, texts: int) -> bytes:
    """The serialized ``ClassifyRequest`` of ``texts`` one-character texts for ``model``."""
    from relserve.service._proto import inference_pb2 as pb

    return pb.ClassifyRequest(model=model, texts=["x"] * texts).SerializeToString()


def _flooder(target: str, payload: bytes, stop_at: float, codes: dict[str, int], lock: threading.Lock) -> None:
    import grpc

    with _channel(target) as ch:
        classify = ch.unary_unary("/relserve.v1.Inference/Classify")  # bytes in, bytes out: no re-encoding
        while time.monotonic() < stop_at:
            try:
                classify(payload, timeout=30)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            with lock:
                codes[code] = codes.get(code, 0) + 1


def _prober(target: str, kind: str, model: str, interval: float, stop_at: float, out: dict[str, list]) -> None:
    """Closed loop of ``kind`` calls (``health``: grpc.health.v1 Check; ``classify``: one short text) on its own
    connection, ``interval`` seconds apart, until ``stop_at``: latencies into ``out[kind]``, failures into
    ``out[kind + "_errors"]``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from relserve.service._proto import inference_pb2 as pb
    from relserve.service._proto import inference_pb2_grpc as pb_grpc

    with _channel(target) as ch:
        if kind == "health":
            stub, request = health_pb2_grpc.HealthStub(ch).Check, health_pb2.HealthCheckRequest()
        else:
            stub, request = pb_grpc.InferenceStub(ch).Classify, pb.ClassifyRequest(model=model, texts=[SHORT_TEXT])
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            try:
                stub(request, timeout=10)
                out[kind].append(time.perf_counter() - t0)
            except grpc.RpcError as exc:
                out[f"{kind}_errors"].append(exc.code().name)
            time.sleep(interval)


def _latency(samples: list[float]) -> dict[str, float | None]:
    if not samples:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"n": len(samples), "p50_ms": statistics.median(ordered) * 1e3, "p99_ms": p99 * 1e3,
            "max_ms": ordered[-1] * 1e3}


def flood(target: str, pid: int, model: str, *, clients: int, duration: float, texts: int,
          probe_interval: float) -> dict[str, Any]:
    """Run the flood against the server at ``target`` (process ``pid``); returns the figures :func:`main` prints."""
    payload = flood_request(model, texts)
    codes: dict[str, int] = {}
    lock = threading.Lock()
    probes: dict[str, list] = {"health": [], "classify": [], "health_errors": [], "classify_errors": []}
    start_mb = rss_mb(pid)
    sampler = RssSampler(pid)
    sampler.start()
    t0 = time.monotonic()
    stop_at = t0 + duration
    threads = [threading.Thread(target=_flooder, args=(target, payload, stop_at, codes, lock), daemon=True)
               for _ in range(clients)]
    threads += [threading.Thread(target=_prober, args=(target, kind, model, interval, stop_at, probes), daemon=True)
                for kind, interval in (("health", probe_interval), ("classify", CLASSIFY_INTERVAL_S))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    time.sleep(SETTLE_S)
    end_mb = rss_mb(pid)
    sampler.stop()
    refused = sum(n for code, n in codes.items() if code != "OK")
    return {
        "clients": clients, "duration_s": duration, "texts": texts, "request_mb": len(payload) / 1e6,
        "calls": dict(sorted(codes.items())), "refused_per_s": refused / elapsed,
        "rss_start_mb": start_mb, "rss_peak_mb": sampler.peak, "rss_end_mb": end_mb,
        "rss_peak_growth_mb": sampler.peak - start_mb, "rss_end_growth_mb": end_mb - start_mb,
        "health": _latency(probes["health"]), "health_errors": len(probes["health_errors"]),
        "classify": _latency(probes["classify"]), "classify_errors": len(probes["classify_errors"]),
    }


def _fmt_latency(name: str, lat: dict[str, Any], errors: int) -> str:
    if not lat["n"]:
        return f"{name:10s} no answers, {errors} failed"
    return (f"{name:10s} n={lat['n']:4d}  p50 {lat['p50_ms']:7.1f} ms  p99 {lat['p99_ms']:7.1f} ms  "
            f"max {lat['max_ms']:7.1f} ms  failed {errors}")


def print_result(r: dict[str, Any], pid: int) -> None:
    print(f"grpc_flood on {harness.cpu_name()}: {r['clients']} clients x {r['duration_s']:g} s, {r['texts']} texts "
          f"({r['request_mb']:.1f} MB) per Classify, server pid {pid}")
    calls = ", ".join(f"{code} {n}" for code, n in r["calls"].items())
    print(f"flood calls: {calls} ({r['refused_per_s']:.1f} refused/s)")
    verdict = "within" if r["rss_peak_growth_mb"] <= TARGET_GROWTH_MB else "OVER"
    print(f"server RSS MB: start {r['rss_start_mb']:.1f}  peak {r['rss_peak_mb']:.1f} "
          f"(+{r['rss_peak_growth_mb']:.1f}, {verdict} the {TARGET_GROWTH_MB:g} MB target)  "
          f"end {r['rss_end_mb']:.1f} (+{r['rss_end_growth_mb']:.1f}, {SETTLE_S:g} s after)")
    print(_fmt_latency("health", r["health"], r["health_errors"]))
    print(_fmt_latency("classify", r["classify"], r["classify_errors"]))


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("grpc_flood", __doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=6, help="flooding clients, one connection each (default 6)")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds of flood (default 12)")
    ap.add_argument("--texts", type=int, default=1_000_000, help="one-character texts per request (default 1M)")
    ap.add_argument("--probe-interval", type=float, default=0.02,
                    help="seconds between health probes (default 0.02)")
    ap.add_argument("--model", default="sentiment", help="the classification model to call (default sentiment)")
    ap.add_argument("--target", help="HOST:PORT of a running server (with --pid); default: start one")
    ap.add_argument("--pid", type=int, help="the process id of --target's server, for its RSS")
    ap.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                    help=f"relserve serve flags of the server started here (default: {DEFAULT_SERVER_ARGS!r})")
    harness.add_common_args(ap, json="print")
    args = ap.parse_args(argv)
    if args.target and args.pid is None:
        ap.error("--target needs --pid (the server's process id, for its RSS)")
    if args.target and not args.target.startswith(("127.0.0.1:", "localhost:")):
        ap.error("--target must be a loopback address (127.0.0.1:PORT): this is a flood")
    srv = None
    try:
        if args.target:
            target, pid = args.target, args.pid
        else:
            srv = ServerProcess(shlex.split(args.server_args), start_timeout=300).start()
            target, pid = srv.target, srv.pid
            time.sleep(SETTLE_S)  # warm-up's allocations settle before the start figure
        result = flood(target, pid, args.model, clients=args.clients, duration=args.duration, texts=args.texts,
                       probe_interval=args.probe_interval)
    finally:
        if srv is not None:
            srv.close()
    print_result(result, pid)
    harness.emit_json(args, [result])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
