"""Task pre/post-processing (service/tasks) with real tokenizers and constructed logits (cases C04-C08)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fixtures.data import qa_rows
from relserve.models import qa_spans
from relserve.models.tokenization import load_tokenizer
from relserve.service.errors import InvalidArgument
from relserve.service.tasks import classify, qa

TOKENIZER_DIRS = ["unigram_tokenizer_dir", "spm_tokenizer_dir"]


@pytest.fixture(params=TOKENIZER_DIRS)
def tok(request):
    return load_tokenizer(request.getfixturevalue(request.param))


def _logits(windows, start=None, end=None, cls=(0.0, 0.0), high=10.0, seed=0):
    """Low random logits per window; ``start``/``end`` = (window, token) get ``high``; CLS gets ``cls``."""
    rng = np.random.default_rng(seed)
    s_all, e_all = [], []
    for w_i, w in enumerate(windows):
        s = rng.normal(0.0, 0.1, len(w))
        e = rng.normal(0.0, 0.1, len(w))
        s[0], e[0] = cls
        if start is not None and start[0] == w_i:
            s[start[1]] = high
        if end is not None and end[0] == w_i:
            e[end[1]] = high
        s_all.append(s)
        e_all.append(e)
    return s_all, e_all


def _check_well_formed(answers, context, windows=None):
    assert answers
    for a in answers:
        assert a.text == context[a.start : a.end]
        if a.is_impossible:
            assert (a.text, a.start, a.end) == ("", 0, 0)
        else:
            assert a.text and a.text == a.text.strip() and 0 <= a.start < a.end <= len(context)
        assert 0.0 <= a.score <= 1.0


def _brute_force_best(windows, starts, ends, context, max_answer_len):
    best = (-math.inf, None)
    for w, s, e in zip(windows, starts, ends):
        for i, oi in enumerate(w.context_offsets):
            for j in range(i, min(i + max_answer_len, len(w))):
                oj = w.context_offsets[j]
                if oi is None or oj is None:
                    continue
                si, ei = qa_spans.trim_span(context, *oi)
                sj, ej = qa_spans.trim_span(context, *oj)
                if si == ei or sj == ej:  # whitespace-only tokens neither start nor end a span
                    continue
                if s[i] + e[j] > best[0]:
                    best = (s[i] + e[j], (si, ej))
    return best


# ---- classification --------------------------------------------------------------------------------


def test_classify_postprocess_softmax_sigmoid_top_k():
    logits = np.array([1.0, 3.0, 2.0])
    id2label = {0: "neg", 1: "pos", 2: "neutral"}
    out = classify.postprocess(logits, id2label, None, 0)
    assert [l for l, _ in out] == ["pos", "neutral", "neg"]
    assert sum(s for _, s in out) == pytest.approx(1.0)
    assert out[0][1] == pytest.approx(math.exp(3) / (math.exp(1) + math.exp(2) + math.exp(3)))
    assert classify.postprocess(logits, {"0": "a", "1": "b", "2": "c"}, "single_label_classification", 1) == [
        ("b", pytest.approx(out[0][1]))
    ]
    multi = classify.postprocess(logits, id2label, "multi_label_classification", 2)
    assert multi == [("pos", pytest.approx(1 / (1 + math.exp(-3)))), ("neutral", pytest.approx(1 / (1 + math.exp(-2))))]
    assert classify.postprocess(np.array([0.0, 0.0]), None, None, 0)[0][0] == "LABEL_0"
    with pytest.raises(InvalidArgument, match="top_k"):
        classify.validate_classify(["x"], None, -1, 3, "m")


def test_classify_preprocess_validation(tok):
    with pytest.raises(InvalidArgument, match="texts is empty"):
        classify.validate_classify([], None, 0, 3, "m")
    with pytest.raises(InvalidArgument, match=r"texts\[1\] is empty or only whitespace"):
        classify.validate_classify(["ok", " \n "], None, 0, 3, "m")
    with pytest.raises(InvalidArgument, match="one pair per text"):
        classify.validate_classify(["a", "b"], ["c"], 0, 3, "m")
    encs = classify.preprocess(tok, ["some text", "some longer text"], ["x", "y"], 128)
    assert [e.token_type_ids[-1] for e in encs] == [1, 1]


def test_case_C08_classify_truncates_600_tokens(spm_tokenizer_dir):
    """C08: model_max_length is a placeholder (None); the server's max_seq_len applies, flagged."""
    tok = load_tokenizer(spm_tokenizer_dir)
    assert tok.model_max_length is None
    text = " ".join(["review"] * 600)
    (enc,) = classify.preprocess(tok, [text], None, 512)
    assert len(enc) == 512 and enc.truncated
    (short,) = classify.preprocess(tok, ["fine"], None, 512)
    assert not short.truncated
    windows = tok.qa_windows("what?", text, 384, 128)
    assert len(windows) >= 2 and all(len(w) <= 384 for w in windows)
    s, e = _logits(windows, start=(1, 30), end=(1, 32))
    _check_well_formed(qa_spans.best_answers(windows, s, e, text, top_k=3), text)


