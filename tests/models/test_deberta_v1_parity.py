"""DeBERTa v1 (``model_type: deberta``) against transformers' ``Deberta*`` oracle (random weights, no hub).

Oracle checkpoints (``fixtures.deberta_v1.make_v1_checkpoint``): random-initialised from a ``DebertaConfig``,
weights re-drawn with large scales, ``save_pretrained``, loaded back through our ``load_checkpoint``. Texts run
past ``max_relative_positions`` (16) so the clamp of the relative table is exercised. The tokenizer is a small
GPT-2 byte-level BPE trained here, in both forms a v1 checkpoint ships (``vocab.json`` + ``merges.txt``, and
the ``tokenizer.json`` transformers 5 ``DebertaTokenizer`` saves).

Pairs: transformers 5 ``DebertaTokenizer`` builds ``[CLS] a [SEP] [SEP] b [SEP]`` (its template); DeBERTa v1 was
trained, and transformers 4 ``DebertaTokenizer`` encodes, ``[CLS] a [SEP] b [SEP]``, which is what relserve
builds. Pair ids are therefore checked against transformers' ids of each segment in that template.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from fixtures.deberta_v1 import make_v1_checkpoint, train_bpe_tokenizer  # noqa: E402
from relserve.models.checkpoint import (  # noqa: E402
    SUPPORTED_ARCHITECTURES, CheckpointError, load_checkpoint, save_checkpoint,
)
from relserve.models.deberta_v1 import DebertaV1Config  # noqa: E402
from relserve.models.qa_spans import trim_span  # noqa: E402
from relserve.models.tokenization import load_tokenizer  # noqa: E402

TOL = 1e-4
VOCAB = 800
LENGTHS = (1, 7, 40, 200)  # 40 and 200 are past max_relative_positions = 16

CONFIGS = {
    "base": {},  # c2p + p2c, absolute positions, no talking heads
    "talking_nopos": dict(talking_head=True, position_biased_input=False),
    "c2p_only": dict(pos_att_type="c2p", max_relative_positions=-1),  # span = max_position_embeddings
    "p2c_talking": dict(pos_att_type=["p2c"], talking_head=True, max_relative_positions=8),
}
TASKS = ("classification", "question-answering")
_CACHE: dict[tuple[str, str], tuple] = {}


def _pair(name, task, tmp_path_factory):
    key = (name, task)
    if key not in _CACHE:
        tiny = make_v1_checkpoint(tmp_path_factory.mktemp(f"v1-{name}-{task}"), task=task, vocab_size=VOCAB,
                                  seed=list(CONFIGS).index(name) * 10 + TASKS.index(task), **CONFIGS[name])
        _CACHE[key] = (tiny.model, load_checkpoint(tiny.path, load_tokenizer=False), tiny.path)
    return _CACHE[key]


def _inputs(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    return ids, mask


def _hf(hf, task, ids, mask):
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask)
    return out.logits if task == "classification" else (out.start_logits, out.end_logits)


def _ours(model, ids, mask):
    with torch.inference_mode():
        return model(ids, mask)


def _check(task, a, b, lengths, tol=TOL):
    if task == "classification":
        diff = (a - b).abs().max().item()
        assert diff <= tol, f"classification logits differ by {diff}"
        return
    for x, y, what in ((a[0], b[0], "start"), (a[1], b[1], "end")):
        for i, n in enumerate(lengths):  # padded positions mean nothing; real tokens only
            diff = (x[i, :n] - y[i, :n]).abs().max().item()
            assert diff <= tol, f"{what} logits of sequence {i} (len {n}) differ by {diff}"


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_single_and_padded(name, task, tmp_path_factory):
    hf, ours, _ = _pair(name, task, tmp_path_factory)
    assert ours.task == task and ours.config.model_type == "deberta"
    assert ours.config.talking_head == hf.config.talking_head
    for T in LENGTHS:
        ids, mask = _inputs([T], seed=T)
        _check(task, _hf(hf, task, ids, mask), _ours(ours.model, ids, mask), [T])
    lengths = [200, 7, 40, 1]
    ids, mask = _inputs(lengths, seed=5)
    _check(task, _hf(hf, task, ids, mask), _ours(ours.model, ids, mask), lengths)
    ids, mask = _inputs([120], seed=1)  # the encoder output itself, the most sensitive place
    with torch.no_grad():
        a = hf.deberta(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (a - _ours(ours.model.deberta, ids, mask)).abs().max().item() <= TOL


def test_logits_are_spread_and_positions_matter(tmp_path_factory):
    """The oracle is not degenerate: logits vary between inputs, and the relative terms change them."""
    hf, ours, _ = _pair("base", "classification", tmp_path_factory)
    ids, mask = _inputs([40, 40], seed=9)
    logits = _ours(ours.model, ids, mask)
    assert (logits[0] - logits[1]).abs().max().item() > 0.1
    for layer in ours.model.deberta.encoder.layer:
        layer.attention.self.relative_attention = False
    try:
        assert (_ours(ours.model, ids, mask) - logits).abs().max().item() > 1e-2
    finally:
        for layer in ours.model.deberta.encoder.layer:
            layer.attention.self.relative_attention = True


def test_v2_only_keys_are_ignored_like_transformers(tmp_path):
    """transformers' v1 code never reads position_buckets / share_att_key / norm_rel_ebd / conv_*; nor do we."""
    tiny = make_v1_checkpoint(tmp_path / "c", task="classification", vocab_size=VOCAB, seed=7, position_buckets=8,
                              share_att_key=True, norm_rel_ebd="layer_norm", conv_kernel_size=3)
    ours = load_checkpoint(tiny.path, load_tokenizer=False)
    assert ours.config.position_buckets == -1 and ours.config.extra["position_buckets"] == 8
    ids, mask = _inputs([60, 9], seed=2)
    _check("classification", _hf(tiny.model, "classification", ids, mask), _ours(ours.model, ids, mask), [60, 9])
    with pytest.raises(ValueError, match="position_buckets"):
        DebertaV1Config(position_buckets=8)


