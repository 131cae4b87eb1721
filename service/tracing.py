"""OpenTelemetry traces of the calls, and the call's ids in its log lines.

Off unless an OTLP endpoint is configured (server key ``otlp_endpoint`` / ``--otlp-endpoint``, else the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``): then :func:`configure` imports the
OpenTelemetry SDK (the ``[otel]`` extra) and sets :data:`ENABLED`. Every hook in the transports and schedulers
checks that module-level flag first, so with tracing off no ``opentelemetry`` module is ever imported and a call
costs one attribute read per hook.

What a traced call records (times are the server's own measurements, so spans need no clock of their own):

* the call: one SERVER span per gRPC call (:func:`begin_grpc`) or HTTP request (:func:`http_middleware`),
  continuing the client's W3C ``traceparent`` / ``tracestate`` (gRPC metadata or HTTP headers), with the route,
  the model and the status code;
* tokenization (:func:`record`, from ``Runner.tokenize``);
* queue wait: one span per request and model, from its submission to the start of the first backend call that
  served it (:func:`backend_call`);
* each backend call (a batch, or a translation encoder batch): one span with the batch size, real and padded
  tokens, the model's backend and dtype, and a *link* to the call span of every request it served. A batch
  serves many requests, so it cannot be their child: it belongs to the trace of its oldest request (the one
  that anchored it) and links to all of them, that one included;
* a translation text's decoder steps: one summary span (step count and seconds), never a span per step.

Log lines: :class:`LogContext` adds `` [trace_id=... request_id=...]`` to every record logged in a call's task
(``request_id`` is the client's ``x-request-id`` header or metadata, kept even with tracing off).
"""

from __future__ import annotations

import contextvars
import logging
import time
from typing import Any, Callable, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from .errors import ConfigError

log = logging.getLogger(__name__)

ENABLED = False  # set by configure(): every hook checks this first

EXTRA = "relserve[otel]"
REQUEST_ID = "x-request-id"
MAX_REQUEST_ID = 128  # characters of a client's x-request-id kept (log lines stay bounded)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(call_context)s"
DEFAULT_SERVICE_NAME = "relserve"
# the gRPC codes that mark a server span as failed (OpenTelemetry's RPC semantic conventions); the others are the
# client's doing (a bad argument, an unknown model, its own cancellation)
GRPC_SERVER_ERRORS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE",
                                "DATA_LOSS"})

_tracer: Any = None
_provider: Any = None
_otel: Any = None  # the OpenTelemetry names the hooks use, once configured (_Otel)


class Call:
    """One traced (or at least identified) call: its span (None with tracing off), trace id (hex, "" off),
    the client's request id ("" when it sent none) and the model it reached."""

    __slots__ = ("span", "trace_id", "request_id", "model", "_token")

    def __init__(self, span: Any, trace_id: str, request_id: str) -> None:
        self.span, self.trace_id, self.request_id = span, trace_id, request_id
        self.model = ""
        self._token: contextvars.Token | None = None

    def end(self, model: str | None, status: int | str) -> None:
        """End the call: its span gets ``model`` (else the one the schedulers saw) and ``status`` (the gRPC
        code name or HTTP status), ERROR for a server fault (HTTP 5xx; the gRPC codes of
        :data:`GRPC_SERVER_ERRORS`, as OpenTelemetry's RPC conventions say); the call leaves the log context."""
        if log.isEnabledFor(logging.DEBUG):  # an access line, carrying the call's ids (LogContext)
            log.debug("call ended: %s", status)
        if self._token is not None:
            try:
                _current.reset(self._token)
            except ValueError:  # ended from another context (cannot happen on the transports' paths)
                pass
            self._token = None
        span = self.span
        if span is None:
            return
        model = model if model and not model.startswith("_") else self.model
        if model:
            span.set_attribute("relserve.model", model)
        if isinstance(status, int):
            span.set_attribute("http.response.status_code", status)
            error = status >= 500
        else:
            span.set_attribute("rpc.grpc.status_code", _grpc_code(status))
            span.set_attribute("relserve.status", status)
            error = status in GRPC_SERVER_ERRORS
        if error:
            span.set_status(_otel.Status(_otel.StatusCode.ERROR, str(status)))
        span.end()