# ---- QA ------------------------------------------------------------------------------------------


def test_qa_validation():
    for q, c, what in (("", "ctx", "question"), ("q", " \t", "context"), ("  ", "ctx", "question")):
        with pytest.raises(InvalidArgument, match=f"{what} is empty or only whitespace"):
            qa.validate_answer(q, c, top_k=0, max_answer_len=0, doc_stride=0, allow_impossible=False,
                               null_threshold=None, max_seq_len=64, default_max_answer_len=30, default_doc_stride=16)
    with pytest.raises(InvalidArgument, match="max_answer_len"):
        qa.validate_answer("q", "ctx", top_k=0, max_answer_len=100, doc_stride=0, allow_impossible=False,
                           null_threshold=None, max_seq_len=64, default_max_answer_len=30, default_doc_stride=16)
    for kwargs, what in (({"max_answer_len": 0}, "max_answer_len"), ({"top_k": 0}, "top_k"),
                         ({"null_threshold": math.nan}, "null_threshold")):
        with pytest.raises(ValueError, match=what):
            qa_spans.best_answers([], [], [], "ctx", **kwargs)


def test_case_C04_spans_only_from_context(tok):
    question, context = "test finding", "My name is <NAME> and I live in Berlin"
    windows = tok.qa_windows(question, context, 64, 16)
    (w,) = windows
    q_tokens = [i for i, o in enumerate(w.context_offsets) if o is None]
    # the best logits sit on question and special tokens: never returned
    s, e = _logits(windows)
    for i in q_tokens:
        s[0][i] = e[0][i] = 50.0
    answers = qa_spans.best_answers(windows, s, e, context, top_k=5)
    _check_well_formed(answers, context)
    assert all(not a.is_impossible for a in answers)
    # random logits, many seeds: always well-formed substrings of the context
    for seed in range(20):
        s, e = _logits(windows, seed=seed)
        s = [x * 10 for x in s]
        e = [x * 10 for x in e]
        _check_well_formed(qa_spans.best_answers(windows, s, e, context, top_k=3, allow_impossible=True), context)


def test_case_C05_no_answer(tok):
    question, context = "How is the weather?", "Washington is the capital of the United States."
    windows = tok.qa_windows(question, context, 64, 16)
    c0 = windows[0].token_type_ids.index(1)  # first context token
    s, e = _logits(windows, start=(0, c0), end=(0, c0 + 1), cls=(8.0, 8.0), high=3.0)
    (ans,) = qa_spans.best_answers(windows, s, e, context, allow_impossible=True, null_threshold=0.0)
    assert ans.is_impossible and (ans.text, ans.start, ans.end) == ("", 0, 0)
    # impossible not allowed, or threshold infinite: the best real span
    for kwargs in ({"allow_impossible": False}, {"allow_impossible": True, "null_threshold": math.inf}):
        (ans,) = qa_spans.best_answers(windows, s, e, context, **kwargs)
        assert not ans.is_impossible and context.startswith(ans.text) and ans.text
    # threshold above the margin (16 - 6 = 10): real span
    (ans,) = qa_spans.best_answers(windows, s, e, context, allow_impossible=True, null_threshold=10.5)
    assert not ans.is_impossible
    # top_k with a no-answer: no-answer first, then real spans
    answers = qa_spans.best_answers(windows, s, e, context, top_k=3, allow_impossible=True)
    assert answers[0].is_impossible and len(answers) == 3 and not answers[1].is_impossible
    _check_well_formed(answers, context)


