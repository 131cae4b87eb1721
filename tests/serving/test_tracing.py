"""OpenTelemetry tracing through the batcher, on a real ``relserve serve`` process (tiny classifier) that exports
to an OTLP/HTTP receiver run by the test (``/v1/traces``, decoded with opentelemetry-proto's classes).

Two clients send their own W3C ``traceparent`` at once: each trace gets the call span (a child of the client's
span), tokenization and queue spans; the one backend call that served both is one batch span, in the trace of
the request that anchored it, linked to both call spans, with its sizes, backend and dtype. The call's log line
carries its trace id and x-request-id. An HTTP request is traced too. With tracing off no ``opentelemetry``
module is imported; with an endpoint but without the extra the server exits 2 naming it."""

from __future__ import annotations

import gzip
import http.server
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

pytest.importorskip("torch")
trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.hidden_modules import hiding_env  # noqa: E402
from relserve.loadtest.serverproc import ServerProcess  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service._proto import inference_pb2_grpc as pb_grpc  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parents[1]
CLIENT_SPAN = {"a": "00f067aa0ba902b7", "b": "10f067aa0ba902b8", "h": "20f067aa0ba902b9"}
TRACE = {"a": "4bf92f3577b34da6a3ce929d0e0e4736", "b": "5bf92f3577b34da6a3ce929d0e0e4737",
         "h": "6bf92f3577b34da6a3ce929d0e0e4738"}


def traceparent(who: str) -> str:
    return f"00-{TRACE[who]}-{CLIENT_SPAN[who]}-01"