class RequestTrace:
    """What the schedulers keep of one request's call: the call span (parent of its queue, backend and decode
    spans), when the request was submitted (``time.monotonic()``) and whether its queue span was recorded."""

    __slots__ = ("span", "enqueued_at", "queued")

    def __init__(self, span: Any, enqueued_at: float) -> None:
        self.span, self.enqueued_at, self.queued = span, enqueued_at, False


_current: contextvars.ContextVar[Call | None] = contextvars.ContextVar("relserve_call", default=None)


# ---------------------------------------------------------------------------------------------- configuration

def endpoint_from(flag: str | None, env: Mapping[str, str]) -> tuple[str | None, str]:
    """(the traces endpoint to pass the exporter, or None to let it read the environment itself; the protocol).

    ``flag`` (the ``otlp_endpoint`` key) is a collector address like ``OTEL_EXPORTER_OTLP_ENDPOINT``: for
    http/protobuf ``/v1/traces`` is appended unless the path already ends so. Without it the exporters read
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` themselves (the OTLP exporter
    specification). The protocol is ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``,
    else ``http/protobuf``.

    Raises:
        ConfigError: a protocol other than http/protobuf or grpc (http/json has no exporter here), or a ``flag``
            that is not an http(s) URL with a host (the exporter would drop every span without a word).
    """
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    if protocol not in ("http/protobuf", "grpc"):
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} is not supported; use http/protobuf or grpc")
    if not flag:
        return None, protocol
    url = urlsplit(flag)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"otlp_endpoint {flag[:200]!r} is not a collector URL; give http(s)://HOST[:PORT], e.g. "
                          f"http://collector:4318")
    if protocol == "http/protobuf" and not flag.rstrip("/").endswith("/v1/traces"):
        return flag.rstrip("/") + "/v1/traces", protocol
    return flag, protocol


