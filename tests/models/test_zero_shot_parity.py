"""Zero-shot classification and rerank through a real runner (``relserve.service.tasks.zero_shot`` /
``rerank`` called in-process on a started ``ModelRunner``: tokenizer, batcher, backend), against transformers.

* Zero-shot equals ``transformers.pipeline("zero-shot-classification", model=hf_model, tokenizer=hf_tokenizer)``
  within 1e-5, labels in the same order, for ``multi_label`` False and True and a custom template, on random NLI
  checkpoints of DeBERTa v1 (byte-level BPE ``tokenizer.json``), v2 (Unigram ``tokenizer.json``; its labels put
  entailment first, so contradiction is the last label, the pipeline's other branch) and v3 (``spm.model``
  only), on the torch backend, and v3 on the ONNX backend (the task code is backend-blind: the backend only
  returns each pair's logits). v3 runs a text longer than the window: the pipeline's ``only_first`` truncation,
  with its tokenizer's ``model_max_length`` set to the runner's window.
* v1: transformers 5 ``DebertaTokenizer`` builds pairs as ``[CLS] a [SEP] [SEP] b [SEP]``; DeBERTa v1 was trained
  (and relserve encodes) ``[CLS] a [SEP] b [SEP]`` (see test_deberta_v1_parity.py), so the pipeline gets the same
  BPE with that pair template.
* Rerank equals sigmoid / raw logits of transformers' one-label model on the (query, text) pairs, and an NLI
  head's entailment probability.
* Two concurrent zero-shot requests share one batch (``relserve_batch_size`` observes the pairs of both once).
* Every refusal (InvalidArgument) leaves the batcher untouched: no execution, nothing queued.
* A bfloat16 model answers a zero-shot request.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from prometheus_client import REGISTRY  # noqa: E402

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.deberta_v1 import make_v1_checkpoint, train_bpe_tokenizer  # noqa: E402
from fixtures.runners import started_runners  # noqa: E402
from relserve.service.config import ModelConfig  # noqa: E402
from relserve.service.errors import InvalidArgument  # noqa: E402
from relserve.service.registry import build_runner  # noqa: E402
from relserve.service.tasks import rerank as rr  # noqa: E402
from relserve.service.tasks import zero_shot as zs  # noqa: E402

NLI = ["contradiction", "neutral", "entailment"]
TEXTS = ["The film was a delight from start to finish.", "Der Service war schlecht, aber das Essen gut.", "ok"]
LABELS = ["cinema", "food and drink", "politics", "sport"]
LONG = "The Broncos defeated the Pittsburgh Steelers in the divisional round and went on to win. " * 8
WINDOW = 64
COMMON = dict(device="cpu", dtype="float32", max_seq_len=WINDOW, max_queue_delay=0.0, worker_process=False,
              warmup=False)


def _v1_pipeline_tokenizer(directory):
    """The checkpoint's BPE with the v1 training pair template ``[CLS] a [SEP] b [SEP]``."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                            special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]",
                                                pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")


@pytest.fixture(scope="module")
def world(unigram_tokenizer_dir, spm_tokenizer_dir, tmp_path_factory):
    """Checkpoints, their oracles, and started runners on one event loop (closed at the end)."""
    root = tmp_path_factory.mktemp("zero-shot")
    bpe = train_bpe_tokenizer(root / "bpe", form="json", vocab_size=800)
    v1 = make_v1_checkpoint(root / "v1", tokenizer_dir=bpe, vocab_size=800, num_labels=3, seed=1,
                            id2label=dict(enumerate(NLI)), label2id={n: i for i, n in enumerate(NLI)})
    v2 = make_deberta_checkpoint(root / "v2", version="v2", oracle=True, tokenizer_dir=unigram_tokenizer_dir,
                                 labels=list(reversed(NLI)), init="matrices", seed=2)
    v3 = make_deberta_checkpoint(root / "v3", version="v3", oracle=True, tokenizer_dir=spm_tokenizer_dir,
                                 labels=NLI, init="matrices", seed=3)
    ce = make_deberta_checkpoint(root / "ce", version="v3", oracle=True, tokenizer_dir=unigram_tokenizer_dir,
                                 labels=1, init="matrices", seed=4)
    auto = transformers.AutoTokenizer.from_pretrained
    oracles = {"v1": (v1.model, _v1_pipeline_tokenizer(v1.path)), "v2": (v2.model, auto(str(v2.path))),
               "v3": (v3.model, auto(str(v3.path))), "ce": (ce.model, auto(str(ce.path)))}
    configs = [ModelConfig(name="v1", path=v1.path, **COMMON), ModelConfig(name="v2", path=v2.path, **COMMON),
               ModelConfig(name="v3", path=v3.path, **COMMON), ModelConfig(name="ce", path=ce.path, **COMMON),
               ModelConfig(name="v3-onnx", path=v3.path, backend="onnx", onnx_cache_dir=root / "onnx",
                           onnx_intra_op_threads=1, **COMMON),
               # one batch of 8 once 8 units wait (the two requests of the sharing test), however long it takes
               ModelConfig(name="v3-shared", path=v3.path, **dict(COMMON, max_batch_size=8, max_queue_delay=30.0))]
    with started_runners(configs) as (loop, runners):
        yield loop, runners, oracles