class Receiver:
    """An OTLP/HTTP trace receiver on a free loopback port: every exported span, decoded, in ``spans``."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.add(self.path, body)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, path: str, body: bytes) -> None:
        assert path == "/v1/traces", path
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        spans = []
        for rs in request.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({
                        "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                        "service": service, "error": s.status.code == 2,
                        "attrs": {a.key: _value(a.value) for a in s.attributes},
                        "links": {(link.trace_id.hex(), link.span_id.hex()) for link in s.links},
                    })
        with self.lock:
            self.spans.extend(spans)

    def wait_for(self, predicate, timeout: float = 20.0) -> list[dict]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"spans never arrived; got {[(s['name'], s['trace']) for s in spans]}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def traced(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tracing")
    cls = make_deberta_checkpoint(root / "cls", task="classification", tokenizer_dir=unigram_tokenizer_dir,
                                  labels=("a", "b"), seed=1).path
    # two requests of one text each fill a batch of two; the first waits for the second at most 5 s
    model = {"name": "cls", "path": str(cls), "max_seq_len": 64, "device": "cpu", "worker_process": False,
             "warmup": False, "dtype": "float32", "max_batch_size": 2, "max_queue_delay": 5.0}
    config = root / "config.yaml"
    config.write_text(json.dumps({"http_port": 0, "models": [model]}))
    receiver = Receiver()
    server = ServerProcess(["--config", str(config), "--otlp-endpoint", f"http://127.0.0.1:{receiver.port}"],
                           env={"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": "relserve-test"},
                           start_timeout=180)
    server.command = lambda: [*ServerProcess.command(server)[:-1], "DEBUG"]  # the call's access line is DEBUG
    server.start()
    channel = grpc.insecure_channel(server.target)
    try:
        yield server, pb_grpc.InferenceStub(channel), receiver, cls
    finally:
        channel.close()
        server.close()
        receiver.close()


def _one(spans, **match):
    found = [s for s in spans if all(s[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, [(s["name"], s["trace"]) for s in spans])
    return found[0]


def test_two_traced_calls_in_one_batch(traced):
    server, stub, receiver, _ = traced
    replies = {}

    def send(who: str) -> None:
        replies[who] = stub.Classify(pb.ClassifyRequest(model="cls", texts=[f"text number {who}"]), timeout=60,
                                     metadata=(("traceparent", traceparent(who)), ("x-request-id", f"req-{who}")))

    threads = [threading.Thread(target=send, args=(who,)) for who in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(replies) == {"a", "b"}

    spans = receiver.wait_for(lambda ss: sum(s["name"] == "relserve.batch" for s in ss) >= 1
                              and sum(s["name"] == "grpc_v1/Classify" for s in ss) >= 2)
    calls = {}
    for who in "ab":
        call = _one(spans, name="grpc_v1/Classify", trace=TRACE[who])
        assert call["parent"] == CLIENT_SPAN[who]  # continues the client's trace
        assert call["service"] == "relserve-test"
        assert call["attrs"]["relserve.model"] == "cls" and call["attrs"]["rpc.grpc.status_code"] == 0
        assert call["attrs"]["relserve.request_id"] == f"req-{who}" and not call["error"]
        for phase in ("relserve.tokenize", "relserve.queue"):
            assert _one(spans, name=phase, trace=TRACE[who])["parent"] == call["id"]
        calls[who] = call

    batch = _one(spans, name="relserve.batch")
    # one backend call served both requests: it links to both call spans, and lives in its anchor's trace
    assert batch["links"] == {(TRACE[w], calls[w]["id"]) for w in "ab"}
    anchor = next(w for w in "ab" if TRACE[w] == batch["trace"])
    assert batch["parent"] == calls[anchor]["id"]
    attrs = batch["attrs"]
    assert attrs["relserve.batch.size"] == 2 and attrs["relserve.batch.requests"] == 2
    assert attrs["relserve.batch.padded_tokens"] >= attrs["relserve.batch.real_tokens"] >= 2
    assert attrs["relserve.backend"] == "torch" and attrs["relserve.dtype"] == "float32"
    assert attrs["relserve.model"] == "cls"

    log = server.log_text()
    for who in "ab":
        assert re.search(rf"call ended: OK \[trace_id={TRACE[who]} request_id=req-{who}\]", log), log[-3000:]


def test_http_request_is_traced(traced):
    server, _, receiver, _ = traced
    http_port = int(re.search(r"HTTP/JSON API \(http\) on \S+:(\d+)", server.log_text()).group(1))
    body = json.dumps({"model": "cls", "texts": ["one text over http", "and another"]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/classify", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "traceparent": traceparent("h")})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200
    spans = receiver.wait_for(lambda ss: any(s["trace"] == TRACE["h"] and s["name"] == "relserve.batch" for s in ss)
                              and any(s["trace"] == TRACE["h"] and s["name"].startswith("POST") for s in ss))
    call = _one(spans, name="POST /v1/classify", trace=TRACE["h"])
    assert call["parent"] == CLIENT_SPAN["h"] and call["attrs"]["http.response.status_code"] == 200
    assert call["attrs"]["relserve.model"] == "cls"  # the model the call reached, learnt from the batcher
    batch = _one(spans, name="relserve.batch", trace=TRACE["h"])
    assert batch["links"] == {(TRACE["h"], call["id"])} and batch["attrs"]["relserve.batch.size"] == 2


_OFF = """
import asyncio, os, sys
sys.path.insert(0, sys.argv[1])
for key in [k for k in os.environ if k.startswith("OTEL_")]:
    del os.environ[key]
import grpc
from fixtures.fake_serving import runner, server_config
from relserve.service import main, tracing
from relserve.service.server import InferenceServer
from relserve.service._proto import inference_pb2 as pb, inference_pb2_grpc as pb_grpc

async def run():
    assert not tracing.configure(None, os.environ)
    server = InferenceServer(server_config(metrics_port=None, http_port=0), [runner("m")])
    port = await server.start()
    await server.load_models()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await pb_grpc.InferenceStub(channel).Classify(
            pb.ClassifyRequest(model="m", texts=["a b"]), timeout=20,
            metadata=(("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),))
    assert reply.results, reply
    await server.stop(0.5)

asyncio.run(run())
print("otel modules:", sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
"""


def test_tracing_off_imports_no_opentelemetry():
    out = subprocess.run([sys.executable, "-c", _OFF, str(TESTS_DIR)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "otel modules: []" in out.stdout, out.stdout


def test_endpoint_without_the_extra_exits_2(traced, tmp_path):
    _, _, _, cls = traced
    env = hiding_env(tmp_path / "site", ("opentelemetry",))
    out = subprocess.run([sys.executable, "-m", "relserve.service.main", "serve", "--port", "0", "--metrics-port", "-1",
                          "--model", f"cls={cls}", "--otlp-endpoint", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "pip install 'relserve[otel]'" in out.stderr and "serving on" not in out.stderr