def test_case_C05_null_score_is_min_over_windows(tok):
    context = " ".join(["Washington is the capital of the United States."] * 12)
    windows = tok.qa_windows("How is the weather?", context, 48, 8)
    assert len(windows) >= 3
    c0 = windows[1].token_type_ids.index(1)
    # window 0 says "no answer" loudly; window 1's null is low: min over windows is low -> answer
    s, e = _logits(windows, start=(1, c0), end=(1, c0 + 2), high=4.0)
    s[0][0] = e[0][0] = 20.0
    s[1][0] = e[1][0] = -5.0
    (ans,) = qa_spans.best_answers(windows, s, e, context, allow_impossible=True, null_threshold=0.0)
    assert not ans.is_impossible and ans.text
    # every window says no answer: impossible
    for x, y in zip(s, e):
        x[0] = y[0] = 20.0
    (ans,) = qa_spans.best_answers(windows, s, e, context, allow_impossible=True, null_threshold=0.0)
    assert ans.is_impossible


def test_case_C06_start_before_end_and_length_bound(tok):
    context = "Washington is the capital of the United States and has many museums along the Mall."
    windows = tok.qa_windows("Which city?", context, 64, 16)
    (w,) = windows
    ctx = [i for i, o in enumerate(w.context_offsets) if o is not None]
    # argmax start lies after argmax end
    s, e = _logits(windows, start=(0, ctx[8]), end=(0, ctx[3]))
    s[0][ctx[2]] = 6.0  # second-best start, before the best end
    (ans,) = qa_spans.best_answers(windows, s, e, context, max_answer_len=30)
    best, span = _brute_force_best(windows, s, e, context, 30)
    assert (ans.start, ans.end) == span
    assert (ans.start, ans.end) == (qa_spans.trim_span(context, *w.context_offsets[ctx[2]])[0],
                                    qa_spans.trim_span(context, *w.context_offsets[ctx[3]])[1])
    # length bound in tokens: end - start + 1 <= max_answer_len
    s, e = _logits(windows, start=(0, ctx[1]), end=(0, ctx[9]))
    for L in (1, 2, 4, 9, 30):
        (ans,) = qa_spans.best_answers(windows, s, e, context, max_answer_len=L)
        _, span = _brute_force_best(windows, s, e, context, L)
        assert (ans.start, ans.end) == span
    # random logits: equals the exhaustive search
    for seed in range(10):
        s, e = _logits(windows, seed=seed)
        s = [x * 20 for x in s]
        e = [x * 20 for x in e]
        (ans,) = qa_spans.best_answers(windows, s, e, context, max_answer_len=5)
        assert (ans.start, ans.end) == _brute_force_best(windows, s, e, context, 5)[1]


def test_case_C07_answers_trimmed(tok):
    context = "The capital  is \u00a0Berlin\u200b , not Bonn.\n\n"
    windows = tok.qa_windows("What is the capital?", context, 64, 16)
    (w,) = windows
    for i, o in enumerate(w.context_offsets):
        if o is None:
            continue
        for j in range(i, min(i + 4, len(w) - 1)):
            if w.context_offsets[j] is None:
                continue
            s, e = _logits(windows, start=(0, i), end=(0, j), high=30.0)
            answers = qa_spans.best_answers(windows, s, e, context, top_k=2, max_answer_len=4)
            _check_well_formed(answers, context)
    # leading space of SentencePiece offsets (C07): "▁Berlin" covers " \xa0Berlin" or similar
    b = context.index("Berlin")
    tok_i = next(i for i, o in enumerate(w.context_offsets) if o and o[0] <= b < o[1])
    tok_j = next(i for i, o in enumerate(w.context_offsets) if o and o[0] < b + 6 <= o[1])
    s, e = _logits(windows, start=(0, tok_i), end=(0, tok_j), high=30.0)
    (ans,) = qa_spans.best_answers(windows, s, e, context)
    assert ans.text == "Berlin" and context[ans.start : ans.end] == "Berlin"


