"""The HTTP/JSON API (service/frontends/http_transport.py, http_v2.py, http_v1.py) of a real server on free loopback ports, driven with plain HTTP
requests (urllib, as curl would send them): the relserve.v1 task routes and the KServe v2 REST routes give the
gRPC answers for the same inputs; errors are JSON with the HTTP status of the gRPC code; limits, deadlines,
bearer tokens, TLS, /metrics and the drain."""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import logging
import socket
import ssl
import zlib
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from google.protobuf import json_format
from prometheus_client import REGISTRY

from fixtures.http_requests import http
from fixtures.fake_serving import FakeBackend, model_config, runner, server_config
from fixtures.server import Running
from fixtures.tls import make_pki
from fixtures.translation import make_tiny_checkpoint
from relserve.service._proto import grpc_predict_v2_pb2 as v2
from relserve.service._proto import grpc_predict_v2_pb2_grpc as v2_grpc
from relserve.service._proto import inference_pb2 as pb
from relserve.service.backends.base import TASK_CLASSIFICATION, TASK_QA, TASK_TRANSLATION
from relserve.service.config import ModelConfig
from relserve.service.metrics import PROTOCOLS
from relserve.service.registry import build_runner
from relserve.service.runner import ModelRunner


class GatedBackend(FakeBackend):
    """The fake classifier, but every batch waits until ``gate`` is set (a request held while it computes)."""

    def __init__(self) -> None:
        super().__init__(TASK_CLASSIFICATION)
        self.gate = threading.Event()
        self.started = threading.Event()

    def run(self, batch, budget=None):
        self.started.set()
        if not self.gate.wait(20):
            raise TimeoutError("the test never opened the gate")
        return super().run(batch)


def as_json(message) -> dict:
    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)


def count(model: str, task: str, code: str) -> float:
    return sum(REGISTRY.get_sample_value("relserve_requests_total", {"model": model, "task": task, "code": code,
                                                                     "protocol": p}) or 0.0 for p in PROTOCOLS)


@pytest.fixture(scope="module")
def gated():
    return GatedBackend()


@pytest.fixture(scope="module")
def srv(tmp_path_factory, gated):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("http-translation") / "tr", seed=1)
    s = Running(server_config(http_port=0), [
        runner("sentiment"),
        runner("qa", TASK_QA),
        runner("broken", fail=True),
        ModelRunner(model_config("gated", max_queue_delay=0.0, max_queue_size=1, max_batch_size=1), gated),
        build_runner(ModelConfig(name="tr", path=checkpoint, device="cpu", max_source_tokens=120,
                                 max_batch_tokens=4096, max_queue_delay=0.002)),
    ])
    s.wait_serving(timeout=60)
    s.base = f"http://127.0.0.1:{s.server.http_port}"
    yield s
    gated.gate.set()
    s.close()


# ---------------------------------------------------------------------- relserve.v1 routes

def test_classify_is_the_grpc_answer(srv):
    texts = ["good good movie", "bad bad", "good bad good"]
    reply = http(srv.base, "POST", "/v1/classify", {"model": "sentiment", "texts": texts, "top_k": 2})
    assert reply.status == 200, reply.body
    assert reply.headers["Content-Type"].startswith("application/json")
    grpc_reply = srv.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=texts, top_k=2), timeout=10)
    assert reply.json == as_json(grpc_reply)
    results = reply.json["results"]
    assert [r["labels"][0]["label"] for r in results] == ["positive", "negative", "positive"]
    assert [len(r["labels"]) for r in results] == [2, 2, 2]
    assert results[0]["numTokens"] == 5 and results[0]["truncated"] is False  # CLS + 3 words + SEP; defaults shown


def test_answer_accepts_both_field_name_forms(srv):
    body = {"model": "qa", "question": "who?", "context": "Alice went home early", "topK": 1}
    camel = http(srv.base, "POST", "/v1/answer", body)
    snake = http(srv.base, "POST", "/v1/answer", {**{k: v for k, v in body.items() if k != "topK"}, "top_k": 1})
    grpc_reply = srv.stub.Answer(pb.AnswerRequest(model="qa", question="who?", context="Alice went home early",
                                                  top_k=1), timeout=10)
    assert camel.status == snake.status == 200, camel.body
    assert camel.json == snake.json == as_json(grpc_reply)
    assert camel.json["answers"][0]["text"] == "Alice"
    assert camel.json["answers"][0]["start"] == 0 and camel.json["answers"][0]["end"] == 5


def test_translate_is_the_grpc_answer(srv):
    body = {"model": "tr", "texts": ["Der Hund schläft.", "Guten Morgen"], "beamSize": 2, "nBest": 2,
            "returnAlignment": True}
    reply = http(srv.base, "POST", "/v1/translate", body)
    assert reply.status == 200, reply.body
    grpc_reply = srv.stub.Translate(pb.TranslateRequest(model="tr", texts=body["texts"], beam_size=2, n_best=2,
                                                        return_alignment=True), timeout=60)
    assert reply.json == as_json(grpc_reply)
    hyps = reply.json["results"][0]["hypotheses"]
    assert len(hyps) == 2 and hyps[0]["alignment"]["weights"]


