"""Zero-shot classification, token classification and rerank through every wire surface of one real server
(tiny random DeBERTa-v3 checkpoints written with transformers' ``save_pretrained``: an NLI classifier, a
one-label cross-encoder, a token classifier; gRPC and HTTP on free loopback ports), against transformers:

* every surface's answer equals ``transformers.pipeline("zero-shot-classification")`` /
  ``pipeline("token-classification")`` and the cross-encoder's sigmoid (or logit) on the (query, text) pairs:
  relserve.v1 gRPC and HTTP/JSON, KServe v2 REST and gRPC, the Hugging Face convention, TEI's ``/rerank``;
* the real clients, unchanged, in their venvs (fixtures/client_venvs.py): huggingface_hub 2.4
  ``InferenceClient.zero_shot_classification`` / ``token_classification`` and tritonclient[http] 2.73.0;
* one bad input per error kind per surface (a template without ``{}``, a blank label, too many labels, token
  classification on a classification model, an unknown aggregation strategy): the surface's status, the field
  named, no model work (the batch-size histogram is untouched);
* the request metrics carry the operations' task labels; docs/api.md's table calls for these models run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from google.protobuf import json_format

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from prometheus_client import REGISTRY  # noqa: E402

from fixtures import client_venvs  # noqa: E402
from fixtures.api_table import grpcurl, table_calls  # noqa: E402
from fixtures.client_venvs import HUGGINGFACE_HUB, TRITONCLIENT  # noqa: E402
from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.fake_serving import server_config  # noqa: E402
from fixtures.server import Running  # noqa: E402
from relserve.client import Client  # noqa: E402
from relserve.client.cli import main as call_main  # noqa: E402
from relserve.loadtest import cli as loadtest_cli  # noqa: E402
from relserve.service._proto import grpc_predict_v2_pb2 as v2  # noqa: E402
from relserve.service._proto import grpc_predict_v2_pb2_grpc as v2_grpc  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service.config import ModelConfig  # noqa: E402
from relserve.service.registry import build_runner  # noqa: E402
from relserve.service.tasks.text import is_blank_char  # noqa: E402

NLI_LABELS = ["contradiction", "neutral", "entailment"]
# the names docs/api.md's table uses
NLI, NER, RERANKER = "nli", "ner", "reranker"
TEXTS = ["Ann moved to Berlin last spring and works near the river.", "The  match ended 2:1… a quiet evening."]
LABELS = ["travel", "sport", "cooking"]
TEMPLATE = "Dieser Text handelt von {}."
QUERY = "Where does Ann live?"
SCORE = 1e-5


@pytest.fixture(scope="module")
def world(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_tasks")
    common = dict(oracle=True, tokenizer_dir=unigram_tokenizer_dir, init="matrices")
    ckpts = {NLI: make_deberta_checkpoint(root / NLI, labels=NLI_LABELS, seed=1, **common),
             RERANKER: make_deberta_checkpoint(root / RERANKER, labels=1, seed=2, **common),
             NER: make_deberta_checkpoint(root / NER, task="token-classification", seed=3, **common)}
    venvs = client_venvs.start(TRITONCLIENT, HUGGINGFACE_HUB)  # built in background threads meanwhile
    # parity with transformers: float32; compute in-process (worker processes have their own tests)
    cfg = dict(device="cpu", dtype="float32", max_seq_len=64, max_queue_delay=0.002, worker_process=False)
    srv = Running(server_config(http_port=0, metrics_port=None),
                  [build_runner(ModelConfig(name=name, path=c.path, **cfg)) for name, c in ckpts.items()])
    srv.wait_serving(timeout=120)
    srv.http_base = f"http://127.0.0.1:{srv.server.http_port}"
    srv.v2 = v2_grpc.GRPCInferenceServiceStub(srv.channel)
    tokenizers = {name: transformers.AutoTokenizer.from_pretrained(str(c.path)) for name, c in ckpts.items()}
    for tok in tokenizers.values():
        tok.model_max_length = 64  # the served window
    models = {name: c.model.eval() for name, c in ckpts.items()}
    yield srv, models, tokenizers, venvs
    srv.close()


def _post(srv, path: str, body: dict) -> tuple[int, object]:
    request = urllib.request.Request(srv.http_base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _ok(srv, path: str, body: dict):
    status, reply = _post(srv, path, body)
    assert status == 200, reply
    return reply


def _v2_rest(srv, model: str, inputs: dict[str, tuple[list, list[str]]], **parameters) -> dict:
    body = {"inputs": [{"name": n, "shape": shape, "datatype": "BYTES", "data": data}
                       for n, (shape, data) in inputs.items()], "parameters": parameters}
    reply = _ok(srv, f"/v2/models/{model}/infer", body)
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in reply["outputs"]}


def _v2_grpc(srv, model: str, inputs: dict[str, tuple[list, list[str]]], **parameters) -> dict:
    request = v2.ModelInferRequest(model_name=model)
    for name, (shape, data) in inputs.items():
        t = request.inputs.add(name=name, datatype="BYTES", shape=shape)
        t.contents.bytes_contents.extend(d.encode() for d in data)
    for key, value in parameters.items():
        field = {bool: "bool_param", int: "int64_param", str: "string_param"}[type(value)]
        setattr(request.parameters[key], field, value)
    reply = srv.v2.ModelInfer(request, timeout=60)
    out = {}
    for o in reply.outputs:
        c = o.contents
        data = (list(c.bytes_contents) and [b.decode() for b in c.bytes_contents]) or list(c.fp32_contents) \
            or list(c.int64_contents)
        out[o.name] = np.array(data).reshape(list(o.shape)) if data else np.zeros(list(o.shape))
    return out


def _batch_units() -> float:
    """Batches executed on any of the three models so far."""
    return sum(REGISTRY.get_sample_value("relserve_batch_size_count", {"model": m}) or 0.0
               for m in (NLI, NER, RERANKER))


# ------------------------------------------------------------------------------------------------- zero-shot

@pytest.mark.parametrize("multi_label,template", [(False, None), (True, TEMPLATE)])
def test_zero_shot_on_every_surface_equals_the_pipeline(world, multi_label, template):
    srv, models, tokenizers, _ = world
    pipe = transformers.pipeline("zero-shot-classification", model=models[NLI], tokenizer=tokenizers[NLI],
                                 device="cpu")
    kw = {} if template is None else {"hypothesis_template": template}
    want = [(w["labels"], w["scores"]) for w in pipe(TEXTS, candidate_labels=LABELS, multi_label=multi_label, **kw)]

    got = {}
    reply = srv.stub.ZeroShotClassify(pb.ZeroShotClassifyRequest(
        model=NLI, texts=TEXTS, candidate_labels=LABELS, multi_label=multi_label, hypothesis_template=template or ""),
        timeout=60)
    assert [r.sequence for r in reply.results] == TEXTS
    got["grpc_v1"] = [([ls.label for ls in r.labels], [ls.score for ls in r.labels]) for r in reply.results]
    body = {"model": NLI, "texts": TEXTS, "candidateLabels": LABELS, "multiLabel": multi_label, **(
        {"hypothesisTemplate": template} if template else {})}
    got["http_v1"] = [([ls["label"] for ls in r["labels"]], [ls["score"] for ls in r["labels"]])
                      for r in _ok(srv, "/v1/zero-shot-classify", body)["results"]]
    params = {"multi_label": multi_label, **({"hypothesis_template": template} if template else {})}
    tensors = {"text": ([len(TEXTS)], TEXTS), "candidate_labels": ([len(LABELS)], LABELS)}
    for name, call in (("v2_rest", _v2_rest), ("v2_grpc", _v2_grpc)):
        out = call(srv, NLI, tensors, **params)
        assert out["labels"].shape == out["scores"].shape == (len(TEXTS), len(LABELS))
        got[name] = [(list(out["labels"][i]), list(out["scores"][i])) for i in range(len(TEXTS))]
    hf = [_ok(srv, f"/models/{NLI}", {"inputs": text, "parameters": {"candidate_labels": LABELS, **params}})
          for text in TEXTS]
    got["hf"] = [([e["label"] for e in row], [e["score"] for e in row]) for row in hf]
    for surface, rows in got.items():
        for (labels, scores), (want_labels, want_scores) in zip(rows, want, strict=True):
            assert labels == want_labels, surface
            np.testing.assert_allclose(scores, want_scores, rtol=0, atol=SCORE, err_msg=surface)


# -------------------------------------------------------------------------------------- token classification

def _entities(rows: list[dict]) -> list[tuple]:
    """Served entities as (label, word, start, end, index, score)."""
    return [(e.get("entity_group") or e.get("entityGroup") or e.get("entity"), e["word"], e["start"], e["end"],
             e.get("index"), float(e["score"])) for e in rows]


def _want(rows: list[dict], text: str, index: bool = True) -> list[tuple]:
    """The pipeline's entities as relserve reports them (tests/models/test_token_classification_parity.py):
    offsets trimmed of whitespace (a word-initial piece's include the space before it), ``word`` the text
    between them, blank ones (a text-initial bare piece) left out; ``index`` False drops the token index (the
    huggingface_hub client does not keep it)."""
    out = []
    for e in rows:
        start, end = int(e["start"]), int(e["end"])
        while start < end and is_blank_char(text[start]):
            start += 1
        while end > start and is_blank_char(text[end - 1]):
            end -= 1
        if start == end or (e["word"] in ("\u2581", "") and int(e["start"]) == 0):
            continue
        out.append((e.get("entity_group") or e.get("entity"), text[start:end], start, end,
                    e.get("index") if index else None, float(e["score"])))
    return out


def _assert_entities(got: list[tuple], want: list[tuple], where: str) -> None:
    assert [g[:5] for g in got] == [w[:5] for w in want], where
    np.testing.assert_allclose([g[5] for g in got], [w[5] for w in want], rtol=0, atol=SCORE, err_msg=where)


@pytest.mark.parametrize("strategy", ["none", "simple", "first", "average", "max"])
def test_token_classification_on_every_surface_equals_the_pipeline(world, strategy):
    srv, models, tokenizers, _ = world
    pipe = transformers.pipeline("token-classification", model=models[NER], tokenizer=tokenizers[NER],
                                 device="cpu", aggregation_strategy=strategy)
    # ignore nothing: random weights label most tokens "O", which would leave little to compare
    want = [_want(row, text) for row, text in zip(pipe(TEXTS, ignore_labels=[]), TEXTS)]
    assert sum(map(len, want)) > 0

    reply = srv.stub.ClassifyTokens(pb.ClassifyTokensRequest(
        model=NER, texts=TEXTS, aggregation_strategy=strategy, ignore_labels=pb.IgnoreLabels(labels=[])),
        timeout=60)
    got = {"grpc_v1": [[(e.entity_group or e.entity, e.word, e.start, e.end,
                         e.index if e.HasField("index") else None, e.score) for e in r.entities]
                       for r in reply.results]}
    body = {"model": NER, "texts": TEXTS, "aggregationStrategy": strategy, "ignoreLabels": {"labels": []}}
    got["http_v1"] = [_entities(r["entities"]) for r in _ok(srv, "/v1/classify-tokens", body)["results"]]
    hf = _ok(srv, f"/models/{NER}", {"inputs": TEXTS, "parameters": {"aggregation_strategy": strategy,
                                                                     "ignore_labels": []}})
    got["hf"] = [_entities(row) for row in hf]
    tensors = {"text": ([len(TEXTS)], TEXTS), "ignore_labels": ([0], [])}
    for name, call in (("v2_rest", _v2_rest), ("v2_grpc", _v2_grpc)):
        out = call(srv, NER, tensors, aggregation_strategy=strategy)
        rows = []
        for i, n in enumerate(out["num_entities"]):
            rows.append([(str(out["entity"][i][j]), str(out["word"][i][j]), int(out["start"][i][j]),
                          int(out["end"][i][j]), None if out["index"][i][j] == -1 else int(out["index"][i][j]),
                          float(out["score"][i][j])) for j in range(int(n))])
        got[name] = rows
    for surface, rows in got.items():
        for i, (g, w) in enumerate(zip(rows, want, strict=True)):
            _assert_entities(g, w, f"{surface} text {i}")
            assert all(TEXTS[i][e[2]:e[3]] == e[1] for e in g), surface  # word == text[start:end]


def test_token_classification_default_ignores_o_labels(world):
    srv, models, tokenizers, _ = world
    pipe = transformers.pipeline("token-classification", model=models[NER], tokenizer=tokenizers[NER], device="cpu")
    want = [_want(row, text) for row, text in zip(pipe(TEXTS), TEXTS)]
    reply = srv.stub.ClassifyTokens(pb.ClassifyTokensRequest(model=NER, texts=TEXTS), timeout=60)
    got = [[(e.entity, e.word, e.start, e.end, e.index, e.score) for e in r.entities] for r in reply.results]
    for g, w in zip(got, want, strict=True):
        _assert_entities(g, w, "default ignore_labels")
    models_reply = srv.stub.ListModels(pb.ListModelsRequest(), timeout=10)
    ner = next(m for m in models_reply.models if m.name == NER)
    assert ner.task == "token-classification" and list(ner.labels) == list(models[NER].config.id2label.values())


# -------------------------------------------------------------------------------------------------- rerank

def test_rerank_on_every_surface_equals_the_cross_encoder(world):
    srv, models, tokenizers, _ = world
    texts = TEXTS + ["Ann lives in Berlin."]
    enc = tokenizers[RERANKER]([QUERY] * len(texts), texts, return_tensors="pt", padding=True, truncation=True)
    with torch.no_grad():
        logits = models[RERANKER](**enc).logits[:, 0].numpy()
    for raw in (False, True):
        scores = logits if raw else 1 / (1 + np.exp(-logits))
        order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
        reply = srv.stub.Rerank(pb.RerankRequest(model=RERANKER, query=QUERY, texts=texts, raw_scores=raw,
                                                 return_text=True), timeout=60)
        got = {"grpc_v1": [(r.index, r.score, r.text) for r in reply.results]}
        body = {"model": RERANKER, "query": QUERY, "texts": texts, "rawScores": raw, "returnText": True}
        got["http_v1"] = [(r["index"], r["score"], r["text"]) for r in _ok(srv, "/v1/rerank", body)["results"]]
        tei = _ok(srv, f"/models/{RERANKER}/rerank", {"query": QUERY, "texts": texts, "raw_scores": raw,
                                                      "return_text": True, "truncate": True})
        got["tei"] = [(r["index"], r["score"], r["text"]) for r in tei]
        tensors = {"query": ([1], [QUERY]), "text": ([len(texts)], texts)}
        for name, call in (("v2_rest", _v2_rest), ("v2_grpc", _v2_grpc)):
            out = call(srv, RERANKER, tensors, raw_scores=raw)
            got[name] = [(int(i), float(s), texts[int(i)]) for i, s in zip(out["index"], out["score"])]
        for surface, rows in got.items():
            assert [r[0] for r in rows] == order, surface
            assert [r[2] for r in rows] == [texts[i] for i in order], surface
            np.testing.assert_allclose([r[1] for r in rows], scores[order], rtol=0, atol=SCORE, err_msg=surface)
    # top_n and TEI's shape without return_text
    reply = srv.stub.Rerank(pb.RerankRequest(model=RERANKER, query=QUERY, texts=texts, top_n=1), timeout=60)
    assert len(reply.results) == 1 and reply.results[0].text == ""
    assert set(_ok(srv, f"/models/{RERANKER}/rerank", {"query": QUERY, "texts": texts})[0]) == {"index", "score"}


# ---------------------------------------------------------------------------------------------- real clients

def _script(world, venv, script: str, *args: str, env: dict | None = None) -> dict:
    return client_venvs.run_script(world[3], venv, script, *args, env=env)


def test_huggingface_hub_client_zero_shot_and_token_classification(world, tmp_path):
    srv, models, tokenizers, _ = world
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
    spec = {"nli": NLI, "ner": NER, "texts": TEXTS, "labels": LABELS, "template": TEMPLATE}
    out = _script(world, HUGGINGFACE_HUB, "hf_client_script.py", srv.http_base, json.dumps(spec), env=env)
    zs = transformers.pipeline("zero-shot-classification", model=models[NLI], tokenizer=tokenizers[NLI], device="cpu")
    for i, text in enumerate(TEXTS):
        for key, kw in (("", {}), ("/multi_label,template", {"multi_label": True, "hypothesis_template": TEMPLATE})):
            want = zs(text, candidate_labels=LABELS, **kw)
            got = out[f"zero_shot_classification/{i}{key}"]
            assert [e["__element__"] for e in got] == ["ZeroShotClassificationOutputElement"] * len(LABELS)
            assert [e["label"] for e in got] == want["labels"]
            np.testing.assert_allclose([e["score"] for e in got], want["scores"], rtol=0, atol=SCORE)
        for strategy, kw in ((None, {}), ("simple", {}), ("max", {}), ("first", {"ignore_labels": [], "stride": 4})):
            key = f"token_classification/{i}/{strategy}" if "stride" not in kw else \
                f"token_classification/{i}/ignore=[],stride=4"
            tc = transformers.pipeline("token-classification", model=models[NER], tokenizer=tokenizers[NER],
                                       device="cpu", aggregation_strategy=strategy or "none",
                                       **({"stride": 4} if "stride" in kw else {}))
            want = _want(tc(text, **{k: v for k, v in kw.items() if k != "stride"}), text, index=False)
            got = out[key]
            assert all(e["__element__"] == "TokenClassificationOutputElement" for e in got)
            _assert_entities(_entities(got), want, key)
    assert out["zero_shot_classification/bad_template"]["error"]["status"] == 400
    assert "hypothesis_template" in out["zero_shot_classification/bad_template"]["error"]["body"]
    assert out["token_classification/bad_strategy"]["error"]["status"] == 400
    assert "aggregation_strategy" in out["token_classification/bad_strategy"]["error"]["body"]


def test_tritonclient_http_zero_shot_rerank_and_token_classification(world):
    srv, _, _, _ = world
    spec = {"nli": NLI, "ner": NER, "reranker": RERANKER, "texts": TEXTS, "labels": LABELS, "query": QUERY}
    out = _script(world, TRITONCLIENT, "tritonclient_http_script.py", f"127.0.0.1:{srv.server.http_port}",
                  json.dumps(spec))
    inputs = {i["name"] for i in out["model_metadata/nli"]["inputs"]}
    assert {"text", "candidate_labels", "query"} <= inputs
    assert {o["name"] for o in out["model_metadata/ner"]["outputs"]} == {
        "entity", "score", "word", "start", "end", "index", "num_entities"}
    zs = srv.stub.ZeroShotClassify(pb.ZeroShotClassifyRequest(model=NLI, texts=TEXTS, candidate_labels=LABELS,
                                                              multi_label=True), timeout=60)
    assert out["zero_shot"]["labels"]["data"] == [[ls.label for ls in r.labels] for r in zs.results]
    np.testing.assert_allclose(out["zero_shot"]["scores"]["data"], [[ls.score for ls in r.labels]
                                                                   for r in zs.results], rtol=0, atol=SCORE)
    rr = srv.stub.Rerank(pb.RerankRequest(model=RERANKER, query=QUERY, texts=TEXTS, top_n=2), timeout=60)
    assert out["rerank"]["index"]["data"] == [r.index for r in rr.results]
    np.testing.assert_allclose(out["rerank"]["score"]["data"], [r.score for r in rr.results], rtol=0, atol=SCORE)
    tc = srv.stub.ClassifyTokens(pb.ClassifyTokensRequest(model=NER, texts=TEXTS, aggregation_strategy="simple"),
                                 timeout=60)
    got = out["token_classification"]
    assert got["num_entities"]["data"] == [len(r.entities) for r in tc.results]
    for i, r in enumerate(tc.results):
        assert got["word"]["data"][i][:len(r.entities)] == [e.word for e in r.entities]
        assert got["start"]["data"][i][:len(r.entities)] == [e.start for e in r.entities]
    all_labels = srv.stub.ClassifyTokens(pb.ClassifyTokensRequest(
        model=NER, texts=TEXTS, ignore_labels=pb.IgnoreLabels()), timeout=60)
    assert out["token_classification/ignore_nothing"]["num_entities"]["data"] == [
        len(r.entities) for r in all_labels.results]
    bad = out["zero_shot/bad_template"]["error"]
    assert bad["status"] == "400" and "hypothesis_template" in bad["message"]


# ---------------------------------------------------------------------------------------------- bad input

# (what is wrong, the field the error names, relserve.v1 request, HF body, KServe v2 inputs and parameters)
BAD = [
    ("template without {}", "hypothesis_template",
     pb.ZeroShotClassifyRequest(model=NLI, texts=TEXTS, candidate_labels=LABELS, hypothesis_template="none"),
     (NLI, {"inputs": TEXTS[0], "parameters": {"candidate_labels": LABELS, "hypothesis_template": "none"}}),
     (NLI, {"text": ([1], TEXTS[:1]), "candidate_labels": ([len(LABELS)], LABELS)}, {"hypothesis_template": "x"})),
    ("blank label", "candidate_labels[1]",
     pb.ZeroShotClassifyRequest(model=NLI, texts=TEXTS, candidate_labels=["a", " "]),
     (NLI, {"inputs": TEXTS[0], "parameters": {"candidate_labels": ["a", " "]}}),
     (NLI, {"text": ([1], TEXTS[:1]), "candidate_labels": ([2], ["a", " "])}, {})),
    ("too many labels", "max_candidate_labels",
     pb.ZeroShotClassifyRequest(model=NLI, texts=TEXTS[:1], candidate_labels=[f"l{i}" for i in range(65)]),
     (NLI, {"inputs": TEXTS[0], "parameters": {"candidate_labels": [f"l{i}" for i in range(65)]}}),
     (NLI, {"text": ([1], TEXTS[:1]), "candidate_labels": ([65], [f"l{i}" for i in range(65)])}, {})),
    ("unknown strategy", "aggregation_strategy",
     pb.ClassifyTokensRequest(model=NER, texts=TEXTS, aggregation_strategy="sum"),
     (NER, {"inputs": TEXTS[0], "parameters": {"aggregation_strategy": "sum"}}),
     (NER, {"text": ([1], TEXTS[:1])}, {"aggregation_strategy": "sum"})),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_refused_on_every_surface_without_model_work(world, case):
    srv = world[0]
    _what, field, message, (hf_model, hf_body), (v2_model, v2_inputs, v2_params) = case
    before = _batch_units()
    rpc = {pb.ZeroShotClassifyRequest: srv.stub.ZeroShotClassify, pb.ClassifyTokensRequest: srv.stub.ClassifyTokens}
    with pytest.raises(grpc.RpcError) as err:
        rpc[type(message)](message, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    path = "/v1/zero-shot-classify" if isinstance(message, pb.ZeroShotClassifyRequest) else "/v1/classify-tokens"
    status, reply = _post(srv, path, json_format.MessageToDict(message))
    assert status == 400 and field in json.dumps(reply)
    status, reply = _post(srv, f"/models/{hf_model}", hf_body)
    assert status == 400 and field in reply["error"]
    body = {"inputs": [{"name": n, "shape": s, "datatype": "BYTES", "data": d} for n, (s, d) in v2_inputs.items()],
            "parameters": v2_params}
    status, reply = _post(srv, f"/v2/models/{v2_model}/infer", body)
    assert status == 400 and (field in reply["error"] or "hypothesis" in reply["error"])
    with pytest.raises(grpc.RpcError) as err:
        _v2_grpc(srv, v2_model, v2_inputs, **v2_params)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _batch_units() == before  # no model work


def test_a_model_of_another_task_is_refused_on_every_surface(world):
    srv = world[0]
    before = _batch_units()
    # token classification on a classification model, zero-shot on a token classifier: INVALID_ARGUMENT naming
    # the model, from the task's validation
    for rpc, message, model in (
            (srv.stub.ClassifyTokens, pb.ClassifyTokensRequest(model=NLI, texts=TEXTS), NLI),
            (srv.stub.ZeroShotClassify, pb.ZeroShotClassifyRequest(model=NER, texts=TEXTS, candidate_labels=LABELS),
             NER),
            (srv.stub.Rerank, pb.RerankRequest(model=NER, query=QUERY, texts=TEXTS), NER)):
        with pytest.raises(grpc.RpcError) as err:
            rpc(message, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and repr(model) in err.value.details()
    status, reply = _post(srv, "/v1/classify-tokens", {"model": NLI, "texts": TEXTS})
    assert (status, reply["code"]) == (400, "INVALID_ARGUMENT") and repr(NLI) in reply["error"]
    # the conventions: a classification model takes no token-classification parameter, a token classifier no
    # candidate labels (400 naming the parameter), TEI's rerank on a token classifier is its Backend error
    status, reply = _post(srv, f"/models/{NLI}", {"inputs": "x", "parameters": {"aggregation_strategy": "simple"}})
    assert status == 400 and "aggregation_strategy" in reply["error"]
    status, reply = _post(srv, f"/v2/models/{NER}/infer", {"inputs": [
        {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]},
        {"name": "candidate_labels", "shape": [1], "datatype": "BYTES", "data": ["a"]}]})
    assert status == 400 and "candidate_labels" in reply["error"]
    status, reply = _post(srv, f"/models/{NER}/rerank", {"query": QUERY, "texts": TEXTS})
    assert status == 424 and reply["error_type"] == "Backend"
    assert _batch_units() == before
    # TEI's own errors: empty texts (Empty, 400), an over-long pair without truncate (Validation, 422)
    status, reply = _post(srv, f"/models/{RERANKER}/rerank", {"query": QUERY, "texts": []})
    assert (status, reply["error_type"]) == (400, "Empty")
    status, reply = _post(srv, f"/models/{RERANKER}/rerank", {"query": QUERY, "texts": ["word " * 200]})
    assert (status, reply["error_type"]) == (422, "Validation")
    # KServe v2: a query that is not one element
    status, reply = _post(srv, f"/v2/models/{RERANKER}/infer", {"inputs": [
        {"name": "query", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]},
        {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["c"]}]})
    assert status == 400 and "query" in reply["error"]


def test_a_blank_rerank_query_is_refused_on_every_surface_without_model_work(world):
    srv = world[0]
    before = _batch_units()
    with pytest.raises(grpc.RpcError) as err:
        srv.stub.Rerank(pb.RerankRequest(model=RERANKER, query=" ", texts=TEXTS), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "query" in err.value.details()
    status, reply = _post(srv, "/v1/rerank", {"model": RERANKER, "query": " ", "texts": TEXTS})
    assert (status, reply["code"]) == (400, "INVALID_ARGUMENT") and "query" in reply["error"]
    status, reply = _post(srv, f"/models/{RERANKER}/rerank", {"query": " ", "texts": TEXTS})
    assert (status, reply["error_type"]) == (422, "Validation") and "query" in reply["error"]
    tensors = {"query": ([1], [" "]), "text": ([len(TEXTS)], TEXTS)}
    status, reply = _post(srv, f"/v2/models/{RERANKER}/infer", {"inputs": [
        {"name": n, "shape": sh, "datatype": "BYTES", "data": d} for n, (sh, d) in tensors.items()]})
    assert status == 400 and "query" in reply["error"]
    with pytest.raises(grpc.RpcError) as err:
        _v2_grpc(srv, RERANKER, tensors)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "query" in err.value.details()
    assert _batch_units() == before


@pytest.mark.parametrize("path,body,field,key", [
    ("/v1/rerank", {"model": RERANKER, "query": "q", "texts": ["a"] * 2000}, "texts", "max_rerank_texts"),
    ("/v1/zero-shot-classify", {"model": NLI, "texts": ["a"], "candidateLabels": ["b"] * 2000}, "candidate_labels",
     "max_candidate_labels"),
    ("/v1/classify-tokens", {"model": NER, "texts": ["a"] * 2000}, "texts", "max_request_texts"),
])
def test_huge_v1_arrays_are_counted_before_the_body_is_parsed(world, path, body, field, key):
    # the wire count's message (not the task's): the array was refused after 1,025 element scans, unparsed
    status, reply = _post(world[0], path, body)
    assert (status, reply["code"]) == (400, "INVALID_ARGUMENT"), reply
    assert f"the request has more than 1024 {field}" in reply["error"] and f"({key})" in reply["error"], reply


def test_request_metrics_carry_the_operations_task_labels(world):
    srv = world[0]
    srv.stub.Rerank(pb.RerankRequest(model=RERANKER, query=QUERY, texts=TEXTS), timeout=60)
    _ok(srv, f"/models/{RERANKER}/rerank", {"query": QUERY, "texts": TEXTS})
    _v2_rest(srv, NLI, {"text": ([1], TEXTS[:1]), "candidate_labels": ([1], LABELS[:1])})
    _ok(srv, f"/models/{NLI}", {"inputs": TEXTS[0], "parameters": {"candidate_labels": LABELS}})

    def count(model, task, protocol):
        return REGISTRY.get_sample_value("relserve_requests_total", {"model": model, "task": task, "code": "OK",
                                                                     "protocol": protocol}) or 0

    assert count(RERANKER, "rerank", "grpc_v1") >= 1
    assert count(RERANKER, "rerank", "tei") >= 1
    assert count(NLI, "zero-shot-classification", "kserve_v2_http") >= 1
    assert count(NLI, "zero-shot-classification", "hf") >= 1
    assert count(NER, "token-classification", "grpc_v1") >= 1


# ------------------------------------------------------------------------------------- docs/api.md's table

def _table_calls() -> list[str]:
    """docs/api.md's "Every surface, every task" calls to this module's models (the others:
    tests/serving/test_real_clients.py)."""
    return [c for c in table_calls() if re.search(rf'"model(?:_name)?": "({NLI}|{NER}|{RERANKER})"|/models/({NLI}|{NER}|'
                                          rf'{RERANKER})\b', c)]


def test_the_api_tables_pipeline_task_calls_run_as_written(world):
    srv = world[0]
    calls = _table_calls()
    assert len(calls) == 15, calls
    for call in calls:
        argv = shlex.split(call)
        body = argv[argv.index("-d") + 1]
        if argv[0] == "curl":
            url = next(a for a in argv if a.startswith("localhost:8000/"))
            assert _ok(srv, url.removeprefix("localhost:8000"), json.loads(body)), call
            continue
        assert grpcurl(srv.channel, argv[-1], body).ByteSize() > 0, call


# ---------------------------------------------------------------------------------- relserve.client and CLI

def test_client_methods_and_call_subcommands(world, capsys):
    srv = world[0]
    target = f"127.0.0.1:{srv.port}"
    with Client(target, timeout=30) as client:
        zs = client.zero_shot_classify(NLI, TEXTS, LABELS, multi_label=True)
        want = srv.stub.ZeroShotClassify(pb.ZeroShotClassifyRequest(model=NLI, texts=TEXTS, candidate_labels=LABELS,
                                                                    multi_label=True), timeout=30)
        assert zs == want
        everything = client.classify_tokens(NER, TEXTS, ignore_labels=[])
        default = client.classify_tokens(NER, TEXTS)
        assert sum(len(r.entities) for r in everything.results) > sum(len(r.entities) for r in default.results)
        rr = client.rerank(RERANKER, QUERY, TEXTS, top_n=1, return_text=True)
        assert len(rr.results) == 1 and rr.results[0].text == TEXTS[rr.results[0].index]
    common = ["--address", target]
    assert call_main(["zero-shot", *common, "--model", NLI, "--text", TEXTS[0], "--label", "a", "--label", "b"]) == 0
    assert [x["label"] for x in json.loads(capsys.readouterr().out)["results"][0]["labels"]] in (["a", "b"],
                                                                                                 ["b", "a"])
    assert call_main(["classify-tokens", *common, "--model", NER, "--text", TEXTS[0], "--no-ignore",
                 "--aggregation-strategy", "simple"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["entities"]
    assert call_main(["rerank", *common, "--model", RERANKER, "--query", QUERY, "--text", "a", "--text", "b",
                 "--top-n", "1"]) == 0
    assert len(json.loads(capsys.readouterr().out)["results"]) == 1
    # the server's refusal, naming the field, as the gRPC status on stderr
    assert call_main(["zero-shot", *common, "--model", NLI, "--text", "x", "--label", " "]) == 1
    assert "candidate_labels[0]" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- load test

@pytest.mark.parametrize("scenario", ["zero-shot", "classify-tokens", "rerank"])
def test_load_test_scenario_per_task(world, tmp_path, scenario):
    srv = world[0]
    rc = loadtest_cli.main(["run", "--target", f"127.0.0.1:{srv.port}", "--metrics-url", "none", "--out",
                            str(tmp_path), "--no-progress", "--no-plots", "--scenario", scenario, "--requests", "3",
                            "--concurrency", "1"])
    assert rc == 0
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert "skipped" not in result and (result["successes"], result["errors"]) == (3, 0), result
