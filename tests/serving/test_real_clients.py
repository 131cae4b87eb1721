"""Real client libraries, unchanged, against one real relserve server (tiny real checkpoints: a DeBERTa
classifier with labels a/b/c, a DeBERTa QA model, an RNNsearch translation model; gRPC and HTTP on free
loopback ports): every call each library makes for a task it supports answers what relserve.v1 answers for the
same inputs and options (scores within 1e-5, the same spans, the same translations).

* kserve 0.21 (``tests/fixtures/kserve_script.py``): ``InferenceGRPCClient`` with list and numpy data (numpy
  goes as raw tensor contents with ``binary_data_size``), ``InferenceRESTClient`` protocol v2 with list, numpy
  (JSON) and binary data (``set_data_from_numpy``'s default, binary outputs asked), protocol v1
  (``{"instances"}`` -> ``{"predictions"}``), and each one's probes and errors;
* tritonclient[http] 2.73.0 (``tests/fixtures/tritonclient_http_script.py``) with its defaults: binary
  tensor data both ways, and its JSON form; tritonclient[grpc] is tests/serving/test_kserve_v2.py's;
* huggingface_hub 2.4 ``InferenceClient(model="http://HOST:PORT/models/{name}")``
  (``tests/fixtures/hf_client_script.py``): text_classification, question_answering, translation.

docs/api.md's table "Every surface, every task" is run here too: each of its curl and grpcurl calls, as written,
against this server (whose models have the default models' names).

Each library runs in its own venv under ``build/`` (fixtures/client_venvs.py), built once; the three builds start
in background threads when this module's first fixture runs and overlap with the server's start. Each script
runs once per module and prints JSON; the tests below check one call each, so a failure names the library,
transport, task and data form.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import urllib.request

import pytest

from fixtures import client_venvs
from fixtures.api_table import grpcurl, table_calls
from fixtures.client_venvs import HUGGINGFACE_HUB, KSERVE, TRITONCLIENT
from fixtures.deberta import make_deberta_checkpoint
from fixtures.fake_serving import server_config
from fixtures.server import Running
from fixtures.translation import make_tiny_checkpoint
from relserve.service._proto import inference_pb2 as pb
from relserve.service.config import ModelConfig
from relserve.service.registry import build_runner

LABELS = ("a", "b", "c")
TEXTS = ["the film was a quiet delight", "a dull and tiring evening"]
PAIRS = ["it was good", "it was bad"]
QUESTIONS = ["Where does Ann live?", "What does Bob drink?"]
CONTEXTS = ["Ann lives in Berlin and works in a small bakery near the river.",
            "Bob drinks green tea every morning before he walks to the station."]
SOURCES = ["Der alte Mann ging gestern Abend mit seinem Hund spazieren.", "Ich habe Hunger."]
# the default models' names, so that docs/api.md's table of calls runs against this server as written
CLS, QA, TR = "sentiment", "qa", "translate-de-en"
SPEC = {"cls": CLS, "qa": QA, "tr": TR, "texts": TEXTS, "pairs": PAIRS, "questions": QUESTIONS,
        "contexts": CONTEXTS, "sources": SOURCES}
TASKS = ("classify", "classify_pairs", "answer", "translate")
SCORE = 1e-5


@pytest.fixture(scope="session")
def venvs():
    """The three client venvs, building in background threads from the first use on (fixtures/client_venvs.py)."""
    return client_venvs.start(KSERVE, TRITONCLIENT, HUGGINGFACE_HUB)


@pytest.fixture(scope="module")
def srv(venvs, unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("real_clients")
    paths = {
        CLS: make_deberta_checkpoint(root / "cls", tokenizer_dir=unigram_tokenizer_dir, labels=LABELS).path,
        QA: make_deberta_checkpoint(root / "qa", task="question-answering", tokenizer_dir=unigram_tokenizer_dir).path,
        TR: make_tiny_checkpoint(root / "tr", seed=1),
    }
    # compute in-process: worker processes have their own tests (test_worker_process.py, test_worker_pool.py)
    cfg = dict(device="cpu", max_seq_len=64, doc_stride=16, max_queue_delay=0.002, worker_process=False)
    s = Running(server_config(http_port=0, metrics_port=None),
                [build_runner(ModelConfig(name=name, path=path, **cfg)) for name, path in paths.items()])
    s.wait_serving(timeout=120)
    s.http_base = f"http://127.0.0.1:{s.server.http_port}"
    s.http_target = f"127.0.0.1:{s.server.http_port}"
    yield s
    s.close()


@pytest.fixture(scope="module")
def kserve_out(venvs, srv):
    return client_venvs.run_script(venvs, KSERVE, "kserve_script.py", srv.http_base, f"127.0.0.1:{srv.port}", json.dumps(SPEC))


@pytest.fixture(scope="module")
def triton_out(venvs, srv):
    return client_venvs.run_script(venvs, TRITONCLIENT, "tritonclient_http_script.py", srv.http_target, json.dumps(SPEC))


@pytest.fixture(scope="module")
def hf_out(venvs, srv, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path_factory.mktemp("hf_home")), HF_HUB_DISABLE_TELEMETRY="1")
    return client_venvs.run_script(venvs, HUGGINGFACE_HUB, "hf_client_script.py", srv.http_base, json.dumps(SPEC), env=env)


# ------------------------------------------------------------------------------------ relserve.v1's answers


@pytest.fixture(scope="module")
def v1(srv):
    """relserve.v1's replies for the inputs and options every surface is asked."""
    def classify(texts, pairs=(), **kw):
        return srv.stub.Classify(pb.ClassifyRequest(model=CLS, texts=texts, text_pairs=pairs, **kw),
                                 timeout=60).results

    def answer(question, context, **kw):
        return srv.stub.Answer(pb.AnswerRequest(model=QA, question=question, context=context, **kw),
                               timeout=60).answers

    def translate(texts, **kw):
        return srv.stub.Translate(pb.TranslateRequest(model=TR, texts=texts, **kw), timeout=60).results

    return {
        "classify": classify(TEXTS),
        "classify_pairs": classify(TEXTS, PAIRS),
        "classify_pairs_top2": classify(TEXTS, PAIRS, top_k=2),
        "answer_top2": [answer(q, c, top_k=2) for q, c in zip(QUESTIONS, CONTEXTS)],
        "answer": [answer(q, c) for q, c in zip(QUESTIONS, CONTEXTS)],
        "translate_3x2": translate(SOURCES, beam_size=3, n_best=2),
        "translate": translate(SOURCES),
        "hf_classify": [classify([t]) for t in TEXTS],
        "hf_classify_top2_sigmoid": [classify([t], top_k=2, function_to_apply="sigmoid") for t in TEXTS],
        "hf_answer_top3": [answer(q, c, top_k=3, max_answer_len=10, doc_stride=16)
                           for q, c in zip(QUESTIONS, CONTEXTS)],
        "hf_translate_3": translate(SOURCES, beam_size=3, max_length=12),
    }


