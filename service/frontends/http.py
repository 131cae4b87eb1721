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
                                            "outputs"}`` (tensors per task: frontends/oip_codec.py)
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
The /v1 routes decode and encode through :mod:`.v1_codec` (the gRPC frontend's codec), so validation,
limits, error messages and the ``relserve_requests_total`` / duration / in-flight metrics are the gRPC
path's; the v2 routes through :mod:`.json_codec` and :mod:`.oip_codec` (the gRPC v2 frontend's codec), with
the same metrics. Both call the tasks directly.

Errors: ``{"error": message, "code": "INVALID_ARGUMENT"}`` with the HTTP status of the domain error's code
(:data:`HTTP_STATUS`); a full queue's 429 has ``Retry-After`` (whole seconds, rounded up, from the error's
``retry_after_s``: on the /v1 routes after the gRPC trailer's rounding to whole milliseconds); a body over
``max_receive_message_length`` (as sent or decoded) is 413, malformed JSON or a field of the wrong JSON type
400 (naming it), an unknown path 404, a wrong method 405. Request bodies may be
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

from .. import metrics
from .._proto import inference_pb2
from ..auth import TokenAuthInterceptor
from ..backends.base import TASK_CLASSIFICATION, TASK_QA, TASK_TRANSLATION
from ..drain import InflightCalls
from ..errors import Cancelled, InvalidArgument, RelserveError, shown, to_status
from ..scheduling.pushback import pushback_ms
from ..registry import ModelRegistry
from . import oip_codec as oip
from . import v1_codec
from .json_codec import loads, parse_infer, tensor_json
from .messages import MalformedRequest, check_message_size, refuse_malformed

log = logging.getLogger(__name__)

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


