"""The grpc.aio server: Inference + health + reflection, metrics over HTTP, load/warm-up, drain.

Seam for tests: ``InferenceServer(config, runners=[ModelRunner(model_cfg, FakeBackend(), tasks=...)])``
serves pre-built runners instead of building torch backends from ``config.models``.

Lifecycle::

    server = InferenceServer(cfg)          # or with runners=[...]
    await server.start()                   # port bound, health NOT_SERVING, /metrics up
    await server.load_models()             # load + warm-up every model, then health SERVING
    ...
    await server.stop(grace)               # NOT_SERVING, refuse new RPCs, drain, close models
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import metrics
from .api import SERVICE_NAME, InferenceServicer, add_to_server
from .config import ServerConfig
from .registry import ModelRegistry, build_runner
from .runner import Runner

log = logging.getLogger(__name__)

HEALTH_SERVICES = ("", SERVICE_NAME)


class InferenceServer:
    def __init__(self, config: ServerConfig, runners: Sequence[Runner] | None = None) -> None:
        self.config = config
        self._given_runners = list(runners) if runners is not None else None
        self.registry: ModelRegistry | None = None
        self.health = None
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_http = None
        self._stopped = asyncio.Event()

    @property
    def runners(self) -> list[Runner]:
        return list(self.registry.runners.values()) if self.registry else []

    async def start(self) -> int:
        """Bind and start serving (health NOT_SERVING until :meth:`load_models` finishes). Returns the port.

        Raises:
            RuntimeError: the gRPC or the metrics port could not be bound.
        """
        cfg = self.config
        if cfg.metrics_port is not None:  # bound first: a busy port then fails before any gRPC state exists
            self._metrics_http, self.metrics_port = metrics.start_http(cfg.metrics_port, cfg.host)
            log.info("metrics on http://%s:%d/metrics", cfg.host, self.metrics_port)
        runners = self._given_runners
        if runners is None:
            runners = [build_runner(m) for m in cfg.models]
        self.registry = ModelRegistry(runners)

        self.health = health.aio.HealthServicer()
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", cfg.max_receive_message_length),
            ("grpc.max_send_message_length", cfg.max_send_message_length),
            ("grpc.so_reuseport", 0),
        ])
        add_to_server(InferenceServicer(self.registry, cfg.max_send_message_length), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        address = f"{cfg.host}:{cfg.port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot bind gRPC port {address}: {exc}") from None
        if not self.port:
            raise RuntimeError(f"cannot bind gRPC port {address}")
        await self.server.start()
        log.info("gRPC bound on %s:%d (NOT_SERVING until models are warm)", cfg.host, self.port)
        return self.port

    async def load_models(self) -> None:
        """Load and warm up every model (each in a worker thread), then flip health to SERVING.

        Raises:
            Exception: the first model that fails to load; health stays NOT_SERVING.
        """
        assert self.registry is not None and self.health is not None
        for runner in self.registry.runners.values():
            log.info("model %r: loading from %s", runner.name, runner.config.path)
            await asyncio.to_thread(runner.load)
            await runner.start()
            info = runner.info()
            log.info("model %r: ready (%s, %s, %s on %s, max_seq_len %d, max_batch_size %d)", info.name,
                     info.task, info.family, info.dtype, info.device, info.max_seq_len, info.max_batch_size)
        if self.registry.draining:
            return
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on %s:%d (models: %s)", self.config.host, self.port, ", ".join(self.registry.names()))

    async def stop(self, grace: float | None = None) -> None:
        """Drain: health NOT_SERVING, refuse new RPCs, let in-flight ones finish for ``grace`` seconds
        (default ``drain_timeout``), then close the models and the metrics endpoint."""
        if self._stopped.is_set():
            return
        grace = self.config.drain_timeout if grace is None else grace
        if self.registry is not None:
            self.registry.draining = True
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        if self.server is not None:
            log.info("draining: waiting up to %.1f s for in-flight requests", grace)
            await self.server.stop(grace)
        for runner in self.runners:
            await runner.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None
        self._stopped.set()
        log.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
