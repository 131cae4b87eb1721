"""Server reflection, both versions: ``grpc.reflection.v1alpha`` and ``grpc.reflection.v1``.

grpcio-reflection 1.85.1 implements only v1alpha. Clients now ask for v1 first (grpcurl does, falling back
to v1alpha on UNIMPLEMENTED), and newer tools may not fall back at all, so v1 is served as well: its stubs
are generated from ``proto/grpc/reflection/v1/reflection.proto`` (the published schema; package, names and
field numbers as upstream) and :class:`V1ReflectionServicer` answers each v1 request with what the
v1alpha implementation answers. The two versions' messages are wire-identical (same fields, same numbers;
tests/serving/test_reflection.py checks it), so a request or reply changes version by re-parsing its bytes.

Both services list each other and resolve symbols from the same default descriptor pool, so a v1 and a
v1alpha client get the same answers. Whether reflection is on at all, and that it needs the bearer token
when tokens are configured, is decided by the server (``reflection`` config key; service/server.py).
"""

from __future__ import annotations

from typing import AsyncIterable, AsyncIterator, Iterable

import grpc
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc

from ._proto import reflection_pb2 as v1_pb2
from ._proto import reflection_pb2_grpc as v1_pb2_grpc

V1ALPHA_SERVICE_NAME = v1alpha.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
V1_SERVICE_NAME = v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name  # "grpc.reflection.v1..."
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)


class V1ReflectionServicer(v1_pb2_grpc.ServerReflectionServicer):
    """``grpc.reflection.v1.ServerReflection`` answered by a v1alpha servicer (grpc.aio).

    Args:
        v1alpha_servicer: the ``grpc_reflection.v1alpha.reflection.aio.ReflectionServicer`` that also serves
            v1alpha, so both versions list the same services and read the same descriptor pool.

    Every request is converted to v1alpha by its bytes and every reply back to v1 the same way; the reply's
    ``original_request`` is therefore the v1 request as sent.
    """

    def __init__(self, v1alpha_servicer: v1alpha.aio.ReflectionServicer) -> None:
        self._v1alpha = v1alpha_servicer

    async def ServerReflectionInfo(self, request_iterator: AsyncIterable[v1_pb2.ServerReflectionRequest],
                                   context: grpc.aio.ServicerContext) -> AsyncIterator[v1_pb2.ServerReflectionResponse]:
        async def as_v1alpha() -> AsyncIterator[v1alpha_pb2.ServerReflectionRequest]:
            async for request in request_iterator:
                yield v1alpha_pb2.ServerReflectionRequest.FromString(request.SerializeToString())

        async for reply in self._v1alpha.ServerReflectionInfo(as_v1alpha(), context):
            yield v1_pb2.ServerReflectionResponse.FromString(reply.SerializeToString())


def enable(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1alpha and v1 on ``server``, listing ``service_names`` plus both reflection services.

    Args:
        service_names: fully-qualified names of the other services served (e.g. ``relserve.v1.Inference``).
        server: a ``grpc.aio.Server`` not yet started.
    """
    servicer = v1alpha.aio.ReflectionServicer((*service_names, *SERVICE_NAMES))
    v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1_pb2_grpc.add_ServerReflectionServicer_to_server(V1ReflectionServicer(servicer), server)