def _probabilities(result) -> list[float]:
    scores = {x.label: x.score for x in result.labels}
    return [scores[label] for label in LABELS]


def _check_tensors(task: str, got: dict, v1: dict) -> None:
    """One Open Inference Protocol reply (``{"outputs": {name: {"shape", "data"}}}``, as the client decoded it)
    equals relserve.v1's for the task's call (fixtures/kserve_script.py ``_calls``)."""
    assert "error" not in got, got["error"]
    out = got["outputs"]
    if task in ("classify", "classify_pairs"):
        full = v1["classify" if task == "classify" else "classify_pairs"]
        assert out["probabilities"]["shape"] == [len(TEXTS), len(LABELS)]
        for row, result in zip(out["probabilities"]["data"], full):
            assert row == pytest.approx(_probabilities(result), abs=SCORE)
        if task == "classify":
            assert out["label"] == {"shape": [len(TEXTS)], "data": [r.labels[0].label for r in full]}
        else:
            assert out["label"] == {"shape": [len(TEXTS), 2],
                                    "data": [[x.label for x in r.labels] for r in v1["classify_pairs_top2"]]}
    elif task == "answer":
        for name in ("answer", "start", "end", "score"):
            assert out[name]["shape"] == [len(QUESTIONS), 2], name
        for i, answers in enumerate(v1["answer_top2"]):
            assert out["answer"]["data"][i] == [a.text for a in answers]
            assert out["start"]["data"][i] == [a.start for a in answers]
            assert out["end"]["data"][i] == [a.end for a in answers]
            assert out["score"]["data"][i] == pytest.approx([a.score for a in answers], abs=SCORE)
    else:
        assert out["translation"] == {"shape": [len(SOURCES), 2],
                                      "data": [[h.text for h in r.hypotheses] for r in v1["translate_3x2"]]}


# ------------------------------------------------------------------------------------------------- kserve