def _error(code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> web.Response:
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    if code == grpc.StatusCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return _json({"error": message, "code": code.name}, HTTP_STATUS.get(code, 500), headers)


def _json(body: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    # "replace": a lone surrogate in an echoed string (a JSON "\ud800") cannot be UTF-8; the request parser
    # refuses those (json_codec.check_text), so this only keeps a reply from ever failing as a 500 with a traceback
    return web.Response(body=json.dumps(body, ensure_ascii=False).encode("utf-8", "replace"), status=status,
                        headers=headers, content_type="application/json")


def _v1_retry_after(exc: BaseException) -> float | None:
    """The Retry-After seconds of a /v1 error: a full queue's ``retry_after_s`` in the whole milliseconds the
    gRPC frontend's pushback trailer carries; None for every other error (no header)."""
    retry_after_s = getattr(exc, "retry_after_s", None)
    return None if retry_after_s is None else int(pushback_ms(retry_after_s)) / 1000.0


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


# relserve.v1 routes: path -> (task, request type, the RPC's name in log lines, codec call)
_V1_ROUTES = {
    "/v1/classify": (TASK_CLASSIFICATION, inference_pb2.ClassifyRequest, "Classify", v1_codec.classify),
    "/v1/answer": (TASK_QA, inference_pb2.AnswerRequest, "Answer", v1_codec.answer),
    "/v1/translate": (TASK_TRANSLATION, inference_pb2.TranslateRequest, "Translate", v1_codec.translate),
}
_TASK_OF_PATH = {"/v1/classify": TASK_CLASSIFICATION, "/v1/answer": TASK_QA, "/v1/translate": TASK_TRANSLATION,
                 "/v1/models": "list_models"}


class HttpApi:
    """The aiohttp application and its listener.

    Args:
        registry: the served models.
        inflight: the drain's count of running calls; each model request counts while it runs.
        max_body: the largest request body in bytes (``max_receive_message_length``; more is 413).
        max_reply: the largest /v1 reply message in bytes (``max_send_message_length``, as on gRPC).
        tokens: the token check of the gRPC port, or None for no auth.
        auth_health: the health routes and /metrics need a token too.
    """

    def __init__(self, registry: ModelRegistry, inflight: InflightCalls, *, max_body: int,
                 max_reply: int = 4 * 1024 * 1024, tokens: TokenAuthInterceptor | None = None,
                 auth_health: bool = False) -> None:
        self.registry = registry
        self.inflight = inflight
        self.max_reply = max_reply
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
        return loads(await self._read(request))

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
                # a /v1 request ends an expired call with CancelledError of its own (_v1)
                if time.monotonic() >= deadline and task is not None and not task.cancelling():
                    raise _Deadline() from None
                raise

    # ------------------------------------------------------------------ relserve.v1 routes

    async def v1_task(self, request: web.Request) -> web.Response:
        """``POST /v1/classify|answer|translate``: the relserve.v1 request message in protobuf's JSON mapping,
        through :mod:`.v1_codec` to the task."""
        task, request_type, rpc, call = _V1_ROUTES[request.path]
        deadline = self._deadline(request)
        t0 = time.monotonic()
        try:
            raw = await self._read(request)
        except Cancelled:
            # counted here: the model is in the unread body, the task is the route's
            metrics.observe_request(metrics.UNKNOWN_MODEL, task, grpc.StatusCode.CANCELLED.name, time.monotonic() - t0)
            raise
        message: Any = request_type()
        try:
            json_format.ParseDict(loads(raw), message)
        except (InvalidArgument, json_format.ParseError) as exc:
            # answered (INVALID_ARGUMENT) and counted by _v1, as undecodable gRPC bytes are
            message = MalformedRequest(f"{request_type.DESCRIPTOR.full_name} in protobuf's JSON mapping", len(raw),
                                       str(exc)[:500])
        return await self._v1(task, rpc, message, deadline, call)

    async def list_models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: relserve.v1 ListModels."""
        return await self._v1("list_models", "ListModels", inference_pb2.ListModelsRequest(),
                              self._deadline(request), None)

    async def _v1(self, task: str, rpc: str, message: Any, deadline: float | None,
                  call: Callable[..., Awaitable[Any]] | None) -> web.Response:
        """Run one /v1 request (``call`` None: ListModels) as relserve.v1's gRPC frontend would: the same
        validation and messages, the reply size limit, and ``relserve_requests_total`` / duration / in-flight
        under the model (once known) and ``task``; counted as a running call for the drain."""
        t0 = time.monotonic()
        model, counted, code = metrics.UNKNOWN_MODEL, False, "OK"

        def expired() -> bool:
            return deadline is not None and deadline - time.monotonic() <= 0

        async def handle() -> web.Response:
            nonlocal model, counted, code
            try:
                if isinstance(message, MalformedRequest):
                    raise refuse_malformed(message)
                if call is None:
                    model = ""
                    reply = v1_codec.list_models(self.registry)
                else:
                    if message.model in self.registry.runners:
                        model = message.model
                    runner = self.registry.get(message.model, task)
                    metrics.inflight(model, +1)
                    counted = True
                    reply = await call(runner, message, deadline)
                check_message_size(reply, self.max_reply, "reply")
            except asyncio.CancelledError:  # the deadline's timeout, or the server stopping
                code = (grpc.StatusCode.DEADLINE_EXCEEDED if expired() else grpc.StatusCode.CANCELLED).name
                raise
            except Exception as exc:
                status, details = to_status(exc)
                code = status.name
                if status == grpc.StatusCode.INTERNAL:
                    log.exception("%s on model %r failed: %s", rpc, model, details)
                if expired():  # answered as the deadline's 504 (_within)
                    code = grpc.StatusCode.DEADLINE_EXCEEDED.name
                    raise asyncio.CancelledError() from None
                return _error(status, details, _v1_retry_after(exc))
            finally:
                if counted:
                    metrics.inflight(model, -1)
                metrics.observe_request(model, task, code, time.monotonic() - t0)
            return _json(json_format.MessageToDict(reply, always_print_fields_with_no_presence=True))

        try:
            return await self._within(deadline, handle())
        except _Deadline:
            return _error(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"the request's deadline ({TIMEOUT_HEADER}) passed before it was answered")

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
        """``POST /v2/models/{name}[/versions/{v}]/infer`` through :func:`.oip_codec.infer_on`;
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
            inputs, parameters, outputs = parse_infer(body)
            runner = oip.lookup(self.registry, name, version)
            metrics.inflight(model, +1)
            counted = True
            result = await self._within(deadline, oip.infer_on(runner, inputs, parameters, outputs, deadline))
            reply = {"model_name": name, "model_version": oip.MODEL_VERSION,
                     "outputs": [tensor_json(t) for t in result]}
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


class _Deadline(Exception):
    """The request's deadline passed (the awaited call was cancelled)."""