def test_save_checkpoint_is_hf_loadable(tmp_path, tmp_path_factory):
    hf, ours, _ = _pair("talking_nopos", "question-answering", tmp_path_factory)
    out = save_checkpoint(ours.model, ours.config, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "deberta" and cfg["architectures"] == ["DebertaForQuestionAnswering"]
    assert cfg["talking_head"] is True and "position_buckets" not in cfg and "share_att_key" not in cfg
    hf2 = transformers.AutoModelForQuestionAnswering.from_pretrained(out).eval()
    assert type(hf2).__name__ == "DebertaForQuestionAnswering"
    ids, mask = _inputs([50], seed=4)
    _check("question-answering", _hf(hf, "question-answering", ids, mask),
           _hf(hf2, "question-answering", ids, mask), [50], tol=0)


def test_refusals_list_exactly_what_is_supported(tmp_path, tmp_path_factory):
    _, _, d = _pair("base", "classification", tmp_path_factory)
    cfg = json.loads((d / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    want = ("model_type 'deberta-v2': DebertaV2ForSequenceClassification, DebertaV2ForQuestionAnswering, "
            "DebertaV2ForTokenClassification; model_type 'deberta': DebertaForSequenceClassification, "
            "DebertaForQuestionAnswering, DebertaForTokenClassification")
    assert set(SUPPORTED_ARCHITECTURES) == {"DebertaV2ForSequenceClassification", "DebertaV2ForQuestionAnswering",
                                            "DebertaV2ForTokenClassification", "DebertaForSequenceClassification",
                                            "DebertaForQuestionAnswering", "DebertaForTokenClassification"}
    cases = [
        (cfg | {"architectures": ["DebertaForMaskedLM"]}, "DebertaForMaskedLM"),  # a pre-training head
        (cfg | {"architectures": ["DebertaV2ForSequenceClassification"]}, "for model_type 'deberta'"),
        (cfg | {"model_type": "bert"}, "model_type 'bert' is not supported"),
    ]
    for config, what in cases:
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(bad, load_tokenizer=False)
        assert what in str(err.value) and want in str(err.value)


# ---- tokenizer ---------------------------------------------------------------------------------------------

TEXTS = [
    "Hello world",
    " Hello world",  # a leading space changes the first token (byte-level BPE marks word starts with spaces)
    "The Broncos defeated the Pittsburgh Steelers in the divisional round, 23–16, by scoring 11 points.",
    "two  spaces\tand a tab\nand a line break   and trailing spaces   ",
    "Größe, Straße – naïve café; 丹佛野马队赢得了比赛。 🙂",
    "a [SEP] inside and a [MASK] too",
    "",
]


@pytest.fixture(scope="module", params=["vocab", "json"])
def bpe(request, tmp_path_factory):
    """(our tokenizer, transformers' DebertaTokenizer) over the same files."""
    d = train_bpe_tokenizer(tmp_path_factory.mktemp(f"bpe-{request.param}"), form=request.param, vocab_size=VOCAB)
    assert (d / "tokenizer.json").is_file() == (request.param == "json")
    hf = transformers.AutoTokenizer.from_pretrained(str(d)) if request.param == "json" else \
        transformers.DebertaTokenizer(vocab=str(d / "vocab.json"), merges=str(d / "merges.txt"))
    return load_tokenizer(d), hf, d


def test_token_ids_and_offsets_equal_transformers(bpe):
    ours, hf, _ = bpe
    assert (ours.cls_token_id, ours.sep_token_id, ours.pad_token_id) == (hf.cls_token_id, hf.sep_token_id, 0)
    for text in TEXTS:
        want = hf(text, return_offsets_mapping=True)
        got = ours.encode(text)
        assert got.input_ids == want["input_ids"], text
        ids, offsets = ours.tokenize(text)
        assert offsets == [tuple(o) for o in want["offset_mapping"][1:-1]], text
        assert all(0 <= s <= e <= len(text) for s, e in offsets)


def test_pairs_and_truncation_follow_the_deberta_template(bpe):
    ours, hf, _ = bpe
    for a, b in zip(TEXTS, reversed(TEXTS)):
        seg_a = hf(a, add_special_tokens=False)["input_ids"]
        seg_b = hf(b, add_special_tokens=False)["input_ids"]
        enc = ours.encode(a, b)
        assert enc.input_ids == [hf.cls_token_id, *seg_a, hf.sep_token_id, *seg_b, hf.sep_token_id]
        assert enc.token_type_ids == [0] * (len(seg_a) + 2) + [1] * (len(seg_b) + 1)
    long = " ".join(TEXTS[:5]) * 40  # the bounded (prefix) path must give transformers' truncation exactly
    for max_length in (16, 64, 333):
        got = ours.encode(long, max_length=max_length)
        assert got.input_ids == hf(long, truncation=True, max_length=max_length)["input_ids"]
        assert got.truncated


def test_qa_window_offsets_index_the_context(bpe):
    """Each window's context tokens are the next slice of transformers' tokens of the context, offsets and all."""
    ours, hf, _ = bpe
    context = TEXTS[2] + " " + TEXTS[4] + "  " + TEXTS[3]
    question = "Who won?"
    ref = hf(context, add_special_tokens=False, return_offsets_mapping=True)
    ref = list(zip(ref["input_ids"], map(tuple, ref["offset_mapping"])))
    room = 24 - 3 - len(hf(question, add_special_tokens=False)["input_ids"])
    windows = ours.qa_windows(question, context, max_seq_len=24, doc_stride=6)
    assert len(windows) > 2
    for k, w in enumerate(windows):
        got = [(t, o) for t, o in zip(w.input_ids, w.context_offsets) if o is not None]
        assert got == ref[k * (room - 6): k * (room - 6) + room]
        assert all(0 <= s <= e <= len(context) for _, (s, e) in got)
    assert windows[-1].context_offsets[-2] == ref[-1][1]


# ---- serving -------------------------------------------------------------------------------------------------

QA_CASES = [
    ("Who lost to the Broncos in the divisional round?",
     "The Broncos defeated the Pittsburgh Steelers in the divisional round, 23–16, by scoring 11 points in the "
     "final three minutes of the game."),
    ("Where does she live?", "My name is Ann  and I live in Berlin,\nthe capital of Germany. Größe: 1,70 m 🙂"),
]


def _oracle_span(hf_model, hf_tok, question, context, max_answer_len, align_to_words=False):
    """Exhaustive best span over transformers' logits on ``[CLS] q [SEP] c [SEP]``, trimmed char offsets; tokens
    that are only whitespace neither start nor end a span (the server's rule, ``qa_spans``). ``align_to_words``:
    the best pair's span widened as the question-answering pipeline does, ``word_to_chars(token_to_word(t))`` of
    transformers' encoding (byte-level BPE words: punctuation is a word of its own), trimmed."""
    q = hf_tok(question, add_special_tokens=False)["input_ids"]
    c = hf_tok(context, add_special_tokens=False, return_offsets_mapping=True)
    ids = [hf_tok.cls_token_id, *q, hf_tok.sep_token_id, *c["input_ids"], hf_tok.sep_token_id]
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([ids]))
    s, e = out.start_logits[0].numpy(), out.end_logits[0].numpy()
    first = len(q) + 2
    best, best_score = None, -np.inf
    offs = c["offset_mapping"]
    usable = [bool(context[a:b].strip()) for a, b in offs]
    for i in range(len(c["input_ids"])):
        for j in range(i, min(len(c["input_ids"]), i + max_answer_len)):
            if not (usable[i] and usable[j]):
                continue
            score = s[first + i] + e[first + j]
            a, b = c["offset_mapping"][i][0], c["offset_mapping"][j][1]
            while a < b and context[a].isspace():
                a += 1
            while b > a and context[b - 1].isspace():
                b -= 1
            if a < b and score > best_score:
                best, best_score, pair = (a, b), score, (i, j)
    if align_to_words:
        return trim_span(context, c.word_to_chars(c.token_to_word(pair[0]))[0],
                         c.word_to_chars(c.token_to_word(pair[1]))[1])
    return best


def test_qa_and_classification_through_a_real_server(tmp_path_factory):
    from fixtures.fake_serving import server_config
    from fixtures.server import Running
    from relserve.service._proto import inference_pb2 as pb
    from relserve.service.config import ModelConfig
    from relserve.service.registry import build_runner

    root = tmp_path_factory.mktemp("v1-serve")
    tok_dir = train_bpe_tokenizer(root / "tok", form="vocab", vocab_size=VOCAB)
    qa = make_v1_checkpoint(root / "qa", task="question-answering", tokenizer_dir=tok_dir, vocab_size=VOCAB, seed=3,
                            talking_head=True)
    cls = make_v1_checkpoint(root / "cls", task="classification", tokenizer_dir=tok_dir, vocab_size=VOCAB, seed=4)
    hf_tok = transformers.DebertaTokenizer(vocab=str(tok_dir / "vocab.json"), merges=str(tok_dir / "merges.txt"))
    # parity with transformers: float32, never dtype auto's bfloat16
    common = dict(device="cpu", dtype="float32", max_seq_len=256, max_queue_delay=0.002, doc_stride=32)
    s = Running(server_config(), [build_runner(ModelConfig(name="qa", path=qa.path, **common)),
                                  build_runner(ModelConfig(name="cls", path=cls.path, **common))])
    try:
        s.wait_serving(timeout=60)
        models = {m.name: m for m in s.stub.ListModels(pb.ListModelsRequest()).models}
        assert models["qa"].task == "question-answering" and models["qa"].family == "deberta"
        for question, context in QA_CASES:
            for max_answer_len in (3, 15):
                want = _oracle_span(qa.model, hf_tok, question, context, max_answer_len)
                want_words = _oracle_span(qa.model, hf_tok, question, context, max_answer_len, align_to_words=True)
                for words in (False, True):  # token-exact spans, and widened to whole words (the default)
                    reply = s.stub.Answer(pb.AnswerRequest(model="qa", question=question, context=context, top_k=1,
                                                           max_answer_len=max_answer_len, align_to_words=words),
                                          timeout=60)
                    ans = reply.answers[0]
                    assert reply.num_windows == 1
                    assert ans.text == context[ans.start:ans.end] and ans.text == ans.text.strip()
                    assert (ans.start, ans.end) == (want_words if words else want)
        texts = [t for t in TEXTS if t.strip()]
        reply = s.stub.Classify(pb.ClassifyRequest(model="cls", texts=texts, top_k=0), timeout=60)
        for text, res in zip(texts, reply.results):
            with torch.no_grad():
                want = torch.softmax(cls.model(**hf_tok(text, return_tensors="pt")).logits[0], -1).numpy()
            got = {ls.label: ls.score for ls in res.labels}
            np.testing.assert_allclose([got[f"LABEL_{i}"] for i in range(3)], want, atol=1e-4)
    finally:
        s.close()


def test_onnx_export_of_v1_passes_its_parity_report(tmp_path, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    from relserve.models.onnx.export import export_checkpoint

    hf, ours, d = _pair("talking_nopos", "classification", tmp_path_factory)
    result = export_checkpoint(d, tmp_path / "onnx")
    assert result.report["parity"]["passed"]
    assert max(c["max_abs_diff"] for c in result.report["parity"]["cases"]) <= TOL
