"""service/tracing.py without a model: where the endpoint comes from, the OTLP/gRPC exporter against a collector
run here (``trace_service_pb2_grpc``), the decode loop's spans (queue, encoder call with its link, one decode
summary per text) with fake step backends, and the call's ids in log lines."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import logging

import grpc
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from relserve.models.decode_types import DecodeOptions  # noqa: E402
from relserve.service import tracing  # noqa: E402
from relserve.service.errors import ConfigError  # noqa: E402
from relserve.service.scheduling.decode_loop import DecodeLoop  # noqa: E402

from test_decode_loop import FakeStepBackend, src  # noqa: E402

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"


def test_endpoint_and_protocol():
    assert tracing.endpoint_from("http://c:4318", {}) == ("http://c:4318/v1/traces", "http/protobuf")
    assert tracing.endpoint_from("http://c:4318/v1/traces/", {}) == ("http://c:4318/v1/traces/", "http/protobuf")
    grpc_env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert tracing.endpoint_from("http://c:4317", grpc_env) == ("http://c:4317", "grpc")
    # without the key the exporter reads the standard variables itself
    assert tracing.endpoint_from(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == (None, "http/protobuf")
    assert tracing.wanted(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert not tracing.wanted(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    assert not tracing.wanted("http://c:4318", {"OTEL_SDK_DISABLED": "true"})  # the standard off switches
    assert not tracing.wanted(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"})
    with pytest.raises(ConfigError, match="http/json"):
        tracing.endpoint_from("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    for bad in ("not a url", "ftp://x", "http://", "collector:4318"):
        with pytest.raises(ConfigError, match="otlp_endpoint .* is not a collector URL"):
            tracing.endpoint_from(bad, {})
    assert not tracing.configure(None, {}) and not tracing.ENABLED


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list = []

    def Export(self, request, context):  # noqa: N802 - the service's name
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                self.spans.extend(ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def grpc_collector():
    collector = Collector()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    assert tracing.configure(f"http://127.0.0.1:{port}", env) and tracing.ENABLED
    try:
        yield collector
    finally:
        tracing.shutdown()
        server.stop(0)
    assert not tracing.ENABLED


def test_decode_loop_spans_over_otlp_grpc(grpc_collector):
    options = DecodeOptions(beam_size=1, n_best=1, max_length=100)

    async def main():
        loop = DecodeLoop("tr", FakeStepBackend(delay=0.001))
        loop.start()
        call = tracing.begin("test/Translate", {"traceparent": TRACEPARENT}.get, {})
        try:
            results = await loop.run([(src(100, 5), options), (src(200, 3), options)])
        finally:
            call.end("tr", "OK")
            await loop.close()
        return call, results

    call, results = asyncio.run(asyncio.wait_for(main(), 20))
    assert [r[0].tokens for r in results] == [list(range(100, 105)), list(range(200, 203))]
    tracing.shutdown()  # flushes the batch processor into the collector
    spans = {s.name: [] for s in grpc_collector.spans}
    for s in grpc_collector.spans:
        spans[s.name].append(s)
    assert all(s.trace_id.hex() == TRACE for s in grpc_collector.spans)
    (root,) = spans["test/Translate"]
    assert root.parent_span_id.hex() == PARENT
    (queue,) = spans["relserve.queue"]  # one per request, not per text
    (encode,) = spans["relserve.batch"]
    assert queue.parent_span_id == root.span_id and encode.parent_span_id == root.span_id
    assert [(link.trace_id.hex(), link.span_id) for link in encode.links] == [(TRACE, root.span_id)]
    attrs = {a.key: a.value for a in encode.attributes}
    assert attrs["relserve.batch.size"].int_value == 2 and attrs["relserve.phase"].string_value == "encode"
    assert attrs["relserve.batch.real_tokens"].int_value == 8 and attrs["relserve.batch.padded_tokens"].int_value == 10
    # one summary per text: its decoder step count and their seconds, never a span per step
    steps = sorted({a.key: a.value for a in s.attributes}["relserve.decode.steps"].int_value for s in spans["relserve.decode"])
    assert steps == [3, 5]
    assert all(s.parent_span_id == root.span_id for s in spans["relserve.decode"])


def test_log_lines_carry_the_call_ids():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s%(call_context)s"))
    tracing.install_log_context([handler])
    logger = logging.getLogger("relserve.test_tracing")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        async def main():
            logger.info("outside")
            call = tracing.begin("x", {"x-request-id": "req-7"}.get, {})  # tracing off: the request id only
            assert call is not None and call.span is None
            logger.info("inside")
            call.end(None, "OK")
            logger.info("after")
            assert tracing.begin("x", {}.get, {}) is None  # nothing to record: no call at all

        asyncio.run(main())
    finally:
        logger.removeHandler(handler)
    assert out.getvalue().splitlines() == ["outside", "inside [request_id=req-7]", "after"]
