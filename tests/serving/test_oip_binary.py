"""The Open Inference Protocol's binary tensor data extension (Triton's ``binary_tensor_data``), the REST body's
``model_name`` / ``model_version``, and the extensions the server metadata lists, on a real server with the tiny
checkpoints of test_kserve_v2.py (DeBERTa classification and QA, RNNsearch translation), driven with plain HTTP
bytes and our own gRPC stubs.

Binary answers are decoded here (BYTES: 4-byte little-endian length + bytes; FP32 / INT64 / BOOL little-endian)
and compared with the JSON path's answers of the same request: equal, not approximately. Malformed binary
requests (declared lengths past the body, negative, overlapping, left over, huge) are 400 with a message naming
what was wrong, and the server keeps answering. Element counts are refused before the elements are decoded.
"""

from __future__ import annotations

import gzip
import json
import struct
import urllib.error
import urllib.request

import grpc
import pytest

from fixtures.deberta import make_deberta_checkpoint
from fixtures.fake_serving import server_config
from fixtures.server import Running
from fixtures.translation import make_tiny_checkpoint
from relserve.service._proto import grpc_predict_v2_pb2 as v2
from relserve.service._proto import grpc_predict_v2_pb2_grpc as v2_grpc
from relserve.service.config import ModelConfig
from relserve.service.registry import build_runner

HEADER = "Inference-Header-Content-Length"
MAX_TEXTS = 6  # max_request_texts of every model here
TEXTS = ["the film was a quiet delight", "a dull and tiring evening", "Grüße aus Köln ✓"]
PAIRS = ["it was good", "it was bad", "so so"]
QUESTIONS = ["Where does Ann live?", "What does Bob drink?"]
CONTEXTS = ["Ann lives in Berlin and works in a small bakery near the river.",
            "Bob drinks green tea every morning before he walks to the station."]
SOURCES = ["Der alte Mann ging gestern Abend mit seinem Hund spazieren.", "Ich habe Hunger."]
_FORMAT = {"FP32": "f", "INT64": "q", "BOOL": "?"}


