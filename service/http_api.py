"""The HTTP/JSON API (server key ``http_port``): KServe v2 REST routes and relserve.v1 task routes, on aiohttp.

It runs on the server's asyncio loop (the one grpc.aio uses), beside the gRPC port, with the same TLS /
mTLS files, bearer tokens and message limit, and joins the drain like a gRPC call. Routes:

=========================================== =================================================================
``GET /v2``                                 server metadata ``{"name", "version", "extensions"}``
``GET /v2/health/live``                     200 ``{"live": true}``
``GET /v2/health/ready``                    200 ``{"ready": true}`` when every model is warm and the server is
                                            not draining, else 400 ``{"ready": false}`` (the v2 spec: 4xx is
                                            false)
``GET /v2/models/{name}[/versions/{v}]``    model metadata ``{"name", "versions", "platform", "inputs",
                                            "outputs"}`` (tensors per task: service/oip.py)
``GET /v2/models/{name}[/versions/{v}]/ready``  as ``/v2/health/ready`` for one model
``POST /v2/models/{name}[/versions/{v}]/infer`` ``{"id"?, "parameters"?, "inputs": [{"name", "shape",
                                            "datatype", "data"}], "outputs"?: [{"name"}]}`` ->
                                            ``{"model_name", "model_version", "id", "outputs": [...]}``;
                                            ``data`` flat or nested exactly as ``shape``, row-major, BYTES
                                            as JSON strings; tensor ``parameters`` as the gRPC servicer's
``GET /v1/models``                          relserve.v1 ListModels
``POST /v1/classify`` / ``/v1/answer`` /    the relserve.v1 request message (``model`` included) in
``/v1/translate``                           protobuf's canonical JSON mapping -> the response message in it
``GET /metrics``                            the Prometheus exposition (as the metrics port)
=========================================== =================================================================

JSON mapping of the /v1 routes: :func:`google.protobuf.json_format.ParseDict` (so both ``topK`` and
``top_k`` are accepted; an unknown field is 400) and ``MessageToDict`` with protobuf's canonical
lowerCamelCase names (``numTokens``, ``isImpossible``), every field printed, also when it holds its default.
The handlers are relserve.v1's own (:class:`relserve.service.api.InferenceServicer`), called with
:class:`HttpContext` in place of the grpc ServicerContext: validation, limits, error messages and the
``relserve_requests_total`` / duration / in-flight metrics are the gRPC path's. The v2 routes call the
transport-neutral core :mod:`relserve.service.oip` (the gRPC v2 servicer's too) and record the same metrics.

Errors: ``{"error": message, "code": "INVALID_ARGUMENT"}`` with the HTTP status of the gRPC code
(:data:`HTTP_STATUS`); a full queue's 429 has ``Retry-After`` (whole seconds, rounded up, from the pushback
estimate); a body over ``max_receive_message_length`` (as sent or decoded) is 413, malformed JSON or a
field of the wrong JSON type 400 (naming it), an unknown path 404, a wrong method 405. Request bodies may be
``Content-Encoding`` gzip or deflate (decoded here, not by aiohttp: a body that is not what its label says
is a JSON 400, another encoding a JSON 415). A request aiohttp's parser refuses before any route runs (not
HTTP, a header line without a colon, a bad Content-Length or chunk size) gets aiohttp's plain-text 400 and
one warning line in the log, no traceback (:class:`_ServerLog`). Deadlines: the optional
``X-Request-Timeout`` header (seconds, > 0) is the request's deadline, as a gRPC client's timeout (504
DEADLINE_EXCEEDED). A client that disconnects does not cancel its request (aiohttp's default): the work
finishes and the reply is dropped; one that disconnects while sending the body is CANCELLED (499, unsent),
counted on the URL's model for /v2 (when served, else ``_unknown_``) and on the route's task for /v1. Every
string a reply or status message may echo (``id``, tensor names, datatypes) must be valid UTF-8: a JSON
``"\ud800"`` (a lone surrogate) there is 400 INVALID_ARGUMENT before inference.

Auth: with ``auth_token_file`` every route needs ``Authorization: Bearer <token>`` (the gRPC interceptor's
check, :meth:`relserve.service.auth.TokenAuthInterceptor.check`) except the health routes (``/v2/health/*``,
``/v2/models/{name}/ready``) and ``/metrics``, which stay open unless ``auth_health`` (probes and the
separate metrics port need no token either). Refusals are 401 with ``WWW-Authenticate: Bearer`` and are
counted as ``relserve_requests_total{model="_unknown_", code="UNAUTHENTICATED"}``. No torch here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import time
import zlib
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from google.protobuf import json_format

from . import metrics, oip
from ._proto import inference_pb2
from .api import InferenceServicer, MalformedRequest
from .auth import TokenAuthInterceptor
from .backends.base import TASK_CLASSIFICATION, TASK_QA, TASK_TRANSLATION
from .drain import InflightCalls
from .errors import Cancelled, InvalidArgument, RelserveError, shown, to_status
from .registry import ModelRegistry

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "X-Request-Timeout"  # seconds; the request's deadline (gRPC clients send grpc-timeout)

# gRPC status -> HTTP status (the mapping of google.rpc / grpc-gateway, with FAILED_PRECONDITION as 400 like
# every other client mistake of this API).
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
_HTTP_CODES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 405: "UNIMPLEMENTED", 413: "RESOURCE_EXHAUSTED",
               415: "UNIMPLEMENTED"}
# Content-Encoding of a request body -> zlib wbits (gzip; deflate is zlib-wrapped per RFC 9110 8.4.1.2)
_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class _ServerLog(logging.LoggerAdapter):
    """The logger of aiohttp's connection handler (``aiohttp.web_protocol.RequestHandler``, its ``logger``
    option): ``aiohttp.server``, except that a request aiohttp's parser refuses before any route runs (no
    colon in a header line, a negative Content-Length, a bad chunk size, not HTTP at all) is the client's
    mistake: one warning line without a traceback, where aiohttp logs an ERROR with one."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            remote = args[0] if args else "?"
            reason = " ".join(str(exc_info.message or exc_info).split())  # one line
            log.warning("refused a malformed HTTP request from %s: %s %s", remote, exc_info.code, reason[:300])
        else:
            super().exception(msg, *args, exc_info=exc_info, **kw)


