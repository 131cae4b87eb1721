"""Prometheus metrics: the only module that knows prometheus_client. Base units, ``relserve_`` prefix.

Metrics live in the default registry, so the client's process collector (``process_*``: resident
memory, CPU seconds, open fds) is exposed next to them. They are created once per process at import;
several servers in one process (tests) share them, told apart by the ``model`` label.

Exposed at ``http://<metrics_host>:<metrics_port>/metrics`` by :func:`start_http`, which serves that one
path (every other path is 404: the port is not a health endpoint and must not look like one).
"""

from __future__ import annotations

import gzip
import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs, urlsplit

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

# Buckets, defined once.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# refusals should take well under 10 ms (issue 10's target is p99 < 10 ms): finer steps below that
REJECTION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_TOKENS_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
PADDING_EFFICIENCY_BUCKETS = (0.25, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 1.0)

UNKNOWN_MODEL = "_unknown_"  # label for requests naming a model that is not loaded (bounded cardinality)

REQUESTS = Counter(
    "relserve_requests", "RPCs answered, by status code", ["model", "task", "code"]
)
REQUEST_DURATION = Histogram(
    "relserve_request_duration_seconds", "RPC time from arrival to reply", ["model", "task"],
    buckets=LATENCY_BUCKETS,
)
REJECTION_DURATION = Histogram(
    "relserve_rejection_duration_seconds",
    "RPC time from arrival to a RESOURCE_EXHAUSTED status (queue full or over a size limit)", ["model", "task"],
    buckets=REJECTION_BUCKETS,
)
QUEUE_DURATION = Histogram(
    "relserve_queue_duration_seconds", "Time a sequence waited in the batch queue", ["model"],
    buckets=LATENCY_BUCKETS,
)
INFERENCE_DURATION = Histogram(
    "relserve_inference_duration_seconds", "Backend time per batch", ["model", "backend"],
    buckets=LATENCY_BUCKETS,
)
TOKENIZATION_DURATION = Histogram(
    "relserve_tokenization_duration_seconds", "Tokenization time per request", ["model"],
    buckets=LATENCY_BUCKETS,
)
BATCH_SIZE = Histogram(
    "relserve_batch_size", "Sequences per executed batch", ["model"], buckets=BATCH_SIZE_BUCKETS
)
BATCH_TOKENS = Histogram(
    "relserve_batch_tokens", "Tokens computed per batch (padded: size x longest)", ["model"],
    buckets=BATCH_TOKENS_BUCKETS,
)
TOKENS = Counter(
    "relserve_tokens", "Tokens computed, real or padding", ["model", "kind"]
)
BATCH_PADDING_EFFICIENCY = Histogram(
    "relserve_batch_padding_efficiency",
    "Real tokens / tokens the attention core sees (size x longest on padded backends), per backend call",
    ["model"], buckets=PADDING_EFFICIENCY_BUCKETS,
)
QUEUE_DEPTH = Gauge("relserve_queue_depth", "Sequences waiting in the batch queue", ["model"])
INFLIGHT = Gauge("relserve_inflight_requests", "RPCs being processed", ["model"])
DECODE_STEPS = Counter("relserve_decode_steps", "Decoder steps executed (translation)", ["model"])
GENERATED_TOKENS = Counter(
    "relserve_generated_tokens", "Target tokens computed by decoder steps, one per live hypothesis per step",
    ["model"],
)
ACTIVE_HYPOTHESES = Gauge(
    "relserve_active_hypotheses", "Beam hypotheses in the decode loop (live after the last step)", ["model"]
)
DECODE_STEP_HYPOTHESES = Histogram(
    "relserve_decode_step_hypotheses", "Hypotheses computed per decoder step", ["model"],
    buckets=BATCH_SIZE_BUCKETS,
)
MODEL_INFO = Gauge(
    "relserve_model_info", "Loaded models (value 1)", ["model", "family", "task", "backend", "device", "dtype"]
)

MemorySource = Callable[[], dict[str, tuple[int, int, int]]]


class _GpuMemoryCollector:
    """relserve_gpu_memory_{allocated,reserved,peak}_bytes{device}, read from the backends at scrape time."""

    def __init__(self) -> None:
        self._sources: list[MemorySource] = []
        self._lock = threading.Lock()

    def add(self, source: MemorySource) -> None:
        with self._lock:
            self._sources.append(source)

    def remove(self, source: MemorySource) -> None:
        with self._lock:
            if source in self._sources:
                self._sources.remove(source)

    def collect(self) -> Iterable[GaugeMetricFamily]:
        per_device: dict[str, tuple[int, int, int]] = {}
        with self._lock:
            sources = list(self._sources)
        for source in sources:
            try:
                per_device.update(source())
            except Exception:  # a scrape must not fail because one backend could not answer
                continue
        families = [
            GaugeMetricFamily(f"relserve_gpu_memory_{kind}_bytes", f"GPU memory {kind} by the torch allocator",
                              labels=["device"])
            for kind in ("allocated", "reserved", "peak")
        ]
        for device, values in sorted(per_device.items()):
            for fam, value in zip(families, values):
                fam.add_metric([device], float(value))
        return families if per_device else []

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []


_GPU = _GpuMemoryCollector()
REGISTRY.register(_GPU)

# model -> () -> (cpu seconds, resident bytes) of its worker process, or None while it has none
WorkerSource = Callable[[], "tuple[float, int] | None"]


class _WorkerProcessCollector:
    """``relserve_worker_cpu_seconds_total`` and ``relserve_worker_resident_memory_bytes`` by model: the child
    processes of ``worker_process`` models (service/backends/worker.py), which ``process_*`` (this process
    only) does not count. Read at scrape time."""

    def __init__(self) -> None:
        self._sources: dict[str, WorkerSource] = {}
        self._lock = threading.Lock()

    def add(self, model: str, source: WorkerSource) -> None:
        with self._lock:
            self._sources[model] = source

    def remove(self, model: str, source: WorkerSource) -> None:
        with self._lock:
            if self._sources.get(model) == source:  # bound methods: equal, never identical
                del self._sources[model]

    def collect(self) -> Iterable[Any]:
        with self._lock:
            sources = sorted(self._sources.items())
        cpu = CounterMetricFamily("relserve_worker_cpu_seconds", "CPU seconds (user + system) of the model's "
                                  "worker process (worker_process models; restarts from 0 with a new process)",
                                  labels=["model"])
        rss = GaugeMetricFamily("relserve_worker_resident_memory_bytes", "Resident memory of the model's worker "
                                "process (worker_process models)", labels=["model"])
        for model, source in sources:
            try:
                values = source()
            except Exception:  # a scrape must not fail because one worker could not be read
                continue
            if values is not None:
                cpu.add_metric([model], float(values[0]))
                rss.add_metric([model], float(values[1]))
        return [cpu, rss] if sources else []

    def describe(self) -> Iterable[Any]:
        return []


_WORKERS = _WorkerProcessCollector()
REGISTRY.register(_WORKERS)


def add_worker_source(model: str, source: WorkerSource) -> None:
    """Expose ``source``'s worker process figures under ``model`` (see :class:`_WorkerProcessCollector`)."""
    _WORKERS.add(model, source)


def remove_worker_source(model: str, source: WorkerSource) -> None:
    _WORKERS.remove(model, source)


# ---------------------------------------------------------------------- recording helpers

def observe_request(model: str, task: str, code: str, seconds: float) -> None:
    REQUESTS.labels(model, task, code).inc()
    REQUEST_DURATION.labels(model, task).observe(seconds)
    if code == "RESOURCE_EXHAUSTED":
        REJECTION_DURATION.labels(model, task).observe(seconds)


def inflight(model: str, delta: int) -> None:
    INFLIGHT.labels(model).inc(delta)


def observe_tokenization(model: str, seconds: float) -> None:
    TOKENIZATION_DURATION.labels(model).observe(seconds)


def set_queue_depth(model: str, depth: int) -> None:
    QUEUE_DEPTH.labels(model).set(depth)


def observe_batch(model: str, backend: str, size: int, real_tokens: int, padded_tokens: int,
                  inference_s: float, queue_s: Iterable[float]) -> None:
    BATCH_SIZE.labels(model).observe(size)
    BATCH_TOKENS.labels(model).observe(padded_tokens)
    TOKENS.labels(model, "real").inc(real_tokens)
    TOKENS.labels(model, "padding").inc(max(0, padded_tokens - real_tokens))
    if padded_tokens > 0:
        BATCH_PADDING_EFFICIENCY.labels(model).observe(min(1.0, real_tokens / padded_tokens))
    INFERENCE_DURATION.labels(model, backend).observe(inference_s)
    q = QUEUE_DURATION.labels(model)
    for s in queue_s:
        q.observe(s)


def observe_decode_step(model: str, backend: str, hypotheses: int, seconds: float) -> None:
    """One decoder step over ``hypotheses`` rows (each computes one target token)."""
    DECODE_STEPS.labels(model).inc()
    GENERATED_TOKENS.labels(model).inc(hypotheses)
    DECODE_STEP_HYPOTHESES.labels(model).observe(hypotheses)
    INFERENCE_DURATION.labels(model, backend).observe(seconds)