@pytest.fixture(scope="module")
def srv(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("oip-binary")
    paths = {
        "cls": make_deberta_checkpoint(root / "cls", tokenizer_dir=unigram_tokenizer_dir, labels=("a", "b", "c")).path,
        "qa": make_deberta_checkpoint(root / "qa", task="question-answering", tokenizer_dir=unigram_tokenizer_dir).path,
        "tr": make_tiny_checkpoint(root / "tr", seed=1),
    }
    cfg = dict(device="cpu", max_seq_len=64, doc_stride=16, max_queue_delay=0.002, worker_process=False,
               max_request_texts=MAX_TEXTS)
    runners = [build_runner(ModelConfig(name=name, path=path, **cfg)) for name, path in paths.items()]
    s = Running(server_config(http_port=0, max_receive_message_length=64 * 1024), runners)
    s.wait_serving(timeout=120)
    s.v2 = v2_grpc.GRPCInferenceServiceStub(s.channel)
    s.base = f"http://127.0.0.1:{s.server.http_port}"
    yield s
    s.close()


# ---------------------------------------------------------------------------------------------- helpers


def _prefixed(values: list) -> bytes:
    data = [v.encode() if isinstance(v, str) else v for v in values]
    return b"".join(struct.pack("<I", len(v)) + v for v in data)


def _split(buf: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(buf):
        (n,) = struct.unpack_from("<I", buf, pos)
        out.append(buf[pos + 4:pos + 4 + n])
        pos += 4 + n
    assert pos == len(buf)
    return out


def _post(srv, path: str, payload: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(srv.base + path, data=payload, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _binary_body(obj: dict, chunks: list[bytes]) -> tuple[bytes, dict]:
    head = json.dumps(obj).encode()
    return head + b"".join(chunks), {HEADER: str(len(head)), "Content-Type": "application/octet-stream"}


def _binary_inputs(inputs: dict[str, list[str]], **request) -> tuple[bytes, dict]:
    """A request with every input as binary data."""
    chunks = [_prefixed(values) for values in inputs.values()]
    tensors = [{"name": name, "shape": [len(values)], "datatype": "BYTES",
                "parameters": {"binary_data_size": len(chunk)}}
               for (name, values), chunk in zip(inputs.items(), chunks)]
    return _binary_body({**request, "inputs": tensors}, chunks)


def _json_inputs(inputs: dict[str, list[str]], **request) -> tuple[bytes, dict]:
    tensors = [{"name": name, "shape": [len(values)], "datatype": "BYTES", "data": values}
               for name, values in inputs.items()]
    return json.dumps({**request, "inputs": tensors}).encode(), {"Content-Type": "application/json"}


def _decode(status: int, headers: dict, payload: bytes) -> tuple[dict, dict[str, tuple[list, list, bool]]]:
    """The reply's JSON and its outputs: name -> (shape, elements, sent as binary)."""
    assert status == 200, payload[:500]
    if HEADER not in headers:
        assert headers["Content-Type"].startswith("application/json")
        reply = json.loads(payload)
        return reply, {t["name"]: (t["shape"], t["data"], False) for t in reply["outputs"]}
    assert headers["Content-Type"] == "application/octet-stream"
    length = int(headers[HEADER])
    reply, rest, pos = json.loads(payload[:length]), payload[length:], 0
    out = {}
    for t in reply["outputs"]:
        if "data" in t:
            out[t["name"]] = (t["shape"], t["data"], False)
            continue
        assert set(t["parameters"]) == {"binary_data_size"}, t
        chunk = rest[pos:pos + t["parameters"]["binary_data_size"]]
        pos += len(chunk)
        if t["datatype"] == "BYTES":
            values = [v.decode() for v in _split(chunk)]
        else:
            n = len(chunk) // struct.calcsize(_FORMAT[t["datatype"]])
            values = list(struct.unpack(f"<{n}{_FORMAT[t['datatype']]}", chunk))
        out[t["name"]] = (t["shape"], values, True)
    assert pos == len(rest), "binary data left over after the outputs"
    return reply, out


def _error(status: int, payload: bytes, *needles: str) -> str:
    assert status == 400, (status, payload[:300])
    body = json.loads(payload)
    assert body["code"] == "INVALID_ARGUMENT", body
    for needle in needles:
        assert needle in body["error"], (needle, body["error"])
    return body["error"]


CASES = {
    "cls": ({"text": TEXTS, "text_pair": PAIRS}, {"top_k": 2, "function_to_apply": "sigmoid"}),
    "qa": ({"question": QUESTIONS, "context": CONTEXTS}, {"top_k": 2}),
    "tr": ({"text": SOURCES}, {"beam_size": 2, "n_best": 2}),
}


# ---------------------------------------------------------------------------------------------- the same answers


@pytest.mark.parametrize("model", list(CASES))
def test_binary_inputs_and_outputs_equal_the_json_answers(srv, model):
    inputs, parameters = CASES[model]
    _, expected = _decode(*_post(srv, f"/v2/models/{model}/infer", *_json_inputs(inputs, parameters=parameters)))
    payload, headers = _binary_inputs(inputs, id="b1", parameters={**parameters, "binary_data_output": True})
    status, reply_headers, body = _post(srv, f"/v2/models/{model}/infer", payload, headers)
    reply, got = _decode(status, reply_headers, body)
    assert reply["id"] == "b1" and reply["model_name"] == model and reply["model_version"] == "1"
    assert list(got) == list(expected)
    for name, (shape, values, binary) in got.items():
        assert binary, name
        assert (shape, values) == expected[name][:2], name  # FP32 bytes are the JSON path's float32 values
    # the JSON header is exactly Inference-Header-Content-Length bytes, and the sizes cover the rest
    length = int(reply_headers[HEADER])
    assert sum(t["parameters"]["binary_data_size"] for t in json.loads(body[:length])["outputs"]) == len(body) - length


def test_binary_data_per_output_overrides_the_request_default(srv):
    inputs = {"question": QUESTIONS, "context": CONTEXTS}
    _, expected = _decode(*_post(srv, "/v2/models/qa/infer", *_json_inputs(inputs)))
    # binary_data_output true, but 'answer' asks for JSON; 'is_impossible' (BOOL) and 'start' (INT64) binary
    outputs = [{"name": "answer", "parameters": {"binary_data": False}}, {"name": "start"},
               {"name": "is_impossible"}, {"name": "score", "parameters": {"binary_data": True}}]
    _, got = _decode(*_post(srv, "/v2/models/qa/infer", *_json_inputs(
        inputs, outputs=outputs, parameters={"binary_data_output": True})))
    assert {n: b for n, (_, _, b) in got.items()} == {"answer": False, "start": True, "is_impossible": True,
                                                     "score": True}
    assert all(got[n][:2] == expected[n][:2] for n in got)
    # binary inputs, JSON outputs: a plain JSON reply without the header
    status, headers, body = _post(srv, "/v2/models/qa/infer", *_binary_inputs(inputs))
    reply, got = _decode(status, headers, body)
    assert HEADER not in headers and not any(b for _, _, b in got.values())
    assert {n: v[:2] for n, v in got.items()} == {n: v[:2] for n, v in expected.items()}


def test_mixed_json_and_binary_inputs_and_gzip(srv):
    _, expected = _decode(*_post(srv, "/v2/models/cls/infer", *_json_inputs({"text": TEXTS, "text_pair": PAIRS})))
    chunk = _prefixed(PAIRS)
    payload, headers = _binary_body({"inputs": [
        {"name": "text", "shape": [3, 1], "datatype": "BYTES", "data": [[t] for t in TEXTS]},
        {"name": "text_pair", "shape": [3], "datatype": "BYTES", "parameters": {"binary_data_size": len(chunk)}}],
        "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}]}, [chunk])
    _, got = _decode(*_post(srv, "/v2/models/cls/infer", payload, headers))
    assert got["probabilities"][:2] == expected["probabilities"][:2] and got["probabilities"][2]
    # the header's length is of the decoded body, as Triton reads it
    status, reply_headers, body = _post(srv, "/v2/models/cls/infer", gzip.compress(payload),
                                        {**headers, "Content-Encoding": "gzip"})
    assert _decode(status, reply_headers, body)[1] == got


def test_grpc_raw_inputs_with_binary_data_size_and_binary_outputs(srv):
    def request(raw: bool, **params) -> v2.ModelInferRequest:
        req = v2.ModelInferRequest(model_name="cls", id="g")
        for name, value in params.items():
            req.parameters[name].bool_param = value
        for name, values in (("text", TEXTS), ("text_pair", PAIRS)):
            t = req.inputs.add(name=name, datatype="BYTES", shape=[len(values)])
            if raw:
                req.raw_input_contents.append(_prefixed(values))
                t.parameters["binary_data_size"].int64_param = len(req.raw_input_contents[-1])  # as KServe's client
            else:
                t.contents.bytes_contents.extend(v.encode() for v in values)
        return req

    typed = srv.v2.ModelInfer(request(False), timeout=30)
    assert not typed.raw_output_contents
    expected = {o.name: list(o.contents.fp32_contents) or [v.decode() for v in o.contents.bytes_contents]
                for o in typed.outputs}
    _, json_answer = _decode(*_post(srv, "/v2/models/cls/infer", *_json_inputs({"text": TEXTS, "text_pair": PAIRS})))
    assert expected == {n: v for n, (_, v, _) in json_answer.items()}
    for req in (request(True), request(False, binary_data_output=True)):
        reply = srv.v2.ModelInfer(req, timeout=30)
        got = {}
        for o, raw in zip(reply.outputs, reply.raw_output_contents):
            got[o.name] = ([v.decode() for v in _split(raw)] if o.datatype == "BYTES"
                           else list(struct.unpack(f"<{len(raw) // 4}f", raw)))
        assert got == expected
    req = request(False)
    req.outputs.add(name="label").parameters["binary_data"].bool_param = True
    assert len(srv.v2.ModelInfer(req, timeout=30).raw_output_contents) == 1

    req = request(True)
    req.inputs[1].parameters["binary_data_size"].int64_param = 3
    with pytest.raises(grpc.RpcError) as err:
        srv.v2.ModelInfer(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'text_pair' has binary_data_size 3 but its raw_input_contents entry has" in err.value.details()
    req = request(False)
    req.inputs[0].parameters["binary_data_size"].int64_param = 4
    with pytest.raises(grpc.RpcError) as err:
        srv.v2.ModelInfer(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents" in err.value.details()


def test_server_metadata_lists_the_extensions_served(srv):
    with urllib.request.urlopen(srv.base + "/v2", timeout=10) as reply:
        assert json.loads(reply.read())["extensions"] == ["binary_tensor_data"]
    assert list(srv.v2.ServerMetadata(v2.ServerMetadataRequest(), timeout=10).extensions) == ["binary_tensor_data"]


# ---------------------------------------------------------------------------------------------- model_name


@pytest.mark.parametrize("path,fields,ok", [
    ("/v2/models/cls/infer", {"model_name": "cls"}, True),
    ("/v2/models/cls/infer", {"model_name": "cls", "model_version": "1"}, True),
    ("/v2/models/cls/infer", {"model_name": "cls", "model_version": ""}, True),
    ("/v2/models/cls/versions/1/infer", {"model_name": "cls", "model_version": "1"}, True),
    ("/v2/models/cls/infer", {"model_name": "qa"}, "the body's model_name 'qa' differs from the URL's 'cls'"),
    ("/v2/models/cls/infer", {"model_version": "2"}, "the body's model_version '2' differs from the URL's '1'"),
    ("/v2/models/cls/versions/1/infer", {"model_version": ""},
     "the body's model_version '' differs from the URL's '1'"),
    ("/v2/models/cls/infer", {"model_name": 7}, "'model_name' must be a string"),
])
def test_model_name_and_version_in_the_body_must_agree_with_the_url(srv, path, fields, ok):
    status, headers, body = _post(srv, path, *_json_inputs({"text": TEXTS[:1]}, **fields))
    if ok is True:
        assert status == 200 and json.loads(body)["model_name"] == "cls"
    else:
        _error(status, body, ok)


# ---------------------------------------------------------------------------------------------- malformed binary


def _one_text(size, chunk: bytes, *, extra: bytes = b"", header: str | None = None, **input_fields):
    obj = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": size},
                       **input_fields}]}
    payload, headers = _binary_body(obj, [chunk + extra])
    if header is not None:
        headers[HEADER] = header
    return payload, headers


GOOD = _prefixed(["fine"])


MALFORMED = {
    "header_not_a_number": (_one_text(len(GOOD), GOOD, header="12a"), ["Inference-Header-Content-Length", "'12a'"]),
    "header_negative": (_one_text(len(GOOD), GOOD, header="-5"), ["Inference-Header-Content-Length", "'-5'"]),
    "header_huge": (_one_text(len(GOOD), GOOD, header="9" * 25), ["Inference-Header-Content-Length"]),
    "header_past_body": (_one_text(len(GOOD), GOOD, header="100000"), ["is 100000 but the request body has only"]),
    "header_zero": (_one_text(len(GOOD), GOOD, header="0"), ["raw binary request"]),
    "header_inside_json": (_one_text(len(GOOD), GOOD, header="10"), ["not valid JSON"]),
    "size_past_body": (_one_text(len(GOOD) + 5, GOOD), ["binary_data_size 13 runs past the end of the body",
                                                         "8 bytes of binary data are left"]),
    "size_huge": (_one_text(2 ** 62, GOOD), ["binary_data_size 4611686018427387904 runs past the end"]),
    "size_negative": (_one_text(-1, GOOD), ["'binary_data_size' = '-1'", "non-negative integer"]),
    "size_not_integer": (_one_text("8", GOOD), ["'binary_data_size' = '8'", "non-negative integer"]),
    "size_bool": (_one_text(True, GOOD), ["'binary_data_size' = 'True'"]),
    "bytes_left_over": (_one_text(len(GOOD), GOOD, extra=b"\x00\x00"), ["the body has 2 bytes after the binary data"]),
    "element_past_its_input": (_one_text(6, struct.pack("<I", 9) + b"fi"), ["element 0 has length 9 but only 2"]),
    "prefix_cut": (_one_text(len(GOOD) + 2, GOOD + b"\x01\x00"), ["a length prefix is cut off at byte 8"]),
    "data_and_binary": (_one_text(len(GOOD), GOOD, data=["x"]), ["both 'data' and binary data"]),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_binary_requests_are_400_naming_the_problem(srv, name):
    (payload, headers), needles = MALFORMED[name]
    status, _, body = _post(srv, "/v2/models/cls/infer", payload, headers)
    _error(status, body, *needles)


def test_lengths_that_overlap_the_next_input_are_refused(srv):
    # text's element claims the bytes of text_pair: each input's elements must end inside its own size
    text, pair = _prefixed(["good"]), _prefixed(["bad"])
    overlapping = struct.pack("<I", 4 + len(pair)) + b"good"
    payload, headers = _binary_body({"inputs": [
        {"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": len(text)}},
        {"name": "text_pair", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": len(pair)}}]},
        [overlapping, pair])
    status, _, body = _post(srv, "/v2/models/cls/infer", payload, headers)
    _error(status, body, "binary data of input 'text': element 0 has length 11 but only 4 bytes follow")
    # sizes that add up to more than the body (the second input starts inside the first's bytes)
    payload, headers = _binary_body({"inputs": [
        {"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": len(text)}},
        {"name": "text_pair", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": len(pair)}}]},
        [text[:4] + pair])
    status, _, body = _post(srv, "/v2/models/cls/infer", payload, headers)
    assert status == 400


@pytest.mark.parametrize("fields,needles", [
    ({"parameters": {"binary_data_output": "yes"}}, ["'binary_data_output' must be a boolean"]),
    ({"outputs": [{"name": "label", "parameters": {"binary_data": 1}}]}, ["output 'label'", "must be a boolean"]),
])
def test_binary_output_parameters_must_be_booleans(srv, fields, needles):
    status, _, body = _post(srv, "/v2/models/cls/infer", *_json_inputs({"text": TEXTS[:1]}, **fields))
    _error(status, body, *needles)


def test_binary_data_size_without_the_header_is_refused(srv):
    obj = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 8}}]}
    status, _, body = _post(srv, "/v2/models/cls/infer", json.dumps(obj).encode())
    _error(status, body, "'binary_data_size'", "Inference-Header-Content-Length")


def test_a_body_over_the_limit_is_413_before_any_binary_parsing(srv):
    big = _prefixed(["x" * 70_000])
    status, _, body = _post(srv, "/v2/models/cls/infer", *_one_text(len(big), big))
    assert status == 413 and json.loads(body)["code"] == "RESOURCE_EXHAUSTED"
    # and the server keeps answering
    assert _decode(*_post(srv, "/v2/models/cls/infer", *_binary_inputs({"text": TEXTS[:1]})))[1]


# ---------------------------------------------------------------------------------------------- counts first


def test_element_counts_are_refused_before_the_elements_are_decoded(srv):
    # MAX_TEXTS + 1 elements, one of them not UTF-8: decoding first would name the bad element; the count
    # check on the wire comes first and names max_request_texts
    values = ["ok"] * MAX_TEXTS + [b"\xff"]
    payload, headers = _binary_inputs({"text": values})
    status, _, body = _post(srv, "/v2/models/cls/infer", payload, headers)
    _error(status, body, f"the request has {MAX_TEXTS + 1} texts", "max_request_texts")
    # JSON: a lone surrogate is refused when decoded, the count before
    payload = ('{"inputs": [{"name": "text", "shape": [%d], "datatype": "BYTES", "data": [%s"\\ud800"]}]}'
               % (MAX_TEXTS + 1, '"ok", ' * MAX_TEXTS)).encode()
    status, _, body = _post(srv, "/v2/models/cls/infer", payload)
    _error(status, body, f"the request has {MAX_TEXTS + 1} texts", "max_request_texts")
    for raw in (False, True):
        req = v2.ModelInferRequest(model_name="cls")
        t = req.inputs.add(name="text", datatype="BYTES", shape=[len(values)])
        if raw:
            req.raw_input_contents.append(_prefixed(values))
        else:
            t.contents.bytes_contents.extend(v.encode() if isinstance(v, str) else v for v in values)
        with pytest.raises(grpc.RpcError) as err:
            srv.v2.ModelInfer(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the request has {MAX_TEXTS + 1} texts" in err.value.details(), err.value.details()
    # inputs are counted too: more tensors than the task takes is refused before any is converted
    req = v2.ModelInferRequest(model_name="cls")
    for _ in range(3):
        req.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"x")
    with pytest.raises(grpc.RpcError) as err:
        srv.v2.ModelInfer(req, timeout=30)
    assert "the request has 3 inputs" in err.value.details()


def test_a_large_binary_body_decoded_off_the_event_loop_gives_the_same_answers(srv):
    texts = [f"{i} " + "a quiet and lovely film " * 130 for i in range(MAX_TEXTS)]  # ~19 KB: the decode thread
    _, expected = _decode(*_post(srv, "/v2/models/cls/infer", *_json_inputs({"text": texts})))
    payload, headers = _binary_inputs({"text": texts}, parameters={"binary_data_output": True})
    assert len(payload) >= srv.server._http.OFF_LOOP_BYTES
    before = srv.server._http.decoded_off_loop
    _, got = _decode(*_post(srv, "/v2/models/cls/infer", payload, headers))
    assert srv.server._http.decoded_off_loop > before
    assert {n: v[:2] for n, v in got.items()} == {n: v[:2] for n, v in expected.items()}
