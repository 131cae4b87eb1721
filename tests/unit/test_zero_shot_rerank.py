"""Zero-shot and rerank request checks and score rules without a model (a fake runner whose batcher must never
be reached): which head output is the entailment / relevance, the pipeline's two score rules, the checks that need
the model's head (no entailment label, no relevance label, not a sequence classifier), and the template rules.
The same functions against real checkpoints and transformers: tests/models/test_zero_shot_parity.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from relserve.service.backends.base import TASK_CLASSIFICATION, TASK_QA
from relserve.service.config import ModelConfig
from relserve.service.errors import InvalidArgument, Unavailable
from relserve.service.tasks import rerank as rr
from relserve.service.tasks import zero_shot as zs


class FakeRunner:
    """A ready model with ``labels`` on ``task``; its batcher fails the test if anything reaches it."""

    def __init__(self, labels=("contradiction", "neutral", "entailment"), task=TASK_CLASSIFICATION, ready=True,
                 **config):
        self.name, self.task, self.ready = "m", task, ready
        self.config = ModelConfig(name="m", path=".", **config)
        self.meta = SimpleNamespace(labels=tuple(labels), task=task, problem_type=None)

    def check_ready(self):
        if not self.ready:
            raise Unavailable("model 'm' is not ready (state: loading); retry later")
        return SimpleNamespace()  # no reserve/submit: touching the batcher raises AttributeError


def test_entailment_and_relevance_labels():
    assert zs.entailment_index(("contradiction", "neutral", "entailment")) == 2
    assert zs.entailment_index(("ENTAILMENT", "neutral", "contradiction")) == 0
    assert zs.entailment_index(("Entails", "not")) == 0
    assert zs.entailment_index(("a", "b", "non-entailment")) is None
    assert rr.relevance_index(("LABEL_0",)) == 0
    assert rr.relevance_index(("not_relevant", "relevant")) == 1
    assert rr.relevance_index(("irrelevant", "Relevance", "x")) == 1
    assert rr.relevance_index(("negative", "positive")) == 1
    assert rr.relevance_index(("LABEL_0", "LABEL_1")) == 1
    assert rr.relevance_index(("a", "b", "c")) is None


def test_the_pipelines_two_score_rules():
    logits = np.array([[1.0, 0.0, 3.0], [0.5, 2.0, -1.0]])  # two labels' pairs, [contradiction, neutral, entail]
    np.testing.assert_allclose(zs.label_scores(logits, 2, multi_label=False), np.exp([3, -1]) / np.exp([3, -1]).sum())
    np.testing.assert_allclose(zs.label_scores(logits, 2, multi_label=True),
                               [np.exp(3) / (np.exp(1) + np.exp(3)), np.exp(-1) / (np.exp(0.5) + np.exp(-1))])
    # entailment first: contradiction is the last label
    np.testing.assert_allclose(zs.label_scores(logits, 0, multi_label=True),
                               [np.exp(1) / (np.exp(1) + np.exp(3)), np.exp(0.5) / (np.exp(0.5) + np.exp(-1))])
    # one label is scored against contradiction whatever multi_label says
    np.testing.assert_allclose(zs.label_scores(logits[:1], 2, multi_label=False), [np.exp(3) / (np.exp(1) + np.exp(3))])


def test_relevance_scores():
    one = np.array([[0.0], [2.0]])
    np.testing.assert_allclose(rr.relevance_scores(one, 0, "regression", False), [0.5, 1 / (1 + np.exp(-2))])
    np.testing.assert_allclose(rr.relevance_scores(one, 0, None, True), [0.0, 2.0])
    two = np.array([[0.0, 1.0], [3.0, -1.0]])
    np.testing.assert_allclose(rr.relevance_scores(two, 1, None, False), np.exp(two[:, 1]) / np.exp(two).sum(1))
    np.testing.assert_allclose(rr.relevance_scores(two, 1, "multi_label_classification", False),
                               1 / (1 + np.exp(-two[:, 1])))
    np.testing.assert_allclose(rr.relevance_scores(two, 1, None, True), [1.0, -1.0])


def test_validated_requests():
    runner = FakeRunner()
    req = zs.validate_zero_shot(runner, ("a text",), "sport, politics ,, cinema", "", 1)
    assert req == zs.ZeroShotRequest(["a text"], ["sport", "politics", "cinema"], zs.DEFAULT_HYPOTHESIS_TEMPLATE, True)
    assert zs.validate_zero_shot(runner, ["t"], ["x"], "{{braces}} {}", False).hypothesis_template == "{{braces}} {}"
    req = rr.validate_rerank(FakeRunner(("LABEL_0",)), "q", ("a", "b"), top_n=np.int64(5), return_text=True)
    assert req == rr.RerankRequest("q", ["a", "b"], 5, False, True, True)


def test_refusals_that_need_the_head():
    with pytest.raises(InvalidArgument, match=r"no entailment label \(labels: \['a', 'b', 'c'\]\)"):
        zs.validate_zero_shot(FakeRunner(("a", "b", "c")), ["t"], ["x"], None, False)
    with pytest.raises(InvalidArgument, match=r"3 labels \['a', 'b', 'c'\] and none of them names relevance"):
        rr.validate_rerank(FakeRunner(("a", "b", "c")), "q", ["t"])
    with pytest.raises(InvalidArgument, match="is a question-answering model; rerank needs a sequence class"):
        rr.validate_rerank(FakeRunner(task=TASK_QA), "q", ["t"])
    with pytest.raises(InvalidArgument, match="zero-shot classification needs a sequence classification model"):
        zs.validate_zero_shot(FakeRunner(task=TASK_QA), ["t"], ["x"], None, False)
    with pytest.raises(Unavailable, match="not ready"):
        zs.validate_zero_shot(FakeRunner(ready=False), ["t"], ["x"], None, False)


@pytest.mark.parametrize("call,match", [
    (lambda r: zs.validate_zero_shot(r, ["t"], ["x", 3], None, False), r"candidate_labels\[1\] must be a string"),
    (lambda r: zs.validate_zero_shot(r, ["t"], ["x"], 5, False), "hypothesis_template must be a string"),
    (lambda r: zs.validate_zero_shot(r, ["t"], ["x"], "{", False), "hypothesis_template '{' is not a valid"),
    (lambda r: zs.validate_zero_shot(r, ["t"], ["x"], "{{}}", False), "exactly one {}"),
    (lambda r: zs.validate_zero_shot(r, ["t"], ["x"], "{!r}", False), "exactly one {}"),
    (lambda r: zs.validate_zero_shot(r, ["t"], ["x"], "{:>9}", False), "exactly one {}"),
    (lambda r: zs.validate_zero_shot(r, ["t"], " , ", None, False), "candidate_labels is empty"),
    (lambda r: rr.validate_rerank(r, "q", ["t"], top_n=True), "top_n True must be a non-negative integer"),
    (lambda r: rr.validate_rerank(r, "q", ["t"], top_n="2"), "top_n '2' must be a non-negative integer"),
    (lambda r: rr.validate_rerank(r, 5, ["t"]), "query must be a string"),
    (lambda r: rr.validate_rerank(r, "q", ["t", None]), r"texts\[1\] must be a string"),
])
def test_malformed_fields(call, match):
    with pytest.raises(InvalidArgument, match=match):
        call(FakeRunner())