def test_list_models(srv):
    reply = http(srv.base, "GET", "/v1/models")
    assert reply.status == 200
    assert reply.json == as_json(srv.stub.ListModels(pb.ListModelsRequest(), timeout=10))
    assert {m["name"] for m in reply.json["models"]} == {"sentiment", "qa", "broken", "gated", "tr"}


def test_v1_requests_are_counted_like_grpc_calls(srv):
    before = count("sentiment", TASK_CLASSIFICATION, "OK")
    bad_before = count("sentiment", TASK_CLASSIFICATION, "INVALID_ARGUMENT")
    assert http(srv.base, "POST", "/v1/classify", {"model": "sentiment", "texts": ["good"]}).status == 200
    assert http(srv.base, "POST", "/v1/classify", {"model": "sentiment", "texts": []}).status == 400
    assert count("sentiment", TASK_CLASSIFICATION, "OK") == before + 1
    assert count("sentiment", TASK_CLASSIFICATION, "INVALID_ARGUMENT") == bad_before + 1


# ---------------------------------------------------------------------- errors

def _grpc_error(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)
    return err.value.code(), err.value.details()


@pytest.mark.parametrize("path,body,rpc,request_type,status,code", [
    ("/v1/classify", {"model": "nope", "texts": ["good"]}, "Classify", pb.ClassifyRequest, 404, "NOT_FOUND"),
    ("/v1/classify", {"model": "sentiment", "texts": []}, "Classify", pb.ClassifyRequest, 400, "INVALID_ARGUMENT"),
    ("/v1/classify", {"model": "qa", "texts": ["good"]}, "Classify", pb.ClassifyRequest, 400, "FAILED_PRECONDITION"),
    ("/v1/classify", {"model": "broken", "texts": ["good"]}, "Classify", pb.ClassifyRequest, 500, "INTERNAL"),
    ("/v1/answer", {"model": "qa", "question": "", "context": "x"}, "Answer", pb.AnswerRequest, 400,
     "INVALID_ARGUMENT"),
    ("/v1/translate", {"model": "tr", "texts": ["a"], "beamSize": 99}, "Translate", pb.TranslateRequest, 400,
     "INVALID_ARGUMENT"),
])
def test_errors_carry_the_grpc_status_and_message(srv, path, body, rpc, request_type, status, code):
    reply = http(srv.base, "POST", path, body)
    grpc_code, details = _grpc_error(getattr(srv.stub, rpc), json_format.ParseDict(body, request_type()))
    assert (reply.status, reply.json) == (status, {"error": details, "code": grpc_code.name})
    assert grpc_code.name == code


@pytest.mark.parametrize("raw,why", [
    (b'{"model": "sentiment", "texts": [', "not valid JSON"),
    (b'["good"]', "must be a JSON object, got a list"),
    (b'null', "must be a JSON object, got null"),
    (b'{"model": "sentiment", "txts": ["good"]}', "txts"),
    (b'{"model": "sentiment", "texts": "good"}', "texts"),
    (b'{"model": "sentiment", "topK": -1}', "topK"),
    (b'\xff\xfe', "not UTF-8"),
])
def test_malformed_bodies_are_400(srv, raw, why):
    before = count("_unknown_", TASK_CLASSIFICATION, "INVALID_ARGUMENT")
    reply = http(srv.base, "POST", "/v1/classify", raw=raw)
    assert reply.status == 400 and reply.json["code"] == "INVALID_ARGUMENT"
    assert "relserve.v1.ClassifyRequest" in reply.json["error"] and why in reply.json["error"], reply.json
    assert count("_unknown_", TASK_CLASSIFICATION, "INVALID_ARGUMENT") == before + 1


def test_wrong_method_unknown_path_and_bad_timeout(srv):
    wrong = http(srv.base, "GET", "/v1/classify")
    assert wrong.status == 405 and wrong.json["code"] == "UNIMPLEMENTED" and "POST" in wrong.headers["Allow"]
    missing = http(srv.base, "GET", "/v1/nothing")
    assert missing.status == 404 and missing.json["code"] == "NOT_FOUND" and "/v1/nothing" in missing.json["error"]
    bad = http(srv.base, "POST", "/v1/classify", {"model": "sentiment", "texts": ["good"]},
               headers={"X-Request-Timeout": "soon"})
    assert bad.status == 400 and "X-Request-Timeout" in bad.json["error"]


