"""End to end: spm.model-only checkpoints (the hub layout of deberta-v3 / mdeberta) served by the real
``relserve serve`` process, tokenized with the model's own ``nmt_nfkc`` normaliser (``spm_normalization: spm``,
the default) and with ``split_by_punct`` honoured.

Oracle: sentencepiece's own ``encode`` for the ids (transformers 4's sentencepiece-backed DebertaV2Tokenizer;
the pinned transformers 5 drops the normaliser), and transformers' ``DebertaV2For*`` model (random-initialised
from a config) fed those ids for the probabilities and QA logits. Texts: full-width letters and punctuation,
NBSP, ZWSP, ligatures, ①, ™, CJK. QA answers index the original context where normalisation changes lengths.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import grpc  # noqa: E402

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.server import ServerProcess  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service._proto import inference_pb2_grpc as pb_grpc  # noqa: E402

from fixtures.spm import oracle_ids, reference_punct_split, spm_checkpoint_dir  # noqa: E402

TEXTS = [
    "ＡＢＣ！？ Ｔｈｅ　ｆｉｌｍ　ｗａｓ　ｇｒｅａｔ．",
    "The ﬁlm was ﬁne, ﬂawless™ ①",
    "no\u00a0break\u00a0space and zero\u200bwidth\u200bspace",
    "这部电影非常好看！我们明天见，好吗？",
    "Hello, world! It's 3.5 (really).",
]
QA_CASES = [
    ("Where was the ﬁrst ﬁlm shot？",
     "Ｔｈｅ ﬁrst ﬁlm™ was shot in Ｂｅｒｌｉｎ,\u00a0Germany; ① the\u200bsecond ﬁlm in Ｔｏｋｙｏ, Japan."),
    ("谁赢得了比赛？", "丹佛野马队以２４比１０击败了卡罗莱纳黑豹队，赢得了第５０届超级碗。"),
]
SHAPE = dict(hidden_size=48, intermediate_size=96)
INVISIBLE = "\u200b\u200c\u200d\u2060\ufeff"


@pytest.fixture(scope="module")
def sp(spm_tokenizer_dir):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(spm_tokenizer_dir / "spm.model"))


@pytest.fixture(scope="module")
def spm_server(tmp_path_factory, spm_tokenizer_dir):
    tmp = tmp_path_factory.mktemp("spm_norm")
    models = {}
    for punct in (False, True):
        tok_dir = spm_checkpoint_dir(spm_tokenizer_dir, tmp / f"tok-{punct}", punct)
        for task in ("classification", "question-answering"):
            name = f"{'cls' if task == 'classification' else 'qa'}-{'punct' if punct else 'plain'}"
            models[name] = (punct, make_deberta_checkpoint(
                tmp / name, task=task, version="v3", oracle=True, tokenizer_dir=tok_dir,
                labels=("negative", "positive"), init="matrices", seed=len(models) + 1, **SHAPE))
    args = []
    for name, (_, ckpt) in models.items():
        # parity with transformers: float32, never dtype auto's bfloat16
        args += ["--model", f"{name}={ckpt.path},max_queue_delay=0.01,dtype=float32"]
    # the transformers 5 behaviour, selected per model
    args += ["--model", f"cls-v5={models['cls-plain'][1].path},spm_normalization=transformers5,dtype=float32"]
    srv = ServerProcess(args, env={"OMP_NUM_THREADS": "1"}).start()
    channel = grpc.insecure_channel(srv.target)
    try:
        yield models, pb_grpc.InferenceStub(channel), srv
    finally:
        channel.close()
        code = srv.stop()
        srv.close()
    assert code == 0


def _ids(sp, text, punct, pair=None):
    cls, sep = sp.piece_to_id("[CLS]"), sp.piece_to_id("[SEP]")
    ids = [cls, *oracle_ids(sp, text, punct), sep]
    types = [0] * len(ids)
    if pair is not None:
        b = [*oracle_ids(sp, pair, punct), sep]
        ids, types = ids + b, types + [1] * len(b)
    return ids, types


@pytest.mark.parametrize("name", ["cls-plain", "cls-punct"])
def test_classify_probabilities_match_transformers_fed_sentencepiece_ids(spm_server, sp, name):
    models, stub, _ = spm_server
    punct, ckpt = models[name]
    reply = stub.Classify(pb.ClassifyRequest(model=name, texts=TEXTS, top_k=0), timeout=60)
    for text, res in zip(TEXTS, reply.results):
        ids, types = _ids(sp, text, punct)
        assert res.num_tokens == len(ids)
        with torch.no_grad():
            logits = ckpt.model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0]
        expected = torch.softmax(logits, -1).numpy()
        got = {ls.label: ls.score for ls in res.labels}
        np.testing.assert_allclose([got["negative"], got["positive"]], expected, atol=1e-5, rtol=0)


def test_transformers5_option_serves_the_old_tokenization(spm_server, sp):
    """spm_normalization=transformers5 on the same checkpoint: different token counts where NFKC folds characters
    (today's behaviour, kept behind the option), identical ones on plain ASCII."""
    _, stub, _ = spm_server
    texts = ["ＡＢＣ！？", "The ﬁlm", "plain ascii words here"]
    new = stub.Classify(pb.ClassifyRequest(model="cls-plain", texts=texts, top_k=0), timeout=60).results
    old = stub.Classify(pb.ClassifyRequest(model="cls-v5", texts=texts, top_k=0), timeout=60).results
    assert new[0].num_tokens == len(_ids(sp, texts[0], False)[0]) != old[0].num_tokens
    assert new[2].num_tokens == old[2].num_tokens
    assert [ls.score for ls in new[2].labels] == pytest.approx([ls.score for ls in old[2].labels], abs=1e-6)


def test_load_log_names_the_normalisation(spm_server):
    _, _, srv = spm_server
    log = srv.log_text()
    assert log.count("tokenizing with the model's own normaliser 'nmt_nfkc'") == 4
    assert log.count("split_by_punct=True") == 2
    assert "spm_normalization is transformers5" in log


def _trim(context, a, b):
    while a < b and (context[a].isspace() or context[a] in INVISIBLE):
        a += 1
    while b > a and (context[b - 1].isspace() or context[b - 1] in INVISIBLE):
        b -= 1
    return a, b


def _oracle_span(sp, ckpt, punct, question, context, max_answer_len):
    """Best span by exhaustive search over transformers' logits on sentencepiece's ids, with sentencepiece's own
    offsets into the original context (per punctuation-split word when split_by_punct)."""
    ids, types = _ids(sp, question, punct, context)
    offsets, pos = [], 0
    for w in (reference_punct_split(context) if punct else [context]):
        enc = sp.encode(w, return_type="offset_mapping")
        offsets += [(pos + s, pos + e) for s, e in enc["offsets"]]
        pos += len(w)
    first = types.index(1)
    assert len(offsets) == len(ids) - first - 1
    with torch.no_grad():
        out = ckpt.model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types]))
    s, e = out.start_logits[0].numpy(), out.end_logits[0].numpy()
    spans = {first + k: _trim(context, *o) for k, o in enumerate(offsets)}
    usable = [i for i, (a, b) in spans.items() if a < b]
    best, best_score = None, -np.inf
    for i in usable:
        for j in usable:
            if i <= j < i + max_answer_len and s[i] + e[j] > best_score:
                best, best_score = (spans[i][0], spans[j][1]), s[i] + e[j]
    return best


@pytest.mark.parametrize("name", ["qa-plain", "qa-punct"])
def test_answer_offsets_index_the_original_context(spm_server, sp, name):
    models, stub, _ = spm_server
    punct, ckpt = models[name]
    for question, context in QA_CASES:
        assert len(sp.normalize(context)) != len(context)  # normalisation changes lengths here
        for max_answer_len in (3, 15):
            reply = stub.Answer(pb.AnswerRequest(model=name, question=question, context=context, top_k=1,
                                                 max_answer_len=max_answer_len, align_to_words=False), timeout=60)
            ans = reply.answers[0]
            assert reply.num_windows == 1
            assert 0 <= ans.start < ans.end <= len(context)
            assert ans.text == context[ans.start:ans.end]
            assert (ans.start, ans.end) == _oracle_span(sp, ckpt, punct, question, context, max_answer_len)
        # word-aligned answers (the default) index the original text too
        reply = stub.Answer(pb.AnswerRequest(model=name, question=question, context=context, top_k=3), timeout=60)
        for ans in reply.answers:
            assert ans.text == context[ans.start:ans.end] and ans.text.strip()
