"""Prometheus metrics: the only module that knows prometheus_client. Base units, ``relserve_`` prefix.

Metrics live in the default registry, so the client's process collector (``process_*``: resident
memory, CPU seconds, open fds) is exposed next to them. They are created once per process at import;
several servers in one process (tests) share them, told apart by the ``model`` label.

Exposed at ``http://<host>:<metrics_port>/metrics`` by :func:`start_http`.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

# Buckets, defined once.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_TOKENS_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

UNKNOWN_MODEL = "_unknown_"  # label for requests naming a model that is not loaded (bounded cardinality)

REQUESTS = Counter(
    "relserve_requests", "RPCs answered, by status code", ["model", "task", "code"]
)
REQUEST_DURATION = Histogram(
    "relserve_request_duration_seconds", "RPC time from arrival to reply", ["model", "task"],
    buckets=LATENCY_BUCKETS,
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


# ---------------------------------------------------------------------- recording helpers

def observe_request(model: str, task: str, code: str, seconds: float) -> None:
    REQUESTS.labels(model, task, code).inc()
    REQUEST_DURATION.labels(model, task).observe(seconds)


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


def start_http(port: int, addr: str = "0.0.0.0"):
    """Serve /metrics on ``addr:port`` (0 picks a free port). Returns ``(server, bound_port)``;
    stop it with ``server.shutdown()``.

    Raises:
        RuntimeError: the port could not be bound (message names the address).
    """
    try:
        server, _thread = start_http_server(port, addr=addr)
    except OSError as exc:
        raise RuntimeError(f"cannot bind metrics port {addr}:{port}: {exc.strerror or exc}; "
                           f"choose another --metrics-port (-1 disables metrics)") from None
    return server, server.server_port
