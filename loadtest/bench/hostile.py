"""Hostile and heavy traffic: what one maximal request costs the rest of the server.

    python -m relserve.loadtest.bench.hostile                          # default models, default limits
    python -m relserve.loadtest.bench.hostile --model-option max_request_chars=8388608 \\
        --max-message-bytes 8388608                                    # the same requests past the char limit

Each scenario starts ``relserve serve`` with the default models (``defaults/``) as a child process on free
loopback ports, and while it sends its hostile request(s), a probe process calls ``grpc.health.v1 Check``
every ``--probe-interval`` seconds (10 ms) on its own channel. A probe's latency is the time the server's
event loop needed to answer it, so the largest one is how long the request stalled the loop (a Kubernetes
readiness probe fails at 2 s). Scenarios (one function each, ``SCENARIOS``):

* ``classify-words``   — one Classify with a ``--size``-byte text of repeated short words;
* ``classify-prose``   — one Classify with ``--size`` bytes (UTF-8) of real prose (``loadtest/data`` XQuAD contexts);
* ``classify-nospace`` — one Classify with ``--size`` bytes and no whitespace (no word boundary to cut at);
* ``qa-context``       — one Answer with a ``--size``-byte prose context;
* ``translate-prose``  — one Translate with ``--size`` bytes of German prose (skipped without a
  translation model);
* ``cross-model``      — six concurrent ``classify-prose`` requests while a small Translate (or, without a
  translation model, a small Answer) on another model is timed back to back: its worst latency;
* ``overload`` (item 5; starts its own servers, sentiment model only) — capacity with 8 closed-loop clients,
  then 64 clients in separate processes that retry every RESOURCE_EXHAUSTED after the server's
  ``grpc-retry-pushback-ms`` (and, for comparison, after a fixed 50 ms) against ``max_queue_size`` 8, with
  one and four texts per request: goodput, goodput / capacity (target >= 0.8), the rejection time at the
  server p50 / p99 (``relserve_rejection_duration_seconds``, target p99 < 10 ms) and the cores used; the
  goodput ratio is also given per server CPU-second (capacity and overload run at different moments, and
  on a shared machine other jobs take different shares of the cores in each). Last, the gRPC call floor: the
  server and client CPU of a health Check that does nothing, and each overload run's refusals/s times it (a
  refusal cannot cost less, so that share of the cores is lost to the retry storm whatever the server does).
  ``--quick``: 6 s windows; ``--overload-duration``: the window otherwise (30 s).
* ``switch-interval`` (opt-in: ``--only switch-interval``) — ``overload`` with one text per request, once per
  ``--switch-intervals`` value of the server's GIL switch interval, for ``--rounds`` rounds in turn: the
  medians side by side and their ratios to the first (default: Python's 5000 us, the server's default, against 10 us).
* ``worker-process`` (opt-in: ``--only worker-process``) — ``overload`` with one and four texts per request,
  the model in the server's process (``worker_process=false``) and in a worker process (``true``), for
  ``--rounds`` rounds in turn: the medians side by side, their ratios, and each one's goodput / capacity.

Prints, per scenario: the hostile request's status and wall time, the worst and 99th-percentile probe
latency, the ratio worst probe / the 50 ms target, the median over ``--repeat`` requests of the worst probe
during each (one-off scheduling noise on a busy machine shows in the max, not in the median), and the worst
probe of one idle second just before (the machine's own noise); writes ``<out>/bench_hostile.json``. ``--size``
defaults to 4 MiB minus 1 KiB, the largest text a default 4 MiB message carries. One run each on a shared
machine: read the figures as orders of magnitude.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc

from . import harness
from ..scenarios import _jsonl
from ..serverproc import ServerProcess

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SIZE = 4 * 1024 * 1024 - 1024
STALL_TARGET_S = 0.050


def _probe_loop(target: str, interval: float, timeout: float, stop, out) -> None:
    """The probe process: health Check every ``interval`` s until ``stop`` is set; sends ([(monotonic start,
    latency)], failures) (CLOCK_MONOTONIC is system-wide, so the parent can place the samples in time)."""
    latencies: list[tuple[float, float]] = []
    failures = 0
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)  # connected before measuring
        out.send("ready")
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            except grpc.RpcError:
                failures += 1
            latencies.append((t0, time.monotonic() - t0))
            stop.wait(interval)
    out.send((latencies, failures))


class HealthProbe:
    """A separate process calling health Check every ``interval`` seconds (its own interpreter, so the client
    threads sending the hostile requests cannot delay it through this process's GIL); ``latencies`` in seconds
    (a failed or timed-out call counts with its elapsed time, and in ``failures``)."""

    def __init__(self, target: str, interval: float = 0.010, timeout: float = 10.0) -> None:
        self.target, self.interval, self.timeout = target, interval, timeout
        self.latencies: list[float] = []
        self.samples: list[tuple[float, float]] = []  # (monotonic start, latency)
        self.failures = 0
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._conn, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_probe_loop, args=(target, interval, timeout, self._stop, child), daemon=True)

    def __enter__(self) -> "HealthProbe":
        self._proc.start()
        if not self._conn.poll(60) or self._conn.recv() != "ready":
            raise RuntimeError("health probe process did not start")
        time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.1)
        self._stop.set()
        if self._conn.poll(self.timeout + 5):
            self.samples, self.failures = self._conn.recv()
            self.latencies = [lat for _, lat in self.samples]
        self._proc.join(5)

    def worst_between(self, t0: float, t1: float) -> float:
        """The slowest probe that was in flight at some point between monotonic times ``t0`` and ``t1``."""
        return max((lat for start, lat in self.samples if start <= t1 and start + lat >= t0), default=0.0)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies) or [0.0]
        return {"probes": len(self.latencies), "failures": self.failures, "max_s": lat[-1],
                "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "p50_s": statistics.median(lat)}


# ---------------------------------------------------------------------------------------------- texts

def _prose(size: int, field: str = "context", name: str = "qa_dev.jsonl") -> str:
    rows = [r[field] for r in _jsonl(name)]
    out, n = [], 0
    while n < size:
        for r in rows:
            out.append(r)
            n += len(r) + 1
            if n >= size:
                break
    # at most ``size`` UTF-8 bytes, so the request fits the message limit the size was chosen for
    return " ".join(out).encode("utf-8")[:size].decode("utf-8", errors="ignore")


def _words(size: int) -> str:
    return ("good movie " * (size // 11 + 1))[:size]


def _german(size: int) -> str:
    return _prose(size, "source", "de_en_dev.jsonl")


# ---------------------------------------------------------------------------------------------- calls

def _timed(call: Callable[[], Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        reply = call()
        code, details = "OK", ""
    except grpc.RpcError as err:
        reply, code, details = None, err.code().name, (err.details() or "")[:200]
    out: dict[str, Any] = {"code": code, "seconds": time.perf_counter() - t0}
    if details:
        out["details"] = details
    if reply is not None and hasattr(reply, "results") and reply.results and hasattr(reply.results[0], "truncated"):
        out["truncated"], out["num_tokens"] = reply.results[0].truncated, reply.results[0].num_tokens
    if reply is not None and hasattr(reply, "num_windows"):
        out["num_windows"] = reply.num_windows
    return out


def _one_request(srv: ServerProcess, args: argparse.Namespace, make: Callable[[Any], Callable[[], Any]]
                 ) -> dict[str, Any]:
    channel = grpc.insecure_channel(srv.target, options=_channel_options(args))
    stub = pb_grpc.InferenceStub(channel)
    try:
        with HealthProbe(srv.target, args.probe_interval) as idle:  # the same probe with nothing else to do
            time.sleep(1.0)
        windows = []
        with HealthProbe(srv.target, args.probe_interval) as probe:
            for _ in range(args.repeat):
                t0 = time.monotonic()
                result = _timed(make(stub))
                windows.append((t0, time.monotonic()))
        per_request = [probe.worst_between(*w) for w in windows]
        return {"request": result, "health": {**probe.summary(), "per_request_max_s": per_request},
                "health_idle": idle.summary()}
    finally:
        channel.close()


def _channel_options(args: argparse.Namespace) -> list[tuple[str, int]]:
    n = args.max_message_bytes or 4 * 1024 * 1024
    return [("grpc.max_send_message_length", n), ("grpc.max_receive_message_length", n)]


# ---------------------------------------------------------------------------------------------- scenarios

def classify_words(srv: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    text = _words(args.size)
    return _one_request(srv, args, lambda stub: lambda: stub.Classify(
        pb.ClassifyRequest(model="sentiment", texts=[text]), timeout=args.timeout))


def classify_prose(srv: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    text = _prose(args.size)
    return _one_request(srv, args, lambda stub: lambda: stub.Classify(
        pb.ClassifyRequest(model="sentiment", texts=[text]), timeout=args.timeout))


def classify_nospace(srv: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    text = ("abcdefghij" * (args.size // 10 + 1))[:args.size]
    return _one_request(srv, args, lambda stub: lambda: stub.Classify(
        pb.ClassifyRequest(model="sentiment", texts=[text]), timeout=args.timeout))


def qa_context(srv: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    context = _prose(args.size)
    return _one_request(srv, args, lambda stub: lambda: stub.Answer(
        pb.AnswerRequest(model="qa", question="Who won the game?", context=context), timeout=args.timeout))


def translate_prose(srv: ServerProcess, args: argparse.Namespace) -> dict[str, Any] | None:
    if not _has_translation():
        return None
    text = _german(args.size)
    return _one_request(srv, args, lambda stub: lambda: stub.Translate(
        pb.TranslateRequest(model="translate-de-en", texts=[text]), timeout=args.timeout))


def cross_model(srv: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    """Six concurrent maximal Classify requests; meanwhile a small request on another model, back to back."""
    text = _prose(args.size)
    channel = grpc.insecure_channel(srv.target, options=_channel_options(args))
    stub = pb_grpc.InferenceStub(channel)
    if _has_translation():
        small, victim = (lambda: stub.Translate(pb.TranslateRequest(model="translate-de-en", texts=["Guten Morgen."]),
                                                timeout=args.timeout)), "translate-de-en"
    else:
        small, victim = (lambda: stub.Answer(pb.AnswerRequest(model="qa", question="Who?", context="Ann lives here."),
                                             timeout=args.timeout)), "qa"
    idle = [_timed(small)["seconds"] for _ in range(10)]
    latencies: list[float] = []
    try:
        with HealthProbe(srv.target, args.probe_interval) as probe, ThreadPoolExecutor(6) as pool:
            hostile = [pool.submit(_timed, lambda: stub.Classify(pb.ClassifyRequest(model="sentiment", texts=[text]),
                                                                  timeout=args.timeout)) for _ in range(6)]
            while not all(f.done() for f in hostile):
                latencies.append(_timed(small)["seconds"])
            results = [f.result() for f in hostile]
        return {"request": {"codes": sorted({r["code"] for r in results}),
                            "seconds": max(r["seconds"] for r in results)},
                "victim": victim, "victim_idle_p50_s": statistics.median(idle),
                "victim_max_s": max(latencies or [0.0]), "victim_calls": len(latencies),
                "health": probe.summary()}
    finally:
        channel.close()


# ---------------------------------------------------------------------------------------------- overload (item 5)

OVERLOAD_QUEUE_SIZE = 8        # max_queue_size of the overloaded server (units)
CAPACITY_CLIENTS = 8           # closed-loop clients that saturate the sentiment model
OVERLOAD_CLIENTS = 64          # 8x that, each retrying after every RESOURCE_EXHAUSTED
GOODPUT_TARGET = 0.80          # goodput / capacity
REJECTION_P99_TARGET_S = 0.010  # at the server, arrival to status


def overload(args: argparse.Namespace, server_flags: tuple[str, ...] = (), texts_options: tuple[int, ...] = (1, 4),
             floor: bool = True) -> dict[str, Any]:
    """Capacity (``CAPACITY_CLIENTS`` closed-loop clients, default queue) against goodput when
    ``OVERLOAD_CLIENTS`` clients retry after each RESOURCE_EXHAUSTED (``max_queue_size`` 8 units, or with
    ``--queue-requests N`` N requests' worth: N x texts per request), with one and with four texts per request;
    the retrying clients wait the server's ``grpc-retry-pushback-ms`` (or 50 ms without one), and, for
    comparison, a fixed 50 ms. Clients run in ``--client-processes`` processes (``loadtest/retrying.py``); the
    rejection time is read from the server's ``relserve_rejection_duration_seconds`` histogram. Starts a
    capacity server and one overloaded server per queue size (sentiment model only), each with
    ``server_flags`` added; ``texts_options``: the texts per request to run; ``floor``: also measure the call
    floor and each run's goodput ceiling.

    Why ``--queue-requests``: a queue of 8 units holds two 4-text requests, so the overloaded server's batches
    take at most 8 texts while the capacity run (8 clients x 4 texts, default queue) forms larger ones; on
    a CPU where small batches cost more per text (bfloat16: 84 texts/s at 4 per call against 136 at 8, one
    thread, the default sentiment model) that difference, not the refusals, is then most of the gap."""
    from ..retrying import ClientSpec, call_floor, run_clients

    duration, warmup = (6.0, 1.5) if args.quick else (args.overload_duration, 4.0)
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    opts = "".join(f",{o}" for o in args.model_option)
    model = f"sentiment={REPO / 'defaults' / 'sentiment'}{opts}"

    def spec(target: str, clients: int, texts: int, honour: bool = True) -> Any:
        return ClientSpec(target, "sentiment", clients=clients, duration=duration, warmup=warmup,
                          texts_per_request=texts, honour_pushback=honour, timeout=30.0)

    # the overloaded server's max_queue_size per texts-per-request: OVERLOAD_QUEUE_SIZE units (the issue's
    # repro), or --queue-requests requests' worth of units (the same number of requests for every size)
    queue_requests = getattr(args, "queue_requests", None)
    queue_sizes = {t: queue_requests * t if queue_requests else OVERLOAD_QUEUE_SIZE for t in texts_options}
    out: dict[str, Any] = {"duration_s": duration, "queue_size": queue_sizes, "runs": {}}
    runs = out["runs"]
    with ServerProcess(["--model", model, "--drain-timeout", "2", *server_flags], env=env) as srv:
        for texts in texts_options:
            runs[f"capacity-{texts}"] = run_clients(spec(srv.target, CAPACITY_CLIENTS, texts),
                                                     processes=args.client_processes, metrics_url=srv.metrics_url)
            _print_overload_run(f"capacity-{texts}", runs[f"capacity-{texts}"])
    for size in sorted(set(queue_sizes.values())):
        with ServerProcess(["--model", f"{model},max_queue_size={size}", "--drain-timeout", "2", *server_flags],
                           env=env) as srv:
            _overload_runs(args, srv, [t for t in texts_options if queue_sizes[t] == size], spec, runs)
            if floor and size == max(queue_sizes.values()):
                # What the refusals cost at the least: a health Check that does nothing, on the same (now idle) server
                out["call_floor"] = call_floor(srv.target, srv.metrics_url, duration=2.0 if args.quick else 5.0)
    if not floor:
        return out
    figures = out["call_floor"]
    per_call_s = (figures["server_us_per_call"] + figures["client_us_per_call"]) / 1e6
    print(f"{'grpc call floor':28s} a call that does nothing: server {figures['server_us_per_call']:.0f} us + client "
          f"{figures['client_us_per_call']:.0f} us CPU ({figures['calls_per_s']:.0f} calls/s from 16 callers)",
          flush=True)
    cores = multiprocessing.cpu_count()
    for name, r in runs.items():
        if name.startswith("overload-"):
            r["refusal_floor_cores"] = r["rejections_per_s"] * per_call_s
            r["goodput_ceiling"] = goodput_ceiling(runs[f"capacity-{r['texts_per_request']}"], r["refusal_floor_cores"],
                                                   cores)
            ceiling = "n/a" if r["goodput_ceiling"] is None else f"{r['goodput_ceiling']:.2f}"
            print(f"{'':28s} {name}: {r['rejections_per_s']:.0f} refusals/s x floor = "
                  f"{r['refusal_floor_cores']:.2f} of {cores} cores; goodput / capacity can be at most {ceiling} "
                  f"(measured {r['goodput_over_capacity']:.2f})", flush=True)
    return out


def _overload_runs(args: argparse.Namespace, srv: ServerProcess, texts_options: list[int], spec: Callable[..., Any],
                   runs: dict[str, Any]) -> None:
    """The retrying-client runs of :func:`overload` on one overloaded server: per texts-per-request, clients
    that honour the pushback and clients that wait a fixed 50 ms; each against its ``capacity-<texts>`` run."""
    from ..retrying import run_clients

    for texts in texts_options:
        for honour in (True, False):
            name = f"overload-{texts}-{'pushback' if honour else 'fixed50ms'}"
            runs[name] = run_clients(spec(srv.target, OVERLOAD_CLIENTS, texts, honour),
                                     processes=args.client_processes, metrics_url=srv.metrics_url)
            capacity = runs[f"capacity-{texts}"]["goodput_rps"]
            runs[name]["goodput_over_capacity"] = runs[name]["goodput_rps"] / capacity if capacity else None
            # the same per CPU-second the server got: other jobs on a shared machine move both runs' cores
            runs[name]["goodput_over_capacity_per_core"] = _per_core(runs[name], runs[f"capacity-{texts}"])
            _print_overload_run(name, runs[name])


def side_by_side(args: argparse.Namespace, variants: dict[str, tuple[tuple[str, ...], tuple[str, ...]]],
                 texts_options: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """The ``overload`` scenario (capacity, then 64 retrying clients with pushback and with a fixed 50 ms) once
    per variant, in turn for ``--rounds`` rounds: the median over rounds of each figure side by side, its
    ratio to the first variant's, and each variant's goodput / capacity. ``variants``: label ->
    ``(server flags, per-model options)`` added to the scenario's own."""
    labels = list(variants)
    figures = {label: collections.defaultdict(list) for label in labels}
    for round_ in range(args.rounds):
        for label, (flags, options) in variants.items():
            print(f"-- {label}, round {round_ + 1} of {args.rounds}", flush=True)
            run_args = argparse.Namespace(**{**vars(args), "model_option": [*args.model_option, *options]})
            runs = overload(run_args, flags, texts_options=texts_options, floor=False)["runs"]
            for name, r in runs.items():
                figures[label][f"{name} req/s"].append(r["goodput_rps"])
                server = r.get("server", {})
                if server.get("mean_batch_s") is not None:
                    figures[label][f"{name} batch ms"].append(server["mean_batch_s"] * 1000)
                if server.get("cpu_cores") is not None:
                    figures[label][f"{name} server cores"].append(server["cpu_cores"])
    medians = {label: harness.medians(f) for label, f in figures.items()}
    for line in harness.side_by_side_table("median over rounds", medians):
        print(line, flush=True)
    for label in labels:
        m = medians[label]
        for texts in texts_options:
            cap = m.get(f"capacity-{texts} req/s")
            if cap:
                print(f"{label:20s} {texts} text(s): fixed-50ms goodput / capacity = "
                      f"{m.get(f'overload-{texts}-fixed50ms req/s', 0) / cap:.2f}, pushback "
                      f"{m.get(f'overload-{texts}-pushback req/s', 0) / cap:.2f} (target >= {GOODPUT_TARGET:.2f})",
                      flush=True)
    return {"variants": labels, "rounds": args.rounds, "figures": figures, "medians": medians}


def switch_interval(args: argparse.Namespace) -> dict[str, Any]:
    """The GIL switch interval's effect (:func:`side_by_side`): one variant per ``--switch-intervals`` value
    (microseconds, the server's ``--gil-switch-interval-us``), one text per request."""
    return side_by_side(args, {f"{us:g} us": (("--gil-switch-interval-us", f"{us:g}"), ()) for us in
                               args.switch_intervals})


def worker_process(args: argparse.Namespace) -> dict[str, Any]:
    """The model in the server's process against in a worker process (``worker_process`` false / true;
    :func:`side_by_side`), one and four texts per request."""
    return side_by_side(args, {"in-process": ((), ("worker_process=false",)),
                               "worker": ((), ("worker_process=true",))}, texts_options=(1, 4))


def _intervals(text: str) -> list[float]:
    """``--switch-intervals``: comma-separated microseconds, each within the server's limits."""
    from relserve.service.config import MAX_SWITCH_INTERVAL_US

    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
    if not values or not all(1.0 <= v <= MAX_SWITCH_INTERVAL_US for v in values):
        raise argparse.ArgumentTypeError(f"each interval must be between 1 and {MAX_SWITCH_INTERVAL_US:.0f} us")
    return values


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def goodput_ceiling(capacity: dict[str, Any], refusal_floor_cores: float, cores: int) -> float | None:
    """The most goodput / capacity an overload run can reach when its refusals cost the call floor: the cores
    left after the refusals, over the cores (server + clients) the capacity run used for its successes.

    An upper bound: it assumes a success costs no more under the storm than at capacity. Capped at 1 (a
    capacity run that did not fill the cores). None without the server's CPU figure."""
    server_cores = capacity.get("server", {}).get("cpu_cores")
    if not server_cores:
        return None
    used = server_cores + capacity["client_cpu_s"] / capacity["client_window_s"]
    return min(1.0, max(0.0, cores - refusal_floor_cores) / used)


def _per_core(run: dict[str, Any], capacity: dict[str, Any]) -> float | None:
    cores = [x.get("server", {}).get("cpu_cores") for x in (run, capacity)]
    if not all(cores) or not capacity["goodput_rps"]:
        return None
    return (run["goodput_rps"] / cores[0]) / (capacity["goodput_rps"] / cores[1])


def _print_overload_run(name: str, r: dict[str, Any]) -> None:
    server = r.get("server", {})
    rej = server.get("rejection_s", {})
    line = (f"{name:28s} {r['clients']:3d} clients x {r['texts_per_request']} text(s): "
            f"{r['goodput_rps']:7.1f} req/s OK, {r['rejections_per_s']:7.1f} rejections/s, "
            f"latency p50 {_ms_or(r['latency_s']['p50'])} p99 {_ms_or(r['latency_s']['p99'])}")
    if "goodput_over_capacity" in r and r["goodput_over_capacity"] is not None:
        line += (f"\n{'':28s} goodput / capacity = {r['goodput_over_capacity']:.2f} "
                 f"(target >= {GOODPUT_TARGET:.2f})")
        if r.get("goodput_over_capacity_per_core") is not None:
            line += f"; per server CPU-second {r['goodput_over_capacity_per_core']:.2f}"
    if r["rejected"]:
        p99 = rej.get("p99")
        line += (f"\n{'':28s} rejection at the server p50 {_ms_or(rej.get('p50'), 2)} p99 {_ms_or(p99, 2)}"
                 + (f" (p99 / 10 ms target = {p99 / REJECTION_P99_TARGET_S:.2f})" if p99 is not None else "")
                 + f"; at the client p50 {_ms_or(r['client_rejection_latency_s']['p50'], 2)}"
                 f" p99 {_ms_or(r['client_rejection_latency_s']['p99'], 2)}; pushback p50 "
                 f"{_ms_or(r['pushback_s']['p50'])} on {r['pushback_s']['replies_with_trailer']} of "
                 f"{r['rejected']} refusals; {r['mean_attempts_per_ok'] or 0:.2f} attempts per OK")
    if server.get("cpu_cores") is not None:
        worker = (f" (of which the worker process {server['worker_cpu_cores']:.2f})"
                  if server.get("worker_cpu_cores") is not None else "")
        line += (f"\n{'':28s} server CPU {server['cpu_cores']:.2f} cores{worker}, clients "
                 f"{r['client_cpu_s'] / r['client_window_s']:.2f} cores; mean batch {server['mean_batch_size'] or 0:.1f} "
                 f"units in {_ms_or(server['mean_batch_s'])}")
    if r["other_errors"]:
        line += f"\n{'':28s} other errors {r['other_errors']}"
    print(line, flush=True)


def _ms_or(seconds: float | None, digits: int = 1) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f} ms"


SCENARIOS: dict[str, Callable[[ServerProcess, argparse.Namespace], dict[str, Any] | None]] = {
    "classify-words": classify_words,
    "classify-prose": classify_prose,
    "classify-nospace": classify_nospace,
    "qa-context": qa_context,
    "translate-prose": translate_prose,
    "cross-model": cross_model,
}
# scenarios that start their own server(s) with their own settings
OWN_SERVER_SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "overload": overload,
    "switch-interval": switch_interval,
    "worker-process": worker_process,
}
OPT_IN_SCENARIOS = ("switch-interval", "worker-process")  # run only when named with --only