@pytest.mark.parametrize("call", [f"{task}/{form}" for form in ("list", "numpy") for task in TASKS])
def test_kserve_grpc_client_answers_as_v1(kserve_out, v1, call):
    got = kserve_out["grpc"][call]
    _check_tensors(call.split("/")[0], got, v1)
    assert got["id"] == "req-1"


@pytest.mark.parametrize("call", [f"{task}/{form}" for form in ("list", "numpy", "binary") for task in TASKS])
def test_kserve_rest_v2_client_answers_as_v1(kserve_out, v1, call):
    got = kserve_out["rest_v2"][call]
    _check_tensors(call.split("/")[0], got, v1)
    assert got["id"] == "req-1" and got["model_name"] == {"classify": CLS, "classify_pairs": CLS,
                                                          "answer": QA, "translate": TR}[call.split("/")[0]]


def test_kserve_probes_and_errors(kserve_out):
    g, v2, rest_v1 = kserve_out["grpc"], kserve_out["rest_v2"], kserve_out["rest_v1"]
    assert g["live"] is True and g["ready"] is True
    assert v2["live"] is True and v2["ready"] is True
    assert rest_v1["live"] is True  # GET / -> {"status": "alive"}
    for m in (CLS, QA, TR):
        assert g[f"model_ready/{m}"] is True and v2[f"model_ready/{m}"] is True and rest_v1[f"model_ready/{m}"] is True
    assert v2["model_ready/no-such-model"] is False
    assert rest_v1["model_ready/no-such-model"]["error"]["status"] == 404
    assert g["unknown_parameter"]["error"]["code"] == "INVALID_ARGUMENT"
    assert "beam_size" in g["unknown_parameter"]["error"]["message"]
    assert v2["unknown_parameter"]["error"]["status"] == 400
    assert "beam_size" in v2["unknown_parameter"]["error"]["message"]
    assert rest_v1["unknown_model"]["error"]["status"] == 404


def test_kserve_rest_v1_client_gets_huggingfaceservers_shapes_with_v1s_numbers(kserve_out, v1):
    got = kserve_out["rest_v1"]
    # classification: huggingfaceserver's default prediction, the argmax label's index
    assert got["classify"] == {"predictions": [LABELS.index(r.labels[0].label) for r in v1["classify"]]}
    answers = got["answer"]["predictions"]
    assert len(answers) == len(QUESTIONS)
    for pred, best in zip(answers, (a[0] for a in v1["answer"])):
        assert (pred["answer"], pred["start"], pred["end"]) == (best.text, best.start, best.end)
        assert pred["score"] == pytest.approx(best.score, abs=SCORE)
    assert got["translate"] == {"predictions": [r.hypotheses[0].text for r in v1["translate"]]}


# -------------------------------------------------------------------------------------------- tritonclient


@pytest.mark.parametrize("call", [f"{task}/{form}" for form in ("binary", "json") for task in TASKS])
def test_tritonclient_http_answers_as_v1(triton_out, v1, call):
    got = triton_out[call]
    _check_tensors(call.split("/")[0], got, v1)
    binary = call.endswith("/binary")
    assert got["binary"] == {n: binary for n in got["outputs"]}  # each output in the form it was asked
    assert got["id"] == "req-1"


def test_tritonclient_http_defaults_probes_and_errors(triton_out, v1):
    got = triton_out["classify/all_outputs"]  # no outputs named: binary_data_output, every output binary
    assert got["binary"] == {"probabilities": True, "label": True}
    _check_tensors("classify", got, v1)
    assert triton_out["live"] is True and triton_out["ready"] is True
    assert {m: triton_out[f"model_ready/{m}"] for m in (CLS, QA, TR, "no-such-model")} == {
        CLS: True, QA: True, TR: True, "no-such-model": False}
    assert "binary_tensor_data" in triton_out["server_metadata"]["extensions"]
    meta = triton_out["model_metadata/cls"]
    assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == [("text", "BYTES"), ("text_pair", "BYTES")]
    assert triton_out["unknown_parameter"]["error"]["status"] == "400"
    assert "beam_size" in triton_out["unknown_parameter"]["error"]["message"]
    assert triton_out["unknown_model"]["error"]["status"] == "404"


# --------------------------------------------------------------------------------------- huggingface_hub


def _labels(got) -> list[tuple[str, float]]:
    assert isinstance(got, list) and all(g["__element__"] == "TextClassificationOutputElement" for g in got), got
    return [(g["label"], g["score"]) for g in got]