def test_queue_full_is_429_with_retry_after_and_deadline_is_504(srv, gated):
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        held = pool.submit(http, srv.base, "POST", "/v1/classify", {"model": "gated", "texts": ["good"]})
        assert gated.started.wait(10)
        queued = pool.submit(http, srv.base, "POST", "/v1/classify", {"model": "gated", "texts": ["bad"]})
        runner = srv.server.registry.runners["gated"]
        end = time.monotonic() + 10
        while runner.batcher.queue_depth < 1 and time.monotonic() < end:
            time.sleep(0.005)
        full = http(srv.base, "POST", "/v1/classify", {"model": "gated", "texts": ["good"]})
        v2_full = http(srv.base, "POST", "/v2/models/gated/infer",
                       {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["good"]}]})
        before = count("tr", TASK_TRANSLATION, "DEADLINE_EXCEEDED")
        # a microsecond's timeout has passed before the server reads the request: no answer can be in time
        late = http(srv.base, "POST", "/v1/translate", {"model": "tr", "texts": ["Guten Morgen"]},
                    headers={"X-Request-Timeout": "1e-6"})
        gated.gate.set()
        assert held.result().json["results"][0]["labels"][0]["label"] == "positive"
        assert queued.result().json["results"][0]["labels"][0]["label"] == "negative"
    finally:
        gated.gate.set()
        pool.shutdown()
    for reply in (full, v2_full):
        assert reply.status == 429 and reply.json["code"] == "RESOURCE_EXHAUSTED", reply.body
        assert "max_queue_size is 1" in reply.json["error"]
        assert int(reply.headers["Retry-After"]) >= 1
    assert late.status == 504 and late.json["code"] == "DEADLINE_EXCEEDED", late.body
    assert count("tr", TASK_TRANSLATION, "DEADLINE_EXCEEDED") == before + 1


# ---------------------------------------------------------------------- KServe v2 REST

def test_v2_server_and_model_metadata(srv):
    meta = http(srv.base, "GET", "/v2")
    assert meta.status == 200 and meta.json["name"] == "relserve" and meta.json["extensions"] == ["binary_tensor_data"]
    assert http(srv.base, "GET", "/v2/health/live").json == {"live": True}
    ready = http(srv.base, "GET", "/v2/health/ready")
    assert (ready.status, ready.json) == (200, {"ready": True})
    model = http(srv.base, "GET", "/v2/models/sentiment")
    assert model.status == 200
    assert model.json == {"name": "sentiment", "versions": ["1"], "platform": "relserve_fake",
                          "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]},
                                     {"name": "text_pair", "datatype": "BYTES", "shape": [-1]}],
                          "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]},
                                      {"name": "label", "datatype": "BYTES", "shape": [-1]}]}
    assert http(srv.base, "GET", "/v2/models/sentiment/versions/1").json == model.json
    assert http(srv.base, "GET", "/v2/models/qa/ready").status == 200
    assert http(srv.base, "GET", "/v2/models/nope/ready").status == 400
    missing = http(srv.base, "GET", "/v2/models/nope")
    assert missing.status == 404 and "nope" in missing.json["error"] and "sentiment" in missing.json["error"]
    assert http(srv.base, "GET", "/v2/models/sentiment/versions/7").status == 404


def test_v2_classify_gives_the_v1_scores(srv):
    texts = ["good good movie", "bad bad"]
    body = {"id": "req-1", "inputs": [{"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": [[t] for t in texts]}]}
    before = count("sentiment", TASK_CLASSIFICATION, "OK")
    reply = http(srv.base, "POST", "/v2/models/sentiment/infer", body)
    assert reply.status == 200, reply.body
    assert count("sentiment", TASK_CLASSIFICATION, "OK") == before + 1
    out = {t["name"]: t for t in reply.json["outputs"]}
    assert reply.json["model_name"] == "sentiment" and reply.json["model_version"] == "1"
    assert reply.json["id"] == "req-1"
    v1 = srv.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=texts, top_k=2), timeout=10)
    expected = [next(s.score for s in r.labels if s.label == label) for r in v1.results
                for label in ("negative", "positive")]
    assert out["probabilities"]["shape"] == [2, 2] and out["probabilities"]["datatype"] == "FP32"
    assert out["probabilities"]["data"] == pytest.approx(expected, abs=1e-7)
    assert out["label"] == {"name": "label", "datatype": "BYTES", "shape": [2], "data": ["positive", "negative"]}
    only = http(srv.base, "POST", "/v2/models/sentiment/infer", {**body, "outputs": [{"name": "label"}]})
    assert [t["name"] for t in only.json["outputs"]] == ["label"]


def test_v2_qa_and_translate_give_the_v1_answers(srv):
    context = "Alice went home early"
    qa = http(srv.base, "POST", "/v2/models/qa/infer", {"parameters": {"top_k": 1}, "inputs": [
        {"name": "question", "shape": [1], "datatype": "BYTES", "data": ["who?"]},
        {"name": "context", "shape": [1], "datatype": "BYTES", "data": [context]}]})
    assert qa.status == 200, qa.body
    answer = srv.stub.Answer(pb.AnswerRequest(model="qa", question="who?", context=context, top_k=1),
                             timeout=10).answers[0]
    out = {t["name"]: t["data"] for t in qa.json["outputs"]}
    assert (out["answer"], out["start"], out["end"]) == ([answer.text], [answer.start], [answer.end])
    assert out["score"] == pytest.approx([answer.score], abs=1e-7)
    texts = ["Der Hund schläft.", "Guten Morgen"]
    tr = http(srv.base, "POST", "/v2/models/tr/infer", {"parameters": {"beam_size": 2}, "inputs": [
        {"name": "text", "shape": [2], "datatype": "BYTES", "data": texts}]})
    assert tr.status == 200, tr.body
    v1 = srv.stub.Translate(pb.TranslateRequest(model="tr", texts=texts, beam_size=2), timeout=60)
    assert tr.json["outputs"][0]["data"] == [r.hypotheses[0].text for r in v1.results]


