"""Transport security and auth on a real grpc.aio server (fake models, free loopback ports): TLS and mTLS
with a CA built at test time (tests/fixtures/tls.py), bearer tokens (service/auth.py), reflection on / off,
the plaintext health-only listener, and the /metrics-only HTTP server. (Config validation of these keys:
tests/unit/test_config.py; the flags: tests/unit/test_cli.py; the k8s component: tests/deploy.)"""

from __future__ import annotations

import asyncio
import gzip
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY

from fixtures.fake_serving import FakeBackend, model_config, runner, server_config
from fixtures.server import Running
from fixtures.tls import make_pki
from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc
from relserve.service.metrics import UNKNOWN_MODEL
from relserve.service.runner import ModelRunner
from relserve.service.server import InferenceServer

TOKENS = ("first-token-0123456789", "second-token-abcdefghij")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CLASSIFY = pb.ClassifyRequest(model="sentiment", texts=["good movie"])


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"# relserve tokens, one per line\n\n{TOKENS[0]}\n  {TOKENS[1]}  \n")
    return path


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _tls_channel(pki, port: int, *, client_cert: bool = False, root=None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=(root or pki.ca_cert).read_bytes(),
        private_key=pki.client_key.read_bytes() if client_cert else None,
        certificate_chain=pki.client_cert.read_bytes() if client_cert else None,
    )
    return grpc.secure_channel(f"127.0.0.1:{port}", creds)


def _wait_serving(channel: grpc.Channel, metadata=None, timeout: float = 15) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    end = time.monotonic() + timeout
    while True:
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=2).status == SERVING:
                return
        except grpc.RpcError:
            if time.monotonic() > end:
                raise
        if time.monotonic() > end:
            raise AssertionError("server never became SERVING")
        time.sleep(0.02)


def _code(call, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kw)
    return err.value.code(), err.value.details()


def _classified(channel: grpc.Channel, **kw) -> str:
    reply = pb_grpc.InferenceStub(channel).Classify(CLASSIFY, timeout=5, **kw)
    return reply.results[0].labels[0].label


def _list_services(channel: grpc.Channel, metadata=None) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             metadata=metadata, timeout=5))
    return sorted(s.name for s in replies[0].list_services_response.service)


def _unauthenticated_count(task: str) -> float:
    return sum(s.value for f in REGISTRY.collect() for s in f.samples
               if s.name == "relserve_requests_total" and {k: v for k, v in s.labels.items() if k != "protocol"}
               == {"model": UNKNOWN_MODEL, "task": task, "code": "UNAUTHENTICATED"})


# ---------------------------------------------------------------------- TLS and mTLS

def test_tls_call_needs_the_ca_and_refuses_plaintext(pki):
    s = Running(server_config(metrics_port=None, tls_cert=pki.server_cert, tls_key=pki.server_key),
                [runner("sentiment")])
    tls = _tls_channel(pki, s.port)
    try:
        _wait_serving(tls)
        assert _classified(tls) == "positive"
        # plaintext on the TLS port: the handshake fails, the call never reaches the servicer
        code, _ = _code(pb_grpc.InferenceStub(s.channel).Classify, CLASSIFY, timeout=5)
        assert code == grpc.StatusCode.UNAVAILABLE
        # a client that trusts another CA rejects the server's certificate
        with _tls_channel(pki, s.port, root=pki.other_ca_cert) as wrong_ca:
            code, _ = _code(pb_grpc.InferenceStub(wrong_ca).Classify, CLASSIFY, timeout=5)
        assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        tls.close()
        s.close()


