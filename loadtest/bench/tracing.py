"""What OpenTelemetry tracing costs a serving process: the same closed-loop load on a server with tracing off and on
one with tracing on (``--otlp-endpoint`` pointing at an OTLP/HTTP receiver run in this process), side by side.

    python -m relserve.loadtest.bench.tracing                       # about 75 s: 3 rounds of 10 s per server
    python -m relserve.loadtest.bench.tracing --seconds 5 --rounds 2 --clients 4 --json out.json

Starts two ``relserve serve`` processes with the sentiment default model on free loopback ports, both for the
whole run (the idle one costs nothing), and measures them in alternating rounds so that drift in the machine's
load hits both alike. Every call carries a W3C ``traceparent``, so the traced server records the full set of spans
(call, tokenize, queue, batch with its links). ``--clients`` threads call Classify (one short text) back to back.
The receiver decodes nothing: it answers 200 and counts the requests and bytes it received (what a collector's
network receiver costs the server is its export, which happens in the server's own exporter thread).

Prints requests/s, p50 / p99 latency and the server process's CPU milliseconds per request (its own CPU from
/proc, worker processes not included: where the tracing hooks and the exporter run) per server, and the traced
server's ratio to the untraced one (with no endpoint configured tracing costs nothing; this says what it costs
when on). On a machine shared with other jobs the CPU per request is the steadiest of the four.
Needs the ``[otel]`` extra (``make serve`` installs it).
"""

from __future__ import annotations

import http.server
import os
import statistics
import threading
import time
from pathlib import Path

import grpc

from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc

from . import harness
from ..serverproc import ServerProcess