def _v2(data: list, **tensor) -> dict:
    """A v2 REST request body of one BYTES input 'text' of shape [len(data)]."""
    return {"inputs": [{"name": "text", "shape": [len(data)], "datatype": "BYTES", "data": data, **tensor}]}


@pytest.mark.parametrize("body,status,needle", [
    ({"inputs": [{"name": "txt", "shape": [1], "datatype": "BYTES", "data": ["good"]}]}, 400, "unknown input 'txt'"),
    ({"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["good"]}]}, 400, "1 elements"),
    ({"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, 400, "BYTES"),
    ({"inputs": []}, 400, "'inputs'"),
    ({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["good"]}], "parameters": {"beam": 1}},
     400, "unknown parameter 'beam'"),
    ({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}], "outputs": [{"name": "z"}]},
     400, "unknown output 'z'"),
    ({"inputs": [{"name": "text", "datatype": "BYTES", "data": ["x"]}]}, 400, "'shape'"),
    ({"input": []}, 400, "unknown field"),
    # every field's JSON type is checked (a wrong one was a 500 AttributeError / TypeError)
    (_v2(["a"], parameters="x"), 400, "inputs[0] ('text'): 'parameters' must be a JSON object, got a string"),
    ({**_v2(["a"]), "outputs": [{"name": "label", "parameters": "z"}]}, 400,
     "outputs[0] ('label'): 'parameters' must be a JSON object, got a string"),
    ({**_v2(["a"]), "outputs": 5}, 400, "'outputs' must be a JSON array of {name, parameters}, got an integer"),
    ({**_v2(["a"]), "outputs": ["label"]}, 400, "outputs[0] must be a JSON object {name, parameters}, got a string"),
    ({**_v2(["a"]), "outputs": [{"name": 3}]}, 400, "outputs[0]: 'name' must be a string, got an integer"),
    ({**_v2(["a"]), "outputs": [{"name": "label", "binary": True}]}, 400, "unknown field(s) ['binary'] in outputs[0]"),
    ({**_v2(["a"]), "id": 7}, 400, "'id' must be a string, got an integer"),
    ({**_v2(["a"]), "parameters": []}, 400, "the inference request: 'parameters' must be a JSON object, got a list"),
    ({"inputs": None}, 400,
     "'inputs' must be a non-empty JSON array of tensors {name, shape, datatype, data}, got null"),
    ({"inputs": ["text"]}, 400,
     "inputs[0] must be a JSON object {name, shape, datatype, parameters, data}, got a string"),
    ({"inputs": [{"name": 1, "shape": [1], "datatype": "BYTES", "data": ["a"]}]}, 400,
     "inputs[0]: 'name' must be a string, got an integer"),
    ({"inputs": [{"name": "text", "shape": [1], "datatype": None, "data": ["a"]}]}, 400,
     "inputs[0]: 'datatype' must be a string, got null"),
    ({"inputs": [{"name": "text", "shape": 1, "datatype": "BYTES", "data": ["a"]}]}, 400,
     "inputs[0]: 'shape' must be a list, got an integer"),
    ({"inputs": [{"name": "text", "shape": [True], "datatype": "BYTES", "data": ["a"]}]}, 400,
     "'shape' must be a list of non-negative integers"),
    ({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": "a"}]}, 400,
     "inputs[0] ('text'): 'data' must be a JSON array, got a string"),
    ({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES"}]}, 400, "inputs[0] ('text'): 'data' is missing"),
    ({"inputs": [{**_v2(["a"])["inputs"][0], "contents": []}]}, 400, "unknown field(s) ['contents'] in inputs[0]"),
    (_v2([5]), 400, "input 'text'[0] is an integer; BYTES elements must be UTF-8 strings"),
    (_v2(["a"], parameters={"binary_data_size": 1}), 400, "input 'text' has parameter 'binary_data_size'"),
    # nesting must be flat or exactly as the shape (a [1] tensor nested three deep was accepted)
    ({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [[["a"]]]}]}, 400,
     "inputs[0] ('text'): data[0] is a list but 'shape' [1] has 1 dimension(s)"),
    ({"inputs": [{"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": [["a"], "b"]}]}, 400,
     "data[1] must be a list of length 1 (dimension 1 of 'shape' [2, 1]), got a string"),
    ({"inputs": [{"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": [["a", "b"]]}]}, 400,
     "data must be a list of length 2 (dimension 0 of 'shape' [2, 1]), got 1 elements"),
    ({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [[["a"]]]}]}, 400,
     "data[0][0] is a list but 'shape' [1, 1] has 2 dimension(s)"),
])
def test_v2_bad_requests(srv, body, status, needle):
    reply = http(srv.base, "POST", "/v2/models/sentiment/infer", body)
    assert reply.status == status and needle in reply.json["error"], reply.json
    assert reply.json["code"] == "INVALID_ARGUMENT"