class _Aborted(Exception):
    """Raised by :meth:`HttpContext.abort`: the status a relserve.v1 handler ended the call with."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing


class HttpContext:
    """The subset of ``grpc.aio.ServicerContext`` that relserve.v1's handlers and their ``_rpc`` wrapper use,
    for one HTTP request.

    Args:
        deadline: ``time.monotonic()`` value of the request's deadline (from ``X-Request-Timeout``), or None.
        metadata: the request's headers as ``(lower-case name, value)`` pairs (``invocation_metadata``).
    """

    def __init__(self, deadline: float | None, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.deadline = deadline
        self.metadata = metadata
        self.trailing: tuple = ()
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        """Raises :class:`_Aborted` (grpc's abort raises too: the handler never returns)."""
        raise _Aborted(code, details, tuple(trailing_metadata) or self.trailing)


def _error(code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> web.Response:
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    if code == grpc.StatusCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return _json({"error": message, "code": code.name}, HTTP_STATUS.get(code, 500), headers)


def _json(body: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    # "replace": a lone surrogate in an echoed string (a JSON "\ud800") cannot be UTF-8; the request parser
    # refuses those (_check_text), so this only keeps a reply from ever failing as a 500 with a traceback
    return web.Response(body=json.dumps(body, ensure_ascii=False).encode("utf-8", "replace"), status=status,
                        headers=headers, content_type="application/json")


def _retry_after_from_trailer(trailing: tuple) -> float | None:
    for key, value in trailing:
        if key == "grpc-retry-pushback-ms":
            ms = int(value)
            return ms / 1000.0 if ms >= 0 else None  # negative: do not retry (gRFC A6), so no Retry-After
    return None


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


# relserve.v1 routes: path -> (RPC name, request type)
_V1_ROUTES = {
    "/v1/classify": ("Classify", inference_pb2.ClassifyRequest),
    "/v1/answer": ("Answer", inference_pb2.AnswerRequest),
    "/v1/translate": ("Translate", inference_pb2.TranslateRequest),
}
_TASK_OF_PATH = {"/v1/classify": TASK_CLASSIFICATION, "/v1/answer": TASK_QA, "/v1/translate": TASK_TRANSLATION,
                 "/v1/models": "list_models"}


class HttpApi:
    """The aiohttp application and its listener.

    Args:
        registry: the served models.
        servicer: relserve.v1's servicer (its handlers answer the /v1 routes).
        inflight: the drain's count of running calls; each model request counts while it runs.
        max_body: the largest request body in bytes (``max_receive_message_length``; more is 413).
        tokens: the token check of the gRPC port, or None for no auth.
        auth_health: the health routes and /metrics need a token too.
    """

    def __init__(self, registry: ModelRegistry, servicer: InferenceServicer, inflight: InflightCalls, *,
                 max_body: int, tokens: TokenAuthInterceptor | None = None, auth_health: bool = False) -> None:
        self.registry = registry
        self.servicer = servicer
        self.inflight = inflight
        self.tokens = tokens
        self.auth_health = auth_health
        self.app = web.Application(client_max_size=max_body, middlewares=[self._errors, self._auth])
        self.max_body = max_body
        r = self.app.router
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            r.add_get(base, self.model_metadata)
            r.add_get(base + "/ready", self.model_ready)
            r.add_post(base + "/infer", self.infer)
        r.add_get("/v1/models", self.list_models)
        for path in _V1_ROUTES:
            r.add_post(path, self.v1_task)
        r.add_get(metrics.METRICS_PATH, self.metrics)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------ listener

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Bind ``host:port`` (0: a free port) and serve. Returns the bound port.

        Raises:
            RuntimeError: the address could not be bound (message names it).
        """
        # shutdown_timeout 0: the drain has already waited for the running requests (InflightCalls)
        # auto_decompress off: _read decodes the body itself, so that a bad or unsupported Content-Encoding
        # is a JSON 400 / 415 from the route rather than a plain-text 400 from aiohttp's parser
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=0.0,
                                     auto_decompress=False, logger=_ServerLog())
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            raise RuntimeError(f"cannot bind HTTP/JSON port {host}:{port}: {exc.strerror or exc}") from None
        self.port = self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        """Close the listener and its connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ middlewares

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """Every error as JSON: aiohttp's own refusals (404, 405, 413) and anything a route raises."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if exc.status == 413:
                message = (f"the request body is over the server's max_receive_message_length of "
                           f"{self.max_body} bytes; send fewer or shorter texts, or raise the limit in the "
                           f"server config")
            elif exc.status == 405:
                message = f"{request.method} is not allowed on {shown(request.path)}; allowed: " \
                          f"{exc.headers.get('Allow', '')}"
            elif exc.status == 404:
                message = f"no route {shown(request.path)}; see the HTTP/JSON API in the README"
            else:
                message = exc.text or exc.reason
            code = _HTTP_CODES.get(exc.status, "INTERNAL" if exc.status >= 500 else "INVALID_ARGUMENT")
            headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
            return _json({"error": message, "code": code}, exc.status, headers)
        except RelserveError as exc:
            status, details = to_status(exc)
            return _error(status, details, getattr(exc, "retry_after_s", None))
        except Exception as exc:  # a bug: INTERNAL for this request only, the server keeps serving
            status, details = to_status(exc)
            log.exception("%s %s failed: %s", request.method, shown(request.path), details)
            return _error(status, details)

    def _is_open(self, request: web.Request) -> bool:
        if self.auth_health:
            return False
        path = request.path
        return (path.startswith("/v2/health/") or path == metrics.METRICS_PATH
                or (path.startswith("/v2/models/") and path.endswith("/ready")))

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if self.tokens is None or self._is_open(request):
            return await handler(request)
        reason = self.tokens.check([("authorization", v) for v in request.headers.getall("Authorization", [])])
        if reason is None:
            return await handler(request)
        # the gRPC interceptor's words are about metadata; an HTTP client sends a header
        reason = (reason.replace("'authorization' metadata entry", "'Authorization' header")
                  .replace("'authorization' metadata", "'Authorization' header")
                  .replace("'authorization: Bearer <token>'", "'Authorization: Bearer <token>'"))
        task = _TASK_OF_PATH.get(request.path, metrics.UNKNOWN_MODEL)
        metrics.count_refused(task, grpc.StatusCode.UNAUTHENTICATED.name)
        return _error(grpc.StatusCode.UNAUTHENTICATED, reason)

    # ------------------------------------------------------------------ request helpers

    async def _body(self, request: web.Request) -> dict:
        """The JSON object in the request body (:meth:`_read`).

        Raises:
            InvalidArgument: not UTF-8 JSON, or not an object; or as :meth:`_read`.
            web.HTTPException: as :meth:`_read`.
        """
        return _loads(await self._read(request))

    async def _read(self, request: web.Request) -> bytes:
        """The request body, decoded as its ``Content-Encoding`` says (``gzip``, ``deflate``, ``identity``;
        a list is applied last to first).

        Raises:
            InvalidArgument: the body is malformed in transit (chunked encoding, Content-Length), or is not
                what its Content-Encoding says.
            Cancelled: the client closed the connection before the body's end (nobody gets the answer).
            web.HTTPUnsupportedMediaType: another Content-Encoding (the middleware answers a JSON 415).
            web.HTTPRequestEntityTooLarge: over ``max_receive_message_length``, as sent or decoded (413).
        """
        header = request.headers.get("Content-Encoding", "")
        encodings = [e.strip().lower() for e in header.split(",") if e.strip().lower() not in ("", "identity")]
        unsupported = [e for e in encodings if e not in _DECODERS]
        if unsupported:
            raise web.HTTPUnsupportedMediaType(
                text=f"Content-Encoding {shown(header)} is not supported; send the body uncompressed, gzip or "
                     f"deflate")
        try:
            body = await request.read()
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

    @staticmethod
    def _deadline(request: web.Request) -> float | None:
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

    async def _within(self, deadline: float | None, call: Awaitable[Any]) -> Any:
        """Await ``call`` until ``deadline`` (then it is cancelled, as grpc cancels a handler whose deadline
        passed; the handler counts it DEADLINE_EXCEEDED). Counted as a running call for the drain.

        Raises:
            _Deadline: the deadline passed.
        """
        with self.inflight.counting():
            if deadline is None:
                return await call
            task = asyncio.current_task()
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    return await call
            except TimeoutError:
                raise _Deadline() from None
            except asyncio.CancelledError:
                # relserve.v1's wrapper ends an expired call with CancelledError of its own
                if time.monotonic() >= deadline and task is not None and not task.cancelling():
                    raise _Deadline() from None
                raise

    # ------------------------------------------------------------------ relserve.v1 routes

    async def v1_task(self, request: web.Request) -> web.Response:
        """``POST /v1/classify|answer|translate``: the relserve.v1 handler on the JSON-mapped message."""
        rpc, request_type = _V1_ROUTES[request.path]
        deadline = self._deadline(request)
        t0 = time.monotonic()
        try:
            raw = await self._read(request)
        except Cancelled:
            # no handler ran, so its wrapper cannot count it (as /v2 infer does): the model is in the unread
            # body, the task is the route's
            metrics.observe_request(metrics.UNKNOWN_MODEL, _TASK_OF_PATH[request.path],
                                    grpc.StatusCode.CANCELLED.name, time.monotonic() - t0)
            raise
        message: Any = request_type()
        try:
            json_format.ParseDict(_loads(raw), message)
        except (InvalidArgument, json_format.ParseError) as exc:
            # answered (INVALID_ARGUMENT) and counted by the handler's wrapper, as undecodable gRPC bytes are
            message = MalformedRequest(f"{request_type.DESCRIPTOR.full_name} in protobuf's JSON mapping", len(raw),
                                       str(exc)[:500])
        return await self._call_v1(rpc, message, deadline, request)

    async def list_models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: relserve.v1 ListModels."""
        return await self._call_v1("ListModels", inference_pb2.ListModelsRequest(), self._deadline(request),
                                   request)

    async def _call_v1(self, rpc: str, message: Any, deadline: float | None, request: web.Request) -> web.Response:
        context = HttpContext(deadline, tuple((k.lower(), v) for k, v in request.headers.items()))
        try:
            reply = await self._within(deadline, getattr(self.servicer, rpc)(message, context))
        except _Aborted as exc:
            return _error(exc.code, exc.details, _retry_after_from_trailer(exc.trailing))
        except _Deadline:
            return _error(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"the request's deadline ({TIMEOUT_HEADER}) passed before it was answered")
        return _json(json_format.MessageToDict(reply, always_print_fields_with_no_presence=True))

    # ------------------------------------------------------------------ KServe v2 routes

    async def server_metadata(self, request: web.Request) -> web.Response:
        meta = oip.server_metadata()
        return _json({"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)})

    async def live(self, request: web.Request) -> web.Response:
        return _json({"live": oip.server_live()})

    async def ready(self, request: web.Request) -> web.Response:
        ready = oip.server_ready(self.registry)
        return _json({"ready": ready}, 200 if ready else 400)

    async def model_ready(self, request: web.Request) -> web.Response:
        ready = oip.model_ready(self.registry, request.match_info["name"], request.match_info.get("version", ""))
        return _json({"name": request.match_info["name"], "ready": ready}, 200 if ready else 400)

    async def model_metadata(self, request: web.Request) -> web.Response:
        meta = oip.model_metadata(self.registry, request.match_info["name"], request.match_info.get("version", ""))

        def tensors(ts):
            return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in ts]

        return _json({"name": meta.name, "versions": list(meta.versions), "platform": meta.platform,
                      "inputs": tensors(meta.inputs), "outputs": tensors(meta.outputs)})

    async def infer(self, request: web.Request) -> web.Response:
        """``POST /v2/models/{name}[/versions/{v}]/infer`` through :func:`relserve.service.oip.infer_on`;
        counted in the request metrics (model and task labels once known), as the gRPC v2 servicer's ModelInfer."""
        t0 = time.monotonic()
        name, version = request.match_info["name"], request.match_info.get("version", "")
        # labels as the gRPC v2 servicer's ModelInfer: model and task once known. Here the URL names the model
        # before the body is read, so even a client gone mid-body is counted on it; a name that is not served
        # stays _unknown_ (label values are bounded by the served models)
        model, task, code, counted = metrics.UNKNOWN_MODEL, metrics.UNKNOWN_MODEL, "OK", False
        if name in self.registry.runners:
            model = name
            task = self.registry.runners[name].task or task
        try:
            if "Inference-Header-Content-Length" in request.headers:
                raise InvalidArgument("the binary tensor data extension (Inference-Header-Content-Length) is not "
                                      "supported; send the tensors as JSON")
            deadline = self._deadline(request)
            body = await self._body(request)
            inputs, parameters, outputs = _parse_infer(body)
            runner = oip.lookup(self.registry, name, version)
            metrics.inflight(model, +1)
            counted = True
            result = await self._within(deadline, oip.infer_on(runner, inputs, parameters, outputs, deadline))
            reply = {"model_name": name, "model_version": oip.MODEL_VERSION,
                     "outputs": [_tensor_json(t) for t in result]}
            if "id" in body:
                reply["id"] = body["id"]
            return _json(reply)
        except _Deadline:
            code = grpc.StatusCode.DEADLINE_EXCEEDED.name
            return _error(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"the request's deadline ({TIMEOUT_HEADER}) passed before it was answered")
        except web.HTTPException as exc:  # 413 / 415 from _read: the middleware answers them as JSON
            code = _HTTP_CODES.get(exc.status, "INVALID_ARGUMENT")
            raise
        except Exception as exc:
            status, details = to_status(exc)
            code = status.name
            if status == grpc.StatusCode.INTERNAL:
                log.exception("v2 infer on model %r failed: %s", model, details)
            return _error(status, details, getattr(exc, "retry_after_s", None))
        finally:
            if counted:
                metrics.inflight(model, -1)
            metrics.observe_request(model, task, code, time.monotonic() - t0)

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


def _loads(raw: bytes) -> dict:
    """The JSON object in a request body.

    Raises:
        InvalidArgument: not UTF-8 JSON, or not an object (the message says which).
    """
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"the request body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument("the request body is JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"the request body must be a JSON object, got {oip.describe(body)}")
    return body


class _Deadline(Exception):
    """The request's deadline passed (the awaited call was cancelled)."""


_REQUEST_FIELDS = ("id", "parameters", "inputs", "outputs")
_INPUT_FIELDS = ("name", "shape", "datatype", "parameters", "data")
_OUTPUT_FIELDS = ("name", "parameters")


def _object(value: Any, where: str, fields: tuple[str, ...]) -> dict:
    """``value`` if it is a JSON object with no field outside ``fields``.

    Raises:
        InvalidArgument: not an object, or an unknown field (naming ``where`` and the known fields).
    """
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be a JSON object {{{', '.join(fields)}}}, got {oip.describe(value)}")
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise InvalidArgument(f"unknown field(s) {unknown} in {where}; known: {', '.join(fields)}")
    return value


def _parameters_of(obj: dict, where: str) -> dict:
    """``obj["parameters"]``: a JSON object, or {} when absent or null."""
    parameters = obj.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"{where}: 'parameters' must be a JSON object, got {oip.describe(parameters)}")
    return parameters


def _flatten(data: Any, shape: list[int], where: str) -> list:
    """Row-major elements of a JSON tensor's ``data``: a flat array (its length is checked against the shape
    by :mod:`relserve.service.oip`), or arrays nested exactly as ``shape`` says (the v2 REST spec's two forms).

    Raises:
        InvalidArgument: not an array, or nested otherwise than ``shape`` (names the element and dimension).
    """
    if not isinstance(data, list):
        raise InvalidArgument(f"{where}: 'data' must be a JSON array, got {oip.describe(data)}")
    if not any(isinstance(v, list) for v in data):
        return data
    out: list = []
    hint = f"send the data flat or nested exactly as 'shape' {shape}"

    def walk(value: Any, depth: int, path: str) -> None:
        if depth == len(shape):
            if isinstance(value, list):
                raise InvalidArgument(f"{where}: data{path} is a list but 'shape' {shape} has {len(shape)} "
                                      f"dimension(s); {hint}")
            out.append(value)
            return
        if not isinstance(value, list) or len(value) != shape[depth]:
            got = f"{len(value)} elements" if isinstance(value, list) else oip.describe(value)
            raise InvalidArgument(f"{where}: data{path} must be a list of length {shape[depth]} (dimension "
                                  f"{depth} of 'shape' {shape}), got {got}; {hint}")
        for i, v in enumerate(value):
            walk(v, depth + 1, f"{path}[{i}]")

    walk(data, 0, "")
    return out


def _parse_infer(body: dict) -> tuple[list[oip.Tensor], dict, list[str]]:
    """The v2 REST inference request's inputs, parameters and requested output names; tensor-level
    parameters follow :func:`relserve.service.oip.check_tensor_parameters` (as the gRPC servicer's).

    Raises:
        InvalidArgument: an unknown, missing or mis-typed field (naming it and where it is).
    """
    _object(body, "the inference request", _REQUEST_FIELDS)
    if body.get("id") is not None and not isinstance(body["id"], str):
        raise InvalidArgument(f"'id' must be a string, got {oip.describe(body['id'])}")
    if body.get("id") is not None:
        _check_text(body["id"], "'id'")
    parameters = _parameters_of(body, "the inference request")
    raw_inputs = body.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidArgument(f"'inputs' must be a non-empty JSON array of tensors {{name, shape, datatype, data}}, "
                              f"got {'an empty list' if raw_inputs == [] else oip.describe(raw_inputs)}")
    inputs = []
    for i, t in enumerate(raw_inputs):
        where = f"inputs[{i}]"
        _object(t, where, _INPUT_FIELDS)
        for key, kind, words in (("name", str, "a string"), ("datatype", str, "a string"), ("shape", list, "a list")):
            if key not in t:
                raise InvalidArgument(f"{where}: {key!r} is missing")
            if not isinstance(t[key], kind):
                raise InvalidArgument(f"{where}: {key!r} must be {words}, got {oip.describe(t[key])}")
            if kind is str:
                _check_text(t[key], f"{where}: {key!r}")
        where = f"inputs[{i}] ({shown(t['name'])})"
        if "data" not in t:
            raise InvalidArgument(f"{where}: 'data' is missing")
        shape = t["shape"]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise InvalidArgument(f"{where}: 'shape' must be a list of non-negative integers, got {shown(str(shape))}")
        oip.check_tensor_parameters("input", t["name"], _parameters_of(t, where))
        try:
            data = _flatten(t["data"], shape, where)
        except RecursionError:
            raise InvalidArgument(f"{where}: 'data' is nested too deeply for 'shape' {shape}") from None
        inputs.append(oip.Tensor(t["name"], t["datatype"], tuple(shape), data))
    raw_outputs = body.get("outputs")
    if raw_outputs is None:
        raw_outputs = []
    if not isinstance(raw_outputs, list):
        raise InvalidArgument(f"'outputs' must be a JSON array of {{name, parameters}}, got "
                              f"{oip.describe(raw_outputs)}")
    names = []
    for i, o in enumerate(raw_outputs):
        where = f"outputs[{i}]"
        _object(o, where, _OUTPUT_FIELDS)
        if not isinstance(o.get("name"), str):
            raise InvalidArgument(f"{where}: 'name' must be a string, got {oip.describe(o.get('name'))}")
        _check_text(o["name"], f"{where}: 'name'")
        oip.check_tensor_parameters("output", o["name"], _parameters_of(o, f"{where} ({shown(o['name'])})"))
        names.append(o["name"])
    return inputs, parameters, names


def _check_text(value: str, where: str) -> None:
    """Refuse a string that UTF-8 cannot carry: JSON's ``"\ud800"`` escape parses to a lone surrogate, which
    would reach the reply (the echoed ``id``) or a status message and cannot be encoded there.

    Raises:
        InvalidArgument: ``value`` holds an unpaired surrogate (naming ``where`` and the character index).
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{where} is not valid UTF-8 text (an unpaired surrogate at character "
                              f"{exc.start})") from None


def _tensor_json(t: oip.Tensor) -> dict:
    data = [v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else v for v in t.data]
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "data": data}