def wanted(flag: str | None, env: Mapping[str, str]) -> bool:
    """Whether tracing is configured: the key, or one of the standard endpoint variables, is set, and the standard
    switches do not turn it off (``OTEL_SDK_DISABLED=true``, ``OTEL_TRACES_EXPORTER=none``)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(flag or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(flag: str | None, env: Mapping[str, str]) -> bool:
    """Turn tracing on when an endpoint is configured (:func:`wanted`); returns whether it is on. The service
    name is ``OTEL_SERVICE_NAME``, else ``relserve``; spans leave in batches (the SDK's ``OTEL_BSP_*``
    variables apply). Nothing is imported when no endpoint is configured.

    Raises:
        ConfigError: an endpoint is configured but the ``[otel]`` extra is not installed (names it), or the
            protocol is not supported.
    """
    global ENABLED, _tracer, _provider, _otel
    if not wanted(flag, env):
        return False
    endpoint, protocol = endpoint_from(flag, env)
    try:
        otel = _Otel(protocol)
    except ImportError as exc:
        raise ConfigError(f"tracing is configured (otlp_endpoint or OTEL_EXPORTER_OTLP_*ENDPOINT) but OpenTelemetry "
                          f"is not installed ({exc.name or exc}): pip install '{EXTRA}'") from None
    resource = otel.Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME})
    provider = otel.TracerProvider(resource=resource)
    exporter = otel.Exporter(endpoint=endpoint) if endpoint else otel.Exporter()
    provider.add_span_processor(otel.BatchSpanProcessor(exporter))
    _otel, _provider = otel, provider
    _tracer = provider.get_tracer("relserve")
    ENABLED = True
    return True


def shutdown() -> None:
    """Send what is buffered and stop (the server's exit); a no-op with tracing off."""
    global ENABLED, _provider, _tracer
    if _provider is not None:
        ENABLED = False
        provider, _provider, _tracer = _provider, None, None
        provider.shutdown()


class _Otel:
    """The OpenTelemetry names used here, imported on first configuration only."""

    def __init__(self, protocol: str) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        self.trace, self.Resource, self.TracerProvider = trace, Resource, TracerProvider
        self.BatchSpanProcessor, self.Exporter = BatchSpanProcessor, OTLPSpanExporter
        self.Link, self.SpanKind, self.Status, self.StatusCode = Link, SpanKind, Status, StatusCode
        self.propagator = TraceContextTextMapPropagator()

        class Getter:  # a carrier is a one-argument lookup of a lower-case header name
            def get(self, carrier: Callable[[str], str | None], key: str) -> list[str] | None:
                value = carrier(key)
                return None if value is None else [value]

            def keys(self, carrier: Any) -> list[str]:
                return []

        self.getter = Getter()


# ---------------------------------------------------------------------------------------------- calls

def begin(name: str, header: Callable[[str], str | None], attributes: Mapping[str, Any]) -> Call | None:
    """Open a call in the current context (the transport's task): a span continuing the client's trace when
    tracing is on, the client's request id either way; None when there is nothing to record."""
    request_id = header(REQUEST_ID)
    request_id = request_id[:MAX_REQUEST_ID] if isinstance(request_id, str) else ""
    if not ENABLED:
        if not request_id:
            return None
        call = Call(None, "", request_id)
    else:
        parent = _otel.propagator.extract(header, getter=_otel.getter)
        span = _tracer.start_span(name, context=parent, kind=_otel.SpanKind.SERVER, attributes=attributes)
        if request_id:
            span.set_attribute("relserve.request_id", request_id)
        call = Call(span, format(span.get_span_context().trace_id, "032x"), request_id)
    call._token = _current.set(call)
    return call


def begin_grpc(method: str, protocol: str, context: Any) -> Call | None:
    """:func:`begin` for a gRPC call: ``method`` the handler's RPC name, ``protocol`` the surface's metrics label,
    the headers from the call's invocation metadata."""
    metadata = context.invocation_metadata() or ()
    found = {key: value for key, value in metadata if key in ("traceparent", "tracestate", REQUEST_ID)}
    if not found and not ENABLED:
        return None
    value = found.get
    return begin(f"{protocol}/{method}", lambda key: (v if isinstance(v := value(key), str) else None),
                  {"rpc.system": "grpc", "rpc.method": method, "relserve.protocol": protocol})


def _http_begin(request: Any) -> Call | None:
    headers = request.headers
    if not ENABLED and REQUEST_ID not in headers:
        return None
    resource = getattr(getattr(request.match_info, "route", None), "resource", None)
    if resource is None:  # no route matched: the method alone (a client-chosen path is no span name)
        return begin(request.method, headers.get, {"http.request.method": request.method})
    template = resource.canonical
    return begin(f"{request.method} {template}", headers.get,
                 {"http.request.method": request.method, "http.route": template})


async def http_middleware(request: Any, handler: Callable) -> Any:
    """aiohttp middleware (the HTTP listener's first): the request as a call (:func:`begin`), its status the
    reply's, or that of the aiohttp exception it raised."""
    call = _http_begin(request)
    if call is None:
        return await handler(request)
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except BaseException as exc:
        status = getattr(exc, "status", 500) if isinstance(getattr(exc, "status", None), int) else 500
        raise
    finally:
        call.end(request.match_info.get("name"), status)


http_middleware.__middleware_version__ = 1  # type: ignore[attr-defined]  # aiohttp's new-style marker


def current() -> Call | None:
    """The call the current context belongs to, if any."""
    return _current.get()


def request(model: str, enqueued_at: float) -> RequestTrace | None:
    """For a scheduler's submit (with tracing on): the current call's handle for the request's units (None
    outside a traced call); the call learns the model it reached."""
    call = _current.get()
    if call is None or call.span is None:
        return None
    if not call.model:
        call.model = model
    return RequestTrace(call.span, enqueued_at)


# ---------------------------------------------------------------------------------------------- spans

def _wall_ns(monotonic: float, now_mono: float, now_ns: int) -> int:
    return now_ns - int((now_mono - monotonic) * 1e9)


def record(name: str, start: float, end: float, attributes: Mapping[str, Any]) -> None:
    """A child span of the current call from ``start`` to ``end`` (``time.monotonic()`` seconds); nothing
    outside a traced call."""
    call = _current.get()
    if call is None or call.span is None:
        return
    _child(call.span, name, start, end, attributes)


def record_for(trace: RequestTrace | None, name: str, start: float, end: float,
               attributes: Mapping[str, Any]) -> None:
    """A child span of a request's call (``trace`` from :func:`request`; None: nothing)."""
    if trace is not None and ENABLED:
        _child(trace.span, name, start, end, attributes)


def _child(parent: Any, name: str, start: float, end: float, attributes: Mapping[str, Any]) -> None:
    now_mono, now_ns = time.monotonic(), time.time_ns()
    span = _tracer.start_span(name, context=_otel.trace.set_span_in_context(parent), attributes=attributes,
                              start_time=_wall_ns(start, now_mono, now_ns))
    span.end(end_time=_wall_ns(end, now_mono, now_ns))


def backend_call(traces: Iterable[RequestTrace | None], start: float, end: float, attributes: Mapping[str, Any],
                 failed: bool = False) -> None:
    """One backend call from ``start`` to ``end`` (``time.monotonic()`` seconds) over units whose requests are
    ``traces`` (oldest first): each request's queue span, if not yet recorded (submission to ``start``), then the
    call's span in the trace of the first request, linked to the call span of every request it served.
    Untraced units (warm-up, a call outside any traced context) add nothing; no traced unit, no span."""
    if not ENABLED:
        return
    seen: dict[int, RequestTrace] = {}
    for t in traces:
        if t is not None and id(t.span) not in seen:
            seen[id(t.span)] = t
    if not seen:
        return
    model = attributes.get("relserve.model", "")
    for t in seen.values():
        if not t.queued:
            t.queued = True
            _child(t.span, "relserve.queue", t.enqueued_at, start, {"relserve.model": model})
    served = list(seen.values())
    now_mono, now_ns = time.monotonic(), time.time_ns()
    links = [_otel.Link(t.span.get_span_context()) for t in served]
    span = _tracer.start_span("relserve.batch", context=_otel.trace.set_span_in_context(served[0].span),
                              links=links, attributes={**attributes, "relserve.batch.requests": len(served)},
                              start_time=_wall_ns(start, now_mono, now_ns))
    if failed:
        span.set_status(_otel.Status(_otel.StatusCode.ERROR, "backend call failed"))
    span.end(end_time=_wall_ns(end, now_mono, now_ns))


def _grpc_code(name: str) -> int:
    import grpc  # the server's own dependency; only reached with tracing on

    try:
        return grpc.StatusCode[name].value[0]
    except KeyError:
        return grpc.StatusCode.UNKNOWN.value[0]


# ---------------------------------------------------------------------------------------------- logging

class LogContext(logging.Filter):
    """Adds ``call_context`` to every record: `` [trace_id=<32 hex> request_id=<x-request-id>]`` (the parts
    known) when it is logged in a call's context, else ""; :data:`LOG_FORMAT` prints it after the message."""

    def filter(self, record: logging.LogRecord) -> bool:
        call = _current.get()
        if call is None:
            record.call_context = ""
        else:
            parts = [f"trace_id={call.trace_id}"] if call.trace_id else []
            if call.request_id:
                parts.append(f"request_id={call.request_id}")
            record.call_context = f" [{' '.join(parts)}]" if parts else ""
        return True


def install_log_context(handlers: Sequence[logging.Handler]) -> None:
    """Give each handler the :class:`LogContext` filter (their format may then name ``%(call_context)s``)."""
    for handler in handlers:
        handler.addFilter(LogContext())
