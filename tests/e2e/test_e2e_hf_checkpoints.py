"""End to end: random Hugging Face checkpoints served with ``--model`` agree with ``transformers``.

This is how a user brings a checkpoint: ``save_pretrained`` output (config.json + model.safetensors or
pytorch_model.bin) plus a tokenizer directory, served by the real ``relserve serve`` process on free
loopback ports. The oracle is transformers' DebertaV2 (random-initialised from a config, no hub) with
its AutoTokenizer on the same directory; QA spans are checked against an exhaustive span search over the
oracle's logits and offsets (start <= end, length <= max_answer_len, context tokens only).
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from relserve.loadtest.serverproc import ServerProcess  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service._proto import inference_pb2_grpc as pb_grpc  # noqa: E402

TEXTS = [
    "The film was a delight from start to finish.",
    "Schlechter Service, ich komme nicht wieder.",
    "这部电影非常好看。",
    "ok",
]
PAIRS = ["It was good.", "Der Service war schlecht.", "电影很好。", "fine"]
# The shapes on top of fixtures.deberta's v3 / v2 presets that these checkpoints have always had. (With the plain
# presets the QA span search disagrees with this oracle where a span starts on the bare "▁" word-boundary token,
# which transformers maps onto the next character and ours gives zero width.)
SHAPES = {
    "v3": dict(hidden_size=48, intermediate_size=96),
    "v2": dict(num_attention_heads=2, max_position_embeddings=512, pos_att_type="c2p|p2c", max_relative_positions=128),
}


def _save(tmp, name, head, version, tok_dir, seed, safetensors=True):
    """A transformers checkpoint as a user brings it (``fixtures.deberta``: v3 / v2 shape; weight matrices re-drawn
    because HF's std-0.02 init makes attention almost uniform, which would hide position bugs), the tokenizer
    files beside it."""
    return make_deberta_checkpoint(tmp / name, task="classification" if head == "cls" else "question-answering",
                                   version=version, oracle=True, tokenizer_dir=tok_dir, labels=("negative", "positive"),
                                   init="matrices", seed=seed, weights="safetensors" if safetensors else "bin",
                                   **SHAPES[version]).path


@pytest.fixture(scope="module")
def hf_server(tmp_path_factory, unigram_tokenizer_dir, spm_tokenizer_dir):
    tmp = tmp_path_factory.mktemp("hf_ckpt")
    dirs = {
        "cls-v3": _save(tmp, "cls-v3", "cls", "v3", spm_tokenizer_dir, 1),
        "cls-v2": _save(tmp, "cls-v2", "cls", "v2", unigram_tokenizer_dir, 2, safetensors=False),
        "qa-v3": _save(tmp, "qa-v3", "qa", "v3", spm_tokenizer_dir, 3),
        "qa-v2": _save(tmp, "qa-v2", "qa", "v2", unigram_tokenizer_dir, 4),
    }
    args = []
    for name, d in dirs.items():
        # the oracle is transformers 5's AutoTokenizer, which drops the spm.model's own normaliser: the v3 models
        # (spm.model only) are served the same way (the default, sentencepiece's normaliser, is checked against
        # sentencepiece in test_e2e_spm_normalization.py)
        v5 = ",spm_normalization=transformers5" if name.endswith("v3") else ""
        # parity with transformers: float32, never dtype auto's bfloat16
        args += ["--model", f"{name}={d},max_queue_delay=0.02,dtype=float32{v5}"]
    srv = ServerProcess(args, env={"OMP_NUM_THREADS": "1"}).start()
    channel = grpc.insecure_channel(srv.target)
    try:
        yield dirs, pb_grpc.InferenceStub(channel), channel
    finally:
        channel.close()
        code = srv.stop()
        srv.close()
    assert code == 0


def _hf_model(d):
    from transformers import AutoModelForQuestionAnswering, AutoModelForSequenceClassification

    cfg = transformers.AutoConfig.from_pretrained(str(d))
    cls = (AutoModelForSequenceClassification if "SequenceClassification" in cfg.architectures[0]
           else AutoModelForQuestionAnswering)
    return cls.from_pretrained(str(d)).eval(), transformers.AutoTokenizer.from_pretrained(str(d))


def _hf_probs(d, texts, pairs=None, max_length=512):
    model, tok = _hf_model(d)
    out = []
    for i, t in enumerate(texts):
        enc = tok(t, pairs[i] if pairs else None, truncation=True, max_length=max_length, return_tensors="pt")
        if model.config.type_vocab_size == 0:
            enc.pop("token_type_ids", None)
        with torch.no_grad():
            out.append(torch.softmax(model(**enc).logits[0], -1).numpy())
    return out


@pytest.mark.parametrize("name", ["cls-v3", "cls-v2"])
def test_classify_probabilities_match_transformers(hf_server, name):
    dirs, stub, _ = hf_server
    long_text = " ".join(["word"] * 700)  # past 512 tokens: server truncates and says so (C08)
    texts = TEXTS + [long_text]
    reply = stub.Classify(pb.ClassifyRequest(model=name, texts=texts, top_k=0), timeout=60)
    expected = _hf_probs(dirs[name], texts)
    for res, exp in zip(reply.results, expected):
        got = {ls.label: ls.score for ls in res.labels}
        assert list(got) == sorted(got, key=got.get, reverse=True)  # best first
        np.testing.assert_allclose([got["negative"], got["positive"]], exp, atol=1e-4)
    assert [r.truncated for r in reply.results] == [False] * len(TEXTS) + [True]
    assert reply.results[-1].num_tokens == 512


def test_classify_text_pairs_match_transformers(hf_server):
    dirs, stub, _ = hf_server
    for name in ("cls-v3", "cls-v2"):
        reply = stub.Classify(pb.ClassifyRequest(model=name, texts=TEXTS, text_pairs=PAIRS, top_k=1), timeout=60)
        expected = _hf_probs(dirs[name], TEXTS, PAIRS)
        for res, exp in zip(reply.results, expected):
            assert len(res.labels) == 1
            best = ["negative", "positive"][int(np.argmax(exp))]
            assert res.labels[0].label == best
            assert res.labels[0].score == pytest.approx(float(exp.max()), abs=1e-4)


def _hf_qa_logits(d, question, context):
    """transformers' QA model on (question, context): (encoding, offsets, sequence ids, start logits [T], end
    logits [T])."""
    model, tok = _hf_model(d)
    enc = tok(question, context, return_offsets_mapping=True, return_tensors="pt")
    offsets = enc.pop("offset_mapping")[0].tolist()
    seq_ids = enc.sequence_ids(0)
    if model.config.type_vocab_size == 0:
        enc.pop("token_type_ids", None)
    with torch.no_grad():
        out = model(**enc)
    return enc, offsets, seq_ids, out.start_logits[0].numpy(), out.end_logits[0].numpy()


def _oracle_span(d, question, context, max_answer_len):
    """Exhaustive best span over transformers' logits, mapped to trimmed character offsets."""
    enc, offsets, seq_ids, s, e = _hf_qa_logits(d, question, context)
    ctx = [i for i, sid in enumerate(seq_ids) if sid == 1]
    best, best_score = None, -np.inf
    for i in ctx:
        for j in ctx:
            if i <= j < i + max_answer_len and s[i] + e[j] > best_score:
                a, b = offsets[i][0], offsets[j][1]
                while a < b and context[a].isspace():
                    a += 1
                while b > a and context[b - 1].isspace():
                    b -= 1
                if a < b:
                    best, best_score = (a, b), s[i] + e[j]
    return best


