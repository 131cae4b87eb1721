"""align_to_words uses the tokenizer's own words, as transformers' question-answering pipeline does.

The pipeline (transformers 4) widens a span to ``enc.word_to_chars(enc.token_to_word(t), sequence_index=1)`` of its
start and end tokens. Where the pre-tokenizer splits off punctuation (DeBERTa v1's GPT-2 byte-level BPE, a v2/v3
tokenizer with ``split_by_punct``), "Berlin," is two words, so an answer on "Berlin" must not take the comma.
Checked two ways against transformers' own tokenizer on the same files: every context token's word span
(``qa_spans.token_word_span`` on real windows), and best answers through a real server (random oracle checkpoints,
``fixtures.deberta`` / ``fixtures.deberta_v1``), where some answers must differ from whitespace-word widening.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.deberta_v1 import make_v1_checkpoint, train_bpe_tokenizer  # noqa: E402
from fixtures.spm import spm_checkpoint_dir  # noqa: E402
from relserve.models import qa_spans  # noqa: E402
from relserve.models.tokenization import load_tokenizer  # noqa: E402

# punctuation attached to words: trailing, around, inside (abbreviations, contractions), digits
CASES = [
    ("Where do I live?", "My name is Wolfgang and I live in Berlin, the capital of Germany."),
    ("Where is the museum?", "The museum (Paris) opened in 1793; it holds works by da Vinci, Raphael and Titian."),
    ("Who signed it?", "The U.S. and the U.K. signed the treaty in Washington, D.C., on 4 April 1949."),
    ("Why not?", "I don't know why they're late, but it's raining: \"heavily\", they said."),
    ("What did she buy?", "She bought apples, pears, (ripe) plums and 2.5 kg of cherries - all for $12.50!"),
    ("Where did they go?", "After lunch they went to Rome, then Naples; finally, on Sunday, to Capri."),
]


def _context_encoding(hf, context):
    """transformers' encoding of the context alone (its word ids are the same as in a question/context pair: words
    are pre-tokenizer splits of each sequence). Alone, because transformers 5's DebertaTokenizer pair template is
    ``[CLS] A [SEP] [SEP] B [SEP]``, not DeBERTa's ``[CLS] A [SEP] B [SEP]``; positions are shifted instead."""
    return hf(context, add_special_tokens=False, return_offsets_mapping=True)


def _word_chars(enc, context, t):
    """The pipeline's ``enc.word_to_chars(enc.token_to_word(t))`` for context token ``t``, trimmed (C07)."""
    return _trim(context, *enc.word_to_chars(enc.token_to_word(t), sequence_index=0))


def _trim(context: str, a: int, b: int) -> tuple[int, int]:
    while a < b and context[a].isspace():
        a += 1
    while b > a and context[b - 1].isspace():
        b -= 1
    return a, b


@pytest.fixture(scope="module")
def tokenizers_under_test(tmp_path_factory, spm_tokenizer_dir):
    """name -> (directory, spm_normalization, transformers' tokenizer): a v1 BPE as vocab.json + merges.txt and as
    tokenizer.json, a v3 spm.model with split_by_punct served the way transformers 5 tokenizes it (so its ids are
    the oracle's); and for the default spm normalisation the same spm.model with and without split_by_punct."""
    root = tmp_path_factory.mktemp("align_words")
    bpe = train_bpe_tokenizer(root / "bpe", form="vocab", vocab_size=800)
    bpe_json = train_bpe_tokenizer(root / "bpe-json", form="json", vocab_size=800)
    spm = spm_checkpoint_dir(spm_tokenizer_dir, root / "spm-punct", split_by_punct=True)
    spm_plain = spm_checkpoint_dir(spm_tokenizer_dir, root / "spm-plain", split_by_punct=False)
    hf_spm = transformers.AutoTokenizer.from_pretrained(str(spm))
    return {
        "v1": (bpe, "spm", transformers.DebertaTokenizer(vocab=str(bpe / "vocab.json"),
                                                           merges=str(bpe / "merges.txt"))),
        "v1-json": (bpe_json, "spm", transformers.AutoTokenizer.from_pretrained(str(bpe_json))),
        "v3-punct": (spm, "transformers5", hf_spm),
        "v3-punct-spm": (spm, "spm", hf_spm),
        "v3-spm": (spm_plain, "spm", transformers.AutoTokenizer.from_pretrained(str(spm_plain))),
    }


@pytest.mark.parametrize("name", ["v1", "v1-json", "v3-punct"])
def test_every_token_widens_to_transformers_word(tokenizers_under_test, name):
    """For every context token t of a real window: ``token_word_span`` = the trimmed
    ``word_to_chars(token_to_word(t))`` of transformers' encoding of the same pair (same ids, same positions)."""
    d, mode, hf = tokenizers_under_test[name]
    ours = load_tokenizer(d, spm_normalization=mode)
    split = 0
    for question, context in CASES:
        (w,) = ours.qa_windows(question, context, max_seq_len=256, doc_stride=32)
        enc = _context_encoding(hf, context)
        first = w.context_offsets.index(next(o for o in w.context_offsets if o is not None))
        assert w.input_ids[first:-1] == enc["input_ids"]
        assert w.context_words is not None
        for t, off in enumerate(w.context_offsets):
            if off is None or not context[off[0]:off[1]].strip():
                continue  # question / special tokens; blank tokens never start or end a span
            want = _word_chars(enc, context, t - first)
            got = qa_spans.token_word_span(w, context, t, t)
            assert got == want, (context, t, context[got[0]:got[1]], context[want[0]:want[1]])
            split += got != qa_spans.word_span(context, *qa_spans.trim_span(context, *off))
    assert split  # punctuation is a word of its own here, unlike whitespace-delimited words