def test_top_k_distinct_spans_across_windows(tok):
    context = " ".join(["Washington is the capital of the United States."] * 8)
    windows = tok.qa_windows("capital?", context, 48, 16)
    s, e = _logits(windows, seed=3)
    answers = qa_spans.best_answers(windows, s, e, context, top_k=10)
    spans = [(a.start, a.end) for a in answers]
    assert len(spans) == len(set(spans)) == 10
    assert [a.score for a in answers] == sorted((a.score for a in answers), reverse=True)
    _check_well_formed(answers, context)


@pytest.mark.parametrize("sample", ["xquad_zh_sample.jsonl", "xquad_de_sample.jsonl"])
def test_multilingual_gold_answers_round_trip(tok, sample):
    """Logits at the tokens covering a gold answer give back that answer (or a span just around it)."""
    exact = total = 0
    for row in qa_rows(sample, answers=True):
        ctx = row["context"]
        ans = row["answers"][0]
        a0, a1 = ans["answer_start"], ans["answer_start"] + len(ans["text"])
        assert ctx[a0:a1] == ans["text"]
        # clamp_stride: the tiny test tokenizer makes some questions long (65 tokens leave room for an overlap of 62)
        windows = tok.qa_windows(row["question"], ctx, 192, 64, clamp_stride=True)
        # the first window holding the whole answer
        for w_i, w in enumerate(windows):
            idx = [i for i, o in enumerate(w.context_offsets) if o and o[0] < a1 and o[1] > a0 and o[1] > o[0]]
            offs = [o for o in w.context_offsets if o]
            if idx and offs[0][0] <= a0 and offs[-1][1] >= a1:
                break
        else:
            pytest.fail(f"no window holds the answer of {row['id']}")
        s, e = _logits(windows, start=(w_i, idx[0]), end=(w_i, idx[-1]), high=30.0)
        (got,) = qa_spans.best_answers(windows, s, e, ctx, max_answer_len=64)
        assert got.text == ctx[got.start : got.end]
        assert got.start <= a0 and got.end >= a1, (row["id"], got, ans)  # whole tokens around the answer
        total += 1
        exact += got.text == ans["text"].strip()
    # token boundaries of a tiny vocabulary do not always fall on answer boundaries (Chinese especially)
    print(f"{sample}: {exact}/{total} exact")
    assert exact / total > 0.85, (exact, total)


# ---- per-request limits (checked before any tokenizing) ---------------------------------------------------


def test_classify_request_size_limits_name_the_keys():
    with pytest.raises(InvalidArgument, match=r"257 texts; model 'm' takes at most 256 per request "
                                              r"\(max_request_texts\)"):
        classify.validate_classify(["a"] * 257, None, 0, 2, "m", max_texts=256, max_chars=10**6)
    with pytest.raises(InvalidArgument, match=r"has 12 characters; .* at most 11 per request \(max_request_chars\)"):
        classify.validate_classify(["abcd", "ef"], ["ghijkl", ""], 0, 2, "m", max_texts=256, max_chars=11)
    # the size limits come first: a request over them is refused before any per-text work
    with pytest.raises(InvalidArgument, match="max_request_chars"):
        classify.validate_classify(["   "], None, 0, 2, "m", max_chars=2)
    assert classify.validate_classify(["abcd", "ef"], ["ghijk", "l"], 0, 2, "m", max_texts=2, max_chars=12)[0]


def test_answer_limits_doc_stride_and_default_flag():
    common = dict(top_k=0, max_answer_len=0, allow_impossible=False, null_threshold=None, max_seq_len=64,
                  default_max_answer_len=30, default_doc_stride=16)
    opts = qa.validate_answer("q", "c", doc_stride=0, **common)
    assert opts.doc_stride == 16 and opts.stride_is_default
    opts = qa.validate_answer("q", "c", doc_stride=30, **common)  # (64 - 4) // 2
    assert opts.doc_stride == 30 and not opts.stride_is_default
    with pytest.raises(InvalidArgument, match="doc_stride 31 is over the limit of 30 tokens"):
        qa.validate_answer("q", "c", doc_stride=31, **common)
    with pytest.raises(InvalidArgument, match=r"has 9 characters; model 'qa' .* \(max_request_chars\)"):
        qa.validate_answer("what", "ctxxx", doc_stride=0, max_chars=8, model="qa", **common)



# ---- scores as transformers' text-classification pipeline (issue 13 item 4) -----------------------------


