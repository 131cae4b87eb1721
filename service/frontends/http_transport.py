"""The HTTP listener (server key ``http_port``) every HTTP surface shares, on aiohttp.

It runs on the server's asyncio loop (the one grpc.aio uses), beside the gRPC port, with the same TLS /
mTLS files, bearer tokens and message limit, and joins the drain like a gRPC call. This module is the
transport only: the listener, the error table and JSON replies, body reading (size limit, Content-Encoding),
the deadline header, token checks, drain and request-metrics accounting, and ``/metrics``. The routes come
from the surfaces (:class:`HttpTransport` ``surfaces``): ``http_v2`` (KServe v2 REST) and ``http_v1``
(relserve's /v1 JSON routes); ``service/server.py`` chooses them. A surface is a module with

- ``routes(core) -> list[aiohttp.web.RouteDef]``: its routes, the handlers bound to ``core`` (this
  transport: :meth:`HttpTransport.read`, :meth:`~HttpTransport.body`, :meth:`~HttpTransport.deadline`,
  :meth:`~HttpTransport.within`, ``registry``, ``max_reply``);
- optionally ``open_path(path) -> bool``: the paths that need no token unless ``auth_health`` (probes);
- optionally ``admin_path(path) -> bool``: paths whose routes check the admin token themselves (the
  inference token check here passes them);
- ``PROTOCOL``: its ``protocol`` label in ``relserve_requests_total`` (:class:`Counted`);
- optionally ``refused_task(path) -> str | None``: the metrics ``task`` label of a request to ``path``
  refused for its token, counted under the surface's ``PROTOCOL`` (None: not this surface's path; a path no
  surface knows counts as ``_unknown_`` under ``http``).

``GET /metrics`` (the Prometheus exposition, as the metrics port) is the transport's own route.

Connections (:mod:`.http_guard`, server keys ``http_*``): a request head must arrive within
``http_header_timeout`` (60 s), a body may pause at most ``http_body_timeout`` (60 s) between two reads (then
408 and the connection is closed), an idle connection is closed ``http_keepalive_timeout`` (75 s) after its last
reply; at most ``http_max_connections`` are open (more are closed at once; default: half the open-files limit);
accept() errors for want of descriptors are one log line a second with their count. A ``Content-Length`` over
``max_receive_message_length`` is 413 before any of the body is read, and with ``Expect: 100-continue`` 417
without ``100 Continue``. A half-closed client (``shutdown(SHUT_WR)`` after its request) gets its reply. Bodies
of :attr:`HttpTransport.OFF_LOOP_BYTES` or more are decoded (JSON, protobuf's mapping) in a thread of their own
(:meth:`HttpTransport.decode`), so the event loop, which gRPC shares, keeps its turns; a /v1 body's text arrays
are counted before it is parsed (:meth:`HttpTransport.counted_loads`), so a refused one costs no parse of them.

Errors: ``{"error": message, "code": "INVALID_ARGUMENT"}`` with the HTTP status of the domain error's code
(:data:`HTTP_STATUS`); a full queue's 429 has ``Retry-After`` (whole seconds, rounded up, from the error's
``retry_after_s``); a body over ``max_receive_message_length`` (as sent or decoded) is 413, malformed JSON or
a field of the wrong JSON type 400 (naming it), an unknown path 404, a wrong method 405. Request bodies may be
``Content-Encoding`` gzip or deflate (decoded here, not by aiohttp: a body that is not what its label says
is a JSON 400, another encoding a JSON 415). A request aiohttp's parser refuses before any route runs (not
HTTP, a header line without a colon, a bad Content-Length or chunk size) gets aiohttp's plain-text 400 and
one warning line in the log, no traceback (:class:`.http_guard.ServerLog`). Deadlines: the optional
``X-Request-Timeout`` header (seconds, > 0) is the request's deadline, as a gRPC client's timeout (504
DEADLINE_EXCEEDED). A client that disconnects does not cancel its request (aiohttp's default): the work
finishes and the reply is dropped; one that disconnects while sending the body is CANCELLED (499, unsent).

Auth: with ``auth_token_file`` every route needs ``Authorization: Bearer <token>`` (the gRPC interceptor's
check, :meth:`relserve.service.auth.TokenAuthInterceptor.check`) except the surfaces' open paths and
``/metrics``, which stay open unless ``auth_health`` (probes and the separate metrics port need no token
either). Refusals are 401 with ``WWW-Authenticate: Bearer`` and are counted as
``relserve_requests_total{model="_unknown_", code="UNAUTHENTICATED"}``. No torch here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .. import metrics, tracing
from ..auth import TokenAuthInterceptor
from ..drain import InflightCalls
from ..errors import Cancelled, InvalidArgument, RelserveError, shown, to_status
from ..registry import ModelRegistry
from ..config import ServerConfig
from .http_guard import (ConnectionGuard, ListenerLimits, ServerLog, ThrottledLog, accept_error_handler,
                         default_max_connections)
from .grpc_transport import WIRE_COUNT_MIN, TooManyEntries
from .json_codec import CountRefused, check_counts, count_top_arrays, loads

log = logging.getLogger(__name__)
T = TypeVar("T")

TIMEOUT_HEADER = "X-Request-Timeout"  # seconds; the request's deadline (gRPC clients send grpc-timeout)

# The HTTP transport's error table: the domain error's code (errors.to_status) -> HTTP status (the mapping of
# google.rpc / grpc-gateway, with FAILED_PRECONDITION as 400 like every other client mistake of this API).
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.DATA_LOSS: 500,
}
# aiohttp's own refusals (no route, wrong method, body too large) -> the code named in the JSON error
HTTP_CODES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 405: "UNIMPLEMENTED", 408: "DEADLINE_EXCEEDED",
              413: "RESOURCE_EXHAUSTED", 415: "UNIMPLEMENTED"}
# Content-Encoding of a request body -> zlib wbits (gzip; deflate is zlib-wrapped per RFC 9110 8.4.1.2)
_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def error_response(code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> web.Response:
    """The JSON error reply ``{"error": message, "code": code name}`` with the status of :data:`HTTP_STATUS`;
    ``Retry-After`` (whole seconds, rounded up) when ``retry_after_s`` is given, ``WWW-Authenticate: Bearer``
    for UNAUTHENTICATED."""
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    if code == grpc.StatusCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return json_response({"error": message, "code": code.name}, HTTP_STATUS.get(code, 500), headers)


def authorization(request: web.Request) -> list[tuple[str, str]]:
    """The request's ``Authorization`` headers as the gRPC token checks take metadata."""
    return [("authorization", v) for v in request.headers.getall("Authorization", [])]


