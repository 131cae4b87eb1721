"""Prometheus metrics: the only module that knows prometheus_client. Base units, ``relserve_`` prefix.

Metrics live in the default registry, so the client's process collector (``process_*``: resident
memory, CPU seconds, open fds) is exposed next to them. They are created once per process at import;
several servers in one process (tests) share them, told apart by the ``model`` label.

Exposed at ``http://<metrics_host>:<metrics_port>/metrics`` by :func:`start_http`, which serves that one
path (every other path is 404: the port is not a health endpoint and must not look like one) from one thread
of its own, whatever the number of connections (:class:`MetricsServer`: a connection cap and a read timeout).
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import threading
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs, urlsplit

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

# Buckets, defined once.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# refusals should take well under 10 ms (the overload target is p99 < 10 ms): finer steps below that
REJECTION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_TOKENS_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
PADDING_EFFICIENCY_BUCKETS = (0.25, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 1.0)

UNKNOWN_MODEL = "_unknown_"  # label for requests naming a model that is not loaded (bounded cardinality)

# the wire surface a request came by (the ``protocol`` label of relserve_requests_total): relserve.v1 gRPC, KServe v2
# gRPC, KServe v2 REST, relserve's HTTP/JSON /v1 routes, KServe v1, the Hugging Face Inference API, TEI; "grpc" /
# "http" for a call refused before it reached a surface (a token refused on grpc.health.v1 or reflection; an HTTP
# path no surface serves)
PROTOCOLS = ("grpc_v1", "kserve_v2_grpc", "kserve_v2_http", "http_v1", "kserve_v1", "hf", "tei", "grpc", "http")
REQUESTS = Counter(
    "relserve_requests", "RPCs answered, by status code and wire protocol", ["model", "task", "code", "protocol"]
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

MODEL_LOADS = Counter(
    "relserve_model_loads", "Model version loads of the model repository (outcome ok or failed)", ["model", "outcome"]
)
_model_info_labels: dict[str, tuple[str, ...]] = {}  # model -> its relserve_model_info labels (one series a model)

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

def observe_request(model: str, task: str, code: str, seconds: float, *, protocol: str) -> None:
    """One answered request: ``relserve_requests_total`` under its ``protocol`` (one of :data:`PROTOCOLS`), the
    duration (and a RESOURCE_EXHAUSTED refusal's) under model and task."""
    REQUESTS.labels(model, task, code, protocol).inc()
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
    labels = (model, family, task, backend, device, dtype)
    previous = _model_info_labels.get(model)
    if previous is not None and previous != labels:  # a new version of the model, e.g. another dtype
        remove_model_info(model)
    _model_info_labels[model] = labels
    MODEL_INFO.labels(*labels).set(1)


def remove_model_info(model: str) -> None:
    """``model`` is no longer loaded (the model repository unloaded it): its relserve_model_info series goes."""
    labels = _model_info_labels.pop(model, None)
    if labels is not None:
        try:
            MODEL_INFO.remove(*labels)
        except KeyError:
            pass


def count_model_load(model: str, ok: bool) -> None:
    """One version load of a repository model ended (``relserve_model_loads_total{model, outcome}``)."""
    MODEL_LOADS.labels(model, "ok" if ok else "failed").inc()


def add_memory_source(source: MemorySource) -> None:
    _GPU.add(source)


def remove_memory_source(source: MemorySource) -> None:
    _GPU.remove(source)


def count_refused(task: str, code: str, *, protocol: str) -> None:
    """A call refused before any handler ran (e.g. UNAUTHENTICATED): counted in relserve_requests_total with
    model ``_unknown_`` (the request was never decoded) under its ``protocol``, no duration observed."""
    REQUESTS.labels(UNKNOWN_MODEL, task, code, protocol).inc()


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
# the metrics port's own bounds: one scrape needs one short connection, so a few dozen are plenty; a client
# gets this long for its request head (a trickling connection is closed then, holding nothing but a socket)
METRICS_MAX_CONNECTIONS = 64
METRICS_READ_TIMEOUT_S = 10.0
_MAX_HEAD = 16 * 1024  # bytes of request line + headers (http.server allowed 64 KiB lines; a scrape sends ~200 B)
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 408: "Request Timeout", 431: "Request Header Fields "
            "Too Large", 501: "Not Implemented", 505: "HTTP Version Not Supported"}


