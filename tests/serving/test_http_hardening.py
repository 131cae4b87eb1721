"""The HTTP listener and the metrics port under hostile clients, on real servers on free loopback ports
(service/frontends/http_transport.py, http_guard.py; service/metrics.py's listener): header, body and keep-alive
timeouts (short ones configured here), the connection cap while gRPC keeps answering, 413 / 417 before a body
over the limit is read, duplicate JSON keys, half-closed clients, the accept-error log throttle, off-loop JSON
decoding, and the metrics port's bounded threads and read timeout. Socket timeouts are generous bounds (a
dropped connection is seen as EOF or a reset well before them), never timing assertions."""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
import time

import pytest
from grpc_health.v1 import health_pb2

from fixtures.fake_serving import runner, server_config
from fixtures.server import Running
from relserve.service import metrics
from relserve.service._proto import inference_pb2 as pb
from relserve.service.frontends.http_guard import (ThrottledLog, accept_error_handler, default_max_connections,
                                                   raise_open_files_limit)

MAX_BODY = 64 * 1024
CAP = 6
WAIT_S = 20.0  # a socket read's bound: what should happen at once or after a sub-second timeout comes far earlier


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) before :data:`WAIT_S`; data before it is skipped."""
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _reply(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response on ``sock``: (status, lower-cased headers, body by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


def _classify_body(*texts: str) -> bytes:
    return json.dumps({"model": "sentiment", "texts": list(texts)}).encode()


def _wait_until(predicate, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"never: {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def quick():
    """Sub-second header, body and keep-alive timeouts."""
    s = Running(server_config(http_port=0, http_header_timeout=0.4, http_body_timeout=0.4,
                              http_keepalive_timeout=0.6, max_receive_message_length=MAX_BODY),
                [runner("sentiment")])
    s.wait_serving()
    yield s
    s.close()


@pytest.fixture(scope="module")
def capped():
    """Long timeouts, a cap of :data:`CAP` HTTP connections."""
    s = Running(server_config(http_port=0, http_max_connections=CAP, max_receive_message_length=MAX_BODY),
                [runner("sentiment")])
    s.wait_serving()
    yield s
    s.close()


# ---------------------------------------------------------------------- timeouts

def test_a_slow_request_head_is_dropped_after_the_header_timeout(quick):
    port = quick.server.http_port
    guard = quick.server._http.guard
    before = guard.header_timeouts
    silent = _connect(port)  # sends nothing at all
    trickling = _connect(port)
    trickling.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
    stop = threading.Event()

    def trickle() -> None:  # a byte every 50 ms: each one arrives well within the timeout, the head never ends
        while not stop.wait(0.05):
            try:
                trickling.sendall(b"X")
            except OSError:
                return

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    try:
        assert _closed(silent) and _closed(trickling)
    finally:
        stop.set()
        feeder.join(5)
        silent.close()
        trickling.close()
    assert guard.header_timeouts - before >= 2
    with _connect(port) as ok:  # a complete head on a fresh connection is served
        ok.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _reply(ok)[0] == 200


def test_a_stalled_body_gets_408_and_an_idle_connection_is_closed_after_the_keepalive(quick):
    port = quick.server.http_port
    with _connect(port) as sock:
        body = _classify_body("good")
        sock.sendall(_post("/v1/classify", body)[:-5])  # the body's last bytes never come
        status, headers, reply = _reply(sock)
        assert status == 408 and json.loads(reply)["code"] == "DEADLINE_EXCEEDED"
        assert "http_body_timeout" in json.loads(reply)["error"]
        assert _closed(sock)
    with _connect(port) as sock:
        sock.sendall(_post("/v1/classify", _classify_body("good")))
        status, _, reply = _reply(sock)
        assert status == 200 and json.loads(reply)["results"][0]["labels"][0]["label"] == "positive"
        assert _closed(sock)  # idle after its reply: closed by the keep-alive timeout


# ---------------------------------------------------------------------- the connection cap

def _grpc_answers(s: Running) -> None:
    assert s.health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    reply = s.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=["good"]), timeout=10)
    assert reply.results[0].labels[0].label == "positive"


def test_connections_over_the_cap_are_closed_at_once_while_grpc_answers(capped):
    port, guard = capped.server.http_port, capped.server._http.guard
    assert guard.max_connections == CAP
    held = [_connect(port) for _ in range(CAP)]
    try:
        _wait_until(lambda: guard.open == CAP, f"{CAP} open HTTP connections")
        refused_before = guard.refused
        extra = [_connect(port) for _ in range(3 * CAP)]  # the kernel accepts them; the server closes each at once
        try:
            assert all(_closed(sock) for sock in extra)
        finally:
            for sock in extra:
                sock.close()
        assert guard.refused - refused_before == 3 * CAP and guard.open == CAP
        assert guard.refusals.lines <= guard.refusals.total  # throttled: one line a second at most
        _grpc_answers(capped)
        held[0].sendall(_post("/v1/classify", _classify_body("good")))  # the admitted ones are served
        assert _reply(held[0])[0] == 200
    finally:
        for sock in held:
            sock.close()
    _wait_until(lambda: guard.open == 0, "the held connections closed")
    with _connect(port) as sock:  # room again
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _reply(sock)[0] == 200


def test_the_open_files_limit_and_the_default_cap():
    soft_before, soft, hard = raise_open_files_limit()
    assert soft >= soft_before and (soft == hard or hard == -1 or soft_before == soft)
    assert default_max_connections(4096) == 2048 and default_max_connections(1024) == 512
    assert default_max_connections(10**7) == 10_000 and default_max_connections(1) == 1
    cfg = server_config(http_port=0)
    s = Running(cfg, [runner("sentiment")], load=False)
    try:
        assert s.server._http.guard.max_connections == default_max_connections()
    finally:
        s.close()


# ---------------------------------------------------------------------- limits before the body

def test_content_length_over_the_limit_is_413_before_any_body(capped):
    with _connect(capped.server.http_port) as sock:
        sock.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10000000000\r\n\r\n")  # and no body: the reply cannot wait for it
        status, _, reply = _reply(sock)
        assert status == 413 and json.loads(reply)["code"] == "RESOURCE_EXHAUSTED"
        assert str(MAX_BODY) in json.loads(reply)["error"]


def test_expect_100_continue_over_the_limit_is_417_without_100(capped):
    with _connect(capped.server.http_port) as sock:
        sock.sendall(b"POST /v2/models/sentiment/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000000\r\nExpect: 100-continue\r\n\r\n")
        status, _, reply = _reply(sock)  # the first response is final: no "100 Continue" before it
        assert status == 417 and json.loads(reply)["code"] == "RESOURCE_EXHAUSTED"
        assert str(MAX_BODY) in json.loads(reply)["error"]
    with _connect(capped.server.http_port) as sock:  # within the limit: 100 Continue, then the answer
        body = _classify_body("good")
        sock.sendall(_post("/v1/classify", body, "Expect: 100-continue\r\n")[:-len(body)])  # the head alone
        status, _, _ = _reply(sock)
        assert status == 100
        sock.sendall(body)
        status, _, reply = _reply(sock)
        assert status == 200 and json.loads(reply)["results"][0]["labels"][0]["label"] == "positive"


def test_duplicate_json_keys_are_invalid_argument_naming_the_key(capped):
    with _connect(capped.server.http_port) as sock:
        sock.sendall(_post("/v1/classify", b'{"model": "sentiment", "texts": ["good"], "texts": ["bad"]}'))
        status, _, reply = _reply(sock)
        assert status == 400 and json.loads(reply)["code"] == "INVALID_ARGUMENT"
        assert "'texts'" in json.loads(reply)["error"] and "duplicate" in json.loads(reply)["error"]
        infer = (b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["good"], '
                 b'"shape": [1]}]}')
        sock.sendall(_post("/v2/models/sentiment/infer", infer))
        status, _, reply = _reply(sock)
        assert status == 400 and "'shape'" in json.loads(reply)["error"]


def test_a_half_closed_client_gets_its_reply(capped):
    with _connect(capped.server.http_port) as sock:
        sock.sendall(_post("/v1/classify", _classify_body("good")))
        sock.shutdown(socket.SHUT_WR)
        status, _, reply = _reply(sock)
        assert status == 200 and json.loads(reply)["results"][0]["labels"][0]["label"] == "positive"
        assert _closed(sock)
    with _connect(capped.server.http_port) as sock:  # a head that can never end: closed at once (not after 60 s)
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n")
        sock.shutdown(socket.SHUT_WR)
        assert _closed(sock)


def test_a_large_body_is_decoded_off_the_event_loop(capped):
    http = capped.server._http
    before = http.decoded_off_loop
    texts = ["good"] * 8000  # about 64 KiB less the rest: over the off-loop threshold, within the body limit
    body = _classify_body(*texts)
    assert http.OFF_LOOP_BYTES < len(body) <= MAX_BODY
    with _connect(http.port) as sock:
        sock.sendall(_post("/v1/classify", body))
        status, _, reply = _reply(sock)
        assert status == 400 and json.loads(reply)["code"] == "INVALID_ARGUMENT"  # the task's max_request_texts
    assert http.decoded_off_loop == before + 1


def test_too_many_texts_or_pairs_are_refused_before_protobuf_maps_the_body(capped, monkeypatch):
    """/v1 bodies whose texts or text_pairs are over max_request_texts are refused on the parsed JSON's list
    lengths: protobuf's ParseDict never builds the message, and the reply is the gRPC path's refusal."""
    import grpc
    from google.protobuf import json_format
    from prometheus_client import REGISTRY

    mapped = []
    real = json_format.ParseDict
    monkeypatch.setattr(json_format, "ParseDict", lambda *a, **kw: mapped.append(1) or real(*a, **kw))
    limit = capped.server.registry.runners["sentiment"].config.max_request_texts
    labels = {"model": "sentiment", "task": "classification", "code": "INVALID_ARGUMENT", "protocol": "http_v1"}
    before = REGISTRY.get_sample_value("relserve_requests_total", labels) or 0.0
    # just over the model's limit: the task's exact count; over the gRPC port's wire-count threshold (1024): its
    # "more than" refusal, reached after that many element scans instead of a parse of them all
    cases = [{"texts": ["a"] * (limit + 1)}, {"texts": ["a"], "textPairs": ["b"] * (limit + 1)},
             {"texts": [], "text_pairs": ["b"] * (limit + 1)}, {"texts": ["a"] * 3000},
             {"texts": ["a"], "text_pairs": ["b"] * 3000}]
    for fields in cases:
        with pytest.raises(grpc.RpcError) as wire:
            capped.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=fields["texts"],
                                                    text_pairs=fields.get("textPairs", fields.get("text_pairs"))),
                                 timeout=10)
        with _connect(capped.server.http_port) as sock:
            sock.sendall(_post("/v1/classify", json.dumps({"model": "sentiment", **fields}).encode()))
            status, _, reply = _reply(sock)
        assert status == 400 and json.loads(reply) == {"error": wire.value.details(), "code": "INVALID_ARGUMENT"}
    assert "more than 1024 text_pairs" in wire.value.details()
    assert mapped == []
    assert REGISTRY.get_sample_value("relserve_requests_total", labels) == before + len(cases)
    with _connect(capped.server.http_port) as sock:  # within the limit: mapped as before
        sock.sendall(_post("/v1/classify", _classify_body(*["a"] * limit)))
        assert _reply(sock)[0] == 200 and mapped == [1]


# ---------------------------------------------------------------------- accept errors

def test_accept_errors_are_logged_once_a_second_with_a_count(caplog):
    now = [100.0]
    scheduled: list = []
    throttle = ThrottledLog(logging.getLogger("test.accept"), "accept() on the HTTP port failed",
                            clock=lambda: now[0], schedule=lambda delay, fn: scheduled.append((delay, fn)))
    others: list = []
    handler = accept_error_handler(throttle, lambda loop, context: others.append(context))
    emfile = OSError(errno.EMFILE, "Too many open files")
    with caplog.at_level(logging.WARNING, "test.accept"):
        for i in range(5000):  # what asyncio's accept loop reports under a flood: up to 100 per wake-up
            now[0] = 100.0 + i * 0.0001
            handler(None, {"message": "socket.accept() out of system resource", "exception": emfile})
        assert len(caplog.records) == 1 and len(scheduled) == 1 and scheduled[0][0] == pytest.approx(1.0, abs=1e-3)
        now[0] = 101.0
        scheduled[0][1]()  # the interval's end: the rest in one line with their count
        handler(None, {"message": "something else", "exception": ValueError("x")})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "once" in lines[0] and "4999 times" in lines[1] and "(5000 in all)" in lines[1]
    assert "Too many open files" in lines[1]
    assert [c["message"] for c in others] == ["something else"]
    # a flush that comes due just after a hit was logged waits for the next interval's end (no "0.0 s" lines)
    caplog.clear()
    scheduled.clear()
    with caplog.at_level(logging.WARNING, "test.accept"):
        now[0] = 101.5
        throttle.hit("a")  # counted; a flush at 102.0
        now[0] = 102.0
        throttle.hit("b")  # due: logged, with the first
        now[0] = 102.0005
        throttle.hit("c")  # counted
        now[0] = 102.001
        scheduled[0][1]()  # the flush scheduled at 101.5 comes late: it reschedules, logs nothing
        assert len(caplog.records) == 1 and len(scheduled) == 2 and scheduled[1][0] == pytest.approx(0.999)
        now[0] = 103.0
        scheduled[1][1]()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "accept() on the HTTP port failed 2 times in the last 1.0 s", "accept() on the HTTP port failed once in the "
        "last 1.0 s"]


def test_the_http_listener_installs_the_accept_throttle(capped):
    handler = capped.loop.get_exception_handler()
    assert handler is not None and handler.throttle is capped.server._http.accept_errors


# ---------------------------------------------------------------------- the metrics port

def test_trickling_metrics_clients_hold_no_threads_and_are_cut_off():
    server, port = metrics.start_http(0, "127.0.0.1", read_timeout=0.5, max_connections=40)
    threads = threading.active_count()
    socks = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(30)]
    try:
        for sock in socks:
            sock.sendall(b"GET /metr")  # a head that never ends
        _wait_until(lambda: server.open == 30, "30 open metrics connections")
        assert threading.active_count() == threads  # one thread serves them all
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as scrape:  # and still scrapes
            scrape.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
            status, _, body = _reply(scrape)
            assert status == 200 and b"process_resident_memory_bytes" in body
        over = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(15)]
        try:
            assert all(_closed(sock) for sock in over[-5:])  # past max_connections: closed at once
        finally:
            for sock in over:
                sock.close()
        assert all(_closed(sock) for sock in socks)  # each cut off after the read timeout
        assert server.timed_out >= 30 and server.refused >= 5
    finally:
        for sock in socks:
            sock.close()
        server.shutdown()
        server.server_close()