def set_active_hypotheses(model: str, n: int) -> None:
    ACTIVE_HYPOTHESES.labels(model).set(n)


def observe_queue(model: str, seconds: float) -> None:
    QUEUE_DURATION.labels(model).observe(seconds)


def set_model_info(model: str, family: str, task: str, backend: str, device: str, dtype: str) -> None:
    MODEL_INFO.labels(model, family, task, backend, device, dtype).set(1)


def add_memory_source(source: MemorySource) -> None:
    _GPU.add(source)


def remove_memory_source(source: MemorySource) -> None:
    _GPU.remove(source)


def count_refused(task: str, code: str) -> None:
    """A call refused before any handler ran (e.g. UNAUTHENTICATED): counted in relserve_requests_total with
    model ``_unknown_`` (the request was never decoded), no duration observed."""
    REQUESTS.labels(UNKNOWN_MODEL, task, code).inc()


METRICS_PATH = "/metrics"


def exposition(accept: str, accept_encoding: str, names: list[str] | None = None) -> tuple[bytes, str, str | None]:
    """The default registry as a scrape answer: ``(body, content type, content encoding or None)`` in the format
    the ``Accept`` header asks for (prometheus_client's ``choose_encoder``), gzip when ``Accept-Encoding`` allows
    it, only the metrics ``names`` when given (``?name[]=`` as in prometheus_client's own handler). Used by the
    metrics port and by ``/metrics`` on the HTTP/JSON port (service/frontends/http.py)."""
    encoder, content_type = choose_encoder(accept)
    output = encoder(REGISTRY.restricted_registry(names) if names else REGISTRY)
    if gzip_accepted(accept_encoding):
        return gzip.compress(output), content_type, "gzip"
    return output, content_type, None
_NOT_FOUND = b"404 not found: this port serves only /metrics\n"


class _MetricsHandler(BaseHTTPRequestHandler):
    """GET / HEAD ``/metrics``: the default registry in the exposition format the scraper's Accept header asks
    for (prometheus_client's ``choose_encoder``; gzip when accepted; ``?name[]=`` filters as in
    prometheus_client's own handler). Any other path: 404. Other methods: http.server's 501."""

    server_version = "relserve-metrics"
    timeout = 10  # seconds per connection: an idle client must not hold a handler thread for ever

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._reply(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._reply(body=False)

    def _reply(self, body: bool) -> None:
        url = urlsplit(self.path)
        if url.path != METRICS_PATH:
            status, content_type, output, encoding = 404, "text/plain; charset=utf-8", _NOT_FOUND, None
        else:
            output, content_type, encoding = exposition(self.headers.get("Accept", ""),
                                                        self.headers.get("Accept-Encoding", ""),
                                                        parse_qs(url.query).get("name[]"))
            status = 200
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if encoding:
            self.send_header("Content-Encoding", encoding)
        self.send_header("Content-Length", str(len(output)))
        self.end_headers()
        if body:
            self.wfile.write(output)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - one line per scrape would flood the log
        pass


class _MetricsServer(ThreadingHTTPServer):
    daemon_threads = True  # a scrape in progress never holds up process exit

    def handle_error(self, request, client_address) -> None:
        """socketserver's default prints a traceback to stderr for every failed connection, so any client that
        resets its connection (a port scan, an aborted scrape) could flood the log with 15 lines a time. A client
        going away is not an error; anything else is one log line without a traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        log.warning("metrics request from %s failed: %s: %s", client_address[0], type(exc).__name__,
                    str(exc)[:200])


def start_http(port: int, addr: str = "0.0.0.0"):
    """Serve ``/metrics`` (only; 404 elsewhere) on ``addr:port`` (0 picks a free port; IPv4 or IPv6 address
    or host name) from a daemon thread. Returns ``(server, bound_port)``; stop it with ``server.shutdown()``
    then ``server.server_close()``.

    Raises:
        RuntimeError: the address does not resolve or the port could not be bound (message names both).
    """
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("_MetricsServerFamily", (_MetricsServer,), {"address_family": family})
        server = server_class((addr, port), _MetricsHandler)
    except OSError as exc:
        raise RuntimeError(f"cannot bind metrics port {addr}:{port}: {exc.strerror or exc}; "
                           f"choose another --metrics-port / --metrics-host (-1 disables metrics)") from None
    # poll_interval bounds how long shutdown() waits (http.server's default 0.5 s would eat into the drain budget)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="relserve-metrics",
                     daemon=True).start()
    return server, server.server_port