def http_words(reason: str) -> str:
    """A token check's refusal reworded for HTTP: the gRPC checks speak of metadata, a client sends a header."""
    return (reason.replace("'authorization' metadata entry", "'Authorization' header")
            .replace("'authorization' metadata", "'Authorization' header")
            .replace("'authorization: Bearer <token>'", "'Authorization: Bearer <token>'"))


def json_response(body: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    """``body`` as a UTF-8 JSON reply (non-ASCII characters as they are)."""
    # "replace": a lone surrogate in an echoed string (a JSON "\ud800") cannot be UTF-8; the request parser
    # refuses those (json_codec.check_text), so this only keeps a reply from ever failing as a 500 with a traceback
    return web.Response(body=json.dumps(body, ensure_ascii=False).encode("utf-8", "replace"), status=status,
                        headers=headers, content_type="application/json")


def ssl_context(cert: Path, key: Path, client_ca: Path | None) -> ssl.SSLContext:
    """A server TLS context from the gRPC port's PEM files (checked by config validation); with ``client_ca``
    clients must present a certificate it signed (mTLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    if client_ca is not None:
        context.load_verify_locations(cafile=str(client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["http/1.1"])
    return context


class Deadline(Exception):
    """The request's deadline passed (the awaited call was cancelled): :meth:`HttpTransport.within`."""


def deadline_response() -> web.Response:
    """The 504 DEADLINE_EXCEEDED reply of a request whose :data:`TIMEOUT_HEADER` deadline passed."""
    return error_response(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"the request's deadline ({TIMEOUT_HEADER}) passed before it was answered")


class Counted:
    """One request's entry in the request metrics: ``relserve_requests_total`` / duration under ``model``,
    ``task`` and ``code`` (set by the handler; "OK" until then) when :meth:`done`, and the model's in-flight
    gauge from :meth:`running` to :meth:`done`. The duration runs from construction."""

    def __init__(self, model: str = metrics.UNKNOWN_MODEL, task: str = metrics.UNKNOWN_MODEL, *,
                 protocol: str) -> None:
        self.model, self.task, self.code = model, task, "OK"
        self.protocol = protocol  # the surface's label (service/metrics.py PROTOCOLS)
        self.t0 = time.monotonic()
        self._running = False

    @classmethod
    def for_url_model(cls, registry: Any, name: str, *, protocol: str) -> "Counted":
        """An entry labelled with the model the URL names, and its task, when that model is served; else
        ``_unknown_`` (label values stay bounded by the served models). Labelled before the body is read, so
        a client gone mid-body is still counted on its model."""
        count = cls(protocol=protocol)
        served = registry.runners.get(name)
        if served is not None:
            count.model = name
            count.task = served.task or count.task
        return count

    def running(self) -> None:
        """The request reached its model: counted in-flight until :meth:`done`."""
        metrics.inflight(self.model, +1)
        self._running = True

    def done(self) -> None:
        """Count the finished request (once)."""
        if self._running:
            metrics.inflight(self.model, -1)
            self._running = False
        metrics.observe_request(self.model, self.task, self.code, time.monotonic() - self.t0,
                                protocol=self.protocol)


class HttpTransport:
    """The aiohttp application and its listener, with the routes of ``surfaces``.

    Args:
        registry: the served models.
        inflight: the drain's count of running calls; each model request counts while it runs.
        max_body: the largest request body in bytes (``max_receive_message_length``; more is 413).
        max_reply: the largest reply message in bytes (``max_send_message_length``, as on gRPC).
        tokens: the token check of the gRPC port, or None for no auth.
        auth_health: the open paths and /metrics need a token too.
        surfaces: the surfaces whose routes are served (modules, or objects with the same attributes: see the
            module docstring), in route order.
        limits: the listener's timeouts and connection cap (None: the server keys' defaults).
        repository: the server's model repository manager, for the surfaces (None: no repository).
    """

    OFF_LOOP_BYTES = 16 * 1024  # bodies this large or larger are decoded in the decode thread (decode())

    def __init__(self, registry: ModelRegistry, inflight: InflightCalls, *, max_body: int,
                 max_reply: int = 4 * 1024 * 1024, tokens: TokenAuthInterceptor | None = None,
                 auth_health: bool = False, surfaces: Sequence[Any] = (),
                 limits: ListenerLimits | None = None, repository: Any = None) -> None:
        self.registry, self.repository = registry, repository
        self.inflight = inflight
        self.max_reply = max_reply
        self.tokens = tokens
        self.auth_health = auth_health
        self.app = web.Application(client_max_size=max_body,
                                   middlewares=[tracing.http_middleware, self._connection, self._errors, self._auth])
        self.max_body = max_body
        self.limits = limits or ListenerLimits.from_config(ServerConfig())
        self.guard: ConnectionGuard | None = None  # the listening socket's protocol factory, from start()
        self.accept_errors: ThrottledLog | None = None
        self.decoded_off_loop = 0  # bodies decode() handed to its thread
        # one thread: a large body's Python-level decoding then takes at most every other GIL turn from the loop
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relserve-http-decode")
        self._server: asyncio.AbstractServer | None = None
        self._previous_handler: Any = None
        self._open_paths = [s.open_path for s in surfaces if hasattr(s, "open_path")]
        self._admin_paths = [s.admin_path for s in surfaces if hasattr(s, "admin_path")]
        # (refused_task, the surface's protocol label): the first surface that knows the path counts its refusal
        self._refused_tasks = [(s.refused_task, s.PROTOCOL) for s in surfaces if hasattr(s, "refused_task")]
        for surface in surfaces:
            # each route answers Expect: 100-continue itself (_expect): a body over the limit gets 417, not 100
            self.app.router.add_routes(web.RouteDef(d.method, d.path, d.handler, {"expect_handler": self._expect,
                                                                                   **d.kwargs})
                                       for d in surface.routes(self))
        self.app.router.add_get(metrics.METRICS_PATH, self.metrics)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------ listener

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Bind ``host:port`` (0: a free port) and serve. Returns the bound port.

        Raises:
            RuntimeError: the address could not be bound (message names it).
        """
        # shutdown_timeout: the drain has already waited for the running requests (InflightCalls); what is left
        # (a reply being written, a connection lingering over an unread body) gets 0.1 s. Not 0: aiohttp reads
        # 0 as no timeout at all, and a client that never sends its body would hold the stop
        # auto_decompress off: read() decodes the body itself, so that a bad or unsupported Content-Encoding
        # is a JSON 400 / 415 from the route rather than a plain-text 400 from aiohttp's parser
        limits = self.limits
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=0.1,
                                     auto_decompress=False, logger=ServerLog(log),
                                     keepalive_timeout=limits.keepalive_timeout)
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        # aiohttp's low-level server is a protocol factory for loop.create_server; the guard wraps it (caps,
        # header timer, half-close), in place of web.TCPSite
        self.guard = ConnectionGuard(self._runner.server, header_timeout=limits.header_timeout,
                                     max_connections=limits.max_connections or default_max_connections())
        self.guard.bind_loop(loop)
        try:
            self._server = await loop.create_server(self.guard, host, port, ssl=ssl_context, reuse_address=True,
                                                    backlog=128)
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            raise RuntimeError(f"cannot bind HTTP/JSON port {host}:{port}: {exc.strerror or exc}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        # asyncio reports each failed accept() (EMFILE...) with a traceback, up to 100 per wake-up: counted instead
        self.accept_errors = ThrottledLog(log, "accept() on the HTTP port failed for want of descriptors or memory",
                                          schedule=loop.call_later)
        self._previous_handler = loop.get_exception_handler()
        loop.set_exception_handler(accept_error_handler(self.accept_errors, self._previous_handler))
        return self.port

    async def stop(self) -> None:
        """Close the listener and its connections."""
        if self._server is not None:
            self._server.close()
            self._server = None
            loop = asyncio.get_running_loop()
            handler = loop.get_exception_handler()
            if getattr(handler, "throttle", None) is self.accept_errors:  # ours, not replaced since
                loop.set_exception_handler(self._previous_handler)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._decoder.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ middlewares

    @web.middleware
    async def _connection(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """The guard's view of a request: its head arrived (the header timer stops), and its reply is due (a
        half-closed connection closes after it)."""
        guard = self.guard
        if guard is None:
            return await handler(request)
        guard.request_started(request)
        response = None
        try:
            response = await handler(request)
            return response
        finally:
            guard.request_finished(request, response)

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue`` (every route's expect handler, run by aiohttp before the middlewares): a
        ``Content-Length`` over the limit is answered 417 at once, without ``100 Continue`` (the client sends no
        body); other expectations 417 too (RFC 9110 10.1.1); else ``100 Continue`` as aiohttp's default."""
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            response = json_response({"error": f"Expect {shown(expect)} is not supported (only 100-continue)",
                                      "code": "INVALID_ARGUMENT"}, 417)
        elif request.content_length is not None and request.content_length > self.max_body:
            response = json_response({"error": self._too_large(), "code": "RESOURCE_EXHAUSTED"}, 417)
        else:
            if request.version >= (1, 1):
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0  # the reply's own size starts after it (as aiohttp's default)
            return None
        response.force_close()
        return response

    def _too_large(self) -> str:
        return (f"the request body is over the server's max_receive_message_length of {self.max_body} bytes; send "
                f"fewer or shorter texts, or raise the limit in the server config")

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """Every error as JSON: aiohttp's own refusals (404, 405, 413) and anything a route raises."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if exc.status == 413:
                message = self._too_large()
            elif exc.status == 405:
                message = f"{request.method} is not allowed on {shown(request.path)}; allowed: " \
                          f"{exc.headers.get('Allow', '')}"
            elif exc.status == 404:
                message = f"no route {shown(request.path)}; see the HTTP/JSON API in the README"
            else:
                message = exc.text or exc.reason
            code = HTTP_CODES.get(exc.status, "INTERNAL" if exc.status >= 500 else "INVALID_ARGUMENT")
            headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
            response = json_response({"error": message, "code": code}, exc.status, headers)
            if exc.status == 408:
                # a stalled body: the reply is written now and the connection closed after it, where aiohttp
                # would wait lingering_time (10 s) for the rest of the body first
                response.force_close()
                await response.prepare(request)
                await response.write_eof()
                request.protocol.force_close()
            return response
        except RelserveError as exc:
            status, details = to_status(exc)
            return error_response(status, details, getattr(exc, "retry_after_s", None))
        except Exception as exc:  # a bug: INTERNAL for this request only, the server keeps serving
            status, details = to_status(exc)
            log.exception("%s %s failed: %s", request.method, shown(request.path), details)
            return error_response(status, details)

    def _is_open(self, request: web.Request) -> bool:
        if self.auth_health:
            return False
        path = request.path
        return path == metrics.METRICS_PATH or any(is_open(path) for is_open in self._open_paths)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if self.tokens is None or self._is_open(request) or any(f(request.path) for f in self._admin_paths):
            return await handler(request)
        reason = self.tokens.check(authorization(request))
        if reason is None:
            return await handler(request)
        reason = http_words(reason)
        task, protocol = next(((t, p) for t, p in ((f(request.path), p) for f, p in self._refused_tasks)
                               if t is not None), (metrics.UNKNOWN_MODEL, "http"))
        metrics.count_refused(task, grpc.StatusCode.UNAUTHENTICATED.name, protocol=protocol)
        return error_response(grpc.StatusCode.UNAUTHENTICATED, reason)

    # ------------------------------------------------------------------ request helpers (for the surfaces)

    async def body(self, request: web.Request) -> dict:
        """The JSON object in the request body (:meth:`read`).

        Raises:
            InvalidArgument: not UTF-8 JSON, or not an object; or as :meth:`read`.
            web.HTTPException: as :meth:`read`.
        """
        return await self.decode(await self.read(request), loads)

    def counted_loads(self, raw: bytes, fields: Sequence[Sequence[str]], task: str,
                      keys: Mapping[str, str] | None = None) -> dict:
        """The JSON object of ``raw`` (:func:`.json_codec.loads`) with its arrays ``fields`` counted first, as
        relserve.v1's gRPC port counts a request's repeated fields before parsing it: an array with more
        entries than ``max(WIRE_COUNT_MIN, the most any served model takes)`` is refused after that many
        element scans, with the gRPC port's message (:class:`.grpc_transport.TooManyEntries`), before the body
        is parsed; then :meth:`check_counts` on the parsed object. Run it in the decode thread.

        Args:
            fields: per array, the names it may have (the first holds the texts; see :meth:`check_counts`);
                the last name is the protobuf field's, which messages use.
            keys: per array name, the model config key that bounds it (default ``max_request_texts``).

        Raises:
            CountRefused: an array over the limit.
            InvalidArgument: as :func:`.json_codec.loads`.
        """
        limits: dict[str, tuple[int, str]] = {}
        for names in fields:
            for name in names:
                key = (keys or {}).get(name, "max_request_texts")
                most = [getattr(r.config, key) for r in self.registry.runners.values()
                        if getattr(getattr(r, "config", None), key, None) is not None]
                if most:
                    limits[name] = (max(most), key)
        if limits:
            caps = {name: max(limit, WIRE_COUNT_MIN) for name, (limit, _key) in limits.items()}
            over = count_top_arrays(raw, caps)
            if over is not None:
                name, model = over
                limit, key = limits[name]
                field = next(names[-1] for names in fields if name in names)
                raise CountRefused(str(TooManyEntries(field, caps[name], limit, model, key).refusal()), model)
        return self.check_counts(loads(raw), fields, task)

    def check_counts(self, body: dict, fields: Sequence[Sequence[str]], task: str) -> dict:
        """``body`` after :func:`.json_codec.check_counts` of its arrays ``fields`` against the
        ``max_request_texts`` of the model its ``model`` names, when that model is served for ``task`` (else
        the route's own lookup answers, as before); call it on the parsed JSON before any conversion.

        Raises:
            CountRefused: an array over the limit.
        """
        name = body.get("model")
        runner = self.registry.runners.get(name) if isinstance(name, str) else None
        if runner is not None and runner.task == task:
            check_counts(body, fields, name, runner.config.max_request_texts)
        return body

    async def decode(self, raw: bytes, parse: Callable[[bytes], T]) -> T:
        """``parse(raw)``: at once for a small body, in the decode thread for one of :attr:`OFF_LOOP_BYTES` or
        more (4 MiB of one-character texts took 1.4 s in protobuf's ParseDict, all of it on the event loop
        gRPC shares). Raises what ``parse`` raises."""
        if len(raw) < self.OFF_LOOP_BYTES:
            return parse(raw)
        self.decoded_off_loop += 1
        return await asyncio.get_running_loop().run_in_executor(self._decoder, parse, raw)

    async def read(self, request: web.Request) -> bytes:
        """The request body, decoded as its ``Content-Encoding`` says (``gzip``, ``deflate``, ``identity``;
        a list is applied last to first).

        Raises:
            InvalidArgument: the body is malformed in transit (chunked encoding, Content-Length), or is not
                what its Content-Encoding says.
            Cancelled: the client closed the connection before the body's end (nobody gets the answer).
            web.HTTPUnsupportedMediaType: another Content-Encoding (the middleware answers a JSON 415).
            web.HTTPRequestEntityTooLarge: over ``max_receive_message_length``, as sent or decoded (413); by its
                ``Content-Length`` before any of it is read.
            web.HTTPRequestTimeout: nothing arrived for ``http_body_timeout`` seconds (408, connection closed).
        """
        if request.content_length is not None and request.content_length > self.max_body:
            raise web.HTTPRequestEntityTooLarge(self.max_body, request.content_length)
        header = request.headers.get("Content-Encoding", "")
        encodings = [e.strip().lower() for e in header.split(",") if e.strip().lower() not in ("", "identity")]
        unsupported = [e for e in encodings if e not in _DECODERS]
        if unsupported:
            raise web.HTTPUnsupportedMediaType(
                text=f"Content-Encoding {shown(header)} is not supported; send the body uncompressed, gzip or "
                     f"deflate")
        try:
            body = await self._read_sent(request)
        except (web.RequestPayloadError, HttpProcessingError) as exc:
            cause = exc.__cause__ if isinstance(exc, web.RequestPayloadError) and exc.__cause__ else exc
            raise InvalidArgument(f"the request body could not be read: {cause}") from None
        except ConnectionError:
            raise Cancelled("the client closed the connection before sending the whole request body") from None
        for encoding in reversed(encodings):
            decoder = zlib.decompressobj(_DECODERS[encoding])
            try:
                # max_length: a small body must not expand past the limit in memory (a "zip bomb")
                decoded = decoder.decompress(body, self.max_body + 1)
                if not decoder.unconsumed_tail:
                    decoded += decoder.flush()
            except zlib.error as exc:
                raise InvalidArgument(f"the request body is not valid {encoding} data as its Content-Encoding "
                                      f"{shown(header)} says ({exc})") from None
            if len(decoded) > self.max_body or decoder.unconsumed_tail:
                raise web.HTTPRequestEntityTooLarge(self.max_body, len(decoded))
            if not decoder.eof or decoder.unused_data:
                raise InvalidArgument(f"the request body is not one complete {encoding} stream as its "
                                      f"Content-Encoding {shown(header)} says")
            body = decoded
        return body

    async def _read_sent(self, request: web.Request) -> bytes:
        """The body as sent, read as it arrives: at most ``http_body_timeout`` seconds between two reads (nginx's
        ``client_body_timeout``), refused once over the limit (as aiohttp's ``client_max_size``)."""
        body = bytearray()
        timeout = self.limits.body_timeout
        while True:
            try:
                async with asyncio.timeout(timeout):
                    chunk = await request.content.readany()
            except TimeoutError:
                raise web.HTTPRequestTimeout(
                    text=f"the request body stalled: nothing arrived for {timeout:g} s (the server's "
                         f"http_body_timeout); the connection is closed") from None
            if not chunk:
                return bytes(body)
            body.extend(chunk)
            if len(body) > self.max_body:
                raise web.HTTPRequestEntityTooLarge(self.max_body, len(body))

    @staticmethod
    def deadline(request: web.Request) -> float | None:
        """The ``time.monotonic()`` deadline of :data:`TIMEOUT_HEADER`, or None without the header.

        Raises:
            InvalidArgument: the header is not a number of seconds > 0.
        """
        value = request.headers.get(TIMEOUT_HEADER)
        if value is None:
            return None
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not 0 < seconds < math.inf:
            raise InvalidArgument(f"header {TIMEOUT_HEADER} must be a number of seconds > 0, got {shown(value)}")
        return time.monotonic() + seconds

    async def within(self, deadline: float | None, call: Awaitable[Any]) -> Any:
        """Await ``call`` until ``deadline`` (then it is cancelled, as grpc cancels a handler whose deadline
        passed; the handler counts it DEADLINE_EXCEEDED). Counted as a running call for the drain.

        Raises:
            Deadline: the deadline passed.
        """
        with self.inflight.counting():
            if deadline is None:
                return await call
            task = asyncio.current_task()
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    return await call
            except TimeoutError:
                raise Deadline() from None
            except asyncio.CancelledError:
                # a /v1 request ends an expired call with CancelledError of its own (http_v1)
                if time.monotonic() >= deadline and task is not None and not task.cancelling():
                    raise Deadline() from None
                raise

    # ------------------------------------------------------------------ /metrics

    async def metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics``: as the metrics port (service/metrics.py ``exposition``)."""
        output, content_type, encoding = metrics.exposition(
            request.headers.get("Accept", ""), request.headers.get("Accept-Encoding", ""),
            request.query.getall("name[]", None))
        response = web.Response(body=output)
        response.headers["Content-Type"] = content_type
        if encoding:
            response.headers["Content-Encoding"] = encoding
        return response
