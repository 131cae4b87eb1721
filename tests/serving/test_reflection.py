"""Server reflection v1 beside v1alpha (service/reflection.py) on a real grpc.aio server with fake models: the
v1 schema matches v1alpha's field for field, v1 answers equal v1alpha's, and v1 follows the ``reflection``
key and the bearer token exactly as v1alpha does."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc
from prometheus_client import REGISTRY

from fixtures.fake_serving import runner, server_config
from fixtures.server import Running
from relserve.service._proto import reflection_pb2 as v1_pb2
from relserve.service._proto import reflection_pb2_grpc as v1_pb2_grpc
from relserve.service.metrics import UNKNOWN_MODEL

TOKEN = "reflection-token-0123456789"
V1 = (v1_pb2, v1_pb2_grpc)
V1ALPHA = (v1alpha_pb2, v1alpha_pb2_grpc)


def _fields(file_descriptor) -> dict:
    """Every message's fields as (name, number, type, repeated, message type name, oneof): the wire schema."""
    return {name: [(f.name, f.number, f.type, f.is_repeated, f.message_type.name if f.message_type else None,
                    f.containing_oneof.name if f.containing_oneof else None) for f in message.fields]
            for name, message in file_descriptor.message_types_by_name.items()}


def _ask(channel, version, requests: list[dict], metadata=None) -> list:
    """Send ``requests`` (ServerReflectionRequest keyword dicts) on one ServerReflectionInfo stream."""
    pb, pb_grpc = version
    stub = pb_grpc.ServerReflectionStub(channel)
    return list(stub.ServerReflectionInfo(iter([pb.ServerReflectionRequest(**r) for r in requests]),
                                          metadata=metadata, timeout=5))


REQUESTS = [
    {"list_services": ""},
    {"file_containing_symbol": "relserve.v1.Inference"},
    {"file_containing_symbol": "relserve.v1.ClassifyRequest"},
    {"file_by_filename": "inference.proto"},
    {"file_containing_symbol": "no.such.Symbol"},
]


def test_v1_schema_is_v1alpha_field_for_field():
    assert v1_pb2.DESCRIPTOR.package == "grpc.reflection.v1"
    assert _fields(v1_pb2.DESCRIPTOR) == _fields(v1alpha_pb2.DESCRIPTOR)
    (m1,) = v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].methods
    (m0,) = v1alpha_pb2.DESCRIPTOR.services_by_name["ServerReflection"].methods
    assert (m1.name, m1.client_streaming, m1.server_streaming) == (m0.name, m0.client_streaming,
                                                                  m0.server_streaming) == (
        "ServerReflectionInfo", True, True)


@pytest.fixture(scope="module")
def srv():
    s = Running(server_config(metrics_port=None), [runner("sentiment")])
    s.wait_serving()
    yield s
    s.close()


def test_v1_answers_equal_v1alpha(srv):
    v1 = _ask(srv.channel, V1, REQUESTS)
    v1alpha = _ask(srv.channel, V1ALPHA, REQUESTS)
    assert len(v1) == len(v1alpha) == len(REQUESTS)
    for a, b, request in zip(v1, v1alpha, REQUESTS):
        # wire-identical: the v1 reply's bytes are the v1alpha reply's bytes
        assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True), request
        assert a.original_request == v1_pb2.ServerReflectionRequest(**request)

    services = sorted(s.name for s in v1[0].list_services_response.service)
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection",
            "grpc.health.v1.Health", "relserve.v1.Inference"} <= set(services)
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in v1[1].file_descriptor_response.file_descriptor_proto]
    inference = next(f for f in files if f.package == "relserve.v1")
    assert "Inference" in [s.name for s in inference.service]
    assert {m.name for m in inference.service[0].method} >= {"Classify", "Answer", "Translate", "TranslateStream"}
    assert v1[4].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_v1_describes_itself(srv):
    (reply,) = _ask(srv.channel, V1, [{"file_containing_symbol": "grpc.reflection.v1.ServerReflection"}])
    (proto,) = [descriptor_pb2.FileDescriptorProto.FromString(b)
                for b in reply.file_descriptor_response.file_descriptor_proto]
    assert proto.package == "grpc.reflection.v1"
    assert [m.name for m in proto.service[0].method] == ["ServerReflectionInfo"]


def _unauthenticated_reflection() -> float:
    return sum(s.value for f in REGISTRY.collect() for s in f.samples
               if s.name == "relserve_requests_total" and {k: v for k, v in s.labels.items() if k != "protocol"}
               == {"model": UNKNOWN_MODEL, "task": "reflection", "code": "UNAUTHENTICATED"})


def test_v1_is_off_with_reflection_off_and_needs_the_token(tmp_path):
    off = Running(server_config(metrics_port=None, reflection=False), [runner("sentiment")])
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    guarded = Running(server_config(metrics_port=None, auth_token_file=tokens), [runner("sentiment")])
    try:
        off.wait_serving()
        guarded.wait_serving()  # health needs no token by default
        for version in (V1, V1ALPHA):
            with pytest.raises(grpc.RpcError) as err:
                _ask(off.channel, version, [{"list_services": ""}])
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        before = _unauthenticated_reflection()
        with pytest.raises(grpc.RpcError) as err:
            _ask(guarded.channel, V1, [{"list_services": ""}])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _unauthenticated_reflection() - before == 1  # counted under task "reflection", as v1alpha is
        bearer = [("authorization", f"Bearer {TOKEN}")]
        (reply,) = _ask(guarded.channel, V1, [{"list_services": ""}], metadata=bearer)
        assert "relserve.v1.Inference" in {s.name for s in reply.list_services_response.service}
    finally:
        off.close()
        guarded.close()