@pytest.mark.parametrize("i", range(len(TEXTS)))
def test_hf_text_classification_answers_as_v1(hf_out, v1, i):
    for key, ref in ((f"text_classification/{i}", v1["hf_classify"][i][0]),
                     (f"text_classification/{i}/top_k=2,sigmoid", v1["hf_classify_top2_sigmoid"][i][0])):
        got = _labels(hf_out[key])
        assert [label for label, _ in got] == [x.label for x in ref.labels], key
        assert [score for _, score in got] == pytest.approx([x.score for x in ref.labels], abs=SCORE), key


@pytest.mark.parametrize("i", range(len(QUESTIONS)))
def test_hf_question_answering_answers_as_v1(hf_out, v1, i):
    one = hf_out[f"question_answering/{i}"]  # top_k unset: one element, the best answer with the model's options
    assert isinstance(one, dict) and one.get("__element__") == "QuestionAnsweringOutputElement", one
    best = v1["answer"][i][0]
    assert (one["answer"], one["start"], one["end"]) == (best.text, best.start, best.end)
    assert one["score"] == pytest.approx(best.score, abs=SCORE)
    several = hf_out[f"question_answering/{i}/top_k=3"]
    ref = v1["hf_answer_top3"][i]
    assert isinstance(several, list) and len(several) == len(ref), several
    assert [(a["answer"], a["start"], a["end"]) for a in several] == [(a.text, a.start, a.end) for a in ref]
    assert [a["score"] for a in several] == pytest.approx([a.score for a in ref], abs=SCORE)


@pytest.mark.parametrize("i", range(len(SOURCES)))
def test_hf_translation_answers_as_v1(hf_out, v1, i):
    assert hf_out[f"translation/{i}"] == {"__element__": "TranslationOutput",
                                          "translation_text": v1["translate"][i].hypotheses[0].text}
    assert hf_out[f"translation/{i}/num_beams=3"] == {"__element__": "TranslationOutput",
                                                      "translation_text": v1["hf_translate_3"][i].hypotheses[0].text}


def test_hf_errors_reach_the_client_with_their_status(hf_out):
    assert hf_out["unknown_model"]["error"]["status"] == 404
    assert json.loads(hf_out["unknown_model"]["error"]["body"]).keys() == {"error"}
    assert hf_out["bad_parameter"]["error"]["status"] == 400
    assert "top_k" in hf_out["bad_parameter"]["error"]["body"]


# ------------------------------------------------------------------------------ docs/api.md's table of calls


def _table_calls(models: tuple[str, ...] | None = None) -> list[str]:
    """The curl and grpcurl calls in the cells of docs/api.md's "Every surface, every task" table; with
    ``models``, those to one of them (tests/serving/test_pipeline_tasks_server.py runs the pipeline tasks')."""
    calls = table_calls()
    return calls if models is None else [c for c in calls if _table_model(c) in models]


def _table_model(call: str) -> str:
    """The model a table call names (its ``model`` / ``model_name`` field or its URL's ``/models/{name}``)."""
    found = re.search(r'"model(?:_name)?": "([\w.-]+)"|/models/([\w.-]+)', call)
    assert found, call
    return found.group(1) or found.group(2)


def test_the_api_table_has_a_call_per_surface_and_task():
    calls = _table_calls()
    # 7 surfaces x 3 tasks, less TEI's QA and translation, plus TEI's /tokenize for a QA model; then the pipeline
    # tasks: zero-shot and token classification on 5 surfaces (not KServe v1, TEI), rerank on 5 (not KServe v1, HF)
    assert len(calls) == 20 + 5 + 5 + 5, calls
    assert sum(c.startswith("grpcurl") for c in calls) == 6 + 6
    assert len(_table_calls((CLS, QA, TR))) == 20


@pytest.mark.parametrize("call", _table_calls((CLS, QA, TR)),
                         ids=lambda c: re.sub(r"[^\w/:.-]+", "_", c.split("-d")[0] + c[-40:]))
def test_the_api_tables_calls_run_as_written(srv, call):
    argv = shlex.split(call)
    body = argv[argv.index("-d") + 1] if "-d" in argv else None
    if argv[0] == "curl":
        url = next(a for a in argv if a.startswith("localhost:8000/"))
        request = urllib.request.Request(srv.http_base + url.removeprefix("localhost:8000"),
                                         data=body.encode() if body is not None else None,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status == 200
            assert json.loads(reply.read())
        return
    assert argv[:2] == ["grpcurl", "-plaintext"] and argv[-2] == "127.0.0.1:50051", argv
    assert grpcurl(srv.channel, argv[-1], body).ByteSize() > 0