QA_CASES = [
    ("Where do I live?", "My name is Wolfgang and I live in Berlin, the capital of Germany."),
    ("Wer hat das Spiel gewonnen?", "Die Broncos haben das Spiel mit 24 zu 10 gegen die Panthers gewonnen."),
    ("谁赢得了比赛？", "丹佛野马队以24比10击败了卡罗莱纳黑豹队，赢得了第50届超级碗。"),
]


@pytest.mark.parametrize("name", ["qa-v3", "qa-v2"])
def test_answer_best_span_matches_transformers(hf_server, name):
    dirs, stub, _ = hf_server
    for question, context in QA_CASES:
        for max_answer_len in (3, 15):
            reply = stub.Answer(pb.AnswerRequest(model=name, question=question, context=context, top_k=1,
                                                 max_answer_len=max_answer_len, align_to_words=False), timeout=60)
            ans = reply.answers[0]
            assert reply.num_windows == 1
            assert ans.text == context[ans.start:ans.end] and ans.text == ans.text.strip()
            assert (ans.start, ans.end) == _oracle_span(dirs[name], question, context, max_answer_len)


def _pipeline_words(d, question, context, max_answer_len):
    """transformers' question-answering pipeline's ``align_to_words=True`` span of the best token pair (the
    oracle's exhaustive search as :func:`_oracle_span`): ``enc.word_to_chars(enc.token_to_word(t), sequence_index=1)``
    of the start and end tokens, as its ``postprocess`` does (the pipeline itself is no longer in transformers 5, so
    its mapping is applied here to the same tokenizer's encoding); then trimmed of whitespace (C07: the pipeline can
    keep the space a Metaspace word's first token covers)."""
    enc, offsets, seq_ids, s, e = _hf_qa_logits(d, question, context)
    usable = [i for i, sid in enumerate(seq_ids) if sid == 1 and context[offsets[i][0]:offsets[i][1]].strip()]
    best, best_score = None, -np.inf
    for i in usable:
        for j in usable:
            if i <= j < i + max_answer_len and s[i] + e[j] > best_score:
                best, best_score = (i, j), s[i] + e[j]
    a = enc.word_to_chars(enc.token_to_word(best[0]), sequence_index=1)[0]
    b = enc.word_to_chars(enc.token_to_word(best[1]), sequence_index=1)[1]
    while a < b and context[a].isspace():
        a += 1
    while b > a and context[b - 1].isspace():
        b -= 1
    return a, b