def _has_translation() -> bool:
    return (REPO / "defaults" / "translate-de-en" / "config.json").is_file()


def _server_args(args: argparse.Namespace) -> list[str]:
    out = ["--drain-timeout", "2"]
    if args.max_message_bytes:
        out += ["--max-message-bytes", str(args.max_message_bytes)]
    if args.model_option:
        opts = "," + ",".join(args.model_option)
        models = [("sentiment", "sentiment"), ("qa", "qa")]
        if _has_translation():
            models.append(("translate-de-en", "translate-de-en"))
        for name, sub in models:
            out += ["--model", f"{name}={REPO / 'defaults' / sub}{opts}"]
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("hostile", __doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted([*SCENARIOS, *OWN_SERVER_SCENARIOS]), action="append",
                    help="run only these scenarios")
    ap.add_argument("--quick", action="store_true", help="overload: 6 s windows (about 1.5 min in all)")
    ap.add_argument("--overload-duration", type=float, default=30.0, help="overload: seconds per measured window")
    ap.add_argument("--client-processes", type=int, default=4, help="overload: client processes (default 4)")
    ap.add_argument("--size", type=int, default=DEFAULT_SIZE,
                    help=f"UTF-8 bytes per hostile text (default {DEFAULT_SIZE})")
    ap.add_argument("--repeat", type=int, default=3, help="hostile requests per single-request scenario (default 3)")
    ap.add_argument("--probe-interval", type=float, default=0.010, help="seconds between health Checks (default 0.01)")
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline of each hostile request (s)")
    ap.add_argument("--max-message-bytes", type=int, default=None, help="server and client message limit")
    ap.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                    help="per-model option added to every default model (repeatable), e.g. max_request_chars=8388608")
    harness.add_common_args(ap, threads=1, threads_help="OMP_NUM_THREADS of the server (default 1)")
    ap.add_argument("--queue-requests", type=_positive_int, default=None, metavar="N",
                    help="overload: the overloaded server's max_queue_size holds N requests (N x texts per request "
                         f"units) instead of {OVERLOAD_QUEUE_SIZE} units whatever the request size")
    ap.add_argument("--switch-intervals", default="5000,10", metavar="US,US...", type=_intervals,
                    help="switch-interval: the --gil-switch-interval-us values to compare (default 5000,10: "
                         "Python's own, the server's default, and the value that helps encoders most)")
    ap.add_argument("--rounds", type=_positive_int, default=2,
                    help="switch-interval, worker-process: rounds over the variants (default 2)")
    ap.add_argument("--out", default="loadtest-results", help="directory for bench_hostile.json")
    args = ap.parse_args(argv)
    names = args.only or [n for n in (*SCENARIOS, *OWN_SERVER_SCENARIOS) if n not in OPT_IN_SCENARIOS]
    report: dict[str, Any] = {"machine": platform.platform(), "size": args.size, "model_options": args.model_option,
                              "max_message_bytes": args.max_message_bytes, "scenarios": {}}
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    for name in names:
        if name in OWN_SERVER_SCENARIOS:  # prints its own lines
            report["scenarios"][name] = OWN_SERVER_SCENARIOS[name](args)
            continue
        with ServerProcess(_server_args(args), env=env) as srv:
            res = SCENARIOS[name](srv, args)
        if res is None:
            print(f"{name:18s} skipped (no translation model)")
            continue
        report["scenarios"][name] = res
        req, health = res["request"], res["health"]
        line = (f"{name:18s} {req.get('code', req.get('codes'))!s:22s} request {_ms(req['seconds']):>9s}  "
                f"health max {_ms(health['max_s']):>8s} p99 {_ms(health['p99_s']):>7s} "
                f"({health['probes']} probes, {health['failures']} failed)  "
                f"max / 50 ms target = {health['max_s'] / STALL_TARGET_S:.2f}")
        if "per_request_max_s" in health:
            worst = health["per_request_max_s"]
            line += f"  worst probe per request: median {_ms(statistics.median(worst))} of {len(worst)}"
        if "health_idle" in res:
            line += f"  (idle: max {_ms(res['health_idle']['max_s'])})"
        if "truncated" in req:
            line += f"  truncated={req['truncated']} num_tokens={req['num_tokens']}"
        if "victim_max_s" in res:
            line += (f"  {res['victim']} small call: idle p50 {_ms(res['victim_idle_p50_s'])}, worst during "
                     f"{_ms(res['victim_max_s'])} ({res['victim_max_s'] / max(res['victim_idle_p50_s'], 1e-9):.1f}x)")
        if req.get("details"):
            line += f"\n{'':18s} {req['details']}"
        print(line, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    harness.write_json(out / "bench_hostile.json", report)
    print(f"wrote {out / 'bench_hostile.json'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
