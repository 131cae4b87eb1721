"""KServe v2 REST (the Open Inference Protocol's HTTP/REST binding): a surface of :mod:`.http_transport`.

=========================================== =================================================================
``GET /v2``                                 server metadata ``{"name", "version", "extensions"}``
                                            (``extensions``: ``["binary_tensor_data"]``, and
                                            ``"model_repository"`` while a model repository is served:
                                            frontends/http_repository.py)
``GET /v2/health/live``                     200 ``{"live": true}``
``GET /v2/health/ready``                    200 ``{"ready": true}`` when every model is warm and the server is
                                            not draining, else 400 ``{"ready": false}`` (the v2 spec: 4xx is
                                            false)
``GET /v2/models/{name}[/versions/{v}]``    model metadata ``{"name", "versions", "platform", "inputs",
                                            "outputs"}`` (tensors per task: frontends/oip_codec.py)
``GET /v2/models/{name}[/versions/{v}]/ready``  as ``/v2/health/ready`` for one model
``POST /v2/models/{name}[/versions/{v}]/infer`` ``{"id"?, "model_name"?, "model_version"?, "parameters"?,
                                            "inputs": [{"name", "shape", "datatype", "data"}], "outputs"?:
                                            [{"name"}]}`` -> ``{"model_name", "model_version", "outputs":
                                            [...], "id"}``; ``data`` flat or nested exactly as ``shape``,
                                            row-major, BYTES as JSON strings; tensor ``parameters`` as the
                                            gRPC servicer's; ``model_name`` / ``model_version`` must agree
                                            with the URL
=========================================== =================================================================

Binary tensor data, as Triton's ``binary_tensor_data`` extension specifies it: a request with the
``Inference-Header-Content-Length`` header has that many bytes of JSON, then the binary data of each input
that declares ``parameters: {"binary_data_size": n}`` (instead of ``data``), in the order of ``inputs``, to
the body's end (BYTES elements as a 4-byte little-endian length then the bytes). An output asked
``binary_data: true`` (or every output, with the request parameter ``binary_data_output: true``, unless the
output says false) comes back as ``parameters: {"binary_data_size": n}`` with its bytes after the JSON
(FP32 / INT64 little-endian, BOOL one byte); such a reply is ``application/octet-stream`` with the
``Inference-Header-Content-Length`` header, a reply without binary outputs plain JSON as before. The
declared lengths are checked against the body (the body is read up to ``max_receive_message_length`` only):
a header that is not a number, 0 (Triton's raw binary request, which no model here qualifies for), or longer
than the body, a ``binary_data_size`` that is negative, runs past the body's end, or leaves bytes over, are
400 naming the input and the sizes.

The requests decode through :mod:`.json_codec` and :mod:`.oip_codec` (the gRPC v2 frontend's codec), with the
same metrics (``relserve_requests_total`` under the URL's model, when served, and its task; ``_unknown_``
before). A client gone while sending the body is CANCELLED (499, unsent), counted on the URL's model. The
health routes (``/v2/health/*``, ``/v2/models/{name}/ready``) need no token unless ``auth_health``.
No torch here.
"""

from __future__ import annotations

import logging

import grpc
from aiohttp import web

from . import oip_codec as oip
from . import repository_codec as repo
from .http_transport import (HTTP_CODES, Counted, Deadline, HttpTransport, deadline_response, error_response,
                             json_response)
from .http_calls import counted_failure
from .json_codec import INFERENCE_HEADER, InferRequest, encode_reply, loads, parse_infer, split_body

log = logging.getLogger(__name__)

PROTOCOL = "kserve_v2_http"  # the metrics label (service/metrics.py PROTOCOLS)


def routes(core: HttpTransport) -> list[web.RouteDef]:
    """The v2 routes, served on ``core`` (see the module docstring)."""
    api = _V2(core)
    out = [web.get("/v2", api.server_metadata), web.get("/v2/health/live", api.live),
           web.get("/v2/health/ready", api.ready)]
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        out += [web.get(base, api.model_metadata), web.get(base + "/ready", api.model_ready),
                web.post(base + "/infer", api.infer)]
    return out


