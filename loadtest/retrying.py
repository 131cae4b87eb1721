"""Closed-loop Classify clients in separate processes that retry after RESOURCE_EXHAUSTED (overload runs).

    result = run_clients(ClientSpec(target, "sentiment", clients=64, duration=30), processes=4,
                         metrics_url=srv.metrics_url)

Each client sends a request, waits for its answer, and sends the next one. After a RESOURCE_EXHAUSTED it
sends the *same* request again after the server's ``grpc-retry-pushback-ms`` (gRFC A6) when the reply
carries one and ``honour_pushback`` is set, else after ``backoff_s`` (50 ms): the careful client the
overload scenarios assume. Other errors are counted and the client moves on after ``backoff_s``.

Clients run in ``processes`` spawned interpreters (one grpc.aio channel each, the clients split evenly) so
that the load generator is not one Python thread competing with itself; they start together (a barrier,
after every channel is connected) and count only what completes inside the measured window (``warmup``
seconds after the start, ``duration`` long). The parent scrapes the server's ``/metrics`` at both ends of
the window: server-side OK count, the RESOURCE_EXHAUSTED time from the ``relserve_rejection_duration_seconds``
histogram (arrival at the server to status), and the server's CPU seconds.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from . import promscrape

PUSHBACK_TRAILER = "grpc-retry-pushback-ms"


@dataclass(frozen=True)
class ClientSpec:
    """What every client does (see the module docstring)."""

    target: str
    model: str
    clients: int
    duration: float
    warmup: float = 2.0
    texts_per_request: int = 1
    backoff_s: float = 0.050
    honour_pushback: bool = True
    timeout: float = 30.0
    seed: int = 0


def _requests(model: str, texts_per_request: int) -> list[Any]:
    from relserve.service._proto import inference_pb2 as pb

    from .scenarios import sentences

    texts = sentences()
    k = max(1, texts_per_request)
    return [pb.ClassifyRequest(model=model, texts=texts[i:i + k]) for i in range(0, len(texts) - k + 1, k)]


def _pushback_s(err: Any) -> float | None:
    for key, value in err.trailing_metadata() or ():
        if key == PUSHBACK_TRAILER:
            try:
                ms = int(value)
            except ValueError:
                return None
            return ms / 1000.0 if ms >= 0 else None
    return None


async def _clients(spec: ClientSpec, n: int, offset: int, barrier: Any) -> dict[str, Any]:
    import grpc

    from relserve.service._proto import inference_pb2_grpc as pb_grpc

    pool = _requests(spec.model, spec.texts_per_request)
    channel = grpc.aio.insecure_channel(spec.target)
    await asyncio.wait_for(channel.channel_ready(), 30)
    stub = pb_grpc.InferenceStub(channel)
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
    t0 = time.monotonic()
    start = resource.getrusage(resource.RUSAGE_SELF)  # from here: the calls' CPU, not the imports' or connect's
    begin, end = t0 + spec.warmup, t0 + spec.warmup + spec.duration
    out: dict[str, Any] = {"ok": 0, "rejected": 0, "other": {}, "ok_latency_s": [], "reject_latency_s": [],
                           "attempts_per_ok": [], "pushback_s": []}

    def inside(t: float) -> bool:
        return begin <= t <= end

    async def client(i: int) -> None:
        k = (offset + i) * 7919 + spec.seed
        while time.monotonic() < end:
            request = pool[k % len(pool)]
            k += 1
            first, attempts = time.monotonic(), 0
            while time.monotonic() < end:
                attempts += 1
                sent = time.monotonic()
                try:
                    await stub.Classify(request, timeout=spec.timeout)
                except grpc.aio.AioRpcError as err:
                    now = time.monotonic()
                    code = err.code()
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        pushback = _pushback_s(err)
                        if inside(now):
                            out["rejected"] += 1
                            out["reject_latency_s"].append(now - sent)
                            if pushback is not None:
                                out["pushback_s"].append(pushback)
                        delay = pushback if (spec.honour_pushback and pushback is not None) else spec.backoff_s
                        await asyncio.sleep(delay)
                        continue  # the same request again
                    if inside(now):
                        out["other"][code.name] = out["other"].get(code.name, 0) + 1
                    await asyncio.sleep(spec.backoff_s)
                    break
                now = time.monotonic()
                if inside(now):
                    out["ok"] += 1
                    out["ok_latency_s"].append(now - first)
                    out["attempts_per_ok"].append(attempts)
                break

    try:
        await asyncio.gather(*(client(i) for i in range(n)))
    finally:
        await channel.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = (usage.ru_utime + usage.ru_stime) - (start.ru_utime + start.ru_stime)
    return out


def _worker(spec_dict: dict[str, Any], n: int, offset: int, barrier: Any, results: Any) -> None:
    try:
        results.put(asyncio.run(_clients(ClientSpec(**spec_dict), n, offset, barrier)))
    except BaseException as exc:  # report, so the parent does not wait for nothing
        barrier.abort()
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def run_clients(spec: ClientSpec, *, processes: int = 4, metrics_url: str | None = None) -> dict[str, Any]:
    """Run ``spec.clients`` clients in ``processes`` processes; returns the window's figures (rates per second,
    latencies in seconds; server-side figures when ``metrics_url`` is given).

    Raises:
        RuntimeError: a client process failed (its error is in the message).
    """
    processes = max(1, min(processes, spec.clients))
    ctx = multiprocessing.get_context("spawn")  # no fork after grpc started in this process
    barrier = ctx.Barrier(processes + 1)
    results = ctx.Queue()
    per = [spec.clients // processes + (1 if i < spec.clients % processes else 0) for i in range(processes)]
    procs = [ctx.Process(target=_worker, args=(asdict(spec), n, sum(per[:i]), barrier, results), daemon=True)
             for i, n in enumerate(per)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=120)
    except Exception:
        raise RuntimeError(f"client processes did not start: {results.get(timeout=5) if not results.empty() else ''}")
    time.sleep(spec.warmup)
    before = promscrape.scrape(metrics_url) if metrics_url else None
    time.sleep(spec.duration)
    after = promscrape.scrape(metrics_url) if metrics_url else None
    parts = [results.get(timeout=spec.timeout + 60) for _ in procs]
    for p in procs:
        p.join(10)
    errors = [p["error"] for p in parts if "error" in p]
    if errors:
        raise RuntimeError(f"client process failed: {errors[0]}")
    ok = sum(p["ok"] for p in parts)
    rejected = sum(p["rejected"] for p in parts)
    other: dict[str, int] = {}
    for p in parts:
        for code, n in p["other"].items():
            other[code] = other.get(code, 0) + n
    ok_lat = [x for p in parts for x in p["ok_latency_s"]]
    rej_lat = [x for p in parts for x in p["reject_latency_s"]]
    attempts = [x for p in parts for x in p["attempts_per_ok"]]
    pushback = [x for p in parts for x in p["pushback_s"]]
    out: dict[str, Any] = {
        "clients": spec.clients, "processes": processes, "texts_per_request": spec.texts_per_request,
        "duration_s": spec.duration, "honour_pushback": spec.honour_pushback, "backoff_s": spec.backoff_s,
        "ok": ok, "rejected": rejected, "other_errors": other,
        "goodput_rps": ok / spec.duration, "rejections_per_s": rejected / spec.duration,
        "latency_s": {"p50": _quantile(ok_lat, 0.5), "p99": _quantile(ok_lat, 0.99)},
        "client_rejection_latency_s": {"p50": _quantile(rej_lat, 0.5), "p99": _quantile(rej_lat, 0.99)},
        "mean_attempts_per_ok": statistics.fmean(attempts) if attempts else None,
        "pushback_s": {"p50": _quantile(pushback, 0.5), "max": max(pushback) if pushback else None,
                       "replies_with_trailer": len(pushback)},
        "client_cpu_s": sum(p["cpu_s"] for p in parts),  # over client_window_s, all client processes
        "client_window_s": spec.warmup + spec.duration,
    }
    if before is not None and after is not None:
        out["server"] = server_window(before, after, spec.model, spec.duration)
    return out


def server_window(before: promscrape.Snapshot, after: promscrape.Snapshot, model: str,
                  duration: float) -> dict[str, Any]:
    """Server-side figures between two scrapes: OK and RESOURCE_EXHAUSTED counts, the rejection time
    quantiles (arrival to status, from ``relserve_rejection_duration_seconds``; None on a server without
    it), the mean batch size and backend seconds per batch, and the CPU cores the server used (its process and
    the worker processes of ``worker_process`` models; ``worker_cpu_cores`` those alone)."""

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    hist = "relserve_rejection_duration_seconds"
    has_hist = after.has(f"{hist}_count")
    worker_cpu = delta("relserve_worker_cpu_seconds_total")  # worker_process models' children
    cpu = delta("process_cpu_seconds_total") + worker_cpu
    batches = delta("relserve_batch_size_count", model=model)
    return {
        "mean_batch_size": delta("relserve_batch_size_sum", model=model) / batches if batches else None,
        "mean_batch_s": (delta("relserve_inference_duration_seconds_sum", model=model)
                         / max(1.0, delta("relserve_inference_duration_seconds_count", model=model))),
        "ok": int(round(delta("relserve_requests_total", model=model, code="OK"))),
        "rejected": int(round(delta("relserve_requests_total", model=model, code="RESOURCE_EXHAUSTED"))),
        "goodput_rps": delta("relserve_requests_total", model=model, code="OK") / duration,
        "rejection_s": {
            "p50": promscrape.histogram_quantile(before, after, hist, 0.5, model=model) if has_hist else None,
            "p99": promscrape.histogram_quantile(before, after, hist, 0.99, model=model) if has_hist else None,
            "mean": (delta(f"{hist}_sum", model=model) / max(1.0, delta(f"{hist}_count", model=model))
                     if has_hist else None),
        },
        "cpu_cores": cpu / duration if after.has("process_cpu_seconds_total") else None,
        "worker_cpu_cores": worker_cpu / duration if after.has("relserve_worker_cpu_seconds_total") else None,
    }


def call_floor(target: str, metrics_url: str, *, clients: int = 16, duration: float = 4.0) -> dict[str, Any]:
    """The CPU one gRPC round trip costs when it does no work: ``clients`` concurrent callers of
    ``grpc.health.v1.Health/Check`` on one grpc.aio channel for ``duration`` seconds, in this process.

    Returns calls per second, the server's CPU microseconds per call (``process_cpu_seconds_total`` between two
    scrapes) and this client process's (``getrusage``). A refusal cannot cost less than a call that does
    nothing, so refusals/s x (server + client) floor is the share of the cores a retry storm takes whatever
    the server does with the refused requests.

    Raises:
        RuntimeError: no call finished inside the window.
    """
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def run() -> tuple[int, float, float, float]:
        import grpc

        async with grpc.aio.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="")
            await stub.Check(request)
            calls, end = 0, 0.0

            async def caller() -> None:
                nonlocal calls
                while time.monotonic() < end:
                    await stub.Check(request)
                    calls += 1

            before = promscrape.scrape(metrics_url)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.monotonic()
            end = t0 + duration
            await asyncio.gather(*(caller() for _ in range(clients)))
            wall = time.monotonic() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            after = promscrape.scrape(metrics_url)
        client_s = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        server_s = after.get("process_cpu_seconds_total") - before.get("process_cpu_seconds_total")
        return calls, wall, client_s, server_s

    calls, wall, client_s, server_s = asyncio.run(run())
    if not calls:
        raise RuntimeError(f"no health Check finished within {duration} s")
    return {"calls_per_s": calls / wall, "server_us_per_call": server_s / calls * 1e6,
            "client_us_per_call": client_s / calls * 1e6}
