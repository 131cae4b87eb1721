"""Token classification through a real runner (``relserve.service.tasks.token_classification`` called in-process
on a started ``ModelRunner``: tokenizer, batcher, backend), against ``transformers.pipeline("token-classification")``.

* Every aggregation strategy (none / simple / first / average / max), with the default ``ignore_labels`` and with
  none ignored, equals the pipeline on random checkpoints of DeBERTa v1 (byte-level BPE ``tokenizer.json``), v2
  (Unigram ``tokenizer.json``), v3 (``spm.model`` only, transformers 5's normaliser as the oracle's), v3 on the
  ONNX backend (a graph written by ``export_checkpoint``, whose parity report is checked: C01's lengths) and v2 in
  a worker process: same labels, scores within 1e-5, and offsets equal to the pipeline's once those are trimmed
  of whitespace (the pipeline's offsets of a word-initial ``▁`` piece include the space before it; relserve's
  never do). ``word`` is ``text[start:end]`` (the pipeline's is decoded from tokens, e.g. ``"▁Berlin"`` ->
  ``"Berlin"``, ``"[UNK]"`` for a character out of the vocabulary, so it is not compared).
* The pipeline's offsets also cover a text-initial bare ``▁`` piece (it maps it onto the first character);
  relserve gives that piece no width, so an entity of that piece alone (``none``, or a group of it) is not
  reported: the oracle's such entities are left out of the comparison.
* A text longer than the window runs as windows overlapping by ``stride`` and is merged as the pipeline merges
  its chunks (same window count as the tokenizer's overflow).
* The bfloat16 agreement gate decides on a token head, agreement counted per token.
* Twins of the QA offset cases C04-C07 (../shared/cases.md): CJK text, double spaces, ellipses, whitespace never
  at an entity's ends.
* Refusals name the field and cost no model work.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fixtures.deberta import NER_LABELS, make_deberta_checkpoint  # noqa: E402
from fixtures.deberta_v1 import make_v1_checkpoint, train_bpe_tokenizer  # noqa: E402
from fixtures.runners import started_runners  # noqa: E402
from relserve.models.onnx.export import export_checkpoint  # noqa: E402
from relserve.service.backends.precision import CALIBRATION_FILE  # noqa: E402
from relserve.service.config import ModelConfig  # noqa: E402
from relserve.service.errors import InvalidArgument  # noqa: E402
from relserve.service.registry import build_runner  # noqa: E402
from relserve.service.tasks import token_classification as tc  # noqa: E402
from relserve.service.tasks.text import is_blank_char  # noqa: E402

TEXTS = [
    "My name is Wolfgang and I live in Berlin.",
    "Angela Merkel met Emmanuel Macron in Paris, then flew to New York City on Monday.",
    "Hello\u00a0world and\u3000Ｆｕｌｌ width 🙂 ok, Straße in Zürich!",
    "ok",
]
CJK = "東京に住む山田太郎さんは、大阪で John Smith に会った。"
DOUBLE = "John  Smith  lives  in  Paris  with  Marie  Curie."
ELLIPSES = "Wait... Marie Curie…really? Berlin... Paris…London"
LONG = ("The Broncos defeated the Pittsburgh Steelers in Denver and went on to meet Carolina in Santa Clara. "
        * 12).strip()
WINDOW = 128  # every text but LONG fits one window (the pipeline without a stride truncates)
STRATEGIES = tc.AGGREGATION_STRATEGIES
COMMON = dict(device="cpu", dtype="float32", max_seq_len=WINDOW, max_queue_delay=0.0, worker_process=False,
              warmup=False)


@pytest.fixture(scope="module")
def world(unigram_tokenizer_dir, spm_tokenizer_dir, tmp_path_factory):
    """Checkpoints, their pipelines, and started runners on one event loop (closed at the end)."""
    root = tmp_path_factory.mktemp("token-classification")
    bpe = train_bpe_tokenizer(root / "bpe", form="json", vocab_size=800)
    v1 = make_v1_checkpoint(root / "v1", task="token-classification", tokenizer_dir=bpe, vocab_size=800, seed=1)
    v2 = make_deberta_checkpoint(root / "v2", task="token-classification", version="v2", oracle=True,
                                 tokenizer_dir=unigram_tokenizer_dir, init="matrices", seed=2)
    v3 = make_deberta_checkpoint(root / "v3", task="token-classification", version="v3", oracle=True,
                                 tokenizer_dir=spm_tokenizer_dir, init="matrices", seed=3)
    exported = export_checkpoint(v3.path, root / "v3-onnx", progress=None)
    pipes = {}
    for name, ckpt in (("v1", v1), ("v2", v2), ("v3", v3)):
        tok = transformers.AutoTokenizer.from_pretrained(str(ckpt.path))
        tok.model_max_length = WINDOW  # the runner's window: the pipeline's chunks with a stride
        pipes[name] = transformers.pipeline("token-classification", model=ckpt.model, tokenizer=tok, device="cpu")
    v5 = dict(spm_normalization="transformers5")  # the oracle's normaliser for an spm.model-only checkpoint
    configs = [ModelConfig(name="v1", path=v1.path, **COMMON), ModelConfig(name="v2", path=v2.path, **COMMON),
               ModelConfig(name="v3", path=v3.path, **COMMON, **v5),
               ModelConfig(name="v3-onnx", path=v3.path, backend="onnx", onnx_path=root / "v3-onnx",
                           onnx_intra_op_threads=1, **COMMON, **v5),
               ModelConfig(name="v2-worker", path=v2.path, **dict(COMMON, worker_process=True))]
    with started_runners(configs) as (loop, runners):
        yield loop, runners, pipes, exported


def _classify(world, name, texts, strategy=None, ignore_labels=None, stride=None):
    loop, runners, _, _ = world
    request = tc.validate_token_classification(runners[name], texts, strategy, ignore_labels, stride)
    items, _ = loop.run_until_complete(tc.classify_tokens(runners[name], request, None))
    return items


def _trimmed(text, start, end):
    while start < end and is_blank_char(text[start]):
        start += 1
    while end > start and is_blank_char(text[end - 1]):
        end -= 1
    return start, end


def _expected(pipe, text, strategy, ignore_labels, stride=None):
    """The pipeline's entities as relserve reports them: offsets trimmed, blank ones (and those of a text-initial
    bare ``▁`` piece, which the pipeline maps onto the first character) left out."""
    kw = {} if ignore_labels is None else {"ignore_labels": ignore_labels}
    if stride is not None:
        kw["stride"] = stride
    out = []
    for e in pipe(text, aggregation_strategy=strategy, **kw):
        s, t = _trimmed(text, int(e["start"]), int(e["end"]))
        if s == t or (e["word"] in ("▁", "") and int(e["start"]) == 0):
            continue
        label = e["entity"] if strategy == "none" else e["entity_group"]
        out.append((label, s, t, float(e["score"]), e.get("index")))
    return out


def _check(world, name, oracle, texts, strategy, ignore_labels=None, stride=None):
    pipe = world[2][oracle]
    items = _classify(world, name, texts, strategy, ignore_labels, stride)
    for text, item in zip(texts, items, strict=True):
        want = _expected(pipe, text, strategy, ignore_labels, stride)
        got = [(e.entity if strategy == "none" else e.entity_group, e.start, e.end, e.score, e.index)
               for e in item.entities]
        assert [(g[0], g[1], g[2], g[4]) for g in got] == [(w[0], w[1], w[2], w[4]) for w in want], (name, strategy,
                                                                                                    text)
        np.testing.assert_allclose([g[3] for g in got], [w[3] for w in want], rtol=0, atol=1e-5)
        for e in item.entities:
            assert e.word == text[e.start:e.end] and e.word and e.word == e.word.strip()
            assert (e.entity is None) == (strategy != "none") and (e.entity_group is None) == (strategy == "none")
    return items


@pytest.mark.parametrize("name,oracle", [("v1", "v1"), ("v2", "v2"), ("v3", "v3"), ("v3-onnx", "v3"),
                                         ("v2-worker", "v2")])
def test_every_strategy_equals_the_pipeline(world, name, oracle):
    texts = TEXTS + [CJK, ELLIPSES] if name in ("v1", "v2", "v3") else TEXTS
    for strategy in STRATEGIES:
        _check(world, name, oracle, texts, strategy)
        if strategy in ("none", "first"):
            _check(world, name, oracle, texts, strategy, ignore_labels=[])
    # ignore_labels by label: with none the full label, otherwise the group's tag
    _check(world, name, oracle, TEXTS[:2], "none", ignore_labels=["O", "B-PER", "I-LOC"])
    _check(world, name, oracle, TEXTS[:2], "simple", ignore_labels=["PER"])


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_a_long_text_runs_as_stride_windows_merged_as_the_pipeline(world, name):
    tok = world[2][name].tokenizer
    for stride in (8, 40):
        chunks = len(tok(LONG, truncation=True, max_length=WINDOW, stride=stride,
                         return_overflowing_tokens=True)["input_ids"])
        assert chunks >= 3
        for strategy in ("simple", "first", "average", "max"):
            (item,) = _check(world, name, name, [LONG], strategy, stride=stride)
            assert item.num_windows == chunks
            assert item.num_tokens == sum(len(ids) for ids in tok(LONG, truncation=True, max_length=WINDOW,
                                                                  stride=stride,
                                                                  return_overflowing_tokens=True)["input_ids"])
    # with none (the pipeline refuses a stride there) each token is reported once, at its position in the text
    (item,) = _classify(world, name, [LONG], "none", ignore_labels=[], stride=16)
    _, offsets = world[1][name].meta.tokenizer.tokenize(LONG)
    assert item.num_windows > 1
    assert [e.index for e in item.entities] == [i + 1 for i, (s, t) in enumerate(offsets) if LONG[s:t].strip()]


def test_windows_are_the_tokenizers_overflow(world):
    """``window_starts`` equals the ``tokenizers`` library's overflowing windows (first token of each, by its
    offset) over many lengths, windows and strides, the last window reaching the last token."""
    from relserve.models.token_entities import window_count, window_starts

    tok = world[2]["v2"].tokenizer
    words = LONG.split()
    for n_words in (1, 5, 13, 40):
        text = " ".join(words[:n_words])
        offsets = [tuple(o) for o in tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
        for room in (4, 9):
            for stride in (0, 1, room // 2):
                enc = tok(text, truncation=True, max_length=room + 2, stride=stride, return_overflowing_tokens=True,
                          return_offsets_mapping=True)
                firsts = [offsets.index(tuple(m[1])) for m in enc["offset_mapping"]]
                assert window_starts(len(offsets), room, stride) == firsts, (n_words, room, stride)
                assert window_count(len(offsets), room, stride) == len(firsts)


def test_onnx_graph_has_a_dynamic_sequence_axis_and_passes_parity(world):
    import onnx

    exported = world[3]
    parity = exported.report["parity"]
    assert parity["passed"] and parity["max_abs_diff"] <= 1e-4, parity
    lengths = {n for case in parity["cases"] for n in case["lengths"]}
    assert {3, 40, 300} <= lengths and any(len(set(c["lengths"])) > 1 for c in parity["cases"])  # padded batch
    graph = onnx.load(exported.graph, load_external_data=False).graph
    (out,) = graph.output
    dims = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
    assert out.name == "logits" and dims[1] == "sequence" and dims[2] == len(NER_LABELS), dims


def test_case_C04_twin_entities_come_only_from_text_tokens_cjk(world):
    """C04's twin: every entity is a substring of the text with matching offsets, never a special token; CJK text
    without spaces is one pipeline "word" for first / average / max."""
    for name in ("v2", "v3"):
        for strategy in STRATEGIES:
            (item,) = _check(world, name, name, [CJK], strategy, ignore_labels=[])
            assert all(0 <= e.start < e.end <= len(CJK) and "[" not in e.word for e in item.entities)
            if strategy in ("first", "average", "max"):  # no space before 大阪: fused with its neighbours
                assert any(e.start <= CJK.index("大阪") < e.end for e in item.entities)


def test_case_C05_twin_nothing_to_report_double_spaces(world):
    """C05's twin: when every label is ignored the reply is well-formed and empty; double spaces change nothing
    in the offsets the pipeline reports (trimmed)."""
    for name in ("v2", "v3"):
        for strategy in STRATEGIES:
            _check(world, name, name, [DOUBLE], strategy)
            (item,) = _classify(world, name, [DOUBLE], strategy, ignore_labels=list(NER_LABELS) + ["PER", "LOC"])
            assert item.entities == [] and item.num_windows == 1 and item.num_tokens > 2


def test_case_C06_twin_spans_ordered_and_bounded_ellipses(world):
    """C06's twin: entities are in text order with start < end, ellipses (``...`` and ``…``) in the text; word
    strategies never overlap (the byte-level tokens of one ``…`` share its offsets, so per-token entities of v1
    may, as the pipeline's do)."""
    for name in ("v1", "v2", "v3"):
        for strategy in STRATEGIES:
            (item,) = _check(world, name, name, [ELLIPSES], strategy, ignore_labels=[])
            spans = [(e.start, e.end) for e in item.entities]
            assert all(s < t for s, t in spans) and spans == sorted(spans)
            if strategy in ("first", "average", "max"):
                assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_case_C07_twin_entities_never_begin_or_end_with_whitespace(world):
    """C07's twin: SentencePiece offsets of ``▁Berlin`` include the space before it (the pipeline reports them);
    relserve's entity starts at the word, with NBSP, ideographic space and double spaces too."""
    text = "I live in  Berlin\u00a0and\u3000Paris"
    pipe = world[2]["v2"]
    raw = pipe(text, aggregation_strategy="none", ignore_labels=[])
    assert any(text[e["start"]].isspace() for e in raw)  # the oracle's offsets include the space
    for strategy in STRATEGIES:
        (item,) = _check(world, "v2", "v2", [text], strategy, ignore_labels=[])
        assert all(not e.word[0].isspace() and not e.word[-1].isspace() for e in item.entities)


def test_bfloat16_gate_decides_on_a_token_head(world, tmp_path, monkeypatch, unigram_tokenizer_dir):
    """A token head whose labels 0 and 1 are ~1e-4 apart on every token: bfloat16 flips many tokens, the gate
    counts the tokens that keep their label (equal to an independent count) and keeps float32."""
    from relserve.service.backends.padding import pad_batch

    d = make_deberta_checkpoint(tmp_path / "tied", task="token-classification", tokenizer_dir=unigram_tokenizer_dir,
                                init="matrices", seed=5).path
    from relserve.models.checkpoint import load_checkpoint, save_checkpoint

    loaded = load_checkpoint(d)
    head = loaded.model.classifier
    with torch.no_grad():
        head.weight[1] = head.weight[0] + 1e-4 * torch.randn_like(head.weight[0])
        head.bias[1] = head.bias[0]
        head.weight[2:] -= 50.0  # the other labels out of the running
    save_checkpoint(loaded.model, loaded.config, d, tokenizer_dir=unigram_tokenizer_dir)
    texts = [f"Text {i}: Angela Merkel met Emmanuel Macron in Paris on day {i}." for i in range(200)]
    (d / CALIBRATION_FILE).write_text("\n".join(json.dumps({"text": t}) for t in texts), encoding="utf-8")
    monkeypatch.setenv("RELSERVE_CPU_BF16", "assume")
    r = build_runner(ModelConfig(name="tied", path=d, device="cpu", dtype="auto", max_seq_len=WINDOW,
                                 worker_process=False, onnx_cache_dir=tmp_path / "cache"))
    r.load()
    reason = r.info().dtype_reason
    assert r.info().dtype == "float32" and "but bfloat16 failed the agreement gate on" in reason, reason
    m = re.search(r"(\d+) items of .*: agreement ([0-9.]+)", reason)
    tok = loaded.tokenizer
    encodings = tok.batch_encode(texts, None, max_length=WINDOW)
    ids, mask, _ = pad_batch(encodings, 0)
    model = load_checkpoint(d).model
    with torch.inference_mode():
        fp32 = model(torch.from_numpy(ids), torch.from_numpy(mask)).argmax(-1)
        bf16 = model.to(torch.bfloat16)(torch.from_numpy(ids), torch.from_numpy(mask)).argmax(-1)
    real = torch.from_numpy(mask).bool()
    real[:, 0] = False
    real[torch.arange(len(encodings)), torch.tensor([len(e.input_ids) - 1 for e in encodings])] = False
    assert int(m.group(1)) == int(real.sum())  # one gate item per content token
    agreement = float((fp32 == bf16)[real].float().mean())
    assert float(m.group(2)) == pytest.approx(agreement, abs=2e-3) and agreement < 0.99


def test_refusals_name_the_field_and_cost_no_model_work(world):
    loop, runners, _, _ = world
    r = runners["v2"]
    cases = [
        (dict(texts=["x"], aggregation_strategy="mean"), "aggregation_strategy"),
        (dict(texts=["x"], stride=-1), "stride"),
        (dict(texts=["x"], stride=WINDOW), "stride"),
        (dict(texts=[]), "texts"),
        (dict(texts=["ok", " \u200b"]), "texts[1]"),
        (dict(texts=["x"], ignore_labels=[3]), "ignore_labels[0]"),
    ]
    for kw, field in cases:
        with pytest.raises(InvalidArgument, match=re.escape(field)):
            tc.validate_token_classification(r, **kw)
    # a sequence-classification model is refused naming the model
    cls = make_deberta_checkpoint(r.config.path.parent / "cls", tokenizer_dir=r.config.path)
    other = build_runner(ModelConfig(name="cls", path=cls.path, **COMMON))
    other.load()
    with pytest.raises(InvalidArgument, match="model 'cls' is a classification model"):
        tc.validate_token_classification(other, ["x"])
    # too many windows: refused after tokenizing a bounded prefix, before any submission
    request = tc.validate_token_classification(r, ["ok"] * 100 + [LONG * 40], "simple", stride=0)
    submitted = []
    real_submit = r.scheduler.submit
    r.scheduler.submit = lambda *a, **k: submitted.append(a) or real_submit(*a, **k)
    try:
        with pytest.raises(InvalidArgument, match=r"texts\[100\] needs more than 64 windows .*max_token_windows"):
            loop.run_until_complete(tc.classify_tokens(r, request, None))
    finally:
        r.scheduler.submit = real_submit
    assert submitted == []
    assert tc.validate_token_classification(r, ["x"], "MAX").aggregation_strategy == "max"
    assert tc.validate_token_classification(r, ["x"]).ignore_labels == ["O"]
    assert tc.validate_token_classification(r, ["x"]).stride == (WINDOW - 2) // 2