class MetricsServer:
    """``/metrics`` (only; 404 elsewhere) on one thread of its own that runs an asyncio loop: any number of
    connections costs one thread, at most ``max_connections`` are open (more are closed at once), and a client
    that has not sent its request head within ``read_timeout`` seconds is disconnected, so trickling clients
    hold neither threads nor the port. Each connection carries one request (``Connection: close``).

    GET / HEAD ``/metrics``: the default registry in the exposition format the scraper's Accept header asks
    for (prometheus_client's ``choose_encoder``; gzip when accepted; ``?name[]=`` filters as in
    prometheus_client's own handler). Any other path: 404. Other methods: 501.

    Use :func:`start_http`; stop with ``shutdown()`` then ``server_close()`` (as socketserver's servers).
    """

    def __init__(self, sock: socket.socket, read_timeout: float, max_connections: int) -> None:
        self.socket = sock
        self.server_port = sock.getsockname()[1]
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self.open = 0       # connections now
        self.refused = 0    # connections closed at once (over max_connections)
        self.timed_out = 0  # connections closed for want of a request head within read_timeout
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="relserve-metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, sock=self.socket, limit=_MAX_HEAD))
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    def shutdown(self) -> None:
        """Stop serving (open connections are closed) and end the thread."""
        if not self.thread.is_alive():
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:  # the open connections
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.thread.join(5)

    def server_close(self) -> None:
        """Close the listening socket (after :meth:`shutdown`)."""
        self.socket.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= self.max_connections:
            self.refused += 1
            writer.transport.abort()
            return
        self.open += 1
        try:
            try:
                async with asyncio.timeout(self.read_timeout):
                    head = await reader.readuntil(b"\r\n\r\n")
            except TimeoutError:
                self.timed_out += 1
                return await self._reply(writer, 408, b"408 the request head did not arrive in time\n")
            except asyncio.LimitOverrunError:
                return await self._reply(writer, 431, b"431 request head too large\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the client went away (a port scan, an aborted scrape): nothing to log
            await self._answer(writer, head)
        except (ConnectionError, TimeoutError):
            pass
        except Exception as exc:  # one line, no traceback: the port keeps serving
            log.warning("metrics request failed: %s: %s", type(exc).__name__, str(exc)[:200])
        finally:
            self.open -= 1
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return await self._reply(writer, 400, b"400 bad request line\n")
        method, target = parts[0], parts[1]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            return await self._reply(writer, 501, f"501 unsupported method {method[:40]!r}\n".encode())
        url = urlsplit(target)
        if url.path != METRICS_PATH:
            return await self._reply(writer, 404, _NOT_FOUND, body=method == "GET")
        output, content_type, encoding = exposition(headers.get("accept", ""), headers.get("accept-encoding", ""),
                                                    parse_qs(url.query).get("name[]"))
        await self._reply(writer, 200, output, content_type, encoding, body=method == "GET")

    async def _reply(self, writer: asyncio.StreamWriter, status: int, output: bytes,
                     content_type: str = "text/plain; charset=utf-8", encoding: str | None = None,
                     body: bool = True) -> None:
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}", "Server: relserve-metrics",
                f"Content-Type: {content_type}", f"Content-Length: {len(output)}", "Connection: close"]
        if encoding:
            head.append(f"Content-Encoding: {encoding}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (output if body else b""))
        async with asyncio.timeout(self.read_timeout):  # a client that does not read cannot hold the reply
            await writer.drain()


def start_http(port: int, addr: str = "0.0.0.0", *, read_timeout: float = METRICS_READ_TIMEOUT_S,
               max_connections: int = METRICS_MAX_CONNECTIONS) -> tuple[MetricsServer, int]:
    """Serve ``/metrics`` (only; 404 elsewhere) on ``addr:port`` (0 picks a free port; IPv4 or IPv6 address
    or host name) from one daemon thread (:class:`MetricsServer`). Returns ``(server, bound_port)``; stop it
    with ``server.shutdown()`` then ``server.server_close()``.

    Raises:
        RuntimeError: the address does not resolve or the port could not be bound (message names both).
    """
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as socketserver's HTTP servers
            sock.bind((addr, port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
    except OSError as exc:
        raise RuntimeError(f"cannot bind metrics port {addr}:{port}: {exc.strerror or exc}; "
                           f"choose another --metrics-port / --metrics-host (-1 disables metrics)") from None
    server = MetricsServer(sock, read_timeout, max_connections)
    server.start()
    return server, server.server_port