def refused_task(path: str) -> str | None:
    """The metrics ``task`` label of a request to ``path`` refused for its token: ``_unknown_`` on a /v2 path
    (the request was not read), None elsewhere (another surface's path)."""
    return "_unknown_" if path == "/v2" or path.startswith("/v2/") else None


def open_path(path: str) -> bool:
    """The probes: open without a token unless ``auth_health``."""
    return path.startswith("/v2/health/") or (path.startswith("/v2/models/") and path.endswith("/ready"))


class _V2:
    """The handlers of :func:`routes`, on the transport ``core``."""

    def __init__(self, core: HttpTransport) -> None:
        self.core = core
        self.registry = core.registry

    async def server_metadata(self, request: web.Request) -> web.Response:
        meta = oip.server_metadata((repo.EXTENSION,) if repo.serves(self.core.repository) else ())
        return json_response({"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)})

    async def live(self, request: web.Request) -> web.Response:
        return json_response({"live": oip.server_live()})

    async def ready(self, request: web.Request) -> web.Response:
        ready = oip.server_ready(self.registry)
        return json_response({"ready": ready}, 200 if ready else 400)

    async def model_ready(self, request: web.Request) -> web.Response:
        ready = oip.model_ready(self.registry, request.match_info["name"], request.match_info.get("version", ""))
        return json_response({"name": request.match_info["name"], "ready": ready}, 200 if ready else 400)

    async def model_metadata(self, request: web.Request) -> web.Response:
        meta = oip.model_metadata(self.registry, request.match_info["name"], request.match_info.get("version", ""))

        def tensors(ts):
            return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in ts]

        return json_response({"name": meta.name, "versions": list(meta.versions), "platform": meta.platform,
                              "inputs": tensors(meta.inputs), "outputs": tensors(meta.outputs)})

    async def infer(self, request: web.Request) -> web.Response:
        """``POST /v2/models/{name}[/versions/{v}]/infer`` through :func:`.oip_codec.infer_on`;
        counted in the request metrics (model and task labels once known), as the gRPC v2 servicer's ModelInfer."""
        name, version = request.match_info["name"], request.match_info.get("version", "")
        # labels as the gRPC v2 servicer's ModelInfer: model and task once known (here from the URL)
        count = Counted.for_url_model(self.registry, name, protocol=PROTOCOL)
        served = self.registry.runners.get(name)
        try:
            deadline = self.core.deadline(request)
            header = request.headers.get(INFERENCE_HEADER)

            def decode(raw: bytes) -> tuple[dict, InferRequest]:
                text, binary = split_body(raw, header)
                body = loads(text)
                return body, parse_infer(body, binary, model=name, version=version, limit=oip.max_elements(served),
                                         serving=served.version if served is not None else oip.MODEL_VERSION)

            # a large body's JSON and binary elements are decoded in the transport's decode thread, off the loop
            body, parsed = await self.core.decode(await self.core.read(request), decode)
            runner = oip.lookup(self.registry, name, version)
            count.task = oip.operation(runner.task or "", [t.name for t in parsed.inputs]) or count.task
            count.running()
            result = await self.core.within(deadline, oip.infer_on(runner, parsed.inputs, parsed.parameters,
                                                                   parsed.outputs, deadline))
            reply: dict = {"model_name": name, "model_version": runner.version, "outputs": None}
            if "id" in body:
                reply["id"] = body["id"]
            payload, json_length = encode_reply(reply, result, parsed)
            if json_length is None:
                return web.Response(body=payload, content_type="application/json")
            return web.Response(body=payload, content_type="application/octet-stream",
                                headers={INFERENCE_HEADER: str(json_length)})
        except Deadline:
            count.code = grpc.StatusCode.DEADLINE_EXCEEDED.name
            return deadline_response()
        except web.HTTPException as exc:  # 413 / 415 from read(): the transport's middleware answers them as JSON
            count.code = HTTP_CODES.get(exc.status, "INVALID_ARGUMENT")
            raise
        except Exception as exc:
            status, details = counted_failure(count, exc, log, f"v2 infer on model {count.model!r}")
            return error_response(status, details, getattr(exc, "retry_after_s", None))
        finally:
            count.done()
