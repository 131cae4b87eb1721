"""A real grpc.aio server on a free loopback port, serving fake models through the runner seam:
status codes, message limits (C12), health, reflection, metrics, drain. (Config parsing: tests/unit/test_config.py;
what importing the serving modules loads: tests/unit/test_import_graph.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fixtures.fake_serving import LABELS, FakeTokenizer, runner, server_config
from fixtures.server import Running
from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc
from relserve.service.backends.base import TASK_QA
from relserve.service.config import MIB
from relserve.service.metrics import UNKNOWN_MODEL
from relserve.service.server import InferenceServer

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


@pytest.fixture(scope="module")
def srv():
    s = Running(server_config(), [
        runner("sentiment"),
        runner("qa", TASK_QA),
        runner("slow", config={"max_queue_delay": 0.0}, delay=0.5),
        runner("broken", fail=True),
    ])
    s.wait_serving()
    yield s
    s.close()


def _code(call, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kw)
    return err.value.code(), err.value.details()


# ---------------------------------------------------------------------- happy paths

def test_classify_results_in_order(srv):
    reply = srv.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=["good good", "bad movie", "good"]))
    assert [r.labels[0].label for r in reply.results] == ["positive", "negative", "positive"]
    assert [r.num_tokens for r in reply.results] == [4, 4, 3]
    assert all(len(r.labels) == 2 for r in reply.results)
    assert abs(sum(ls.score for ls in reply.results[0].labels) - 1.0) < 1e-6
    top1 = srv.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=["good"], top_k=1))
    assert len(top1.results[0].labels) == 1


def test_classify_truncation_and_pairs(srv):
    long_text = " ".join(["word"] * 200)
    reply = srv.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=[long_text, "good"],
                                                 text_pairs=["bad", "fine"]))
    assert reply.results[0].truncated and reply.results[0].num_tokens == 64
    assert not reply.results[1].truncated and reply.results[1].num_tokens == 5


def test_answer(srv):
    context = "Berlin is the capital of Germany. " * 10
    reply = srv.stub.Answer(pb.AnswerRequest(model="qa", question="what is it", context=context, top_k=1))
    assert reply.num_windows >= 2
    a = reply.answers[0]
    assert context[a.start:a.end] == a.text and a.text
    assert not a.is_impossible


def test_list_models(srv):
    models = {m.name: m for m in srv.stub.ListModels(pb.ListModelsRequest()).models}
    assert set(models) == {"sentiment", "qa", "slow", "broken"}
    s = models["sentiment"]
    assert (s.task, s.family, s.backend, s.device, s.dtype) == ("classification", "fake-deberta", "fake", "cpu",
                                                                 "float32")
    assert list(s.labels) == list(LABELS) and s.max_seq_len == 64 and s.max_batch_size == 32
    assert models["qa"].task == "question-answering" and not models["qa"].labels


# ---------------------------------------------------------------------- status codes

def test_unknown_model_not_found_lists_models(srv):
    code, details = _code(srv.stub.Classify, pb.ClassifyRequest(model="nope", texts=["x"]))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "nope" in details and "sentiment" in details and "qa" in details


def test_long_model_name_is_not_found_with_a_bounded_message(srv):
    """Issue 10 item 2: the message quotes at most 64 characters of the name, so NOT_FOUND reaches the client
    (echoing 20,000 characters overflowed the metadata limit and came back RESOURCE_EXHAUSTED)."""
    code, details = _code(srv.stub.Classify, pb.ClassifyRequest(model="x" * 20000, texts=["x"]))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "(20000 characters)" in details and len(details) < 300 and "sentiment" in details


def _metric(srv, sample: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("method, task, data", [
    ("Classify", "classification", bytes.fromhex("0a02fffe12026869")),  # invalid UTF-8 in the model string
    ("Answer", "question-answering", b"\x0a\x09qa\x12"),  # a length prefix running past the end
    ("TranslateStream", "translation", b"\xff\xff\xff"),  # not a protobuf at all
])
def test_malformed_bytes_are_invalid_argument_and_counted(srv, method, task, data):
    """Issue 10 item 1: bytes that do not decode get INVALID_ARGUMENT (not UNKNOWN), counted under that code;
    the server answers a well-formed request right after."""
    sample = (f'relserve_requests_total{{code="INVALID_ARGUMENT",model="{UNKNOWN_MODEL}",protocol="grpc_v1",'
              f'task="{task}"}}')
    before = _metric(srv, sample)
    path = f"/relserve.v1.Inference/{method}"
    call = (srv.channel.unary_stream if method == "TranslateStream" else srv.channel.unary_unary)(path)
    with pytest.raises(grpc.RpcError) as err:
        reply = call(data, timeout=5)
        list(reply) if method == "TranslateStream" else reply
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid relserve.v1." in err.value.details()
    assert _metric(srv, sample) == before + 1
    reply = srv.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=["good"]), timeout=5)
    assert len(reply.results) == 1


def test_wrong_task_failed_precondition(srv):
    code, details = _code(srv.stub.Answer, pb.AnswerRequest(model="sentiment", question="q", context="c"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "classification" in details
    code, details = _code(srv.stub.Classify, pb.ClassifyRequest(model="qa", texts=["x"]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "question-answering" in details


@pytest.mark.parametrize("request_kw, fragment", [
    ({"texts": []}, "texts is empty"),
    ({"texts": ["ok", ""]}, "texts[1]"),
    ({"texts": ["   \n"]}, "texts[0]"),
    ({"texts": ["a", "b"], "text_pairs": ["x"]}, "text_pairs has 1"),
    ({"texts": ["a"], "top_k": 3}, "2 labels"),
])
def test_classify_invalid_argument(srv, request_kw, fragment):
    code, details = _code(srv.stub.Classify, pb.ClassifyRequest(model="sentiment", **request_kw))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details


@pytest.mark.parametrize("request_kw, fragment", [
    ({"question": "", "context": "c"}, "question"),
    ({"question": "q", "context": "  "}, "context"),
    ({"question": "q", "context": "c", "top_k": 1000}, "limit is 20"),
    ({"question": "q", "context": "c", "max_answer_len": 1000}, "max_seq_len 64"),
    ({"question": "q", "context": "c", "doc_stride": 64}, "doc_stride 64"),
    ({"question": "q", "context": "c", "null_threshold": float("nan")}, "NaN"),
])
def test_answer_invalid_argument(srv, request_kw, fragment):
    code, details = _code(srv.stub.Answer, pb.AnswerRequest(model="qa", **request_kw))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details


def test_backend_failure_is_internal_and_server_keeps_serving(srv):
    code, details = _code(srv.stub.Classify, pb.ClassifyRequest(model="broken", texts=["x"]))
    assert code == grpc.StatusCode.INTERNAL and "fake backend failure" in details
    assert srv.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=["good"])).results


def test_deadline_exceeded(srv):
    code, _ = _code(srv.stub.Classify, pb.ClassifyRequest(model="slow", texts=["x"]), timeout=0.1)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_cancelled_request_leaves_queue(srv):
    slow = srv.server.registry.runners["slow"]
    futures = [srv.stub.Classify.future(pb.ClassifyRequest(model="slow", texts=[f"t{i}"])) for i in range(3)]
    time.sleep(0.2)  # the first runs, the others wait
    for f in futures[1:]:
        f.cancel()
    end = time.monotonic() + 3
    while slow.batcher.queue_depth and time.monotonic() < end:
        time.sleep(0.01)
    assert slow.batcher.queue_depth == 0
    assert futures[0].result(timeout=5).results


# ---------------------------------------------------------------------- C12: message size

def _just_over_4mib() -> pb.ClassifyRequest:
    return pb.ClassifyRequest(model="sentiment", texts=["good " * (4 * MIB // 5 + 64)])


def test_case_C12_oversize_message_resource_exhausted_names_limit(srv):
    request = _just_over_4mib()
    assert 4 * MIB < request.ByteSize() < 4 * MIB + 4096
    code, details = _code(srv.stub.Classify, request)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(4 * MIB) in details, details


def test_case_C12_raised_limits_succeed():
    limit = 8 * MIB
    s = Running(  # a 4 MiB text is also over the default max_request_chars (1,000,000): raised with the rest
        server_config(max_receive_message_length=limit, max_send_message_length=limit, metrics_port=None),
        [runner("sentiment", config={"max_request_chars": limit})],
        channel_options=[("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)],
    )
    try:
        s.wait_serving()
        reply = s.stub.Classify(_just_over_4mib(), timeout=30)
        assert reply.results[0].truncated and reply.results[0].labels[0].label == "positive"
    finally:
        s.close()


# ---------------------------------------------------------------------- health, reflection, metrics

def test_health_not_serving_until_warm():
    gate = threading.Event()
    s = Running(server_config(metrics_port=None), [runner("sentiment", warm_gate=gate)])
    try:
        NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
        assert s.health_status("") == NOT_SERVING
        assert s.health_status("relserve.v1.Inference") == NOT_SERVING
        code, details = _code(s.stub.Classify, pb.ClassifyRequest(model="sentiment", texts=["x"]))
        assert code == grpc.StatusCode.UNAVAILABLE and "not ready" in details
        gate.set()
        s.wait_serving()
        assert s.health_status("relserve.v1.Inference") == health_pb2.HealthCheckResponse.SERVING
    finally:
        gate.set()
        s.close()


def test_the_server_sets_the_gil_switch_interval_while_it_serves_and_restores_it():
    before = sys.getswitchinterval()
    s = Running(server_config(metrics_port=None, gil_switch_interval_us=250), [runner("sentiment")])
    try:
        s.wait_serving()
        assert sys.getswitchinterval() == pytest.approx(250e-6)
        reply = s.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=["good"]), timeout=10)
        assert reply.results[0].labels[0].label == "positive"
    finally:
        s.close()
    assert sys.getswitchinterval() == before
    s = Running(server_config(metrics_port=None, gil_switch_interval_us=None), [runner("sentiment")])
    try:
        assert sys.getswitchinterval() == before  # null: the interpreter's own
    finally:
        s.close()


@pytest.mark.parametrize("stop_order", ["first-started-first", "last-started-first"])
def test_overlapping_servers_leave_the_interval_of_those_still_serving(stop_order):
    from relserve.service.server import SwitchIntervals

    before = sys.getswitchinterval()
    intervals, a, b = SwitchIntervals(), object(), object()
    try:
        intervals.enter(a, 249)  # CPython truncates to whole microseconds: 249 / 1e6 alone would be 248
        assert round(sys.getswitchinterval() * 1e6, 3) == 249
        intervals.leave(a)
        assert sys.getswitchinterval() == before  # not a microsecond less
        intervals.enter(a, 10)
        intervals.enter(b, 20)
        assert sys.getswitchinterval() == pytest.approx(20e-6)
        first, second = (a, b) if stop_order == "first-started-first" else (b, a)
        intervals.leave(first)
        # b's value stays while b serves; once only a is left, a's
        assert sys.getswitchinterval() == pytest.approx(20e-6 if second is b else 10e-6)
        intervals.leave(second)
        assert sys.getswitchinterval() == before
        intervals.leave(a)  # a second stop changes nothing
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)


def test_reflection_lists_services(srv):
    stub = reflection_pb2_grpc.ServerReflectionStub(srv.channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                          timeout=5)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"relserve.v1.Inference", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_metrics_endpoint(srv):
    srv.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=["good", "bad bad"]))
    assert _code(srv.stub.Classify, pb.ClassifyRequest(model="nope-metrics", texts=["x"]))[0] == grpc.StatusCode.NOT_FOUND
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
    for name in [
        "relserve_requests_total", "relserve_request_duration_seconds_bucket",
        "relserve_queue_duration_seconds_bucket", "relserve_inference_duration_seconds_bucket",
        "relserve_tokenization_duration_seconds_bucket", "relserve_batch_size_bucket",
        "relserve_batch_tokens_bucket", "relserve_tokens_total", "relserve_queue_depth",
        "relserve_inflight_requests", "relserve_model_info", "process_resident_memory_bytes",
    ]:
        assert name in text, name
    assert 'relserve_requests_total{code="OK",model="sentiment",protocol="grpc_v1",task="classification"}' in text
    # a request naming no loaded model is counted under one bounded label, not under the name it sent
    assert (f'relserve_requests_total{{code="NOT_FOUND",model="{UNKNOWN_MODEL}",protocol="grpc_v1",'
            f'task="classification"}}') in text
    assert 'model="nope-metrics"' not in text
    assert 'kind="padding"' in text and 'kind="real"' in text
    assert 'relserve_inference_duration_seconds_count{backend="fake",model="sentiment"}' in text


# ---------------------------------------------------------------------- drain on SIGTERM (subprocess)

def test_sigterm_drains_and_exits_zero(tmp_path):
    script = tmp_path / "serve_fake.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from fixtures.fake_serving import runner, server_config
        from relserve.service.main import serve
        import logging
        logging.basicConfig(level="INFO")
        sys.exit(asyncio.run(serve(server_config(metrics_port=None, drain_timeout=5.0),
                                   [runner("sentiment", delay=0.3)])))
    """))
    proc = subprocess.Popen([PYTHON, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        lines = []
        end = time.monotonic() + 30
        while time.monotonic() < end:
            line = proc.stdout.readline()
            lines.append(line)
            m = re.search(r"serving on \S+:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "".join(lines)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.InferenceStub(ch)
            inflight = stub.Classify.future(pb.ClassifyRequest(model="sentiment", texts=["good"]))
            time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            assert inflight.result(timeout=10).results[0].labels[0].label == "positive"  # drained, not dropped
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------- status bookkeeping (metrics = what clients saw)

class _SlowTokenizer(FakeTokenizer):
    def batch_encode(self, texts, pairs=None, max_length=None):
        time.sleep(0.6)  # in the tokenization executor: grpc cancels the handler when the deadline passes
        return super().batch_encode(texts, pairs, max_length)


def _requests_total(model: str) -> dict[str, float]:
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name == "relserve_requests_total" and s.labels.get("model") == model:
                out[s.labels["code"]] = s.value
    return out


def test_deadline_during_tokenization_is_counted_as_deadline_exceeded():
    slow = runner("slowtok")
    load = slow.backend.load
    slow.backend.load = lambda: dataclasses.replace(load(), tokenizer=_SlowTokenizer())
    s = Running(server_config(metrics_port=None), [slow])
    try:
        s.wait_serving()
        code, _ = _code(s.stub.Classify, pb.ClassifyRequest(model="slowtok", texts=["good"]), timeout=0.2)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.8)  # the handler finishes its cleanup after the tokenizer thread returns
        counts = _requests_total("slowtok")
        assert counts.get("DEADLINE_EXCEEDED") == 1 and "CANCELLED" not in counts, counts
    finally:
        s.close()


def test_reply_over_send_limit_is_resource_exhausted_and_counted():
    s = Running(server_config(metrics_port=None, max_send_message_length=1024), [runner("tinyreply")])
    try:
        s.wait_serving()
        code, details = _code(s.stub.Classify, pb.ClassifyRequest(model="tinyreply", texts=["good"] * 200),
                              timeout=10)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_send_message_length of 1024 bytes" in details
        assert s.stub.Classify(pb.ClassifyRequest(model="tinyreply", texts=["good"]), timeout=10).results
        assert _requests_total("tinyreply") == {"RESOURCE_EXHAUSTED": 1, "OK": 1}
    finally:
        s.close()


@pytest.mark.parametrize("text", ["\u200b", "\u2060\ufeff ", " \n\t"])
def test_zero_width_only_text_is_blank(srv, text):
    code, details = _code(srv.stub.Classify, pb.ClassifyRequest(model="sentiment", texts=[text]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "empty or only whitespace" in details


def test_busy_metrics_port_is_a_clean_error():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = InferenceServer(server_config(metrics_port=port), runners=[runner("m")])
        with pytest.raises(RuntimeError, match=f"cannot bind metrics port 127.0.0.1:{port}"):
            asyncio.run(server.start())
