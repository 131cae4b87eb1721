"""The grpc.aio server: Inference (frontends/grpc_v1.py) + KServe v2 (frontends/kserve_v2_grpc.py) + health +
reflection, metrics over HTTP, the HTTP/JSON API (frontends/http_transport.py with its surfaces), load/warm-up, drain.

Security (keys in service/config.py, mechanics in service/auth.py): TLS or mTLS on the gRPC port, bearer
tokens checked by an interceptor before any request is decoded (health open unless ``auth_health``;
reflection, when on, needs the token), and an optional plaintext listener serving only grpc.health.v1
(``health_port``) for probes that speak neither TLS nor tokens; it shares the HealthServicer, so drain
flips both.

Seam for tests: ``InferenceServer(config, runners=[ModelRunner(model_cfg, FakeBackend())])``
serves pre-built runners instead of building torch backends from ``config.models``.

Lifecycle::

    server = InferenceServer(cfg)          # or with runners=[...]
    await server.start()                   # port bound, health NOT_SERVING, /metrics up
    await server.load_models()             # load + warm-up every model, then health SERVING
    ...
    await server.stop(grace)               # drain (service/drain.py), stop gRPC, close models
                                           # (relserve serve: drain(), close_runners(), then the process exits)

Connections: ``connection_options`` turns the connection-management keys (max_connection_age, keepalive)
into grpc channel arguments of the main server.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from typing import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from . import auth, metrics, secrets_watch
from . import reflection  # v1alpha (grpcio-reflection) and v1 (delegating to it)
from .frontends import kserve_v2_grpc
from .frontends.grpc_v1 import SERVICE_NAME, InferenceServicer, add_to_server
from .frontends.grpc_transport import CallGuard
from .frontends.http_guard import ListenerLimits, raise_open_files_limit
from .scheduling.cores import ComputeScheduler, partition
from .config import ServerConfig
from .drain import InflightCalls
from .health import HealthServicer
from .backends.progress import log_phase
from .registry import ModelRegistry, build_runner, check_models
from .repository.manager import RepositoryManager
from .runner import Runner

log = logging.getLogger(__name__)

HEALTH_SERVICES = ("", SERVICE_NAME)
# After the drain deadline: how long closed models' calls get to send their UNAVAILABLE, and Watch streams
# their end (the process must exit within drain_timeout + 0.5 s, service/drain.py).
CUTOFF_S = 0.15
# Task labels of calls refused before a handler ran, for services other than Inference.
_REFUSED_TASKS = {health.SERVICE_NAME: "health", **dict.fromkeys(reflection.SERVICE_NAMES, "reflection")}


class SwitchIntervals:
    """The GIL switch interval of a process whose servers may overlap (tests run several): the latest started
    server's value holds while it serves; when a server stops, the interval is what it would be had that
    server never started (the interpreter's own once every server has stopped)."""

    def __init__(self) -> None:
        self._held: list[tuple[object, float]] = []  # (server, the interval it replaced), in start order

    def enter(self, owner: object, microseconds: float | None) -> None:
        """``owner`` starts serving with ``microseconds`` (``None``: leave the interval as it is)."""
        if microseconds is not None:
            self._held.append((owner, apply_switch_interval(microseconds)))

    def leave(self, owner: object) -> None:
        """``owner`` stops: its value is undone (a later server that replaced it now replaces what it had)."""
        for i, (held, previous) in enumerate(self._held):
            if held is owner:
                del self._held[i]
                if i < len(self._held):  # a later server's value stays; it now stands on our predecessor
                    self._held[i] = (self._held[i][0], previous)
                else:
                    _set_switch_interval_us(previous * 1e6)
                return


SWITCH_INTERVALS = SwitchIntervals()


def apply_switch_interval(microseconds: float | None) -> float:
    """Set the interpreter's GIL switch interval (``sys.setswitchinterval``) for the serving process; returns
    the one it replaces, in seconds. ``None`` leaves it as it is. Servers go through
    :data:`SWITCH_INTERVALS`, which undoes it on stop.

    Why: torch releases the GIL around each op and takes it back after; when the event loop (or grpc's
    threads) holds it, the backend thread waits until the holder drops it, at the latest after the switch
    interval (CPython's default 5 ms), once per op: hundreds of waits per encoder call. Measured on the
    2-core machine, sentiment default model on torch, one intra-op thread, clients on the same cores,
    medians of 2 rounds of 12 s windows (``python -m relserve.loadtest.bench.hostile --only switch-interval
    --overload-duration 12 --switch-intervals 5000,100,10``), 10 us against 5000 us: capacity 45.6 against
    43.0 req/s (1.06x); 64 clients retrying on the server's pushback 1.13x; retrying every 50 ms 15.8
    against 11.5 req/s (1.38x; a batch of about 5 texts 279 against 394 ms). 100 us lay between. The cost
    is more frequent switches between threads that both run Python: the default translation model's
    iteration-level decode loop (``python -m relserve.loadtest.bench.translation --capacity --sat-duration 8
    --sat-warmup 2 --load-fractions 0.5 --load-duration 8``, two runs each, in both orders) saturated at
    41.7 / 46.3 / 51.0 / 46.7 req/s at 10 us against 50.8 / 58.1 / 53.7 / 60.9 at 5000 us (about 0.83x).
    Hence the default (``None``) keeps Python's own; servers of encoder models alone may set 10.
    """
    previous = sys.getswitchinterval()
    if microseconds is not None:
        _set_switch_interval_us(microseconds)
    return previous


def _set_switch_interval_us(microseconds: float) -> None:
    # CPython keeps whole microseconds and truncates: 249 / 1e6 would become 248 us, and so would setting
    # back a value read with getswitchinterval(); half a microsecond up lands on the intended one.
    sys.setswitchinterval((round(microseconds) + 0.5) / 1e6)


def refused_task(method: str) -> str:
    """The ``task`` label for a refused call to ``method`` (``/package.Service/Method``): the Inference RPC's
    task, ``health``, ``reflection``, else ``_unknown_`` (the method name is client input: labels stay bounded)."""
    service, _, name = method.lstrip("/").partition("/")
    if service == SERVICE_NAME:
        return getattr(getattr(InferenceServicer, name, None), "task", metrics.UNKNOWN_MODEL)
    if service == kserve_v2_grpc.SERVICE_NAME:
        return kserve_v2_grpc.refused_task(name)
    return _REFUSED_TASKS.get(service, metrics.UNKNOWN_MODEL)


def refused_protocol(method: str) -> str:
    """The ``protocol`` label for a refused call to ``method``: the service's surface (``grpc_v1``,
    ``kserve_v2_grpc``), else ``grpc`` (health, reflection, an unknown service)."""
    service = method.lstrip("/").partition("/")[0]
    return {SERVICE_NAME: "grpc_v1", kserve_v2_grpc.SERVICE_NAME: "kserve_v2_grpc"}.get(service, "grpc")


def _count_unauthenticated(method: str) -> None:
    metrics.count_refused(refused_task(method), grpc.StatusCode.UNAUTHENTICATED.name,
                          protocol=refused_protocol(method))


def _count_admin_refusal(method: str, status: grpc.StatusCode) -> None:
    """A repository API call refused for its (admin) token: UNAUTHENTICATED or PERMISSION_DENIED."""
    metrics.count_refused(refused_task(method), status.name, protocol=refused_protocol(method))


def _count_guard_refusal(method: str, status: grpc.StatusCode) -> None:
    """A call the CallGuard answered itself (over max_concurrent_rpcs, request late or missing)."""
    metrics.count_refused(refused_task(method), status.name, protocol=refused_protocol(method))


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
        self.health_port: int | None = None  # the plaintext health-only listener (health_port), when on
        self._health_server: grpc.aio.Server | None = None
        self.http_port: int | None = None  # the HTTP/JSON API (http_port, service/frontends/http_transport.py), when on
        self._http = None
        self._stopped = asyncio.Event()
        self.guard: CallGuard | None = None  # the gRPC port's call cap and request-read deadline (start())
        self._inflight = InflightCalls((f"/{SERVICE_NAME}/", kserve_v2_grpc.INFER_METHOD))  # what a drain waits for
        self._runners_closed = False
        self.secrets: secrets_watch.SecretsWatch | None = None  # the TLS and token files' reloads (start())
        # the model repository manager (service/repository/), handed to the frontends; without repositories it
        # is in mode none with an empty index
        self.repository = RepositoryManager(config, fixed=[r.name for r in runners] if runners is not None
                                            else [m.name for m in config.models])
        # one per process: how the models' backend calls share the cores (compute_scheduling)
        self.compute = ComputeScheduler(config.compute_scheduling)

    @property
    def runners(self) -> list[Runner]:
        return list(self.registry.runners.values()) if self.registry else []

    async def start(self) -> int:
        """Bind and start serving (health NOT_SERVING until :meth:`load_models` finishes). Returns the port.

        Raises:
            RuntimeError: the gRPC, health-only or metrics port could not be bound.
            ConfigError: a TLS or token file is unreadable or wrong, or a model's directory, config.json, weights,
                tokenizer or ``onnx_path`` export is missing, unreadable or invalid (checked before anything is
                bound; ``relserve serve`` exits 2).
        """
        cfg = self.config
        if self._given_runners is None:  # every model's files before any port is bound: a typo costs no bind
            check_models(cfg.models)
        self.repository.check_start()  # the repositories too (mode none: every model's files)
        # TLS files re-read while serving (secrets_watch): gRPC's credentials fetch the current certificate
        # at each handshake, the HTTP listener's context switches per connection
        self.tls = None
        if cfg.tls_cert is not None and cfg.tls_key is not None:
            from .frontends.http_transport import ssl_context
            self.tls = secrets_watch.TlsReloader(
                secrets_watch.load_tls(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca), ssl_context)
        credentials = self.tls.credentials() if self.tls is not None else None
        interceptors = []
        if cfg.auth_token_file is not None:
            # health (and KServe v2's ServerLive/ServerReady/ModelReady) stays open unless auth_health:
            # kubelet gRPC probes cannot send metadata
            interceptors.append(auth.TokenAuthInterceptor(
                auth.read_tokens(cfg.auth_token_file), on_refused=_count_unauthenticated,
                open_methods=(*kserve_v2_grpc.REPOSITORY_METHODS,  # the admin guard's (below)
                              *(() if cfg.auth_health else (f"/{health.SERVICE_NAME}/",
                                                            *kserve_v2_grpc.PROBE_METHODS)))))
        token_check = interceptors[0] if interceptors else None  # the HTTP/JSON port checks the same tokens
        # the repository API takes admin tokens only; with no token file at all it is open, as Triton's
        admin = None
        if cfg.admin_token_file is not None or cfg.auth_token_file is not None:
            admin = auth.AdminTokenInterceptor(
                auth.read_tokens(cfg.admin_token_file, "admin_token_file") if cfg.admin_token_file else None,
                methods=kserve_v2_grpc.REPOSITORY_METHODS, on_refused=_count_admin_refusal)
            interceptors.append(admin)
        # every connection is a descriptor: the soft limit up to the hard one (logged); the HTTP listener's
        # connection cap stays below it (frontends/http_guard.py)
        self.open_files_limit = raise_open_files_limit()[1]
        if cfg.metrics_port is not None:  # bound first: a busy port then fails before any gRPC state exists
            metrics_host = cfg.metrics_host or cfg.host
            self._metrics_http, self.metrics_port = metrics.start_http(cfg.metrics_port, metrics_host)
            log.info("metrics on http://%s:%d/metrics", metrics_host, self.metrics_port)
        runners = self._given_runners
        if runners is None:
            models = cfg.models
            if cfg.compute_scheduling == "partition":  # ONNX Runtime pools get their share once; torch per call
                models = partition(models, self.compute.cores)
                log.info("compute_scheduling partition over %d cores: torch threads max(1, cores // active "
                         "models) per call; onnx_intra_op_threads %s", self.compute.cores,
                         {m.name: m.onnx_intra_op_threads for m in models})
            runners = [build_runner(m) for m in models]
        for runner in runners:
            runner.compute = self.compute
        self.registry = ModelRegistry(runners)
        self.repository.attach(self.registry, self._model_health, self.compute)

        self.health = HealthServicer()  # its Watch streams end when a drain has answered the in-flight calls
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self.registry.names():  # each model's own service: SERVING while it can compute
            if name not in HEALTH_SERVICES:
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

        # first: the call cap and the request-read deadline hold for every call, before auth and the drain's count
        self.guard = CallGuard(max_calls=cfg.max_concurrent_rpcs, read_timeout=cfg.request_read_timeout or None,
                               exempt=(f"/{health.SERVICE_NAME}/", *kserve_v2_grpc.PROBE_METHODS),
                               on_refused=_count_guard_refusal)
        self.server = grpc.aio.server(interceptors=[self.guard, *interceptors, self._inflight], options=[
            ("grpc.max_receive_message_length", cfg.max_receive_message_length),
            ("grpc.max_send_message_length", cfg.max_send_message_length),
            ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
            ("grpc.so_reuseport", 0),
            *connection_options(cfg),
        ])
        servicer = InferenceServicer(self.registry, cfg.max_send_message_length,
                                     stream_write_timeout=cfg.stream_write_timeout or None)
        add_to_server(servicer, self.server)
        # KServe v2 / Open Inference Protocol beside relserve.v1: same port, interceptors, registry, metrics
        kserve_v2_grpc.add_to_server(kserve_v2_grpc.GRPCInferenceServicer(self.registry, cfg.max_send_message_length,
                                                                          repository=self.repository),
                                     self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if cfg.reflection:
            reflection.enable(
                (SERVICE_NAME, kserve_v2_grpc.SERVICE_NAME, health.SERVICE_NAME), self.server
            )
        self.port = _bind(self.server, f"{cfg.host}:{cfg.port}", "gRPC", credentials)
        if cfg.health_port is not None:
            # A second server with the same HealthServicer: drain flips both; nothing else is served there.
            self._health_server = grpc.aio.server(
                interceptors=[CallGuard(read_timeout=cfg.request_read_timeout or None,
                                        on_refused=_count_guard_refusal)],
                options=[("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", cfg.max_concurrent_streams)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
            health_host = cfg.health_host or cfg.host
            self.health_port = _bind(self._health_server, f"{health_host}:{cfg.health_port}", "health-only", None)
        if cfg.http_port is not None:
            # on this event loop, with the tokens, TLS files, message limits and the drain's call count
            # each HTTP surface adds its routes to the one listener
            from .frontends import hf_inference, http_v1, http_v2, kserve_v1, tei
            from .frontends.http_repository import RepositorySurface
            from .frontends.http_transport import HttpTransport
            self._http = HttpTransport(self.registry, self._inflight, max_body=cfg.max_receive_message_length,
                                       max_reply=cfg.max_send_message_length, tokens=token_check,
                                       auth_health=cfg.auth_health,
                                       surfaces=(http_v2, http_v1, kserve_v1, hf_inference, tei,
                                                 RepositorySurface(admin)), repository=self.repository,
                                       limits=ListenerLimits.from_config(cfg))
            tls = self.tls.ssl_context() if self.tls is not None else None
            self.http_port = await self._http.start(cfg.http_host or cfg.host, cfg.http_port, tls)
            log.info("HTTP/JSON API (%s) on %s:%d", "https" if tls else "http", cfg.http_host or cfg.host,
                     self.http_port)
        await self.server.start()
        security = ("mTLS" if cfg.tls_client_ca is not None else "TLS") if credentials else "plaintext"
        log.info("gRPC bound on %s:%d (%s, %s, reflection %s; NOT_SERVING until models are warm)", cfg.host,
                 self.port, security, "bearer tokens" if interceptors else "no auth",
                 "on" if cfg.reflection else "off")
        if self._health_server is not None:
            await self._health_server.start()
            log.info("health-only listener (plaintext, grpc.health.v1 only) on %s:%d",
                     cfg.health_host or cfg.host, self.health_port)
        secrets = [secrets_watch.tls_secret(self.tls)] if self.tls is not None else []
        if token_check is not None:
            secrets.append(secrets_watch.token_secret("auth_token_file", cfg.auth_token_file, token_check.set_tokens))
        if admin is not None and cfg.admin_token_file is not None:
            secrets.append(secrets_watch.token_secret("admin_token_file", cfg.admin_token_file, admin.set_tokens))
        if secrets:  # re-read on SIGHUP and when a file changes
            self.secrets = secrets_watch.SecretsWatch(secrets)
            await self.secrets.start()
        # once everything is bound: a start that fails leaves the interpreter as it was
        SWITCH_INTERVALS.enter(self, cfg.gil_switch_interval_us)
        log.info("GIL switch interval %g us", sys.getswitchinterval() * 1e6)
        return self.port

    async def load_models(self) -> None:
        """Load and warm up every model (each in a worker thread), then the model repository's first loads
        (:meth:`relserve.service.repository.manager.RepositoryManager.start`; in poll mode its polling starts),
        then flip health to SERVING (with no model at all too: a repository server is ready empty).

        Raises:
            Exception: the first model that fails to load (a repository model: in mode none only); health stays
                NOT_SERVING.
        """
        assert self.registry is not None and self.health is not None
        for runner in self.registry.runners.values():
            log.info("model %r: loading from %s", runner.name, runner.config.path)
            t0 = time.monotonic()
            await asyncio.to_thread(runner.load)
            await runner.start()
            self._model_health(runner.name, runner.ready)  # and again whenever its worker is replaced
            runner.readiness_listeners.append(functools.partial(self._model_health, runner.name))
            info = runner.info()
            log_phase(info.name, "ready", time.monotonic() - t0,
                      f"{info.task}, {info.family}, {info.dtype} on {info.device}, max_seq_len {info.max_seq_len}, "
                      f"max_batch_size {info.max_batch_size}")
        await self.repository.start()  # mode none: a repository model that fails stops the start, as one above
        self.registry.starting = False
        await asyncio.to_thread(self._trim_heaps)
        if self.registry.draining:
            return
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on %s:%d (models: %s)", self.config.host, self.port, ", ".join(self.registry.names()))

    def _model_health(self, name: str, ready: bool | None) -> None:
        """Model ``name``'s own grpc.health.v1 service follows its readiness (a worker being replaced turns it
        NOT_SERVING); the server's ("" and the Inference service) stays as it is: the other models serve.
        ``None``: the model was unloaded, its service is unknown again (Check NOT_FOUND, Watch SERVICE_UNKNOWN)."""
        if self.health is None or name in HEALTH_SERVICES:
            return
        if ready is None:
            self.health.clear_now(name)
        else:
            self.health.set_now(name, health_pb2.HealthCheckResponse.SERVING if ready
                                else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _trim_heaps(self) -> None:
        """Return what warm-up freed to the OS, here and in each worker process (service/backends/heap.py)."""
        from .backends.heap import trim_heap

        trim_heap()
        for runner in self.runners:
            if runner.backend.worker_processes:
                try:
                    runner.backend.trim_heap()
                except Exception as exc:  # memory not returned is no reason to stay NOT_SERVING
                    log.warning("model %r: trimming the worker's heap failed: %s", runner.name, exc)

    async def drain(self, grace: float) -> bool:
        """Steps 1-3 of the drain (see service/drain.py): new Inference calls get UNAVAILABLE and health turns
        NOT_SERVING (Watch streams hear it at once); wait up to ``grace`` seconds for the running Inference
        calls; if some still run then, close the models so they end UNAVAILABLE (not CANCELLED); then end the
        Watch streams. The gRPC ports stay open throughout, so late calls are answered, not reset.

        Returns:
            whether every running call finished within ``grace``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if self.registry is not None:
            self.registry.draining = True
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        log.info("draining: waiting up to %.1f s for %d in-flight requests", grace, self._inflight.running)
        finished = await self._inflight.wait_idle(deadline - loop.time())
        if not finished:
            log.warning("drain timeout: %d requests still running after %.1f s; closing the models, they end "
                        "UNAVAILABLE", self._inflight.running, grace)
            await self.close_runners()
            await self._inflight.wait_idle(CUTOFF_S)
        if self.health is not None:
            watchers = self.health.watchers
            if not await self.health.end_watches(max(CUTOFF_S, deadline - loop.time())):
                log.warning("%d of %d health Watch streams did not end", self.health.watchers, watchers)
        return finished

    async def close_runners(self) -> None:
        """Close every model once (queued and running work fails with UNAVAILABLE)."""
        if self._runners_closed:
            return
        self._runners_closed = True
        await self.repository.close()  # its polling, drains under way and loaded versions that do not serve
        for runner in self.runners:
            await runner.close()

    async def stop(self, grace: float | None = None) -> None:
        """Drain (:meth:`drain`, ``grace`` seconds, default ``drain_timeout``), stop the gRPC server with what
        is left of ``grace`` for other calls (e.g. reflection streams), then close the models and the
        metrics endpoint.

        grpc core's stop resets calls it has received but not yet handed to Python (their clients see
        CANCELLED, grpc/grpc#41785); only calls arriving within about a millisecond of the stop meet that,
        and the ``relserve serve`` process avoids it by exiting instead (service/main.py ``serve``).
        """
        if self._stopped.is_set():
            return
        grace = self.config.drain_timeout if grace is None else grace
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self.drain(grace)
        if self.secrets is not None:
            await self.secrets.stop()
            self.secrets = None
        if self.server is not None:
            await self.server.stop(max(0.0, deadline - loop.time()))
        if self._health_server is not None:  # after the main port: probes see NOT_SERVING while draining
            await self._health_server.stop(0)
        if self._http is not None:  # the drain answered its requests (they count in _inflight)
            await self._http.stop()
            self._http = None
        await self.close_runners()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None
        SWITCH_INTERVALS.leave(self)
        self._stopped.set()
        log.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


_MAX_MS = 2**31 - 1  # grpc's time arguments are int32 milliseconds; this is also its "off"


def _ms(seconds: float) -> int:
    return min(_MAX_MS, max(0, round(seconds * 1000)))


def connection_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """grpc server channel arguments for connection management (config keys in service/config.py).

    * ``max_connection_age`` (0: off) sends each connection a GOAWAY after that age (grpc adds +-10 %
      jitter), ``max_connection_age_grace`` later it is closed: clients reconnect and re-resolve DNS, so
      long-lived clients of a headless Service reach pods the autoscaler added.
    * ``keepalive_time`` / ``keepalive_timeout``: the server pings each connection (0: no pings) and drops
      it when the ping is not answered in time (half-open connections of vanished clients).
    * ``keepalive_min_ping_interval`` and ``keepalive_permit_without_calls``: the client keepalive the
      server accepts; a client pinging more often gets GOAWAY ``too_many_pings`` after two strikes.
    """
    age = cfg.max_connection_age
    opts = [
        ("grpc.keepalive_time_ms", _ms(cfg.keepalive_time) if cfg.keepalive_time > 0 else _MAX_MS),
        ("grpc.keepalive_timeout_ms", _ms(cfg.keepalive_timeout)),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(cfg.keepalive_min_ping_interval)),
        ("grpc.keepalive_permit_without_calls", int(cfg.keepalive_permit_without_calls)),
    ]
    if age:
        opts += [("grpc.max_connection_age_ms", _ms(age)),
                 ("grpc.max_connection_age_grace_ms", _ms(cfg.max_connection_age_grace))]
    return opts


def _bind(server: grpc.aio.Server, address: str, what: str, credentials: grpc.ServerCredentials | None) -> int:
    """Add a TLS (``credentials``) or plaintext port; returns the bound port.

    Raises:
        RuntimeError: the address could not be bound (message names it).
    """
    try:
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind {what} port {address}: {exc}") from None
    if not port:
        raise RuntimeError(f"cannot bind {what} port {address}")
    return port