def test_classify_default_function_as_the_pipeline():
    # TextClassificationPipeline.postprocess: regression -> none; multi-label or one label -> sigmoid (checked
    # before single_label_classification); single-label or several labels -> softmax; else none
    assert classify.default_function(None, 1) == "sigmoid"  # DeBERTa-v3 cross-encoder rerankers
    assert classify.default_function("regression", 1) == "none"
    assert classify.default_function("multi_label_classification", 3) == "sigmoid"
    assert classify.default_function("single_label_classification", 1) == "sigmoid"
    assert classify.default_function("single_label_classification", 3) == "softmax"
    assert classify.default_function(None, 3) == "softmax"
    assert classify.default_function(None, 0) == "none"


def test_classify_one_label_regression_and_override():
    sigmoid = 1 / (1 + math.exp(-0.79))
    assert sigmoid == pytest.approx(0.688, abs=5e-4)
    assert classify.postprocess(np.array([0.79]), None, None, 0) == [("LABEL_0", pytest.approx(sigmoid))]
    assert classify.postprocess(np.array([-2.5]), None, "regression", 0) == [("LABEL_0", -2.5)]
    logits = np.array([1.0, 3.0, -2.0])
    labels = {0: "a", 1: "b", 2: "c"}
    soft = classify.postprocess(logits, labels, "multi_label_classification", 0, "softmax")
    assert [l for l, _ in soft] == ["b", "a", "c"] and sum(s for _, s in soft) == pytest.approx(1.0)
    assert classify.postprocess(logits, labels, None, 0, "none") == [("b", 3.0), ("a", 1.0), ("c", -2.0)]
    sig = classify.postprocess(logits, labels, None, 2, "sigmoid")
    assert sig == [("b", pytest.approx(1 / (1 + math.exp(-3)))), ("a", pytest.approx(1 / (1 + math.exp(-1))))]
    assert classify.postprocess(np.array([0.5]), None, "regression", 0, "sigmoid")[0][1] == pytest.approx(
        1 / (1 + math.exp(-0.5)))


def test_classify_function_to_apply_validation():
    assert classify.validate_function("") is None
    assert classify.validate_function("SoftMax") == "softmax"  # case-insensitive, as the pipeline's enum lookup
    assert [classify.validate_function(f) for f in classify.FUNCTIONS] == ["softmax", "sigmoid", "none"]
    with pytest.raises(InvalidArgument, match=r"^function_to_apply 'relu' is not one of softmax, sigmoid, none"):
        classify.validate_function("relu")


# ---- QA align_to_words (issue 13 item 10) ----------------------------------------------------------------


def test_word_span_widens_to_whitespace_delimited_words():
    ctx = "Berlin is the capital of Germany.\nIt is\tlarge,  10\u00a0km across \u00a0ok"
    g = ctx.index("Germany")
    assert ctx[slice(*qa_spans.word_span(ctx, g, g + 3))] == "Germany."  # not "Ger"
    assert ctx[slice(*qa_spans.word_span(ctx, g + 2, g + 4))] == "Germany."
    assert ctx[slice(*qa_spans.word_span(ctx, 2, ctx.index("capital") + 1))] == "Berlin is the capital"
    i = ctx.index("It")
    assert ctx[slice(*qa_spans.word_span(ctx, i, i + 1))] == "It"  # a line break ends the word before it
    assert ctx[slice(*qa_spans.word_span(ctx, i + 4, i + 5))] == "is"  # a tab
    assert ctx[slice(*qa_spans.word_span(ctx, ctx.index("large"), ctx.index("large") + 1))] == "large,"
    # a lone no-break space stays inside its word (DeBERTa's normalizer only replaces runs of two or more)
    assert ctx[slice(*qa_spans.word_span(ctx, ctx.index("km"), ctx.index("km") + 1))] == "10\u00a0km"
    assert ctx[slice(*qa_spans.word_span(ctx, len(ctx) - 1, len(ctx)))] == "ok"  # " \u00a0" is a run: a break
    assert qa_spans.word_span(ctx, 0, 1) == (0, len("Berlin"))


def _mid_word_token(w, context):
    """A context token of window ``w`` that starts inside a word (a piece after the first of a word)."""
    for i, o in enumerate(w.context_offsets):
        if o is None:
            continue
        s, e = qa_spans.trim_span(context, *o)
        if e > s and s > 0 and not context[s - 1].isspace():
            return i, (s, e)
    raise AssertionError("no mid-word token")