@pytest.mark.parametrize("name", ["v3-punct-spm", "v3-spm"])
def test_spm_normaliser_words_are_the_converted_tokenizers(tokenizers_under_test, name):
    """spm_normalization spm (sentencepiece's own normaliser, transformers 4's slow tokenizer, which has no word
    ids): its pieces differ from transformers 5's in places (a lone "▁" before punctuation), so tokens are matched
    by character: each non-blank token's word is transformers' word holding the token's first character
    (``char_to_word``), whitespace words split at punctuation exactly when split_by_punct is on."""
    d, mode, hf = tokenizers_under_test[name]
    ours = load_tokenizer(d, spm_normalization=mode)
    split = 0
    for question, context in CASES:
        (w,) = ours.qa_windows(question, context, max_seq_len=256, doc_stride=32)
        enc = _context_encoding(hf, context)
        for t, off in enumerate(w.context_offsets):
            if off is None or not context[off[0]:off[1]].strip():
                continue
            a, b = qa_spans.trim_span(context, *off)
            want = _trim(context, *enc.word_to_chars(enc.char_to_word(a, sequence_index=0), sequence_index=0))
            got = qa_spans.token_word_span(w, context, t, t)
            assert got == want, (context, t, context[got[0]:got[1]], context[want[0]:want[1]])
            split += got != qa_spans.word_span(context, a, b)
    assert bool(split) == (name == "v3-punct-spm")  # without split_by_punct the words are whitespace words


def _pipeline_answer(model, hf, question, context, max_answer_len):
    """The pipeline's align_to_words answer for the best token pair of the oracle's logits (exhaustive search over
    non-blank context tokens, start <= end < start + max_answer_len), trimmed (C07)."""
    q = hf(question, add_special_tokens=False)["input_ids"]
    enc = _context_encoding(hf, context)
    ids = [hf.cls_token_id, *q, hf.sep_token_id, *enc["input_ids"], hf.sep_token_id]
    types = [0] * (len(q) + 2) + [1] * (len(enc["input_ids"]) + 1)
    inputs = dict(input_ids=torch.tensor([ids]))
    if model.config.type_vocab_size:
        inputs["token_type_ids"] = torch.tensor([types])
    with torch.no_grad():
        out = model(**inputs)
    first = len(q) + 2
    s, e = out.start_logits[0].numpy()[first:-1], out.end_logits[0].numpy()[first:-1]
    offsets = enc["offset_mapping"]
    usable = [i for i, (a, b) in enumerate(offsets) if context[a:b].strip()]
    best, best_score = None, -np.inf
    for i in usable:
        for j in usable:
            if i <= j < i + max_answer_len and s[i] + e[j] > best_score:
                best, best_score = (i, j), s[i] + e[j]
    a, b = _word_chars(enc, context, best[0])[0], _word_chars(enc, context, best[1])[1]
    token_span = _trim(context, offsets[best[0]][0], offsets[best[1]][1])
    return _trim(context, a, b), token_span


def test_answers_through_a_real_server_match_the_pipeline(tmp_path_factory, tokenizers_under_test):
    from fixtures.fake_serving import server_config
    from fixtures.server import Running
    from relserve.service._proto import inference_pb2 as pb
    from relserve.service.config import ModelConfig
    from relserve.service.registry import build_runner

    root = tmp_path_factory.mktemp("align_words_serve")
    v1_dir, _, v1_tok = tokenizers_under_test["v1"]
    v3_dir, _, v3_tok = tokenizers_under_test["v3-punct"]
    ckpts = {
        "v1": (make_v1_checkpoint(root / "v1", task="question-answering", tokenizer_dir=v1_dir, vocab_size=800,
                                  seed=5), v1_tok, "spm"),
        "v3-punct": (make_deberta_checkpoint(root / "v3", task="question-answering", version="v3", oracle=True,
                                             tokenizer_dir=v3_dir, init="matrices", seed=6, hidden_size=48,
                                             intermediate_size=96), v3_tok, "transformers5"),
    }
    # parity with transformers: float32, never dtype auto's bfloat16
    common = dict(device="cpu", dtype="float32", max_seq_len=256, max_queue_delay=0.002, doc_stride=32)
    s = Running(server_config(), [build_runner(ModelConfig(name=n, path=c.path, spm_normalization=m, **common))
                                  for n, (c, _, m) in ckpts.items()])
    try:
        s.wait_serving(timeout=60)
        for name, (ckpt, hf, _) in ckpts.items():
            differs = 0
            for question, context in CASES:
                for max_answer_len in (1, 2, 4, 15):
                    kw = dict(model=name, question=question, context=context, top_k=1, max_answer_len=max_answer_len)
                    ans = s.stub.Answer(pb.AnswerRequest(**kw), timeout=60).answers[0]  # align_to_words: default on
                    assert ans.text == context[ans.start:ans.end] and ans.text == ans.text.strip()
                    want, token_span = _pipeline_answer(ckpt.model, hf, question, context, max_answer_len)
                    assert (ans.start, ans.end) == want, (name, context, ans.text, context[want[0]:want[1]])
                    differs += want != qa_spans.word_span(context, *token_span)
            assert differs, name  # some answers touch punctuation, where whitespace words would be wrong
    finally:
        s.close()