REPO = Path(__file__).resolve().parents[2]
REQUEST = pb.ClassifyRequest(model="sentiment", texts=["a good film with a slow middle"])
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Receiver:
    """A local OTLP/HTTP endpoint that accepts every export and counts it."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.exports += 1
                receiver.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def closed_loop(target: str, clients: int, seconds: float) -> list[float]:
    """``clients`` threads calling Classify back to back for ``seconds``; the latencies (seconds) of the calls
    that succeeded. A failed call raises in its thread and is counted out."""
    latencies: list[float] = []
    lock = threading.Lock()
    failures = [0]
    end = time.monotonic() + seconds

    def client() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            mine = []
            while time.monotonic() < end:
                t0 = time.perf_counter()
                try:
                    stub.Classify(REQUEST, timeout=30, metadata=(("traceparent", TRACEPARENT),))
                except grpc.RpcError:
                    failures[0] += 1
                    continue
                mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures[0]:
        print(f"  {failures[0]} calls failed")
    return latencies


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc; its worker processes not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def figures(latencies: list[float], seconds: float, cpu: float) -> dict[str, float]:
    """requests/s, p50 and p99 latency (ms) of the successful calls over ``seconds`` of load, and the server
    process's CPU milliseconds per call (``cpu`` seconds in all): the last is what tracing adds to the process,
    and the figure least moved by other jobs on a shared machine."""
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")
    return {"requests/s": len(ordered) / seconds, "p50 ms": statistics.median(ordered) * 1e3 if ordered else 0.0,
            "p99 ms": p99 * 1e3, "server CPU ms / request": cpu * 1e3 / len(ordered) if ordered else 0.0}


class _Context:
    """The part of a grpc.aio servicer context the call hook reads."""

    def __init__(self, metadata: tuple) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple:
        return self._metadata


def hook_cost(receiver_url: str, calls: int) -> dict[str, float]:
    """Microseconds of this process's CPU per call spent in the tracing hooks a traced Classify passes (the call
    span from gRPC metadata, tokenization, the request handle at submit, its queue and batch spans, the call's
    end), with tracing off, then on against ``receiver_url`` (the export to it included: the provider is flushed
    before the clock stops). In-process, so other jobs on the machine barely move it."""
    import contextvars

    from relserve.service import tracing

    context = _Context((("traceparent", TRACEPARENT), ("user-agent", "grpc-python")))
    attrs = {"relserve.model": "m", "relserve.backend": "torch", "relserve.dtype": "float32",
             "relserve.batch.size": 1, "relserve.batch.real_tokens": 9, "relserve.batch.padded_tokens": 9}

    def one() -> None:  # the hooks in the order a call meets them (grpc_transport, runner, batcher)
        call = tracing.begin_grpc("Classify", "grpc_v1", context)
        t0 = time.monotonic()
        if tracing.ENABLED:
            tracing.record("relserve.tokenize", t0, t0 + 1e-4, {"relserve.model": "m"})
        trace = tracing.request("m", t0) if tracing.ENABLED else None
        if tracing.ENABLED:
            tracing.backend_call([trace], t0 + 2e-4, t0 + 1e-3, attrs)
        if call is not None:
            call.end("m", "OK")

    def timed() -> float:
        start = time.process_time()
        for i in range(calls):
            contextvars.copy_context().run(one)  # each call in a context of its own, as each gRPC call's task
            if tracing.ENABLED and i % 200 == 199:  # the processor's queue (2048 spans) must not overflow
                tracing._provider.force_flush()
        if tracing.ENABLED:
            tracing._provider.force_flush()
        return (time.process_time() - start) / calls * 1e6

    off = timed()
    tracing.configure(receiver_url, {})
    try:
        timed()  # the exporter's first connection
        on = timed()
    finally:
        tracing.shutdown()
    return {"tracing off": off, "tracing on": on}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("tracing", __doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8, help="closed-loop client threads (default 8)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds per round and server (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per server (default 3)")
    ap.add_argument("--model", default=str(REPO / "defaults" / "sentiment"), help="classification checkpoint")
    ap.add_argument("--hook-calls", type=int, default=5000, help="calls through the hooks in-process (default 5000)")
    harness.add_common_args(ap, threads=None, threads_help="OMP_NUM_THREADS of the servers (default: unset)",
                            json="file")
    args = ap.parse_args(argv)
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    clean = {k: "" for k in os.environ if k.startswith("OTEL_EXPORTER_OTLP")}  # the off server must stay off
    receiver = Receiver()
    model = ["--model", f"sentiment={args.model}"]
    servers = {"tracing off": ServerProcess(model, env={**env, **clean}, start_timeout=300),
               "tracing on": ServerProcess([*model, "--otlp-endpoint", receiver.url], env={**env, **clean},
                                           start_timeout=300)}
    samples: dict[str, list[float]] = {label: [] for label in servers}
    cpu = dict.fromkeys(servers, 0.0)
    try:
        for srv in servers.values():
            srv.start()
        for label, srv in servers.items():  # warm-up: first calls, and the exporter's first connection
            closed_loop(srv.target, args.clients, 1.0)
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for label in order:
                before = cpu_seconds(servers[label].pid)
                samples[label].extend(closed_loop(servers[label].target, args.clients, args.seconds))
                cpu[label] += cpu_seconds(servers[label].pid) - before
    finally:
        for srv in servers.values():
            srv.stop()
            srv.close()
    measured = args.seconds * args.rounds
    table = {label: figures(lat, measured, cpu[label]) for label, lat in samples.items()}
    print(f"{args.clients} closed-loop clients, {args.rounds} x {args.seconds:g} s per server, model {args.model}, "
          f"CPU {harness.cpu_name()}, {os.cpu_count()} cores")
    for line in harness.side_by_side_table("Classify, one short text", table):
        print(line)
    print(f"OTLP receiver: {receiver.exports} exports, {receiver.bytes / 1e6:.2f} MB")
    try:
        hooks = hook_cost(receiver.url, args.hook_calls)
    finally:
        receiver.close()
    print(f"the tracing hooks of one call, in-process, {args.hook_calls} calls: {hooks['tracing off']:.1f} us CPU off, "
          f"{hooks['tracing on']:.1f} us on ({harness.fmt_ratio(harness.ratio(hooks['tracing on'], hooks['tracing off']))})")
    if args.json:
        harness.write_json(args.json, {"clients": args.clients, "seconds": args.seconds, "rounds": args.rounds,
                                       "figures": table, "exports": receiver.exports, "bytes": receiver.bytes,
                                       "hook_us": hooks})
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
