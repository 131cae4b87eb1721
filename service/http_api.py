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
                                            ``data`` flat or nested row-major, BYTES as JSON strings
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
estimate); a body over ``max_receive_message_length`` is 413, malformed JSON 400, an unknown path 404, a
wrong method 405. Deadlines: the optional ``X-Request-Timeout`` header (seconds, > 0) is the request's
deadline, as a gRPC client's timeout (504 DEADLINE_EXCEEDED). A client that disconnects does not cancel its
request (aiohttp's default): the work finishes and the reply is dropped.

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
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
from aiohttp import web
from google.protobuf import json_format

from . import metrics, oip
from ._proto import inference_pb2
from .api import InferenceServicer, MalformedRequest
from .auth import TokenAuthInterceptor
from .backends.base import TASK_CLASSIFICATION, TASK_QA, TASK_TRANSLATION
from .drain import InflightCalls
from .errors import InvalidArgument, RelserveError, shown, to_status
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
_HTTP_CODES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 405: "UNIMPLEMENTED", 413: "RESOURCE_EXHAUSTED"}


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
    return web.Response(body=json.dumps(body, ensure_ascii=False).encode(), status=status, headers=headers,
                        content_type="application/json")


def _retry_after_from_trailer(trailing: tuple) -> float | None:
    for key, value in trailing:
        if key == "grpc-retry-pushback-ms":
            return int(value) / 1000.0
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
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=0.0)
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
        reason = reason.replace("'authorization' metadata", "'Authorization' header")
        task = _TASK_OF_PATH.get(request.path, metrics.UNKNOWN_MODEL)
        metrics.count_refused(task, grpc.StatusCode.UNAUTHENTICATED.name)
        return _error(grpc.StatusCode.UNAUTHENTICATED, reason)

    # ------------------------------------------------------------------ request helpers

    async def _body(self, request: web.Request) -> dict:
        """The JSON object in the request body.

        Raises:
            InvalidArgument: not UTF-8 JSON, or not an object.
            web.HTTPRequestEntityTooLarge: over ``max_receive_message_length`` (the middleware answers 413).
        """
        return _loads(await request.read())

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
        raw = await request.read()
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
        # labels as the gRPC v2 servicer's ModelInfer: model and task once known, _unknown_ before
        model, task, code, counted = metrics.UNKNOWN_MODEL, metrics.UNKNOWN_MODEL, "OK", False
        try:
            if "Inference-Header-Content-Length" in request.headers:
                raise InvalidArgument("the binary tensor data extension (Inference-Header-Content-Length) is not "
                                      "supported; send the tensors as JSON")
            deadline = self._deadline(request)
            body = await self._body(request)
            if name in self.registry.runners:
                model = name
                task = self.registry.runners[name].task or task
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
        except web.HTTPRequestEntityTooLarge:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED.name
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
        raise InvalidArgument(f"the request body must be a JSON object, got a JSON {type(body).__name__}")
    return body


class _Deadline(Exception):
    """The request's deadline passed (the awaited call was cancelled)."""


def _flatten(data: Any, where: str) -> list:
    """Row-major elements of a JSON tensor ``data`` (flat or nested lists)."""
    if not isinstance(data, list):
        raise InvalidArgument(f"{where}: 'data' must be a JSON array, got {type(data).__name__}")
    out: list = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            out.append(value)
        else:
            stack.pop()
    return out


def _parse_infer(body: dict) -> tuple[list[oip.Tensor], dict, list[str]]:
    """The v2 REST inference request's inputs, parameters and requested output names.

    Raises:
        InvalidArgument: a missing or mis-typed field (naming it).
    """
    unknown = set(body) - {"id", "parameters", "inputs", "outputs"}
    if unknown:
        raise InvalidArgument(f"unknown field(s) {sorted(unknown)} in the inference request; known: id, "
                              f"parameters, inputs, outputs")
    if "id" in body and not isinstance(body["id"], str):
        raise InvalidArgument("'id' must be a string")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument("'parameters' must be a JSON object")
    raw_inputs = body.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidArgument("'inputs' must be a non-empty JSON array of tensors {name, shape, datatype, data}")
    inputs = []
    for i, t in enumerate(raw_inputs):
        where = f"inputs[{i}]"
        if not isinstance(t, dict):
            raise InvalidArgument(f"{where} must be a JSON object {{name, shape, datatype, data}}")
        for key, kind in (("name", str), ("datatype", str), ("shape", list)):
            if not isinstance(t.get(key), kind):
                raise InvalidArgument(f"{where}: {key!r} is missing or not a JSON {kind.__name__}")
        if "data" not in t:
            raise InvalidArgument(f"{where}: 'data' is missing")
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in t["shape"]):
            raise InvalidArgument(f"{where}: 'shape' must be a list of integers")
        if (t.get("parameters") or {}).get("binary_data_size") is not None:
            raise InvalidArgument(f"{where}: binary tensor data is not supported; send the data as JSON")
        inputs.append(oip.Tensor(t["name"], t["datatype"], tuple(t["shape"]), _flatten(t["data"], where)))
    names = []
    for i, o in enumerate(body.get("outputs") or []):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise InvalidArgument(f"outputs[{i}] must be a JSON object with a string 'name'")
        if (o.get("parameters") or {}).get("binary_data"):
            raise InvalidArgument(f"outputs[{i}]: binary tensor data is not supported")
        names.append(o["name"])
    return inputs, parameters, names


def _tensor_json(t: oip.Tensor) -> dict:
    data = [v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else v for v in t.data]
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "data": data}