def test_align_to_words_widens_answers_and_merges_them(tok):
    context = "Washington is the capital of the United States and has many museums along the Mall."
    windows = tok.qa_windows("Which city?", context, 64, 16)
    (w,) = windows
    i, (s0, e0) = _mid_word_token(w, context)
    s, e = _logits(windows, start=(0, i), end=(0, i), high=30.0)
    (tokens,) = qa_spans.best_answers(windows, s, e, context)
    assert (tokens.start, tokens.end) == (s0, e0)  # token-exact: mid-word
    (words,) = qa_spans.best_answers(windows, s, e, context, align_to_words=True)
    ws, we = qa_spans.word_span(context, s0, e0)
    assert (words.start, words.end) == (ws, we) and words.text == context[ws:we] and words.text.strip() == words.text
    assert ws < s0 and (ws == 0 or context[ws - 1] == " ") and (we == len(context) or context[we] == " ")
    # token spans inside one word become one answer: the top answers are distinct whole words
    answers = qa_spans.best_answers(windows, s, e, context, top_k=5, align_to_words=True)
    assert len({(a.start, a.end) for a in answers}) == len(answers)
    for a in answers:
        assert (a.start, a.end) == qa_spans.word_span(context, a.start, a.end)
    _check_well_formed(answers, context)


def test_cases_C04_C07_hold_with_align_to_words(tok):
    context = "The capital  is \u00a0Berlin\u200b , not Bonn.\n\n My name is <NAME> and I live in Berlin"
    windows = tok.qa_windows("test finding", context, 64, 16)
    for seed in range(20):
        s, e = _logits(windows, seed=seed)
        s = [x * 10 for x in s]
        e = [x * 10 for x in e]
        for allow in (False, True):
            answers = qa_spans.best_answers(windows, s, e, context, top_k=3, allow_impossible=allow,
                                            align_to_words=True)
            _check_well_formed(answers, context)  # substrings of the context, trimmed (C04, C07)
            for a in answers:
                if not a.is_impossible:
                    assert (a.start, a.end) == qa_spans.word_span(context, a.start, a.end)


def test_answer_align_to_words_option():
    common = dict(top_k=0, max_answer_len=0, allow_impossible=False, null_threshold=None, max_seq_len=128,
                  default_max_answer_len=30, default_doc_stride=32, doc_stride=0)
    assert qa.validate_answer("q", "c", **common).align_to_words is True  # the pipeline's default
    assert qa.validate_answer("q", "c", default_align_to_words=False, **common).align_to_words is False
    assert qa.validate_answer("q", "c", align_to_words=False, **common).align_to_words is False
    assert qa.validate_answer("q", "c", align_to_words=True, default_align_to_words=False, **common).align_to_words


WORD_CONTEXTS = ["Berlin is the capital of Germany.", "10\u00a0km across \u00a0ok", "a\u3000b c\u2009d", "x\u200by  z\n\nw",
                 "Die Broncos\tdefeated 24\u201310,\nearning", "丹佛野马队以24比10击败了卡罗莱纳黑豹队，赢得了第50届超级碗。"]


@pytest.mark.parametrize("tok_dir", TOKENIZER_DIRS)
def test_word_span_is_the_words_transformers_tokenizer_gives(request, hf_tokenizer, tok_dir):
    """For every context token, word_span equals the pipeline's word_to_chars(token_to_word(token)) on
    transformers' tokenizer for the same files (trimmed, C07)."""
    hf = hf_tokenizer(request.getfixturevalue(tok_dir))
    for ctx in WORD_CONTEXTS:
        enc = hf("q", ctx, return_offsets_mapping=True)
        checked = 0
        for t, sid in enumerate(enc.sequence_ids()):
            s, e = qa_spans.trim_span(ctx, *enc["offset_mapping"][t]) if sid == 1 else (0, 0)
            if e <= s:
                continue
            hs, he = enc.word_to_chars(enc.token_to_word(t), sequence_index=1)
            assert qa_spans.word_span(ctx, s, e) == qa_spans.trim_span(ctx, hs, he), (ctx, ctx[s:e])
            checked += 1
        assert checked