def _zero_shot(world, name, texts, labels, template=None, multi_label=False):
    loop, runners, _ = world
    runner = runners[name]
    request = zs.validate_zero_shot(runner, texts, labels, template, multi_label)
    items, timings = loop.run_until_complete(zs.zero_shot(runner, request, None))
    assert timings.units == len(texts) * len(labels)
    return items


@pytest.mark.parametrize("name,oracle", [("v1", "v1"), ("v2", "v2"), ("v3", "v3"), ("v3-onnx", "v3")])
def test_zero_shot_equals_the_pipeline(world, name, oracle):
    model, tokenizer = world[2][oracle]
    assert world[1][name].meta.backend == ("onnxruntime" if name.endswith("onnx") else "torch")
    tokenizer.model_max_length = WINDOW  # the runner's window: the pipeline truncates only_first to it
    pipe = transformers.pipeline("zero-shot-classification", model=model, tokenizer=tokenizer, device="cpu")
    texts = TEXTS + [LONG] if oracle == "v3" else TEXTS
    for template, multi_label in ((None, False), (None, True), ("Dieser Text handelt von {}.", False)):
        kw = {} if template is None else {"hypothesis_template": template}
        want = pipe(texts, candidate_labels=LABELS, multi_label=multi_label, **kw)
        got = _zero_shot(world, name, texts, LABELS, template, multi_label)
        for g, w in zip(got, want, strict=True):
            assert g.sequence == w["sequence"]
            assert g.labels == w["labels"], (template, multi_label)
            np.testing.assert_allclose(g.scores, w["scores"], rtol=0, atol=1e-5)
            assert g.truncated == (g.sequence == LONG)
        if not multi_label:
            assert all(abs(sum(g.scores) - 1) < 1e-6 for g in got)
    # one candidate label: the pipeline scores it against contradiction, as multi_label
    want = pipe(TEXTS[0], candidate_labels=["cinema"])
    got = _zero_shot(world, name, TEXTS[:1], ["cinema"])[0]
    np.testing.assert_allclose(got.scores, want["scores"], rtol=0, atol=1e-5)


def test_zero_shot_pairs_of_two_requests_share_one_batch(world):
    loop, runners, _ = world
    runner = runners["v3-shared"]

    def sample(stat):
        return REGISTRY.get_sample_value(f"relserve_batch_size_{stat}", {"model": "v3-shared"}) or 0.0

    before = sample("count"), sample("sum"), runner.batcher.executions
    a = zs.validate_zero_shot(runner, TEXTS[:2], LABELS[:3], None, False)  # 6 pairs
    b = zs.validate_zero_shot(runner, TEXTS[2:], LABELS[:2], None, True)  # 2 pairs

    async def both():
        return await asyncio.gather(zs.zero_shot(runner, a, None), zs.zero_shot(runner, b, None))

    (items_a, _), (items_b, _) = loop.run_until_complete(both())
    assert [len(i.labels) for i in items_a + items_b] == [3, 3, 2]
    # one backend call of 8 pairs: the batch-size histogram counts pairs, once
    assert (sample("count") - before[0], sample("sum") - before[1]) == (1, 8)
    assert runner.batcher.executions - before[2] == 1


def test_rerank_equals_the_models_logits(world):
    loop, runners, oracles = world
    query = "Who won the game?"
    texts = ["The Broncos won the game.", "Der Service war schlecht.", "ok", LONG]
    for name in ("ce", "v3"):
        model, tokenizer = oracles[name]
        tokenizer.model_max_length = WINDOW
        enc = tokenizer([query] * len(texts), texts, truncation=True, max_length=WINDOW, padding=True,
                        return_tensors="pt")
        with torch.no_grad():
            logits = model(**enc).logits.double().numpy()
        for raw in (False, True):
            request = rr.validate_rerank(runners[name], query, texts, raw_scores=raw)
            items, timings = loop.run_until_complete(rr.rerank(runners[name], request, None))
            assert timings.units == len(texts)
            if name == "ce":
                want = logits[:, 0] if raw else 1 / (1 + np.exp(-logits[:, 0]))
            else:  # an NLI head: the entailment label's logit, or its softmax probability
                want = logits[:, 2] if raw else np.exp(logits[:, 2]) / np.exp(logits).sum(1)
            assert [i.index for i in items] == list(np.argsort(-want, kind="stable"))
            np.testing.assert_allclose([i.score for i in items], np.sort(want)[::-1], rtol=0, atol=1e-5)
            assert all(i.text is None for i in items)
    request = rr.validate_rerank(runners["ce"], query, texts, top_n=2, return_text=True)
    items, _ = loop.run_until_complete(rr.rerank(runners["ce"], request, None))
    assert len(items) == 2 and all(i.text == texts[i.index] for i in items)


