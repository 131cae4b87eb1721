"""KServe v2 / Open Inference Protocol (``inference.GRPCInferenceService``) on the relserve.v1 port, with real
tiny checkpoints (DeBERTa classification and QA, RNNsearch translation) loaded by ``build_runner``.

(a) Our own generated stubs: every RPC, typed and raw (length-prefixed) BYTES, answers equal to relserve.v1's
for the same inputs, parameters, requested outputs, errors (each INVALID_ARGUMENT / NOT_FOUND naming what was
wrong), metrics labels, token auth (probes open unless auth_health), readiness before warm-up and in a drain;
the HTTP/JSON v2 route of the same server gives exactly the same FP32 values and tensor-parameter refusals.

(b) tritonclient[grpc]==2.73.0 as a real third-party client. It needs protobuf<7 while relserve runs protobuf 7,
and both define the proto package ``inference``, so it runs in its own venv
(``build/tritonclient-http-grpc-venv`` of tests/fixtures/client_venvs.py, built once and shared with the
real-client tests) as a subprocess (``tests/fixtures/tritonclient_script.py``). ``RELSERVE_TRITONCLIENT_PYTHON`` names
another interpreter that has tritonclient installed (offline machines).
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from fixtures import client_venvs
from fixtures.deberta import make_deberta_checkpoint
from fixtures.fake_serving import runner as fake_runner
from fixtures.fake_serving import server_config
from fixtures.server import Running
from fixtures.translation import make_tiny_checkpoint
from prometheus_client import REGISTRY
from relserve.service._proto import grpc_predict_v2_pb2 as v2
from relserve.service._proto import grpc_predict_v2_pb2_grpc as v2_grpc
from relserve.service._proto import inference_pb2 as pb
from relserve.service.config import ModelConfig
from relserve.service.registry import build_runner

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["the film was a quiet delight", "a dull and tiring evening"]
PAIRS = ["it was good", "it was bad"]
QUESTIONS = ["Where does Ann live?", "What does Bob drink?"]
CONTEXTS = ["Ann lives in Berlin and works in a small bakery near the river.",
            "Bob drinks green tea every morning before he walks to the station."]
SOURCES = ["Der alte Mann ging gestern Abend mit seinem Hund spazieren.", "Ich habe Hunger."]


@pytest.fixture(scope="module")
def checkpoints(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("kserve")
    return {
        "cls": make_deberta_checkpoint(root / "cls", tokenizer_dir=unigram_tokenizer_dir, labels=("a", "b", "c")).path,
        "qa": make_deberta_checkpoint(root / "qa", task="question-answering", tokenizer_dir=unigram_tokenizer_dir).path,
        "tr": make_tiny_checkpoint(root / "tr", seed=1),
    }


@pytest.fixture(scope="module")
def srv(checkpoints):
    # compute in-process: worker processes have their own tests (test_worker_process.py, test_worker_pool.py)
    cfg = dict(device="cpu", max_seq_len=64, doc_stride=16, max_queue_delay=0.002, worker_process=False)
    runners = [build_runner(ModelConfig(name=name, path=path, **cfg)) for name, path in checkpoints.items()]
    s = Running(server_config(http_port=0), runners)
    s.wait_serving(timeout=120)
    s.v2 = v2_grpc.GRPCInferenceServiceStub(s.channel)
    s.http_base = f"http://127.0.0.1:{s.server.http_port}"
    yield s
    s.close()


def _code(call, *args, **kw):
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kw)
    return err.value.code(), err.value.details()


def _param(value) -> v2.InferParameter:
    if isinstance(value, bool):
        return v2.InferParameter(bool_param=value)
    if isinstance(value, int):
        return v2.InferParameter(int64_param=value)
    if isinstance(value, float):
        return v2.InferParameter(double_param=value)
    return v2.InferParameter(string_param=value)


def _prefixed(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def _request(model: str, inputs: dict[str, list], *, raw: bool = False, outputs=(), shape=None, **params):
    req = v2.ModelInferRequest(model_name=model, id="r1", outputs=[{"name": n} for n in outputs])
    for name, value in params.items():
        req.parameters[name].CopyFrom(_param(value))
    for name, values in inputs.items():
        data = [v.encode() if isinstance(v, str) else v for v in values]
        t = req.inputs.add(name=name, datatype="BYTES", shape=shape or [len(values)])
        if raw:
            req.raw_input_contents.append(_prefixed(data))
        else:
            t.contents.bytes_contents.extend(data)
    return req


def _split(buf: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(buf):
        (n,) = struct.unpack_from("<I", buf, pos)
        out.append(buf[pos + 4:pos + 4 + n])
        pos += 4 + n
    return out


_RAW = {"FP32": "f", "INT64": "q", "BOOL": "?"}
_TYPED = {"FP32": "fp32_contents", "INT64": "int64_contents", "BOOL": "bool_contents", "BYTES": "bytes_contents"}


def _outputs(reply) -> dict[str, tuple[list[int], list]]:
    """name -> (shape, flat data), from typed or raw contents (BYTES decoded)."""
    out = {}
    for i, o in enumerate(reply.outputs):
        count = math.prod(o.shape)
        if reply.raw_output_contents:
            assert not o.HasField("contents")
            buf = reply.raw_output_contents[i]
            data = _split(buf) if o.datatype == "BYTES" else list(struct.unpack(f"<{count}{_RAW[o.datatype]}", buf))
        else:
            data = list(getattr(o.contents, _TYPED[o.datatype]))
        if o.datatype == "BYTES":
            data = [b.decode() for b in data]
        assert len(data) == count, o.name
        out[o.name] = (list(o.shape), data)
    return out


def _infer(srv, *args, **kw):
    reply = srv.v2.ModelInfer(_request(*args, **kw), timeout=60)
    assert reply.id == "r1" and reply.model_version == "1"
    return _outputs(reply), reply


def _v1_classify(srv, texts, pairs=(), **kw):
    return srv.stub.Classify(pb.ClassifyRequest(model="cls", texts=texts, text_pairs=pairs, **kw), timeout=60).results


def _v1_answers(srv, question, context, **kw):
    return srv.stub.Answer(pb.AnswerRequest(model="qa", question=question, context=context, **kw), timeout=60).answers


def _v1_translate(srv, texts, **kw):
    return srv.stub.Translate(pb.TranslateRequest(model="tr", texts=texts, **kw), timeout=60).results


def _probabilities_of(result, labels=("a", "b", "c")) -> list[float]:
    scores = {x.label: x.score for x in result.labels}
    return [scores[label] for label in labels]


# ------------------------------------------------------------------------------------- (a) our stubs


def test_probes_and_metadata(srv):
    assert srv.v2.ServerLive(v2.ServerLiveRequest(), timeout=5).live
    assert srv.v2.ServerReady(v2.ServerReadyRequest(), timeout=5).ready
    for name in ("cls", "qa", "tr"):
        assert srv.v2.ModelReady(v2.ModelReadyRequest(name=name), timeout=5).ready
        assert srv.v2.ModelReady(v2.ModelReadyRequest(name=name, version="1"), timeout=5).ready
    assert not srv.v2.ModelReady(v2.ModelReadyRequest(name="nope"), timeout=5).ready
    assert not srv.v2.ModelReady(v2.ModelReadyRequest(name="cls", version="2"), timeout=5).ready

    meta = srv.v2.ServerMetadata(v2.ServerMetadataRequest(), timeout=5)
    assert meta.name == "relserve" and meta.version

    cls = srv.v2.ModelMetadata(v2.ModelMetadataRequest(name="cls"), timeout=5)
    assert cls.name == "cls" and list(cls.versions) == ["1"] and cls.platform == "relserve_torch"
    assert [(t.name, t.datatype, list(t.shape)) for t in cls.inputs] == [("text", "BYTES", [-1]),
                                                                        ("text_pair", "BYTES", [-1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in cls.outputs] == [("probabilities", "FP32", [-1, 3]),
                                                                         ("label", "BYTES", [-1])]
    qa = srv.v2.ModelMetadata(v2.ModelMetadataRequest(name="qa"), timeout=5)
    assert [t.name for t in qa.inputs] == ["question", "context"]
    assert [(t.name, t.datatype) for t in qa.outputs] == [("answer", "BYTES"), ("start", "INT64"), ("end", "INT64"),
                                                          ("score", "FP32"), ("is_impossible", "BOOL")]
    tr = srv.v2.ModelMetadata(v2.ModelMetadataRequest(name="tr"), timeout=5)
    assert [(t.name, t.datatype) for t in tr.inputs] == [("text", "BYTES")]
    assert [(t.name, t.datatype) for t in tr.outputs] == [("translation", "BYTES")]

    code, details = _code(srv.v2.ModelMetadata, v2.ModelMetadataRequest(name="nope"), timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND and "'nope'" in details and "cls" in details
    code, details = _code(srv.v2.ModelMetadata, v2.ModelMetadataRequest(name="cls", version="7"), timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND and "version '7'" in details


@pytest.mark.parametrize("raw", [False, True])
def test_classification_equals_v1(srv, raw):
    out, reply = _infer(srv, "cls", {"text": TEXTS}, raw=raw)
    assert bool(reply.raw_output_contents) == raw
    v1 = _v1_classify(srv, TEXTS)
    shape, probs = out["probabilities"]
    assert shape == [2, 3]
    for i, result in enumerate(v1):
        assert probs[i * 3:(i + 1) * 3] == pytest.approx(_probabilities_of(result), abs=1e-6)
    assert out["label"] == ([2], [r.labels[0].label for r in v1])

    # pairs, [N, 1] shape, top_k -> label [N, top_k] best first
    out, _ = _infer(srv, "cls", {"text": TEXTS, "text_pair": PAIRS}, raw=raw, shape=[2, 1], top_k=2)
    v1 = _v1_classify(srv, TEXTS, PAIRS, top_k=2)
    assert out["label"] == ([2, 2], [x.label for r in v1 for x in r.labels])
    v1_all = _v1_classify(srv, TEXTS, PAIRS)
    assert out["probabilities"][1] == pytest.approx([p for r in v1_all for p in _probabilities_of(r)], abs=1e-6)


def test_classification_function_to_apply_and_requested_outputs(srv):
    out, reply = _infer(srv, "cls", {"text": TEXTS}, outputs=["label"], function_to_apply="sigmoid", top_k=0)
    assert [o.name for o in reply.outputs] == ["label"]
    v1 = _v1_classify(srv, TEXTS, function_to_apply="sigmoid")
    assert out["label"] == ([2, 3], [x.label for r in v1 for x in r.labels])
    out, _ = _infer(srv, "cls", {"text": TEXTS}, function_to_apply="sigmoid")
    assert out["probabilities"][1] == pytest.approx([p for r in v1 for p in _probabilities_of(r)], abs=1e-6)


@pytest.mark.parametrize("raw", [False, True])
def test_qa_equals_v1(srv, raw):
    out, _ = _infer(srv, "qa", {"question": QUESTIONS, "context": CONTEXTS}, raw=raw, top_k=2, max_answer_len=8)
    for name in ("answer", "start", "end", "score", "is_impossible"):
        assert out[name][0] == [2, 2], name
    for i, (q, c) in enumerate(zip(QUESTIONS, CONTEXTS)):
        v1 = _v1_answers(srv, q, c, top_k=2, max_answer_len=8)
        assert len(v1) == 2
        assert out["answer"][1][2 * i:2 * i + 2] == [a.text for a in v1]
        assert out["start"][1][2 * i:2 * i + 2] == [a.start for a in v1]
        assert out["end"][1][2 * i:2 * i + 2] == [a.end for a in v1]
        assert out["score"][1][2 * i:2 * i + 2] == pytest.approx([a.score for a in v1], rel=1e-6)
        assert out["is_impossible"][1][2 * i:2 * i + 2] == [False, False]
        assert out["answer"][1][2 * i] == c[out["start"][1][2 * i]:out["end"][1][2 * i]]
    # defaults: top_k 1
    out, _ = _infer(srv, "qa", {"question": QUESTIONS[:1], "context": CONTEXTS[:1]}, raw=raw)
    assert out["answer"] == ([1, 1], [_v1_answers(srv, QUESTIONS[0], CONTEXTS[0])[0].text])


@pytest.mark.parametrize("raw", [False, True])
def test_translation_equals_v1(srv, raw):
    out, _ = _infer(srv, "tr", {"text": SOURCES}, raw=raw)
    assert out["translation"] == ([2], [r.hypotheses[0].text for r in _v1_translate(srv, SOURCES)])
    out, _ = _infer(srv, "tr", {"text": SOURCES}, raw=raw, beam_size=3, n_best=2, max_length=12)
    v1 = _v1_translate(srv, SOURCES, beam_size=3, n_best=2, max_length=12)
    assert out["translation"] == ([2, 2], [h.text for r in v1 for h in r.hypotheses])


def test_short_rows_are_padded(srv):
    # QA: fewer spans than top_k (a two-word context, one-token answers) -> "", -1, -1, 0.0, false after them
    v1 = _v1_answers(srv, "Where?", "Berlin Paris", top_k=20, max_answer_len=1)
    out, _ = _infer(srv, "qa", {"question": ["Where?"], "context": ["Berlin Paris"]}, top_k=20, max_answer_len=1)
    n = len(v1)
    assert 0 < n < 20 and out["answer"][0] == [1, 20]
    assert out["answer"][1] == [a.text for a in v1] + [""] * (20 - n)
    assert out["start"][1][n:] == out["end"][1][n:] == [-1] * (20 - n)
    assert out["score"][1][n:] == [0.0] * (20 - n) and out["is_impossible"][1] == [False] * 20
    # translation: a blank text has one empty hypothesis, padded to n_best
    out, _ = _infer(srv, "tr", {"text": [SOURCES[1], " "]}, raw=True, beam_size=2, n_best=2)
    v1 = _v1_translate(srv, [SOURCES[1]], beam_size=2, n_best=2)
    assert out["translation"] == ([2, 2], [h.text for h in v1[0].hypotheses] + ["", ""])


def _invalid(srv, request, *needles):
    code, details = _code(srv.v2.ModelInfer, request, timeout=30)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    for needle in needles:
        assert needle in details, (needle, details)
    return details


def test_errors_name_what_was_wrong(srv):
    _invalid(srv, _request("cls", {"text": TEXTS}, beam_size=2), "unknown parameter 'beam_size'",
             "['function_to_apply', 'top_k']")
    _invalid(srv, _request("cls", {"text": TEXTS}, top_k="2"), "parameter 'top_k' must be an integer")
    _invalid(srv, _request("cls", {"text": TEXTS}, top_k=9), "top_k 9 is out of range")
    _invalid(srv, _request("qa", {"question": QUESTIONS, "context": CONTEXTS}, allow_impossible=1),
             "'allow_impossible' must be a boolean")
    _invalid(srv, _request("cls", {"text_pair": PAIRS}), "input 'text' is missing")
    _invalid(srv, _request("cls", {"text": TEXTS, "txt": TEXTS}), "unknown input 'txt'")
    _invalid(srv, _request("cls", {"text": TEXTS}, shape=[1, 2]), "input 'text' has shape [1, 2]")
    _invalid(srv, _request("cls", {"text": TEXTS}, shape=[3]), "has shape [3] but 2 elements")
    _invalid(srv, _request("cls", {"text": TEXTS, "text_pair": PAIRS[:1]}, shape=None),
             "'text_pair' has 1 elements but 'text' has 2")
    _invalid(srv, _request("qa", {"question": QUESTIONS, "context": CONTEXTS[:1]}),
             "'context' has 1 elements but 'question' has 2")
    _invalid(srv, _request("cls", {"text": ["ok", b"\xff\xfe"]}), "input 'text'[1] is not valid UTF-8")
    _invalid(srv, _request("cls", {"text": ["ok", b"\xc3"]}, raw=True), "input 'text'[1] is not valid UTF-8")
    _invalid(srv, _request("cls", {"text": ["  "]}), "texts[0] is empty")
    _invalid(srv, _request("tr", {"text": SOURCES}, n_best=5, beam_size=2), "n_best 5 is out of range")
    _invalid(srv, _request("cls", {"text": TEXTS}, outputs=["logits"]), "unknown output 'logits'",
             "['probabilities', 'label']")

    req = _request("cls", {"text": TEXTS})
    req.inputs[0].datatype = "INT64"
    _invalid(srv, req, "datatype 'INT64'", "BYTES")
    req = _request("cls", {"text": TEXTS}, raw=True)
    req.raw_input_contents[0] = req.raw_input_contents[0][:-3]
    _invalid(srv, req, "raw contents of input 'text'", "element 1")
    req = _request("cls", {"text": TEXTS, "text_pair": PAIRS}, raw=True)
    req.inputs[1].contents.bytes_contents.append(b"x")
    _invalid(srv, req, "one form for all inputs")
    req = _request("cls", {"text": TEXTS}, raw=True)
    req.raw_input_contents.append(b"")
    _invalid(srv, req, "raw_input_contents has 2 entries but the request has 1 inputs")
    req = _request("cls", {"text": TEXTS})
    req.inputs[0].parameters["shared_memory_region"].string_param = "r"
    _invalid(srv, req, "input 'text' has parameter 'shared_memory_region' = 'r'", "not supported")
    req = _request("cls", {"text": TEXTS}, outputs=["label"])
    req.outputs[0].parameters["classification"].int64_param = 2
    _invalid(srv, req, "output 'label' has parameter 'classification' = '2'", "request the 'label' output")
    req = _request("cls", {"text": TEXTS}, outputs=["label"])
    req.outputs[0].parameters["binary_data"].string_param = "yes"  # true / false: tests/serving/test_oip_binary.py
    _invalid(srv, req, "output 'label' has parameter 'binary_data' = 'yes'", "must be a boolean")
    req = _request("cls", {"text": TEXTS})
    req.inputs[0].parameters["binary_data_size"].int64_param = 9
    _invalid(srv, req, "input 'text' has parameter 'binary_data_size'")
    req = _request("cls", {"text": TEXTS}, outputs=["label"])
    req.outputs[0].parameters["binary_data"].bool_param = False  # JSON / typed elements: the one accepted value
    assert _outputs(srv.v2.ModelInfer(req, timeout=30))["label"][0] == [2]

    code, details = _code(srv.v2.ModelInfer, _request("nope", {"text": TEXTS}), timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND and "'nope'" in details
    code, details = _code(srv.v2.ModelInfer, _request("", {"text": TEXTS}), timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "model name is empty" in details
    req = _request("cls", {"text": TEXTS})
    req.model_version = "3"
    code, details = _code(srv.v2.ModelInfer, req, timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND and "no version '3'" in details

    # bytes that are not a ModelInferRequest: INVALID_ARGUMENT (tolerant decoding), not UNKNOWN
    garbage = srv.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                      request_serializer=lambda b: b, response_deserializer=lambda b: b)
    code, details = _code(garbage, b"\x0a\xff\xff", timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "inference.ModelInferRequest" in details


def _http_infer(srv, model: str, body: dict) -> dict[str, list]:
    request = urllib.request.Request(f"{srv.http_base}/v2/models/{model}/infer", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return {t["name"]: t["data"] for t in json.loads(reply.read())["outputs"]}


@pytest.mark.parametrize("raw", [False, True])
def test_http_fp32_values_equal_grpc_exactly(srv, raw):
    # the real checkpoints' scores are not float32 values before rounding (the HTTP reply printed float64s)
    for function in ("softmax", "sigmoid"):
        out, _ = _infer(srv, "cls", {"text": TEXTS}, raw=raw, function_to_apply=function)
        http_out = _http_infer(srv, "cls", {"parameters": {"function_to_apply": function}, "inputs": [
            {"name": "text", "shape": [2], "datatype": "BYTES", "data": TEXTS}]})
        assert http_out["probabilities"] == out["probabilities"][1], function  # ==, not approx
    out, _ = _infer(srv, "qa", {"question": QUESTIONS, "context": CONTEXTS}, raw=raw, top_k=3)
    http_out = _http_infer(srv, "qa", {"parameters": {"top_k": 3}, "inputs": [
        {"name": "question", "shape": [2], "datatype": "BYTES", "data": QUESTIONS},
        {"name": "context", "shape": [2], "datatype": "BYTES", "data": CONTEXTS}]})
    assert http_out["score"] == out["score"][1]
    assert http_out["start"] == out["start"][1] and http_out["answer"] == out["answer"][1]


def _requests_total(model: str, task: str, code: str) -> float:
    return sum(s.value for f in REGISTRY.collect() for s in f.samples
               if s.name == "relserve_requests_total" and {k: v for k, v in s.labels.items() if k != "protocol"}
               == {"model": model, "task": task, "code": code})


def test_metrics_use_the_v1_names_and_labels(srv):
    before = {k: _requests_total(*k) for k in (("qa", "question-answering", "OK"), ("cls", "classification",
                                                                                      "INVALID_ARGUMENT"),
                                                ("_unknown_", "_unknown_", "NOT_FOUND"), ("", "health", "OK"))}
    _infer(srv, "qa", {"question": QUESTIONS[:1], "context": CONTEXTS[:1]})
    _code(srv.v2.ModelInfer, _request("cls", {"text": TEXTS}, bogus=1), timeout=5)
    _code(srv.v2.ModelInfer, _request("nope", {"text": TEXTS}), timeout=5)
    srv.v2.ServerReady(v2.ServerReadyRequest(), timeout=5)
    for key, value in before.items():
        assert _requests_total(*key) == value + 1, key


def test_reflection_lists_the_v2_service(srv):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(srv.channel)
    (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    assert "inference.GRPCInferenceService" in {s.name for s in reply.list_services_response.service}


def test_token_auth_probes_open_unless_auth_health(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    bearer = (("authorization", "Bearer s3cret"),)
    for auth_health in (False, True):
        s = Running(server_config(metrics_port=None, auth_token_file=tokens, auth_health=auth_health),
                    [fake_runner("sentiment")])
        try:
            stub = v2_grpc.GRPCInferenceServiceStub(s.channel)
            probes = (lambda **kw: stub.ServerLive(v2.ServerLiveRequest(), timeout=5, **kw),
                      lambda **kw: stub.ModelReady(v2.ModelReadyRequest(name="sentiment"), timeout=5, **kw))
            for probe in probes:
                if auth_health:
                    assert _code(probe)[0] == grpc.StatusCode.UNAUTHENTICATED
                else:
                    probe()
                probe(metadata=bearer)
            for call, request in ((stub.ServerMetadata, v2.ServerMetadataRequest()),
                                  (stub.ModelInfer, _request("sentiment", {"text": ["good"]}))):
                assert _code(call, request, timeout=5)[0] == grpc.StatusCode.UNAUTHENTICATED
                call(request, timeout=5, metadata=bearer)
        finally:
            s.close()


def test_ready_only_when_warm_and_not_draining():
    gate = threading.Event()
    s = Running(server_config(metrics_port=None), [fake_runner("sentiment", warm_gate=gate, delay=0.3)])
    stub = v2_grpc.GRPCInferenceServiceStub(s.channel)
    try:
        assert stub.ServerLive(v2.ServerLiveRequest(), timeout=5).live
        assert not stub.ServerReady(v2.ServerReadyRequest(), timeout=5).ready
        assert not stub.ModelReady(v2.ModelReadyRequest(name="sentiment"), timeout=5).ready
        code, details = _code(stub.ModelInfer, _request("sentiment", {"text": ["good"]}), timeout=5)
        assert code == grpc.StatusCode.UNAVAILABLE and "not ready" in details
        gate.set()
        s.wait_serving()
        assert stub.ServerReady(v2.ServerReadyRequest(), timeout=5).ready
        out = _outputs(stub.ModelInfer(_request("sentiment", {"text": ["good good"]}), timeout=5))
        assert out["label"] == ([1], ["positive"])
        # a drain waits for a running ModelInfer (InflightCalls counts it) and it ends OK
        running = stub.ModelInfer.future(_request("sentiment", {"text": ["good"]}), timeout=30)
        while s.server._inflight.running == 0 and not running.done():
            time.sleep(0.005)
        assert s.server._inflight.running == 1  # counted while it runs (the fake batch takes 0.3 s)
        assert s.call(s.server.drain(20), timeout=30)
        assert _outputs(running.result())["label"] == ([1], ["positive"])
        assert stub.ServerLive(v2.ServerLiveRequest(), timeout=5).live
        assert not stub.ServerReady(v2.ServerReadyRequest(), timeout=5).ready
        assert not stub.ModelReady(v2.ModelReadyRequest(name="sentiment"), timeout=5).ready
        code, details = _code(stub.ModelInfer, _request("sentiment", {"text": ["good"]}), timeout=5)
        assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
    finally:
        gate.set()
        s.close()


# ------------------------------------------------------------------------------------- (b) tritonclient


def _tritonclient_python() -> str:
    """An interpreter with tritonclient: $RELSERVE_TRITONCLIENT_PYTHON, else the cached venv under build/ that
    the real-client tests share (tests/fixtures/client_venvs.py; built once, under a lock)."""
    return client_venvs.TRITONCLIENT.python()


def test_tritonclient_gets_the_v1_answers(srv):
    python = _tritonclient_python()
    spec = {"cls": "cls", "qa": "qa", "tr": "tr", "texts": TEXTS, "pairs": PAIRS, "questions": QUESTIONS,
            "contexts": CONTEXTS, "sources": SOURCES}
    done = subprocess.run([python, str(REPO / "tests" / "fixtures" / "tritonclient_script.py"),
                           f"127.0.0.1:{srv.port}", json.dumps(spec)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout)

    assert got["live"] and got["ready"]
    assert got["model_ready"] == {"cls": True, "qa": True, "tr": True, "no-such-model": False}
    assert got["server_metadata"]["name"] == "relserve"
    assert got["model_metadata"]["cls"] == {"platform": "relserve_torch", "versions": ["1"],
                                            "inputs": [["text", "BYTES"], ["text_pair", "BYTES"]],
                                            "outputs": [["probabilities", "FP32"], ["label", "BYTES"]]}
    assert got["model_metadata"]["qa"]["inputs"] == [["question", "BYTES"], ["context", "BYTES"]]
    assert got["model_metadata"]["tr"]["outputs"] == [["translation", "BYTES"]]

    cls = got["classify"]
    assert cls["id"] == "req-1" and cls["model_version"] == "1" and cls["raw"] == 2  # answered in raw form
    v1 = _v1_classify(srv, TEXTS)
    assert cls["outputs"]["probabilities"]["shape"] == [2, 3]
    for row, result in zip(cls["outputs"]["probabilities"]["data"], v1):
        assert row == pytest.approx(_probabilities_of(result), abs=1e-6)
    assert cls["outputs"]["label"] == {"shape": [2], "data": [r.labels[0].label for r in v1]}
    v1 = _v1_classify(srv, TEXTS, PAIRS, top_k=2)
    assert got["classify_pairs"]["outputs"]["label"]["data"] == [[x.label for x in r.labels] for r in v1]

    answer = got["answer"]["outputs"]
    for i, (q, c) in enumerate(zip(QUESTIONS, CONTEXTS)):
        v1 = _v1_answers(srv, q, c, top_k=2)
        assert answer["answer"]["data"][i] == [a.text for a in v1]
        assert answer["start"]["data"][i] == [a.start for a in v1]
        assert answer["end"]["data"][i] == [a.end for a in v1]
        assert answer["score"]["data"][i] == pytest.approx([a.score for a in v1], rel=1e-6)

    v1 = _v1_translate(srv, SOURCES, beam_size=3, n_best=2)
    assert got["translate"]["outputs"]["translation"] == {"shape": [2, 2],
                                                          "data": [[h.text for h in r.hypotheses] for r in v1]}
    assert got["error"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "unknown parameter 'beam_size'" in got["error"]["message"]
