"""Classification scores through a real server equal transformers' text-classification pipeline's, for the
model shapes whose default function differs (issue 13 item 4): one label without ``problem_type`` (a
DeBERTa-v3 cross-encoder reranker: sigmoid, not a softmax over one logit), regression (the raw value),
multi-label (sigmoid per label), plain single-label (softmax); and a per-request ``function_to_apply``
override on each, compared with the pipeline's own ``function_to_apply``. The checkpoints are transformers'
``DebertaV2ForSequenceClassification`` random-initialised from a config and saved with ``save_pretrained``
(no hub); the pipeline runs locally on the same directory. One-label models are also served by the ONNX
backend, which shares the runner's post-processing.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.fake_serving import server_config  # noqa: E402
from fixtures.server import Running  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service.config import ModelConfig  # noqa: E402
from relserve.service.registry import build_runner  # noqa: E402

TEXTS = ["How tall is the tower?", "The film was a delight from start to finish.", "ok", "Der Service war schlecht."]
# name -> (labels, config overrides, the pipeline's default function for it)
SHAPES = {
    "one": (1, {}, "sigmoid"),  # num_labels 1, no problem_type: the cross-encoder reranker layout
    "reg": (1, {"problem_type": "regression"}, "none"),
    "multi": (("a", "b", "c"), {"problem_type": "multi_label_classification"}, "sigmoid"),
    "single": (("a", "b", "c"), {}, "softmax"),
}


@pytest.fixture(scope="module")
def served(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cls-functions")
    dirs = {name: make_deberta_checkpoint(root / name, oracle=True, tokenizer_dir=unigram_tokenizer_dir, labels=labels,
                                          init="matrices", seed=i, **over).path
            for i, (name, (labels, over, _)) in enumerate(SHAPES.items())}
    # parity with transformers: float32, never dtype auto's bfloat16
    # compute in-process: worker processes have their own tests (test_worker_process.py, test_worker_pool.py)
    common = dict(device="cpu", dtype="float32", max_seq_len=128, max_queue_delay=0.002, worker_process=False)
    runners = [build_runner(ModelConfig(name=name, path=d, **common)) for name, d in dirs.items()]
    runners.append(build_runner(ModelConfig(name="one-onnx", path=dirs["one"], backend="onnx",
                                            onnx_cache_dir=root / "onnx-cache", onnx_intra_op_threads=1, **common)))
    srv = Running(server_config(), runners)
    srv.wait_serving(timeout=150)
    yield srv, dirs
    srv.close()


def _pipeline(d, function: str | None):
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(d)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    clf = transformers.pipeline("text-classification", model=model, tokenizer=tok, device="cpu")
    kw = {} if function is None else {"function_to_apply": function}
    return [{r["label"]: r["score"] for r in row} for row in clf(TEXTS, top_k=None, **kw)]


def _served(srv, model: str, function: str = ""):
    reply = srv.stub.Classify(pb.ClassifyRequest(model=model, texts=TEXTS, top_k=0, function_to_apply=function),
                              timeout=60)
    out = []
    for res in reply.results:
        scores = [ls.score for ls in res.labels]
        assert scores == sorted(scores, reverse=True)  # best first, as the pipeline sorts
        out.append({ls.label: ls.score for ls in res.labels})
    return out


def _assert_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        np.testing.assert_allclose([g[k] for k in sorted(w)], [w[k] for k in sorted(w)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(SHAPES))
def test_default_function_matches_the_pipeline(served, name):
    srv, dirs = served
    got, want = _served(srv, name), _pipeline(dirs[name], None)
    _assert_close(got, want)
    if name == "one":  # the reported bug: a softmax over one logit made every score 1.0
        assert all(0.0 < row["LABEL_0"] < 1.0 for row in got) and len({row["LABEL_0"] for row in got}) > 1
    if name == "reg":  # the raw logit, not a sigmoid of it
        squashed = [row["LABEL_0"] for row in _pipeline(dirs[name], "sigmoid")]
        assert not np.allclose([row["LABEL_0"] for row in got], squashed, atol=1e-3)
    info = {m.name: m for m in srv.stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
    assert info[name].function_to_apply == SHAPES[name][2]


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("function", ["softmax", "sigmoid", "none"])
def test_function_to_apply_override_matches_the_pipeline(served, name, function):
    srv, dirs = served
    _assert_close(_served(srv, name, function), _pipeline(dirs[name], function))


def test_onnx_backend_scores_like_the_pipeline(served):
    srv, dirs = served
    _assert_close(_served(srv, "one-onnx"), _pipeline(dirs["one"], None))
    _assert_close(_served(srv, "one-onnx", "NONE"), _pipeline(dirs["one"], "none"))  # case-insensitive, as the pipeline


def test_unknown_function_is_invalid_argument(served):
    srv, _ = served
    with pytest.raises(grpc.RpcError) as err:
        srv.stub.Classify(pb.ClassifyRequest(model="one", texts=["x"], function_to_apply="relu"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "function_to_apply 'relu' is not one of softmax, sigmoid, none (or empty for the " \
                                  "model's default)"
