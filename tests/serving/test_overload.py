"""Overload behaviour of a real grpc.aio server over fake backends whose batches wait on a gate:

* a full queue answers RESOURCE_EXHAUSTED with the ``grpc-retry-pushback-ms`` trailer (gRFC A6), counted in
  ``relserve_rejection_duration_seconds``;
* a grpc client with the documented retry policy (``deploy/client/service_config.json``) gets its answer
  after a queue-full refusal, without application code;
* a short Answer sent behind a long one (many QA windows) on the same model runs in the next batch, not
  after all the long request's windows (``max_request_batch_share``).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from fixtures.fake_serving import FakeBackend, model_config, server_config
from fixtures.server import Running
from relserve.service._proto import inference_pb2 as pb
from relserve.service.backends.base import TASK_CLASSIFICATION, TASK_QA
from relserve.service.scheduling.pushback import MAX_RETRY_S, MIN_RETRY_S, PUSHBACK_TRAILER
from relserve.service.runner import ModelRunner

REPO = Path(__file__).resolve().parents[2]
SERVICE_CONFIG = REPO / "deploy" / "client" / "service_config.json"


class GatedBackend(FakeBackend):
    """The fake backend, but every batch waits until ``gate`` is set; records the first token after CLS of
    each item (tells the requests apart) per batch."""

    def __init__(self, task: str) -> None:
        super().__init__(task)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.first_tokens: list[list[int]] = []

    def run(self, batch, budget=None):
        self.first_tokens.append([item.input_ids[1] for item in batch])
        self.started.set()
        if not self.gate.wait(20):
            raise TimeoutError("the test never opened the gate")
        return super().run(batch)


def _serve(name: str, task: str, **config) -> tuple[Running, GatedBackend, ModelRunner]:
    backend = GatedBackend(task)
    runner = ModelRunner(model_config(name, max_queue_delay=0.0, **config), backend)
    srv = Running(server_config(), [runner])
    srv.wait_serving()
    return srv, backend, runner


def _wait_for(condition, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def _count(model: str, code: str) -> float:
    return REGISTRY.get_sample_value("relserve_requests_total", {"model": model, "task": TASK_CLASSIFICATION,
                                                                 "code": code, "protocol": "grpc_v1"}) or 0.0


def _fill(srv: Running, backend: GatedBackend, runner: ModelRunner, model: str) -> list[grpc.Future]:
    """One request computing (held at the gate), one waiting: a queue of max_queue_size 1 is full."""
    running = srv.stub.Classify.future(pb.ClassifyRequest(model=model, texts=["good"]), timeout=20)
    assert backend.started.wait(10)
    waiting = srv.stub.Classify.future(pb.ClassifyRequest(model=model, texts=["bad"]), timeout=20)
    _wait_for(lambda: runner.batcher.queue_depth == 1, "the second request to queue")
    return [running, waiting]


def test_queue_full_is_resource_exhausted_with_a_pushback_trailer():
    model = "overload-trailer"
    srv, backend, runner = _serve(model, TASK_CLASSIFICATION, max_queue_size=1, max_batch_size=1)
    try:
        held = _fill(srv, backend, runner, model)
        hist = {"model": model, "task": TASK_CLASSIFICATION}
        before = REGISTRY.get_sample_value("relserve_rejection_duration_seconds_count", hist) or 0.0
        with pytest.raises(grpc.RpcError) as err:
            srv.stub.Classify(pb.ClassifyRequest(model=model, texts=["good"]), timeout=10)
        backend.gate.set()
        assert [f.result().results[0].labels[0].label for f in held] == ["positive", "negative"]
    finally:
        backend.gate.set()
        srv.close()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queue_size is 1" in err.value.details()
    trailers = dict(err.value.trailing_metadata())
    assert PUSHBACK_TRAILER in trailers, trailers
    assert MIN_RETRY_S * 1000 <= int(trailers[PUSHBACK_TRAILER]) <= MAX_RETRY_S * 1000
    assert (REGISTRY.get_sample_value("relserve_rejection_duration_seconds_count", hist) or 0.0) == before + 1


def test_limit_refusal_tells_retry_policies_not_to_retry():
    """More units than the queue can ever hold: RESOURCE_EXHAUSTED naming the limit, with gRFC A6's negative
    pushback, so a client with the documented retry policy makes one attempt, not maxAttempts."""
    model = "overload-limit"
    srv, backend, _runner = _serve(model, TASK_CLASSIFICATION, max_queue_size=1)
    backend.gate.set()
    retrying = grpc.insecure_channel(f"127.0.0.1:{srv.port}", options=[
        ("grpc.enable_retries", 1), ("grpc.service_config", SERVICE_CONFIG.read_text())])
    try:
        with pytest.raises(grpc.RpcError) as err:
            srv.stub.Classify(pb.ClassifyRequest(model=model, texts=["good", "bad"]), timeout=10)
        before = _count(model, "RESOURCE_EXHAUSTED")
        from relserve.service._proto import inference_pb2_grpc as pb_grpc

        with pytest.raises(grpc.RpcError) as retried:
            pb_grpc.InferenceStub(retrying).Classify(pb.ClassifyRequest(model=model, texts=["good", "bad"]),
                                                     timeout=10)
        attempts = _count(model, "RESOURCE_EXHAUSTED") - before
    finally:
        retrying.close()
        srv.close()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queue_size 1" in err.value.details()
    assert dict(err.value.trailing_metadata())[PUSHBACK_TRAILER] == "-1"
    assert retried.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert attempts == 1  # the documented policy retries RESOURCE_EXHAUSTED, but not against this pushback


def test_client_with_the_documented_retry_policy_succeeds_after_a_queue_full():
    model = "overload-retry"
    service_config = json.loads(SERVICE_CONFIG.read_text())
    policy = service_config["methodConfig"][0]["retryPolicy"]
    assert {"RESOURCE_EXHAUSTED", "UNAVAILABLE"} <= set(policy["retryableStatusCodes"])
    srv, backend, runner = _serve(model, TASK_CLASSIFICATION, max_queue_size=1, max_batch_size=1)
    retrying = grpc.insecure_channel(f"127.0.0.1:{srv.port}", options=[
        ("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(service_config))])
    try:
        held = _fill(srv, backend, runner, model)
        from relserve.service._proto import inference_pb2_grpc as pb_grpc

        call = pb_grpc.InferenceStub(retrying).Classify.future(
            pb.ClassifyRequest(model=model, texts=["good good"]), timeout=20)
        _wait_for(lambda: _count(model, "RESOURCE_EXHAUSTED") >= 1, "the first attempt to be refused")
        backend.gate.set()  # the queue drains; the client's retry (after the pushback) is taken
        reply = call.result()
        for f in held:
            f.result()
    finally:
        backend.gate.set()
        retrying.close()
        srv.close()
    assert reply.results[0].labels[0].label == "positive"
    assert _count(model, "OK") == 3  # the two that filled the queue, and the retried one
    assert _count(model, "RESOURCE_EXHAUSTED") >= 1  # one RPC for the client, several attempts at the server


LONG_QUESTION, SHORT_QUESTION = "what", "abcdefghij"  # first tokens 16 and 22 in the fake tokenizer


@pytest.mark.parametrize("share, short_batch", [(None, 1), (1.0, "last")])
def test_short_answer_is_not_starved_behind_a_long_one(share, short_batch):
    """24 windows (max_seq_len 64, max_batch_size 4) then a 1-window request: with the default share (0.5)
    it runs in the second batch; with the cap off (1.0, the control) after all 24 windows."""
    model = f"overload-fair-{share}"
    config = {"max_batch_size": 4, **({"max_request_batch_share": share} if share is not None else {})}
    srv, backend, runner = _serve(model, TASK_QA, **config)
    context = " ".join(f"w{i % 10}" for i in range(60 + 44 * 23))  # 60 words per window, advancing by 44
    try:
        long = srv.stub.Answer.future(pb.AnswerRequest(model=model, question=LONG_QUESTION, context=context),
                                      timeout=20)
        assert backend.started.wait(10)  # its first batch is computing
        _wait_for(lambda: runner.batcher.queue_depth == 20, "the long request's other windows to queue")
        short = srv.stub.Answer.future(pb.AnswerRequest(model=model, question=SHORT_QUESTION,
                                                        context="Ann lives in Oslo"), timeout=20)
        _wait_for(lambda: runner.batcher.queue_depth == 21, "the short request to queue")
        backend.gate.set()
        long_reply, short_reply = long.result(), short.result()
    finally:
        backend.gate.set()
        srv.close()
    assert long_reply.num_windows == 24 and short_reply.num_windows == 1
    assert short_reply.answers[0].text == "Ann"  # the fake model answers the first context word
    tokens = backend.first_tokens
    short_id, long_id = 12 + len(SHORT_QUESTION), 12 + len(LONG_QUESTION)
    where = [i for i, batch in enumerate(tokens) if short_id in batch]
    assert len(where) == 1 and sum(b.count(long_id) for b in tokens) == 24
    assert where[0] == (len(tokens) - 1 if short_batch == "last" else short_batch), tokens
    assert all(len(b) <= 4 for b in tokens)