def _refused(world, name, call, match):
    loop, runners, _ = world
    batcher = runners[name].batcher
    executions = batcher.executions
    with pytest.raises(InvalidArgument, match=match):
        result = call(runners[name])
        if asyncio.iscoroutine(result):
            loop.run_until_complete(result)
    assert (batcher.executions, batcher.queue_depth, batcher.reserved) == (executions, 0, 0)


def test_refusals_cost_no_model_work(world):
    v = zs.validate_zero_shot
    many = dict(max_request_texts=4, max_candidate_labels=3, max_request_chars=200)
    loop, runners, _ = world
    import dataclasses

    runner = runners["v3"]
    runner.config = dataclasses.replace(runner.config, **many)
    try:
        _refused(world, "v3", lambda r: v(r, ["a"] * 5, ["x"], None, False), r"5 texts.*max_request_texts")
        _refused(world, "v3", lambda r: v(r, ["a"], list("wxyz"), None, False), r"4 labels.*max_candidate_labels")
        _refused(world, "v3", lambda r: v(r, ["a"] * 2, list("xyz"), None, False),
                 r"6 \(text, hypothesis\) pairs.*max_request_texts")
        _refused(world, "v3", lambda r: v(r, ["a" * 40] * 2, ["x", "y"], None, False),
                 r"characters.*max_request_chars")
        _refused(world, "v3", lambda r: rr.validate_rerank(r, "q" * 100, ["a", "b"]), r"max_request_chars")
    finally:
        runner.config = dataclasses.replace(runner.config, max_request_texts=256, max_candidate_labels=64,
                                            max_request_chars=1_000_000)
    _refused(world, "v3", lambda r: v(r, ["a"], [], None, False), "candidate_labels is empty")
    _refused(world, "v3", lambda r: v(r, [], ["x"], None, False), "texts is empty")
    _refused(world, "v3", lambda r: v(r, ["a"], ["x", " \u200b"], None, False), r"candidate_labels\[1\] is empty")
    _refused(world, "v3", lambda r: v(r, ["a", "  "], ["x"], None, False), r"texts\[1\] is empty")
    for template in ("no slot", "{} and {}", "{label}", "{0}", "open {"):
        _refused(world, "v3", lambda r: v(r, ["a"], ["x"], template, False), "hypothesis_template")
    _refused(world, "ce", lambda r: v(r, ["a"], ["x"], None, False), r"no entailment label \(labels: \['LABEL_0'\]")
    # found only once tokenized: before any unit is submitted, the places released
    long_label = "word " * WINDOW
    _refused(world, "v3", lambda r: zs.zero_shot(r, v(r, [LONG], ["x", long_label], None, False), None),
             r"candidate_labels\[1\]: its hypothesis has \d+ tokens")
    _refused(world, "ce", lambda r: rr.rerank(r, rr.validate_rerank(r, "q", ["a", LONG], truncate=False), None),
             r"texts\[1\]: the \(query, text\) pair is longer than the model's 64-token window")
    _refused(world, "ce", lambda r: rr.validate_rerank(r, "q", []), "texts is empty")
    _refused(world, "ce", lambda r: rr.validate_rerank(r, "q", ["a"] * 257), r"257 entries.*max_rerank_texts")
    _refused(world, "ce", lambda r: rr.validate_rerank(r, "q", ["a"], top_n=-1), "top_n")
    _refused(world, "ce", lambda r: rr.validate_rerank(r, " ", ["a"]), "query is empty")
    _refused(world, "ce", lambda r: rr.validate_rerank(r, "q", ["a", ""]), r"texts\[1\] is empty")


def test_a_bfloat16_model_answers_zero_shot(world, monkeypatch):
    from relserve.service.cpu_features import CPU_BF16_ENV

    loop, runners, _ = world
    monkeypatch.setenv(CPU_BF16_ENV, "assume")
    cfg = ModelConfig(name="v3-bf16", path=runners["v3"].config.path, **dict(COMMON, dtype="bfloat16"))
    runner = build_runner(cfg)

    async def run():
        await asyncio.to_thread(runner.load)
        await runner.start()
        try:
            request = zs.validate_zero_shot(runner, TEXTS, LABELS, None, False)
            return runner.meta.dtype, await zs.zero_shot(runner, request, None)
        finally:
            await runner.close()

    dtype, (items, _) = loop.run_until_complete(run())
    assert dtype == "bfloat16"
    assert [sorted(i.labels) for i in items] == [sorted(LABELS)] * len(TEXTS)
    assert all(abs(sum(i.scores) - 1) < 1e-3 for i in items)
