"""The HTTP surfaces of other ecosystems' conventions (service/frontends/kserve_v1.py, hf_inference.py, tei.py) on
one real server on free loopback ports with tiny real checkpoints (a classifier, a QA model, a translation
model), driven with plain HTTP as those clients send it: every answer equals relserve.v1's for the same inputs;
errors come in each surface's own shape with a 4xx (never a 500, also for fuzzed bodies); bearer tokens,
limits and the ``protocol`` label of ``relserve_requests_total`` hold on every route."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from fixtures.http_requests import Reply
from fixtures.http_requests import http as _http
from fixtures.deberta import make_deberta_checkpoint
from fixtures.fake_serving import server_config
from fixtures.server import Running
from fixtures.translation import make_tiny_checkpoint
from relserve.models.tokenization import load_tokenizer
from relserve.service._proto import inference_pb2 as pb
from relserve.service.config import ModelConfig
from relserve.service.registry import build_runner

TOKEN = "surf-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
METADATA = [("authorization", f"Bearer {TOKEN}")]
TEXTS = ["the film was a quiet delight", "a dull and tiring evening", "Grüße aus Köln, schön!"]
PAIRS = ["it was good", "it was bad", "nicht gut"]
QUESTION, CONTEXT = "Where does Ann live?", "Ann lives in Berlin and works in a small bakery near the river."
SOURCES = ["Der alte Mann ging gestern Abend mit seinem Hund spazieren.", "Ich habe Hunger."]
LABELS = ("a", "b", "c")


def http(base: str, method: str, path: str, body=None, *, raw: bytes | None = None, headers: dict | None = None,
         auth: bool = True) -> Reply:
    """fixtures.http's call, with the server's bearer token unless ``auth`` is False."""
    return _http(base, method, path, body, raw=raw, headers={**(AUTH if auth else {}), **(headers or {})})


def count(model: str, task: str, code: str, protocol: str) -> float:
    return REGISTRY.get_sample_value("relserve_requests_total",
                                     {"model": model, "task": task, "code": code, "protocol": protocol}) or 0.0


@pytest.fixture(scope="module")
def srv(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("surfaces")
    cls = make_deberta_checkpoint(root / "cls", tokenizer_dir=unigram_tokenizer_dir, labels=LABELS).path
    qa = make_deberta_checkpoint(root / "qa", task="question-answering", tokenizer_dir=unigram_tokenizer_dir).path
    tr = make_tiny_checkpoint(root / "tr", seed=1)
    tokens = root / "tokens"
    tokens.write_text(TOKEN + "\n")
    # compute in-process: worker processes have their own tests; 8 texts per request to test the limit
    cfg = dict(device="cpu", max_seq_len=64, doc_stride=16, max_queue_delay=0.002, worker_process=False,
               max_request_texts=8)
    runners = [build_runner(ModelConfig(name="cls", path=cls, **cfg)),
               build_runner(ModelConfig(name="cls-probs", path=cls, kserve_v1_predictions="probabilities", **cfg)),
               build_runner(ModelConfig(name="cls-logits", path=cls, kserve_v1_predictions="raw_logits", **cfg)),
               build_runner(ModelConfig(name="qa", path=qa, **cfg)),
               build_runner(ModelConfig(name="tr", path=tr, **cfg))]
    s = Running(server_config(http_port=0, auth_token_file=tokens), runners)
    s.wait_serving(timeout=120)
    s.base = f"http://127.0.0.1:{s.server.http_port}"
    s.tokenizer = load_tokenizer(cls)
    yield s
    s.close()


def v1_classify(srv, texts, pairs=(), function: str = "", top_k: int = 0, model: str = "cls") -> list[list]:
    reply = srv.stub.Classify(pb.ClassifyRequest(model=model, texts=texts, text_pairs=list(pairs), top_k=top_k,
                                                 function_to_apply=function), timeout=30, metadata=METADATA)
    return [[(label.label, label.score) for label in r.labels] for r in reply.results]


def v1_answer(srv, question, context, **kw) -> list[dict]:
    reply = srv.stub.Answer(pb.AnswerRequest(model="qa", question=question, context=context, **kw), timeout=30,
                            metadata=METADATA)
    return [{"answer": a.text, "score": a.score, "start": a.start, "end": a.end} for a in reply.answers]


def v1_translate(srv, texts, **kw) -> list[str]:
    reply = srv.stub.Translate(pb.TranslateRequest(model="tr", texts=texts, **kw), timeout=60, metadata=METADATA)
    return [r.hypotheses[0].text for r in reply.results]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))  # a float32 score printed as JSON and read back


def assert_labels(got: list[dict], want: list[tuple[str, float]]) -> None:
    assert [g["label"] for g in got] == [label for label, _ in want]
    assert all(close(g["score"], score) for g, (_, score) in zip(got, want)), (got, want)


# ---------------------------------------------------------------------- KServe v1

def test_kserve_v1_classification_is_huggingfaceservers_shape(srv):
    want = v1_classify(srv, TEXTS, function="none")
    ids = http(srv.base, "POST", "/v1/models/cls:predict", {"instances": TEXTS})
    assert ids.status == 200, ids.body
    assert ids.json == {"predictions": [LABELS.index(labels[0][0]) for labels in want]}
    # "inputs" is read first, as KServe's get_predict_input does
    assert http(srv.base, "POST", "/v1/models/cls:predict", {"inputs": TEXTS[:1], "instances": []}).json == \
        {"predictions": ids.json["predictions"][:1]}
    probs = http(srv.base, "POST", "/v1/models/cls-probs:predict", {"instances": TEXTS}).json["predictions"]
    softmax = v1_classify(srv, TEXTS, function="softmax")
    assert probs == [{str(LABELS.index(label)): float(f"{score:.4f}") for label, score in sorted(
        labels, key=lambda x: LABELS.index(x[0]))} for labels in softmax]
    assert list(probs[0]) == ["0", "1", "2"]
    logits = http(srv.base, "POST", "/v1/models/cls-logits:predict", {"instances": TEXTS}).json["predictions"]
    for got, labels in zip(logits, want):
        assert set(got) == {"0", "1", "2"}
        for label, score in labels:
            assert close(got[str(LABELS.index(label))], score)


def test_kserve_v1_qa_and_translation(srv):
    reply = http(srv.base, "POST", "/v1/models/qa:predict",
                 {"instances": [{"question": QUESTION, "context": CONTEXT}, {"question": "Who?", "context": CONTEXT}]})
    assert reply.status == 200, reply.body
    for got, (question, context) in zip(reply.json["predictions"], [(QUESTION, CONTEXT), ("Who?", CONTEXT)]):
        want = v1_answer(srv, question, context)[0]
        assert {k: got[k] for k in ("answer", "start", "end")} == {k: want[k] for k in ("answer", "start", "end")}
        assert close(got["score"], want["score"])
    tr = http(srv.base, "POST", "/v1/models/tr:predict", {"instances": SOURCES})
    assert tr.status == 200 and tr.json == {"predictions": v1_translate(srv, SOURCES)}


def test_kserve_v1_probes_and_relserves_own_v1_routes(srv):
    assert http(srv.base, "GET", "/", auth=False).json == {"status": "alive"}
    ready = http(srv.base, "GET", "/v1/models/cls", auth=False)  # a probe: open without a token
    assert ready.status == 200 and ready.json == {"name": "cls", "ready": True}
    missing = http(srv.base, "GET", "/v1/models/nope")
    assert missing.status == 404 and missing.json == {"error": "Model with name nope does not exist."}
    # relserve's own /v1 routes beside KServe's
    models = http(srv.base, "GET", "/v1/models")
    assert models.status == 200 and {m["name"] for m in models.json["models"]} >= {"cls", "qa", "tr"}
    classify = http(srv.base, "POST", "/v1/classify", {"model": "cls", "texts": TEXTS[:1]})
    assert classify.status == 200 and classify.json["results"][0]["labels"][0]["label"] in LABELS


def test_kserve_v1_errors(srv):
    for path, body, status, words in [
        ("/v1/models/nope:predict", {"instances": ["x"]}, 404, "nope"),
        ("/v1/models/cls:predict", {"instances": []}, 400, "empty"),
        ("/v1/models/cls:predict", {"rows": ["x"]}, 400, '"instances"'),
        ("/v1/models/cls:predict", {"instances": [3]}, 400, "instances[0] must be a string"),
        ("/v1/models/cls:predict", {"instances": ["x"] * 9}, 400, "max_request_texts"),
        ("/v1/models/qa:predict", {"instances": [{"question": "q"}]}, 400, "instances[0].context"),
        ("/v1/models/qa:predict", {"instances": [{"question": "q", "context": "c", "x": 1}]}, 400, "'x'"),
    ]:
        reply = http(srv.base, "POST", path, body)
        assert reply.status == status and list(reply.json) == ["error"] and words in reply.json["error"], reply.body
    bad_json = http(srv.base, "POST", "/v1/models/cls:predict", raw=b"{not json")
    assert bad_json.status == 400 and list(bad_json.json) == ["error"]
    wrong_method = http(srv.base, "PUT", "/v1/models/cls:predict", {"instances": ["x"]})
    assert wrong_method.status == 405 and list(wrong_method.json) == ["error"]
    assert wrong_method.headers["Allow"] == "POST"


# ---------------------------------------------------------------------- Hugging Face Inference API

def test_hf_text_classification(srv):
    for parameters, function, k in [({}, "", 0), ({"top_k": 2, "function_to_apply": "sigmoid"}, "sigmoid", 2),
                                    ({"top_k": 99, "function_to_apply": "none"}, "none", 0)]:
        reply = http(srv.base, "POST", "/models/cls", {"inputs": TEXTS[0], "parameters": parameters})
        assert reply.status == 200, reply.body
        (got,) = reply.json  # a list of lists: the client reads the first
        assert_labels(got, v1_classify(srv, TEXTS[:1], function=function, top_k=k)[0])
    batch = http(srv.base, "POST", "/models/cls", {"inputs": TEXTS}).json
    for got, want in zip(batch, v1_classify(srv, TEXTS)):
        assert_labels(got, want)


def test_hf_question_answering(srv):
    body = {"inputs": {"question": QUESTION, "context": CONTEXT}}
    one = http(srv.base, "POST", "/models/qa", body)
    assert one.status == 200, one.body
    want = v1_answer(srv, QUESTION, CONTEXT)
    assert isinstance(one.json, dict) and set(one.json) == {"answer", "score", "start", "end"}
    assert one.json["answer"] == want[0]["answer"] and close(one.json["score"], want[0]["score"])
    parameters = {"top_k": 3, "doc_stride": 8, "max_answer_len": 5, "align_to_words": False,
                  "handle_impossible_answer": True, "max_seq_len": 64, "max_question_len": 64}
    many = http(srv.base, "POST", "/models/qa", {**body, "parameters": parameters})
    assert many.status == 200, many.body
    want = v1_answer(srv, QUESTION, CONTEXT, top_k=3, doc_stride=8, max_answer_len=5, align_to_words=False,
                     allow_impossible=True)
    assert [a["answer"] for a in many.json] == [a["answer"] for a in want]
    assert [(a["start"], a["end"]) for a in many.json] == [(a["start"], a["end"]) for a in want]
    assert all(close(a["score"], b["score"]) for a, b in zip(many.json, want))
    # a smaller window than the model's: more windows over the same context, spans still in it
    small = http(srv.base, "POST", "/models/qa", {**body, "parameters": {"max_seq_len": 16, "doc_stride": 2}})
    assert small.status == 200, small.body
    assert CONTEXT[small.json["start"]:small.json["end"]] == small.json["answer"] != ""


def test_hf_translation(srv):
    reply = http(srv.base, "POST", "/models/tr", {"inputs": SOURCES[0]})
    assert reply.status == 200 and reply.json == [{"translation_text": v1_translate(srv, SOURCES[:1])[0]}]
    generate = {"num_beams": 2, "max_new_tokens": 4}
    reply = http(srv.base, "POST", "/models/tr", {"inputs": SOURCES, "parameters": {"generate_parameters": generate}})
    assert reply.status == 200, reply.body
    assert reply.json == [{"translation_text": t} for t in v1_translate(srv, SOURCES, beam_size=2, max_length=4)]


def test_hf_errors(srv):
    for path, body, status, words in [
        ("/models/nope", {"inputs": "x"}, 404, "nope"),
        ("/models/cls", {"parameters": {}}, 400, '"inputs"'),
        ("/models/cls", {"inputs": 7}, 400, "inputs must be a text"),
        ("/models/cls", {"inputs": "x", "parameters": {"top_k": "2"}}, 400, "parameters.top_k"),
        ("/models/cls", {"inputs": "x", "parameters": {"top_k": 0}}, 400, "parameters.top_k"),
        ("/models/cls", {"inputs": "x", "parameters": {"function_to_apply": "relu"}}, 400, "function_to_apply"),
        ("/models/cls", {"inputs": "x", "parameters": {"temperature": 1}}, 400, "temperature"),
        ("/models/qa", {"inputs": "x"}, 400, "inputs must be a JSON object"),
        ("/models/qa", {"inputs": {"question": "q", "context": "c"}, "parameters": {"max_seq_len": 65}}, 400,
         "max_seq_len 65 is out of range"),
        ("/models/tr", {"inputs": "x", "parameters": {"src_lang": "de"}}, 400, "src_lang"),
        ("/models/tr", {"inputs": "x", "parameters": {"generate_parameters": {"do_sample": True}}}, 400,
         "do_sample"),
    ]:
        reply = http(srv.base, "POST", path, body)
        assert reply.status == status and list(reply.json) == ["error"] and words in reply.json["error"], reply.body
    wrong_method = http(srv.base, "GET", "/models/cls")
    assert wrong_method.status == 405 and list(wrong_method.json) == ["error"]


# ---------------------------------------------------------------------- text-embeddings-inference

def test_tei_predict(srv):
    single = http(srv.base, "POST", "/models/cls/predict", {"inputs": TEXTS[0]})
    assert single.status == 200, single.body
    assert_labels(single.json, v1_classify(srv, TEXTS[:1], function="softmax")[0])
    assert [p["score"] for p in single.json] == sorted((p["score"] for p in single.json), reverse=True)
    assert list(single.json[0]) == ["score", "label"]
    pair = http(srv.base, "POST", "/models/cls/predict", {"inputs": [TEXTS[0], PAIRS[0]], "raw_scores": True})
    assert_labels(pair.json, v1_classify(srv, TEXTS[:1], PAIRS[:1], function="none")[0])
    batch = http(srv.base, "POST", "/models/cls/predict",
                 {"inputs": [[TEXTS[0]], [TEXTS[1], PAIRS[1]], [TEXTS[2]]], "truncate": False,
                  "truncation_direction": "Right"})
    assert batch.status == 200, batch.body
    assert_labels(batch.json[0], v1_classify(srv, TEXTS[:1], function="softmax")[0])
    assert_labels(batch.json[1], v1_classify(srv, TEXTS[1:2], PAIRS[1:2], function="softmax")[0])
    assert_labels(batch.json[2], v1_classify(srv, TEXTS[2:3], function="softmax")[0])


def test_tei_truncation(srv):
    long = " ".join(["word"] * 200)
    refused = http(srv.base, "POST", "/models/cls/predict", {"inputs": long})
    assert refused.status == 422 and refused.json["error_type"] == "Validation", refused.body
    assert "less than 64 tokens" in refused.json["error"]
    cut = http(srv.base, "POST", "/models/cls/predict", {"inputs": long, "truncate": True})
    assert cut.status == 200
    assert_labels(cut.json, v1_classify(srv, [long], function="softmax")[0])


def test_tei_tokenize_and_info(srv):
    text = "Grüße aus Köln"
    reply = http(srv.base, "POST", "/models/cls/tokenize", {"inputs": text})
    assert reply.status == 200, reply.body
    (tokens,) = reply.json
    ids, offsets = srv.tokenizer.tokenize(text)
    assert [t["id"] for t in tokens] == [srv.tokenizer.cls_token_id, *ids, srv.tokenizer.sep_token_id]
    assert tokens[0] == {"id": srv.tokenizer.cls_token_id, "text": "[CLS]", "special": True, "start": None,
                         "stop": None}
    raw = text.encode()
    for token, (start, end) in zip(tokens[1:-1], offsets):
        assert token["special"] is False and token["text"] == text[start:end]
        assert raw[token["start"]:token["stop"]].decode() == token["text"]  # UTF-8 byte offsets, as TEI
    plain = http(srv.base, "POST", "/models/qa/tokenize", {"inputs": [text, "b"], "add_special_tokens": False})
    assert plain.status == 200 and [[t["id"] for t in ts] for ts in plain.json] == [
        ids, srv.tokenizer.tokenize("b")[0]]
    info = http(srv.base, "GET", "/models/cls/info")
    assert info.status == 200, info.body
    assert info.json["model_id"] == "cls" and info.json["max_input_length"] == 64
    assert info.json["model_type"] == {"classifier": {"id2label": {"0": "a", "1": "b", "2": "c"},
                                                      "label2id": {"a": 0, "b": 1, "c": 2}}}
    assert info.json["max_client_batch_size"] == 8 and info.json["auto_truncate"] is False


def test_tei_errors(srv):
    for path, body, status, kind, words in [
        ("/models/cls/predict", {"inputs": []}, 400, "Empty", "cannot be empty"),
        ("/models/cls/predict", {"inputs": ["a", "b", "c"]}, 422, "Validation", "3 strings"),
        ("/models/cls/predict", {"inputs": [["a", "b", "c"]]}, 422, "Validation", "inputs[0]"),
        ("/models/cls/predict", {"inputs": [["a"]] * 9}, 422, "Validation", "batch size 9 > maximum allowed"),
        ("/models/cls/predict", {"inputs": "a", "raw_scores": "yes"}, 422, "Validation", "raw_scores"),
        ("/models/cls/predict", {"inputs": "a", "truncation_direction": "Left"}, 422, "Validation", "Left"),
        ("/models/qa/predict", {"inputs": "a"}, 424, "Backend", "not a classifier"),
        ("/models/nope/predict", {"inputs": "a"}, 404, "Validation", "nope"),
        ("/models/cls/tokenize", {"inputs": "a", "prompt_name": "query"}, 422, "Validation", "prompt_name"),
        ("/models/tr/tokenize", {"inputs": "a"}, 424, "Backend", "encoder"),
    ]:
        reply = http(srv.base, "POST", path, body)
        assert reply.status == status, (path, body, reply.body)
        assert reply.json["error_type"] == kind and set(reply.json) == {"error", "error_type"}
        assert words in reply.json["error"], reply.body
    info = http(srv.base, "GET", "/models/qa/info")
    assert info.status == 424 and info.json["error_type"] == "Backend"
    wrong_method = http(srv.base, "GET", "/models/cls/predict")
    assert wrong_method.status == 405 and wrong_method.headers["Allow"] == "POST"
    assert set(wrong_method.json) == {"error", "error_type"}


# ---------------------------------------------------------------------- one behaviour under every surface

SURFACE_POSTS = [("/v1/models/cls:predict", {"instances": ["x"]}, "kserve_v1"),
                 ("/models/cls", {"inputs": "x"}, "hf"), ("/models/cls/predict", {"inputs": "x"}, "tei")]


@pytest.mark.parametrize("path,body,protocol", SURFACE_POSTS)
def test_tokens_deadline_header_and_protocol_label(srv, path, body, protocol):
    before = count("cls", "classification", "OK", protocol)
    assert http(srv.base, "POST", path, body).status == 200
    assert count("cls", "classification", "OK", protocol) == before + 1
    refused_before = count("_unknown_", "_unknown_", "UNAUTHENTICATED", protocol)
    refused = http(srv.base, "POST", path, body, auth=False)
    assert refused.status == 401 and refused.headers["WWW-Authenticate"] == "Bearer" and "error" in refused.json
    assert count("_unknown_", "_unknown_", "UNAUTHENTICATED", protocol) == refused_before + 1
    bad_deadline = http(srv.base, "POST", path, body, headers={"X-Request-Timeout": "soon"})
    assert bad_deadline.status == 400 or (protocol == "tei" and bad_deadline.status == 422)
    assert "X-Request-Timeout" in bad_deadline.json["error"]


def test_a_draining_server_refuses_in_each_surfaces_shape(srv):
    registry = srv.server.registry
    registry.draining = True  # what the drain sets first (the drain itself: tests/serving/test_drain.py)
    try:
        kserve = http(srv.base, "POST", "/v1/models/cls:predict", {"instances": ["x"]})
        assert kserve.status == 503 and list(kserve.json) == ["error"] and "shutting down" in kserve.json["error"]
        assert http(srv.base, "GET", "/v1/models/cls").json == {"error": "Model with name cls is not ready."}
        hf = http(srv.base, "POST", "/models/cls", {"inputs": "x"})
        assert hf.status == 503 and list(hf.json) == ["error"]
        tei = http(srv.base, "POST", "/models/cls/predict", {"inputs": "x"})
        assert tei.status == 503 and tei.json["error_type"] == "Unhealthy"
    finally:
        registry.draining = False
    assert http(srv.base, "POST", "/models/cls", {"inputs": "x"}).status == 200


# ---------------------------------------------------------------------- fuzz: 4xx in the surface's shape

def _shape_ok(protocol: str, reply: Reply) -> bool:
    body = reply.json
    if protocol == "tei":
        return set(body) == {"error", "error_type"}
    return list(body) == ["error"]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                    | st.text(max_size=12), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = {"kserve_v1": ("instances", "inputs"), "hf": ("inputs", "parameters", "options"),
          "tei": ("inputs", "truncate", "raw_scores", "truncation_direction")}
ROUTES = [("/v1/models/cls:predict", "kserve_v1"), ("/v1/models/qa:predict", "kserve_v1"),
          ("/v1/models/tr:predict", "kserve_v1"), ("/models/cls", "hf"), ("/models/qa", "hf"), ("/models/tr", "hf"),
          ("/models/cls/predict", "tei"), ("/models/cls/tokenize", "tei")]


@pytest.mark.parametrize("path,protocol", ROUTES)
def test_fuzzed_bodies_get_a_4xx_in_the_surfaces_shape(srv, path, protocol):
    bodies = st.one_of(
        st.binary(max_size=40).map(lambda b: ("raw", b)),
        JSON.map(lambda v: ("json", v)),
        st.fixed_dictionaries({}, optional={k: JSON for k in FIELDS[protocol]}).map(lambda v: ("json", v)),
    )

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def check(case):
        kind, value = case
        raw = value if kind == "raw" else json.dumps(value).encode()
        reply = http(srv.base, "POST", path, raw=raw)
        assert reply.status < 500, (path, raw, reply.body)
        if reply.status >= 400:
            assert _shape_ok(protocol, reply), (path, raw, reply.body)

    check()