WORD_CASES = QA_CASES + [
    ("What is the capital?", "Washington is the capital of the United States and has many museums along the Mall."),
    ("Who won?", "The  Broncos\tdefeated the Panthers 24\u201310,\nearning their third Super Bowl title."),
]


@pytest.mark.parametrize("name", ["qa-v3", "qa-v2"])
def test_answer_align_to_words_matches_the_pipeline(hf_server, name):
    """align_to_words (the default, unset in the request) widens the best span to the words transformers' tokenizer
    gives the tokens; false keeps the token-exact span; the words never change which span is best."""
    dirs, stub, _ = hf_server
    widened = 0
    for question, context in WORD_CASES:
        for max_answer_len in (1, 3, 15):
            kw = dict(model=name, question=question, context=context, top_k=1, max_answer_len=max_answer_len)
            words = stub.Answer(pb.AnswerRequest(**kw), timeout=60).answers[0]
            same = stub.Answer(pb.AnswerRequest(align_to_words=True, **kw), timeout=60).answers[0]
            tokens = stub.Answer(pb.AnswerRequest(align_to_words=False, **kw), timeout=60).answers[0]
            assert (same.start, same.end) == (words.start, words.end)
            assert words.text == context[words.start:words.end] and words.text == words.text.strip()
            assert (words.start, words.end) == _pipeline_words(dirs[name], question, context, max_answer_len)
            assert (tokens.start, tokens.end) == _oracle_span(dirs[name], question, context, max_answer_len)
            assert words.start <= tokens.start and tokens.end <= words.end
            widened += (words.start, words.end) != (tokens.start, tokens.end)
    assert widened  # some best spans ended or started mid-word, so the comparison means something


def test_list_models_and_health(hf_server):
    _, stub, channel = hf_server
    models = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
    assert {n: m.task for n, m in models.items()} == {
        "cls-v3": "classification", "cls-v2": "classification",
        "qa-v3": "question-answering", "qa-v2": "question-answering",
    }
    assert list(models["cls-v3"].labels) == ["negative", "positive"]
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "relserve.v1.Inference"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
