"""The KServe v2 / Open Inference Protocol servicer (``inference.GRPCInferenceService``, grpc.aio).

Served on the same server and port as relserve.v1 (``service/server.py``): the same interceptors (bearer
tokens, drain tracking of running ModelInfer calls), the same error mapping and metrics wrapper
(:func:`.grpc_transport.rpc`: ``relserve_requests_total{model,task,code}`` etc., ModelInfer labelled with the
model's task once it is known, ``_unknown_`` before), the same tolerant request decoding (undecodable bytes
-> INVALID_ARGUMENT) and the same reply size limit. What the tensors mean, and every check, is
:mod:`.oip_codec`; this module converts between the wire messages and its :class:`~.oip_codec.Tensor`.

Wire forms (both as in the protocol): input elements as typed ``contents`` or as ``raw_input_contents``
(one entry per input, in binary form: :func:`.oip_codec.split_bytes`; tritonclient and KServe's client send
numpy data so). An input of a raw request may carry ``binary_data_size``, which must equal its entry's length
(KServe's client sets it). A request that used raw inputs, set the request parameter ``binary_data_output``
true or asked ``binary_data`` true for an output is answered in ``raw_output_contents`` (all outputs: the
protocol has one form per reply), else in typed contents. Other tensor-level parameters follow
:func:`.oip_codec.check_tensor_parameters` (as the HTTP routes): Triton's shared-memory keys and
``classification`` are INVALID_ARGUMENT. Input and element counts are checked on the message before any
list is built (``max_request_texts``). ServerLive, ServerReady and ModelReady are open without a token unless
``auth_health``, like grpc.health.v1 (kubelet probes cannot send metadata); metadata and inference need the
token. ``model_version`` addresses a loaded version (:func:`.oip_codec.lookup`; empty: the serving one) and the
reply names the version that answered.

Triton's model repository extension (``RepositoryIndex``, ``RepositoryModelLoad``, ``RepositoryModelUnload``:
:data:`REPOSITORY_METHODS`) goes through :mod:`.repository_codec` to the server's ``RepositoryManager``; those
methods take admin tokens only (``service/auth.py`` ``AdminTokenInterceptor``, before the request is decoded),
and the server metadata lists ``model_repository`` while a repository is served.
No torch here.
"""

from __future__ import annotations

from typing import Any

import grpc

from .. import metrics
from .._proto import grpc_predict_v2_pb2 as pb
from ..errors import InvalidArgument, shown
from ..registry import ModelRegistry
from . import oip_codec as oip
from . import repository_codec as repo
from .grpc_transport import deadline, register, rpc
from .messages import oneof_values