def test_v2_nested_data_as_the_shape_says_is_accepted(srv):
    flat = http(srv.base, "POST", "/v2/models/sentiment/infer", _v2(["good", "bad"]))
    assert flat.status == 200, flat.body
    for shape, data in (([2, 1], [["good"], ["bad"]]), ([2], ["good", "bad"]), ([2, 1], ["good", "bad"])):
        reply = http(srv.base, "POST", "/v2/models/sentiment/infer",
                     {"inputs": [{"name": "text", "shape": shape, "datatype": "BYTES", "data": data}]})
        assert reply.status == 200 and reply.json == flat.json, (shape, data, reply.body)
    # outputs may say binary_data false (JSON elements, what tritonclient.http sends by default)
    reply = http(srv.base, "POST", "/v2/models/sentiment/infer",
                 {**_v2(["good"]), "outputs": [{"name": "label", "parameters": {"binary_data": False}}]})
    assert reply.status == 200 and reply.json["outputs"][0]["data"] == ["positive"], reply.body


@pytest.mark.parametrize("model,body,needle", [
    ("sentiment", '{"inputs":[{"name":"text","shape":[1],"datatype":"BYTES","data":["\\ud800"]}]}',
     "input 'text'[0] is not valid UTF-8 text (an unpaired surrogate at character 0)"),
    ("qa", '{"inputs":[{"name":"question","shape":[1],"datatype":"BYTES","data":["who?"]},'
           '{"name":"context","shape":[1],"datatype":"BYTES","data":["Al\\ud800ice"]}]}',
     "input 'context'[0] is not valid UTF-8 text (an unpaired surrogate at character 2)"),
    ("tr", '{"inputs":[{"name":"text","shape":[2],"datatype":"BYTES","data":["Guten Morgen","\\udfff"]}]}',
     "input 'text'[1] is not valid UTF-8 text (an unpaired surrogate at character 0)"),
])
def test_v2_unpaired_surrogate_is_400_naming_the_element(srv, model, body, needle, caplog):
    assert "\\ud" in body  # the JSON escape itself: json.loads makes it a lone surrogate str
    reply = http(srv.base, "POST", f"/v2/models/{model}/infer", raw=body.encode())
    assert (reply.status, reply.json) == (400, {"error": needle, "code": "INVALID_ARGUMENT"})
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("body,needle", [
    ('{"inputs":[{"name":"text","shape":[1],"datatype":"BYTES","data":["a"]}],"id":"x\\ud800"}',
     "'id' is not valid UTF-8 text (an unpaired surrogate at character 1)"),
    ('{"inputs":[{"name":"te\\udfffxt","shape":[1],"datatype":"BYTES","data":["a"]}]}',
     "inputs[0]: 'name' is not valid UTF-8 text (an unpaired surrogate at character 2)"),
    ('{"inputs":[{"name":"text","shape":[1],"datatype":"BYTES\\ud800","data":["a"]}]}',
     "inputs[0]: 'datatype' is not valid UTF-8 text (an unpaired surrogate at character 5)"),
    ('{"inputs":[{"name":"text","shape":[1],"datatype":"BYTES","data":["a"]}],"outputs":[{"name":"\\ud800"}]}',
     "outputs[0]: 'name' is not valid UTF-8 text (an unpaired surrogate at character 0)"),
])
def test_v2_unpaired_surrogate_in_echoed_field_is_400_before_inference(srv, body, needle, caplog):
    # the id was echoed into the reply after the model ran: UnicodeEncodeError, a 500 and a traceback
    assert "\\ud" in body
    before = REGISTRY.get_sample_value("relserve_batch_size_count", {"model": "sentiment"}) or 0.0
    reply = http(srv.base, "POST", "/v2/models/sentiment/infer", raw=body.encode())
    assert (reply.status, reply.json) == (400, {"error": needle, "code": "INVALID_ARGUMENT"})
    assert (REGISTRY.get_sample_value("relserve_batch_size_count", {"model": "sentiment"}) or 0.0) == before
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def _grpc_v2_error(srv, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        v2_grpc.GRPCInferenceServiceStub(srv.channel).ModelInfer(request, timeout=10)
    return err.value.code(), err.value.details()


def _grpc_v2_request(output_parameters=None, input_parameters=None) -> v2.ModelInferRequest:
    req = v2.ModelInferRequest(model_name="sentiment")
    t = req.inputs.add(name="text", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(b"good")
    for key, value in (input_parameters or {}).items():
        t.parameters[key].int64_param = value
    if output_parameters is not None:
        o = req.outputs.add(name="label")
        for key, value in output_parameters.items():
            o.parameters[key].int64_param = value
    return req


@pytest.mark.parametrize("http_body,grpc_request,needle", [
    (_v2(["good"], parameters={"x": 1}), _grpc_v2_request(input_parameters={"x": 1}),
     "input 'text' has parameter 'x' = '1': tensor-level parameters (e.g. shared memory) are not supported"),
    ({**_v2(["good"]), "outputs": [{"name": "label", "parameters": {"classification": 2}}]},
     _grpc_v2_request(output_parameters={"classification": 2}),
     "output 'label' has parameter 'classification' = '2': the classification extension is not supported"),
    ({**_v2(["good"]), "outputs": [{"name": "label", "parameters": {"class_count": 2}}]},
     _grpc_v2_request(output_parameters={"class_count": 2}), "output 'label' has parameter 'class_count'"),
])
def test_v2_tensor_parameters_follow_one_rule_on_http_and_grpc(srv, http_body, grpc_request, needle):
    reply = http(srv.base, "POST", "/v2/models/sentiment/infer", http_body)
    code, details = _grpc_v2_error(srv, grpc_request)
    assert (reply.status, reply.json["code"], code) == (400, "INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT)
    assert reply.json["error"] == details and needle in details, (reply.json, details)


def test_v2_fp32_outputs_are_the_grpc_float32_values(srv):
    texts = ["good good movie", "bad bad", "good bad good"]
    reply = http(srv.base, "POST", "/v2/models/sentiment/infer",
                 {"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": texts}],
                  "parameters": {"function_to_apply": "sigmoid"}})
    assert reply.status == 200, reply.body
    req = v2.ModelInferRequest(model_name="sentiment")
    req.parameters["function_to_apply"].string_param = "sigmoid"
    req.inputs.add(name="text", datatype="BYTES", shape=[3]).contents.bytes_contents.extend(t.encode() for t in texts)
    grpc_reply = v2_grpc.GRPCInferenceServiceStub(srv.channel).ModelInfer(req, timeout=10)
    http_probabilities = reply.json["outputs"][0]["data"]
    assert http_probabilities == list(grpc_reply.outputs[0].contents.fp32_contents)  # exactly, not approx


def _errors_logged(caplog) -> list[str]:
    """Log records at ERROR or with a traceback (a client's mistake must produce neither)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_content_encoding(srv, caplog):
    caplog.set_level(logging.WARNING)
    body = json.dumps(_v2(["good", "bad"])).encode()
    plain = http(srv.base, "POST", "/v2/models/sentiment/infer", raw=body)
    assert plain.status == 200
    for encoding, encoded in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)),
                              ("identity", body), ("gzip, identity", gzip.compress(body))):
        reply = http(srv.base, "POST", "/v2/models/sentiment/infer", raw=encoded,
                     headers={"Content-Encoding": encoding})
        assert (reply.status, reply.json) == (200, plain.json), (encoding, reply.body)
    v1 = http(srv.base, "POST", "/v1/classify", raw=gzip.compress(b'{"model": "sentiment", "texts": ["good"]}'),
              headers={"Content-Encoding": "gzip"})
    assert v1.status == 200 and v1.json["results"][0]["labels"][0]["label"] == "positive", v1.body
    # labelled gzip but not gzip (was a 500 and tracebacks), or cut short
    for path in ("/v2/models/sentiment/infer", "/v1/classify"):
        bad = http(srv.base, "POST", path, raw=b"not gzip at all", headers={"Content-Encoding": "gzip"})
        assert bad.status == 400 and bad.json["code"] == "INVALID_ARGUMENT", bad.body
        assert "the request body is not valid gzip data as its Content-Encoding 'gzip' says" in bad.json["error"]
    cut = http(srv.base, "POST", "/v2/models/sentiment/infer", raw=gzip.compress(body)[:-12],
               headers={"Content-Encoding": "gzip"})
    assert (cut.status, cut.json["code"]) == (400, "INVALID_ARGUMENT"), cut.body
    assert "not one complete gzip stream" in cut.json["error"]
    # an encoding the server cannot decode (was a plain-text 400 from aiohttp's parser and a traceback)
    for encoding in ("br", "zstd", "gzip, br"):
        reply = http(srv.base, "POST", "/v2/models/sentiment/infer", raw=body, headers={"Content-Encoding": encoding})
        assert reply.status == 415 and reply.headers["Content-Type"].startswith("application/json"), reply.body
        assert reply.json == {"error": f"Content-Encoding '{encoding}' is not supported; send the body "
                                       f"uncompressed, gzip or deflate", "code": "UNIMPLEMENTED"}
    assert _errors_logged(caplog) == []


def _raw_exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(data)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    return reply


@pytest.mark.parametrize("data,reason", [
    (b"GARBAGE\r\n\r\n", None),  # aiohttp logs a first request's bad method at DEBUG only
    (b"GET /v2 HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n", "Invalid header token"),
    (b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", "Content-Length"),
    (b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
     "chunk size"),
    (b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\nzz\r\n",
     "chunk size"),  # the body breaks off after the route started reading it
])
def test_malformed_http_is_400_with_one_warning_line_and_no_traceback(srv, caplog, data, reason):
    caplog.set_level(logging.WARNING)
    reply = _raw_exchange(srv.server.http_port, data)
    assert reply.startswith(b"HTTP/1.") and b" 400 " in reply.split(b"\r\n", 1)[0], reply[:200]
    assert _errors_logged(caplog) == []
    warnings = [r.getMessage() for r in caplog.records if r.name == "relserve.service.frontends.http_transport"]
    if reason is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and "\n" not in warnings[0], warnings
        assert warnings[0].startswith("refused a malformed HTTP request from 127.0.0.1: 400 ") and reason in warnings[0]
    # the server keeps answering
    assert http(srv.base, "GET", "/v2/health/live").json == {"live": True}


@pytest.mark.parametrize("path,model,task", [
    # v2: the URL names the model, so the count is on it (and its task) when it is served
    ("/v2/models/sentiment/infer", "sentiment", TASK_CLASSIFICATION),
    ("/v2/models/tr/infer", "tr", TASK_TRANSLATION),
    ("/v2/models/nope/infer", "_unknown_", "_unknown_"),  # not served: bounded labels
    # v1: the model is in the unread body; the task is the route's (was not counted at all)
    ("/v1/classify", "_unknown_", TASK_CLASSIFICATION),
    ("/v1/answer", "_unknown_", TASK_QA),
    ("/v1/translate", "_unknown_", TASK_TRANSLATION),
])
def test_client_closing_mid_body_is_cancelled_without_a_traceback(srv, caplog, path, model, task):
    caplog.set_level(logging.WARNING)
    before = count(model, task, "CANCELLED")
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=10) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{\"in".encode())
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(65536) == b""  # closed unanswered: the client is gone
    end = time.monotonic() + 10
    while count(model, task, "CANCELLED") == before and time.monotonic() < end:
        time.sleep(0.01)
    assert count(model, task, "CANCELLED") == before + 1
    assert _errors_logged(caplog) == []


def test_v2_unknown_model_and_wrong_method(srv):
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["good"]}]}
    before = count("_unknown_", "_unknown_", "NOT_FOUND")
    missing = http(srv.base, "POST", "/v2/models/nope/infer", body)
    assert missing.status == 404 and missing.json["code"] == "NOT_FOUND"
    assert count("_unknown_", "_unknown_", "NOT_FOUND") == before + 1
    assert http(srv.base, "GET", "/v2/models/sentiment/infer").status == 405


def test_metrics_on_the_http_port(srv):
    assert http(srv.base, "POST", "/v1/classify", {"model": "sentiment", "texts": ["good"]}).status == 200
    reply = http(srv.base, "GET", "/metrics")
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
    text = reply.body.decode()
    line = next(l for l in text.splitlines()
                if l.startswith('relserve_requests_total{code="OK",model="sentiment",protocol="http_v1",'
                              'task="classification"}'))
    assert float(line.split()[-1]) == REGISTRY.get_sample_value("relserve_requests_total", {
        "model": "sentiment", "task": TASK_CLASSIFICATION, "code": "OK", "protocol": "http_v1"})
    urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).close()  # still served


# ---------------------------------------------------------------------- limits, auth, TLS, drain

@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    root = tmp_path_factory.mktemp("http-secure")
    pki = make_pki(root)
    tokens = root / "tokens"
    tokens.write_text("# clients\ns3cret-token\n")
    s = Running(server_config(http_port=0, auth_token_file=tokens, tls_cert=pki.server_cert, tls_key=pki.server_key,
                              max_receive_message_length=4096, max_send_message_length=4096),
                [runner("sentiment")], load=True)
    s.base = f"https://127.0.0.1:{s.server.http_port}"
    s.tls = ssl.create_default_context(cafile=str(pki.ca_cert))
    end = time.monotonic() + 10
    while http(s.base, "GET", "/v2/health/ready", context=s.tls).status != 200:
        assert time.monotonic() < end, "never ready"
        time.sleep(0.02)
    yield s
    s.close()


AUTH = {"Authorization": "Bearer s3cret-token"}


def test_tokens_on_tls(secure):
    body = {"model": "sentiment", "texts": ["good"]}
    ok = http(secure.base, "POST", "/v1/classify", body, headers=AUTH, context=secure.tls)
    assert ok.status == 200 and ok.json["results"][0]["labels"][0]["label"] == "positive"
    before = count("_unknown_", TASK_CLASSIFICATION, "UNAUTHENTICATED")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-token"}):
        refused = http(secure.base, "POST", "/v1/classify", body, headers=headers, context=secure.tls)
        assert refused.status == 401 and refused.json["code"] == "UNAUTHENTICATED", refused.body
        assert refused.headers["WWW-Authenticate"] == "Bearer"
        assert "s3cret" not in refused.json["error"] and "wrong" not in refused.json["error"]
        assert "metadata" not in refused.json["error"] and "'authorization" not in refused.json["error"]
        if not headers:  # the HTTP words: a header, spelled as clients send it
            assert refused.json["error"] == "missing 'Authorization' header; send 'Authorization: Bearer <token>'"
    assert count("_unknown_", TASK_CLASSIFICATION, "UNAUTHENTICATED") == before + 3
    infer = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["good"]}]}
    assert http(secure.base, "POST", "/v2/models/sentiment/infer", infer, context=secure.tls).status == 401
    assert http(secure.base, "GET", "/v2/models/sentiment", context=secure.tls).status == 401
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/sentiment/ready", "/metrics"):
        assert http(secure.base, "GET", path, context=secure.tls).status == 200, path  # probes need no token
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext is not served on the TLS port
        urllib.request.urlopen(f"http://127.0.0.1:{secure.server.http_port}/v2/health/live", timeout=10)


def test_body_over_max_receive_message_length_is_413(secure):
    body = {"model": "sentiment", "texts": ["good " * 1000]}
    reply = http(secure.base, "POST", "/v1/classify", body, headers=AUTH, context=secure.tls)
    assert reply.status == 413 and reply.json["code"] == "RESOURCE_EXHAUSTED"
    assert "max_receive_message_length of 4096 bytes" in reply.json["error"]
    # also when a small gzip body decodes to more than the limit
    small = gzip.compress(json.dumps(body).encode())
    assert len(small) < 4096
    bomb = http(secure.base, "POST", "/v1/classify", raw=small, headers={**AUTH, "Content-Encoding": "gzip"},
                context=secure.tls)
    assert bomb.status == 413 and "max_receive_message_length of 4096 bytes" in bomb.json["error"], bomb.body
    # a reply over max_send_message_length is refused as on gRPC
    big = http(secure.base, "POST", "/v1/classify", {"model": "sentiment", "texts": ["good"] * 200},
               headers=AUTH, context=secure.tls)
    assert big.status == 429 and "max_send_message_length" in big.json["error"], big.body


def test_drain_waits_for_running_http_requests_and_refuses_new_ones():
    backend = GatedBackend()
    s = Running(server_config(http_port=0), [ModelRunner(model_config("gated", max_queue_delay=0.0), backend)])
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        s.wait_serving()
        base = f"http://127.0.0.1:{s.server.http_port}"
        held = pool.submit(http, base, "POST", "/v1/classify", {"model": "gated", "texts": ["good"]})
        assert backend.started.wait(10)
        assert s.server._inflight.running == 1  # the HTTP request counts for the drain
        drained = concurrent.futures.Future()
        drain = s.call(_start_drain(s, drained))
        assert s.server.registry.draining
        refused = http(base, "POST", "/v1/classify", {"model": "gated", "texts": ["good"]})
        ready = http(base, "GET", "/v2/health/ready")
        infer = http(base, "POST", "/v2/models/gated/infer",
                     {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["good"]}]})
        assert not drain.done()  # still waiting for the held request
        backend.gate.set()
        assert held.result(10).json["results"][0]["labels"][0]["label"] == "positive"
        assert drained.result(10) is True
    finally:
        backend.gate.set()
        pool.shutdown()
        s.close()
    assert refused.status == 503 and refused.json["code"] == "UNAVAILABLE" and "shutting down" in refused.json["error"]
    assert infer.status == 503 and infer.json["code"] == "UNAVAILABLE"
    assert (ready.status, ready.json) == (400, {"ready": False})


async def _start_drain(s: Running, done: concurrent.futures.Future):
    import asyncio

    task = asyncio.ensure_future(s.server.drain(10.0))
    task.add_done_callback(lambda t: done.set_result(t.result()))
    await asyncio.sleep(0)  # the drain's first step (registry.draining) has run
    return done


def test_deadline_passing_while_the_model_computes_is_504():
    backend = GatedBackend()
    s = Running(server_config(http_port=0), [ModelRunner(model_config("gated", max_queue_delay=0.0), backend)])
    try:
        s.wait_serving()
        base = f"http://127.0.0.1:{s.server.http_port}"
        before = count("gated", TASK_CLASSIFICATION, "DEADLINE_EXCEEDED")
        # the gate stays closed until both replies are in: neither request can be answered within its 0.2 s
        late = http(base, "POST", "/v1/classify", {"model": "gated", "texts": ["good"]},
                    headers={"X-Request-Timeout": "0.2"})
        v2_late = http(base, "POST", "/v2/models/gated/infer",
                       {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["good"]}]},
                       headers={"X-Request-Timeout": "0.2"})
        backend.gate.set()
        after = http(base, "POST", "/v1/classify", {"model": "gated", "texts": ["bad"]})
        assert s.server._inflight.running == 0  # the expired requests left nothing counted behind
    finally:
        backend.gate.set()
        s.close()
    for reply in (late, v2_late):
        assert reply.status == 504 and reply.json["code"] == "DEADLINE_EXCEEDED", reply.body
    assert count("gated", TASK_CLASSIFICATION, "DEADLINE_EXCEEDED") == before + 2
    assert after.status == 200 and after.json["results"][0]["labels"][0]["label"] == "negative"


def test_mtls_needs_a_client_certificate(tmp_path):
    pki = make_pki(tmp_path)
    s = Running(server_config(http_port=0, tls_cert=pki.server_cert, tls_key=pki.server_key,
                              tls_client_ca=pki.ca_cert), [runner("sentiment")])
    try:
        base = f"https://127.0.0.1:{s.server.http_port}"
        with_cert = ssl.create_default_context(cafile=str(pki.ca_cert))
        with_cert.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        end = time.monotonic() + 10
        while http(base, "GET", "/v2/health/ready", context=with_cert).status != 200:
            assert time.monotonic() < end, "never ready"
            time.sleep(0.02)
        ok = http(base, "POST", "/v1/classify", {"model": "sentiment", "texts": ["good"]}, context=with_cert)
        assert ok.status == 200 and ok.json["results"][0]["labels"][0]["label"] == "positive"
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            http(base, "GET", "/v2/health/live", context=ssl.create_default_context(cafile=str(pki.ca_cert)))
    finally:
        s.close()