def test_mtls_requires_a_client_certificate_from_the_ca(pki):
    s = Running(server_config(metrics_port=None, tls_cert=pki.server_cert, tls_key=pki.server_key,
                              tls_client_ca=pki.ca_cert), [runner("sentiment")])
    with_cert = _tls_channel(pki, s.port, client_cert=True)
    try:
        _wait_serving(with_cert)
        assert _classified(with_cert) == "positive"
        with _tls_channel(pki, s.port) as no_cert:
            code, _ = _code(pb_grpc.InferenceStub(no_cert).Classify, CLASSIFY, timeout=5)
        assert code == grpc.StatusCode.UNAVAILABLE
        # a self-signed certificate (the unrelated CA's own, with its key) is not signed by tls_client_ca
        foreign = grpc.ssl_channel_credentials(root_certificates=pki.ca_cert.read_bytes(),
                                               private_key=pki.other_key.read_bytes(),
                                               certificate_chain=pki.other_ca_cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{s.port}", foreign) as other:
            code, _ = _code(pb_grpc.InferenceStub(other).Classify, CLASSIFY, timeout=5)
        assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        with_cert.close()
        s.close()


# ---------------------------------------------------------------------- bearer tokens

@pytest.fixture(scope="module")
def token_srv(token_file):
    s = Running(server_config(metrics_port=None, auth_token_file=token_file), [runner("sentiment")])
    _wait_serving(s.channel)  # health needs no token by default
    yield s
    s.close()


def test_token_right_missing_wrong(token_srv):
    assert _classified(token_srv.channel, metadata=_bearer(TOKENS[0])) == "positive"
    assert _classified(token_srv.channel, metadata=_bearer(TOKENS[1])) == "positive"  # every line counts
    assert _classified(token_srv.channel, metadata=[("authorization", f"bearer {TOKENS[1]}")]) == "positive"
    before = _unauthenticated_count("classification")
    stub = token_srv.stub
    code, details = _code(stub.Classify, CLASSIFY, timeout=5)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization" in details
    sent = "wrong-token-" + TOKENS[0]
    code, details = _code(stub.Classify, CLASSIFY, metadata=_bearer(sent), timeout=5)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "not valid" in details
    assert sent not in details and TOKENS[0] not in details  # the message never echoes what was sent
    code, details = _code(stub.Classify, CLASSIFY, metadata=[("authorization", f"Basic {TOKENS[0]}")], timeout=5)
    assert code == grpc.StatusCode.UNAUTHENTICATED and TOKENS[0] not in details
    code, _ = _code(stub.Classify, CLASSIFY, metadata=_bearer(TOKENS[0][:-1]), timeout=5)  # a prefix is no token
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert _unauthenticated_count("classification") - before == 4


def test_refused_requests_are_not_decoded(token_srv):
    """Malformed bytes (invalid UTF-8 in a string field) without a token: UNAUTHENTICATED, not INVALID_ARGUMENT,
    because the refusal comes before the request is parsed."""
    raw = token_srv.channel.unary_unary("/relserve.v1.Inference/Classify")
    code, _ = _code(raw, bytes.fromhex("0a02fffe12026869"), timeout=5)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, _ = _code(raw, bytes.fromhex("0a02fffe12026869"), metadata=_bearer(TOKENS[0]), timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_streaming_rpcs_and_unknown_methods_need_the_token(token_srv):
    before = _unauthenticated_count("translation")
    stream = token_srv.stub.TranslateStream(pb.TranslateStreamRequest(model="sentiment", text="hallo"), timeout=5)
    code, _ = _code(list, stream)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert _unauthenticated_count("translation") - before == 1
    # an unauthenticated caller does not learn which methods exist
    unknown = token_srv.channel.unary_unary("/relserve.v1.Inference/NoSuchMethod")
    assert _code(unknown, b"", timeout=5)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert _code(unknown, b"", metadata=_bearer(TOKENS[0]), timeout=5)[0] == grpc.StatusCode.UNIMPLEMENTED


def test_refusal_log_line_quotes_and_caps_the_method_name(token_file, caplog):
    """The method name is the client's :path:; it used to reach the log raw: 9,000 characters in one line, and
    a newline in it forged a second, INFO-looking log line."""
    s = Running(server_config(metrics_port=None, auth_token_file=token_file), [runner("sentiment")])
    try:
        _wait_serving(s.channel)
        forged = "2026-01-01 00:00:00,000 INFO relserve: forged line"
        # 6,000 characters: under grpc's 8 KiB soft metadata limit, past which calls are refused at random
        # (RESOURCE_EXHAUSTED) before any interceptor sees them
        method = "/relserve.v1.Inference/Classify\n" + forged + "A" * 6000
        with caplog.at_level("WARNING", logger="relserve.service.auth"):
            assert _code(s.channel.unary_unary(method), b"", timeout=5)[0] == grpc.StatusCode.UNAUTHENTICATED
        lines = [r.getMessage() for r in caplog.records if r.name == "relserve.service.auth"]
        assert len(lines) == 1  # the first refusal of this server's interceptor is always logged
        assert "\n" not in lines[0] and "\\n" + forged[:20] in lines[0]
        assert len(lines[0]) < 400 and f"({len(method)} characters)" in lines[0]
    finally:
        s.close()


def test_health_is_open_and_reflection_needs_the_token(token_srv):
    assert token_srv.health_status() == SERVING
    assert token_srv.health_status("relserve.v1.Inference") == SERVING
    before = _unauthenticated_count("reflection")
    code, _ = _code(_list_services, token_srv.channel)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert _unauthenticated_count("reflection") - before == 1
    assert "relserve.v1.Inference" in _list_services(token_srv.channel, _bearer(TOKENS[0]))


def test_auth_health_closes_health_too(token_file):
    s = Running(server_config(metrics_port=None, auth_token_file=token_file, auth_health=True),
                [runner("sentiment")])
    try:
        _wait_serving(s.channel, metadata=_bearer(TOKENS[0]))
        code, _ = _code(s.health_status)
        assert code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        s.close()


# ---------------------------------------------------------------------- reflection

def test_reflection_off_and_on():
    off = Running(server_config(metrics_port=None, reflection=False), [runner("sentiment")])
    on = Running(server_config(metrics_port=None), [runner("sentiment")])
    try:
        off.wait_serving()
        on.wait_serving()
        code, _ = _code(_list_services, off.channel)
        assert code == grpc.StatusCode.UNIMPLEMENTED
        assert _list_services(on.channel) == ["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                                              "grpc.reflection.v1alpha.ServerReflection", "inference.GRPCInferenceService",
                                              "relserve.v1.Inference"]
        assert _classified(off.channel) == "positive"  # the rest is served as before
    finally:
        off.close()
        on.close()


# ---------------------------------------------------------------------- metrics HTTP server

def _http(url: str, method: str = "GET", headers=None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_metrics_port_serves_only_metrics():
    s = Running(server_config(), [runner("sentiment")])
    try:
        s.wait_serving()
        _classified(s.channel)
        base = f"http://127.0.0.1:{s.metrics_port}"
        status, headers, body = _http(base + "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        text = body.decode()
        assert 'relserve_requests_total{code="OK",model="sentiment",protocol="grpc_v1",task="classification"}' in text
        assert "relserve_queue_depth" in text and "process_resident_memory_bytes" in text
        for path in ("/", "/health", "/v2/health/ready", "/metrics/", "/metricsx", "/favicon.ico"):
            status, _, body = _http(base + path)
            assert status == 404, path
            assert b"relserve_" not in body
        status, headers, body = _http(base + "/metrics", method="HEAD")
        assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
        status, headers, body = _http(base + "/metrics", headers={"Accept-Encoding": "gzip"})
        assert headers.get("Content-Encoding") == "gzip" and b"relserve_queue_depth" in gzip.decompress(body)
        status, headers, body = _http(base + "/metrics", headers={"Accept": "application/openmetrics-text"})
        assert headers["Content-Type"].startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
        status, _, body = _http(base + "/metrics?name[]=relserve_queue_depth")
        assert status == 200 and b"relserve_queue_depth" in body and b"relserve_requests_total" not in body
        assert _http(base + "/metrics", method="POST")[0] == 501
    finally:
        s.close()


def test_metrics_clients_that_reset_their_connection_log_nothing(capfd):
    """http.server printed a 15-line traceback to stderr for each connection a client reset (a port scan, an
    aborted scrape): 250 resets were 250 tracebacks."""
    s = Running(server_config(), [runner("sentiment")])
    try:
        s.wait_serving()
        capfd.readouterr()
        for payload in (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /metr", b""):
            for _ in range(5):
                sock = socket.create_connection(("127.0.0.1", s.metrics_port), timeout=5)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
                sock.sendall(payload)
                sock.close()
        end = time.monotonic() + 10  # the handler threads of the reset connections have finished
        while any("process_request" in t.name for t in threading.enumerate()) and time.monotonic() < end:
            time.sleep(0.01)
        assert _http(f"http://127.0.0.1:{s.metrics_port}/metrics")[0] == 200
        err = capfd.readouterr().err
        assert "Traceback" not in err and "Exception occurred" not in err
    finally:
        s.close()


def test_metrics_bind_their_own_address():
    s = Running(server_config(metrics_host="127.0.0.2"), [runner("sentiment")])
    try:
        assert _http(f"http://127.0.0.2:{s.metrics_port}/metrics")[0] == 200
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", s.metrics_port), timeout=5).close()
        assert _classified(s.channel) == "positive"  # gRPC stays on host (127.0.0.1)
    finally:
        s.close()


def test_metrics_on_ipv6_loopback():
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    s = Running(server_config(metrics_host="::1"), [runner("sentiment")])
    try:
        assert _http(f"http://[::1]:{s.metrics_port}/metrics")[0] == 200
    finally:
        s.close()


# ---------------------------------------------------------------------- health-only plaintext listener

class GatedBackend(FakeBackend):
    """Blocks each batch until ``gate`` is set, so that a request is certainly in flight during a drain."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def run(self, batch, budget=None):
        self.entered.set()
        assert self.gate.wait(30), "gate never opened"
        return super().run(batch)


def test_health_listener_serves_only_health_and_follows_drain(pki, token_file):
    backend = GatedBackend()
    gated = ModelRunner(model_config("sentiment", max_queue_delay=0.0), backend)
    s = Running(server_config(metrics_port=None, tls_cert=pki.server_cert, tls_key=pki.server_key,
                              auth_token_file=token_file, health_port=0, health_host="127.0.0.1"), [gated])
    assert s.server.health_port not in (None, 0, s.port)
    probe = grpc.insecure_channel(f"127.0.0.1:{s.server.health_port}")  # what the kubelet does: no TLS, no token
    tls = _tls_channel(pki, s.port)
    stopping = None
    try:
        _wait_serving(probe)
        health = health_pb2_grpc.HealthStub(probe)
        assert health.Check(health_pb2.HealthCheckRequest(service="relserve.v1.Inference"), timeout=5).status == SERVING
        # nothing but health there: Inference and reflection are not served on that port
        code, _ = _code(pb_grpc.InferenceStub(probe).Classify, CLASSIFY, metadata=_bearer(TOKENS[0]), timeout=5)
        assert code == grpc.StatusCode.UNIMPLEMENTED
        assert _code(pb_grpc.InferenceStub(probe).ListModels, pb.ListModelsRequest(), timeout=5)[0] == \
            grpc.StatusCode.UNIMPLEMENTED
        assert _code(_list_services, probe, _bearer(TOKENS[0]))[0] == grpc.StatusCode.UNIMPLEMENTED
        # drain: one request in flight, then stop(); the health-only listener reports NOT_SERVING meanwhile
        in_flight = pb_grpc.InferenceStub(tls).Classify.future(CLASSIFY, metadata=_bearer(TOKENS[0]), timeout=30)
        assert backend.entered.wait(10)
        stopping = asyncio.run_coroutine_threadsafe(s.server.stop(20), s.loop)
        end = time.monotonic() + 10
        while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != NOT_SERVING:
            assert time.monotonic() < end, "health-only listener never reported NOT_SERVING during the drain"
            time.sleep(0.02)
        assert health.Check(health_pb2.HealthCheckRequest(service="relserve.v1.Inference"),
                            timeout=5).status == NOT_SERVING
        assert not in_flight.done()
        backend.gate.set()
        assert in_flight.result(timeout=10).results[0].labels[0].label == "positive"
        stopping.result(timeout=30)
        assert _code(health.Check, health_pb2.HealthCheckRequest(), timeout=5)[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        backend.gate.set()
        if stopping is not None:
            stopping.result(timeout=30)
        probe.close()
        tls.close()
        s.close()


def test_health_listener_bind_failure_names_the_address():
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    server = InferenceServer(server_config(metrics_port=None, health_port=taken), [runner("sentiment")])
    try:
        with pytest.raises(RuntimeError, match=f"cannot bind health-only port 127.0.0.1:{taken}"):
            asyncio.run(server.start())
    finally:
        blocker.close()