SERVICE_NAME = "inference.GRPCInferenceService"
# Probe RPCs: open like grpc.health.v1 unless auth_health (method-name prefixes for the token interceptor).
PROBE_METHODS = tuple(f"/{SERVICE_NAME}/{m}" for m in ("ServerLive", "ServerReady", "ModelReady"))
INFER_METHOD = f"/{SERVICE_NAME}/ModelInfer"  # the RPC a drain waits for
# The model repository extension: the admin token's RPCs (service/auth.py AdminTokenInterceptor).
REPOSITORY_METHODS = tuple(f"/{SERVICE_NAME}/{m}"
                           for m in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"))

HEALTH_TASK, METADATA_TASK = "health", "metadata"  # metrics task labels of the non-inference RPCs

# datatype -> InferTensorContents field holding its typed elements
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def add_to_server(servicer: "GRPCInferenceServicer", server: grpc.aio.Server) -> None:
    """Register ``servicer``'s RPCs of ``inference.GRPCInferenceService`` on ``server``, each request decoded
    tolerantly (as relserve.v1's)."""
    register(servicer, server, pb, "GRPCInferenceService")


def refused_task(name: str) -> str:
    """The metrics ``task`` label of a v2 RPC ``name`` refused before its handler ran (ModelInfer's model, and
    so its task, is not known then: ``_unknown_``)."""
    return getattr(getattr(GRPCInferenceServicer, name, None), "task", metrics.UNKNOWN_MODEL)


class GRPCInferenceServicer:
    """The six RPCs of the Open Inference Protocol over ``registry``, and Triton's three of the model
    repository extension over ``repository`` (the server's ``RepositoryManager``; None: no repository, as mode
    none without one) (see the module docstring)."""

    protocol = "kserve_v2_grpc"  # the metrics label (service/metrics.py PROTOCOLS), read by the rpc wrapper

    def __init__(self, registry: ModelRegistry, max_send_message_length: int = 4 * 1024 * 1024,
                 repository: repo.Manager | None = None) -> None:
        self.registry = registry
        self.max_send_message_length = max_send_message_length  # read by the rpc wrapper
        self.repository = repository

    @rpc(HEALTH_TASK)
    async def ServerLive(self, request, context, scope):
        scope.model = ""
        return pb.ServerLiveResponse(live=oip.server_live())

    @rpc(HEALTH_TASK)
    async def ServerReady(self, request, context, scope):
        scope.model = ""
        return pb.ServerReadyResponse(ready=oip.server_ready(self.registry))

    @rpc(HEALTH_TASK)
    async def ModelReady(self, request, context, scope):
        if request.name in self.registry.runners:
            scope.model = request.name
        return pb.ModelReadyResponse(ready=oip.model_ready(self.registry, request.name, request.version))

    @rpc(METADATA_TASK)
    async def ServerMetadata(self, request, context, scope):
        scope.model = ""
        meta = oip.server_metadata((repo.EXTENSION,) if repo.serves(self.repository) else ())
        return pb.ServerMetadataResponse(name=meta.name, version=meta.version, extensions=list(meta.extensions))

    @rpc(METADATA_TASK)
    async def ModelMetadata(self, request, context, scope):
        if request.name in self.registry.runners:
            scope.model = request.name
        meta = oip.model_metadata(self.registry, request.name, request.version)
        out = pb.ModelMetadataResponse(name=meta.name, versions=list(meta.versions), platform=meta.platform)
        for target, tensors in ((out.inputs, meta.inputs), (out.outputs, meta.outputs)):
            for t in tensors:
                target.add(name=t.name, datatype=t.datatype, shape=list(t.shape))
        return out

    @rpc(metrics.UNKNOWN_MODEL)
    async def ModelInfer(self, request, context, scope):
        if request.model_name in self.registry.runners:
            scope.model = request.model_name
        runner = oip.lookup(self.registry, request.model_name, request.model_version)
        # zero-shot and rerank requests to a classification model are labelled with their operation
        scope.task = oip.operation(runner.task or "", [i.name for i in request.inputs]) or scope.task
        scope.count_inflight()
        oip.check_input_count(runner.task or "", len(request.inputs))
        inputs = _inputs(request, runner.name, oip.max_elements(runner))
        parameters = _parameters(request.parameters, "request parameter")
        raw = oip.binary_output_default(parameters) or len(request.raw_input_contents) > 0
        requested = []
        for out in request.outputs:
            where = f"output {shown(out.name)} parameter"
            if oip.check_tensor_parameters("output", out.name, _parameters(out.parameters, where)):
                raw = True
            requested.append(out.name)
        outputs = await oip.infer_on(runner, inputs, parameters, requested, deadline(context))
        reply = pb.ModelInferResponse(model_name=runner.name, model_version=runner.version, id=request.id)
        for t in outputs:
            o = reply.outputs.add(name=t.name, datatype=t.datatype, shape=list(t.shape))
            if raw:
                reply.raw_output_contents.append(oip.to_bytes(t))
            else:
                getattr(o.contents, _CONTENTS_FIELD[t.datatype]).extend(t.data)
        return reply


    @rpc(repo.REPOSITORY_TASK)
    async def RepositoryIndex(self, request, context, scope):
        """Every model of the repositories and each version's state (:func:`.repository_codec.index`)."""
        scope.model = ""
        rows = repo.index(self.repository, request.repository_name, request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(
            name=r.name, version=r.version, state=r.state, reason=r.reason) for r in rows])

    @rpc(repo.REPOSITORY_TASK)
    async def RepositoryModelLoad(self, request, context, scope):
        """Load or reload a repository model; answered once its new versions serve."""
        scope.model = ""
        await repo.load(self.repository, request.model_name, repo.grpc_parameters(request.parameters),
                        request.repository_name)
        return pb.RepositoryModelLoadResponse()

    @rpc(repo.REPOSITORY_TASK)
    async def RepositoryModelUnload(self, request, context, scope):
        """Drain and unload every version of a repository model."""
        scope.model = ""
        await repo.unload(self.repository, request.model_name, repo.grpc_parameters(request.parameters),
                          request.repository_name)
        return pb.RepositoryModelUnloadResponse()


def _parameters(params: Any, what: str) -> dict[str, Any]:
    """A protobuf ``map<string, InferParameter>`` as plain Python values."""
    return oneof_values(params, what, "bool_param, int64_param, uint64_param, double_param, string_param")


def _inputs(request: Any, model: str, limit: int | None) -> list[oip.Tensor]:
    """The request's input tensors; each input's element count is checked against ``limit`` on the message,
    before its elements are copied.

    Raises:
        InvalidArgument: raw and typed contents mixed, a raw entry per input missing or extra, a
            ``binary_data_size`` other than its raw entry's length, a bad tensor parameter, malformed raw
            contents, or too many elements.
    """
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(f"raw_input_contents has {len(raw)} entries but the request has "
                              f"{len(request.inputs)} inputs; send one per input, in the order of inputs")
    tensors = []
    for i, t in enumerate(request.inputs):
        params = _parameters(t.parameters, f"input {shown(t.name)} parameter")
        if raw:
            size = oip.binary_data_size(t.name, params)
            if size is not None and size != len(raw[i]):
                raise InvalidArgument(f"input {shown(t.name)} has binary_data_size {size} but its raw_input_contents "
                                      f"entry has {len(raw[i])} bytes")
        oip.check_tensor_parameters("input", t.name, params)
        if raw:
            if t.HasField("contents"):
                raise InvalidArgument(f"input {shown(t.name)} has typed contents and the request has "
                                      f"raw_input_contents; use one form for all inputs")
            data = (oip.split_bytes(t.name, raw[i], model, limit, "raw contents") if t.datatype == oip.BYTES
                    else [])
        else:
            field = _CONTENTS_FIELD.get(t.datatype)
            if field:
                oip.check_element_count(model, len(getattr(t.contents, field)), limit)
            data = list(getattr(t.contents, field)) if field else []
        # non-BYTES data is not decoded: oip refuses the datatype, naming the input
        tensors.append(oip.Tensor(t.name, t.datatype, tuple(t.shape), data))
    return tensors
