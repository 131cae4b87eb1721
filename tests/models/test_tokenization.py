"""relserve.models.tokenization against transformers' AutoTokenizer on the same directories (the oracle)."""

from __future__ import annotations

import itertools
import json
import random
import unicodedata
from pathlib import Path

import pytest

from fixtures.data import SHARED_DATA, data_path, jsonl, qa_rows
from relserve.models.tokenization import load_tokenizer
from relserve.models.tokenization.tokenizer import _longest_first
from relserve.models.training.tokenizer import corpus_lines, train_unigram_tokenizer

TOKENIZER_DIRS = ["unigram_tokenizer_dir", "spm_tokenizer_dir"]
DEFAULTS = Path(__file__).resolve().parents[2] / "defaults"


def load_v5(directory):
    """Our tokenizer as transformers 5 builds it (the oracle of the tests that compare with AutoTokenizer): an
    spm.model-only directory without the model's own normaliser (spm_normalization "transformers5"; the default
    "spm" is checked against sentencepiece itself, tests/models/test_spm_normalization.py)."""
    return load_tokenizer(directory, spm_normalization="transformers5")


def _texts() -> list[str]:
    en = [r["text"] for r in jsonl("sentiment/dev.jsonl", 8)]
    de = [r["source"] for r in jsonl("translation/de_en_dev.jsonl", 8)]
    zh = [r["context"][:120] for r in qa_rows("xquad_zh_sample.jsonl")[10:14]]
    de += [r["context"][:200] for r in qa_rows("xquad_de_sample.jsonl")[:3]]
    odd = [
        "Hello, my dog is cute",
        "  leading  spaces\tand\nnew\r\nlines  ",
        "a\u00a0b \u200bc\ufeffd e\u00a0\u00a0f",  # NBSP, zero-width space, BOM
        "Cafe\u0301 Café ﬁne Ｔｅｓｔ",  # combining accent (NFC), ligature, full width
        "x",
        "",
        "   ",
    ]
    return en + de + zh + odd


@pytest.fixture(params=TOKENIZER_DIRS)
def tok_dir(request):
    return request.getfixturevalue(request.param)


def test_special_ids_and_max_length(unigram_tokenizer_dir, spm_tokenizer_dir, hf_tokenizer):
    for d, max_len in ((unigram_tokenizer_dir, 512), (spm_tokenizer_dir, None)):
        ours, hf = load_v5(d), hf_tokenizer(d)
        assert (ours.cls_token_id, ours.sep_token_id, ours.pad_token_id, ours.unk_token_id) == (1, 2, 0, 3)
        assert (hf.cls_token_id, hf.sep_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 0, 3)
        assert ours.model_max_length == max_len


def test_ids_and_type_ids_match_transformers(tok_dir, hf_tokenizer):
    ours, hf = load_v5(tok_dir), hf_tokenizer(tok_dir)
    texts = _texts()
    for t in texts:
        h = hf(t)
        e = ours.encode(t)
        assert e.input_ids == h["input_ids"], t
        assert e.token_type_ids == h["token_type_ids"], t
        assert not e.truncated
    for a, b in zip(texts[:-2], texts[3:-2]):
        h = hf(a, b)
        e = ours.encode(a, b)
        assert (e.input_ids, e.token_type_ids) == (h["input_ids"], h["token_type_ids"]), (a, b)


def test_offsets_match_transformers_after_trimming(tok_dir, hf_tokenizer):
    """Each token's characters equal transformers' offsets for the token, up to surrounding spaces."""
    ours, hf = load_v5(tok_dir), hf_tokenizer(tok_dir)
    for t in _texts():
        ids, offs = ours.tokenize(t)
        h = hf(t, add_special_tokens=False, return_offsets_mapping=True)
        assert ids == h["input_ids"]
        for (s, e), (hs, he) in zip(offs, h["offset_mapping"]):
            assert 0 <= s <= e <= len(t)
            if s < e:  # our zero-width tokens are the dummy prefix "▁"
                # transformers aligns a composed character (NFC) to its base only; ours spans the marks too
                same = t[s:e].strip() == t[hs:he].strip()
                assert same or (s <= hs <= he <= e and unicodedata.combining(t[e - 1])), (t, (s, e), (hs, he))
        starts = [s for s, _ in offs]
        assert starts == sorted(starts)


@pytest.mark.parametrize("max_length", [6, 7, 12, 25])
def test_longest_first_truncation_matches_transformers(tok_dir, hf_tokenizer, max_length):
    ours, hf = load_v5(tok_dir), hf_tokenizer(tok_dir)
    a = "The Panthers defense gave up just 308 points, ranking sixth in the league."
    b = "How many points?"
    for x, y in ((a, b), (b, a), (a, a)):
        h = hf(x, y, truncation=True, max_length=max_length)
        e = ours.encode(x, y, max_length=max_length)
        assert e.input_ids == h["input_ids"] and e.token_type_ids == h["token_type_ids"]
        assert e.truncated == (len(e) < ours.num_tokens(x, y))
    h = hf(a, truncation=True, max_length=max_length)
    e = ours.encode(a, max_length=max_length)
    assert e.input_ids == h["input_ids"]
    assert e.truncated == (ours.num_tokens(a) > max_length)


def test_longest_first_lengths():
    assert _longest_first(3, 4, 10) == (3, 4)
    assert _longest_first(20, 2, 10) == (8, 2)
    assert _longest_first(2, 20, 10) == (2, 8)
    assert _longest_first(20, 20, 9) == (4, 5)
    assert _longest_first(30, 20, 9) == (5, 4)


@pytest.mark.parametrize("max_seq_len,doc_stride", [(48, 0), (64, 16), (96, 40)])
def test_qa_windows_match_transformers_overflow(tok_dir, hf_tokenizer, max_seq_len, doc_stride):
    ours, hf = load_v5(tok_dir), hf_tokenizer(tok_dir)
    row = qa_rows("xquad_en_dev.jsonl")[0]
    question, context = "Who won?", row["context"]
    windows = ours.qa_windows(question, context, max_seq_len, doc_stride)
    h = hf(
        question,
        context,
        truncation="only_second",
        max_length=max_seq_len,
        stride=doc_stride,
        return_overflowing_tokens=True,
    )
    assert len(windows) == len(h["input_ids"]) > 1
    for w, ids, types in zip(windows, h["input_ids"], h["token_type_ids"]):
        assert w.input_ids == ids and w.token_type_ids == types
        assert len(w) <= max_seq_len
        q_len = w.token_type_ids.index(1)
        assert all(o is None for o in w.context_offsets[:q_len]) and w.context_offsets[-1] is None
        assert all(o is not None for o in w.context_offsets[q_len:-1])
    # consecutive windows share exactly doc_stride context tokens
    for w0, w1 in zip(windows, windows[1:]):
        c0 = [o for o in w0.context_offsets if o is not None]
        c1 = [o for o in w1.context_offsets if o is not None]
        assert c0[len(c0) - doc_stride :] == c1[:doc_stride] if doc_stride else c0[-1][1] <= c1[0][1]
    # together the windows cover every context token
    _, all_offs = ours.tokenize(context)
    covered = {o for w in windows for o in w.context_offsets if o is not None}
    assert covered == set(all_offs)


def test_qa_windows_long_question_is_cut(tok_dir):
    ours = load_tokenizer(tok_dir)
    q = "what " * 200
    windows = ours.qa_windows(q, "Washington is the capital of the United States.", 64, 8)
    assert windows and all(len(w) <= 64 for w in windows)
    assert windows[0].question_truncated
    assert windows[0].token_type_ids.index(1) - 2 == (64 - 3) // 2  # question tokens


def test_case_C08_placeholder_max_length_and_600_tokens(spm_tokenizer_dir, tmp_path):
    """C08: a huge model_max_length placeholder means "no limit" (None); our own limit still applies."""
    ours = load_tokenizer(spm_tokenizer_dir)
    assert ours.model_max_length is None
    text = " ".join(["word"] * 600)
    assert ours.num_tokens(text) >= 600
    e = ours.encode(text, max_length=512)
    assert len(e) == 512 and e.truncated and e.input_ids[-1] == ours.sep_token_id
    windows = ours.qa_windows("what?", text, 384, 128)
    assert len(windows) >= 2 and all(len(w) <= 384 for w in windows)
    # placeholders written in other forms
    cfg = json.loads((spm_tokenizer_dir / "tokenizer_config.json").read_text())
    for value, expected in ((1000000000000000019884624838656, None), (10**6, None), (256, 256)):
        d = tmp_path / f"c{value}"
        d.mkdir()
        (d / "spm.model").write_bytes((spm_tokenizer_dir / "spm.model").read_bytes())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": value}))
        assert load_tokenizer(d).model_max_length == expected


def test_do_lower_case_spm(spm_tokenizer_dir, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    cfg = json.loads((spm_tokenizer_dir / "tokenizer_config.json").read_text())
    d = tmp_path / "lower"
    d.mkdir()
    (d / "spm.model").write_bytes((spm_tokenizer_dir / "spm.model").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "do_lower_case": True}))
    ours, hf = load_v5(d), AutoTokenizer.from_pretrained(str(d))
    for t in ("The PANTHERS Defense", "Ärger İstanbul ΣΑΣ"):
        assert ours.encode(t).input_ids == hf(t)["input_ids"]
        ids, offs = ours.tokenize(t)
        assert all(0 <= s <= e <= len(t) for s, e in offs)


def test_split_by_punct_transformers5_matches_transformers(spm_tokenizer_dir, tmp_path):
    """split_by_punct with spm_normalization transformers5: transformers 5's Punctuation("isolated") pre-tokenizer
    (each punctuation character a segment with its own prefix ▁), ids, pairs and offsets."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    cfg = json.loads((spm_tokenizer_dir / "tokenizer_config.json").read_text())
    d = tmp_path / "punct"
    d.mkdir()
    (d / "spm.model").write_bytes((spm_tokenizer_dir / "spm.model").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "split_by_punct": True}))
    ours, hf = load_v5(d), AutoTokenizer.from_pretrained(str(d))
    texts = _texts() + ["Hello, world! It's 3.5 (really) -- isn't it?", "a , b", ", ,", "  x.y  ", ".start", "end."]
    for t in texts:
        assert ours.encode(t).input_ids == hf(t)["input_ids"], t
        ids, offs = ours.tokenize(t)
        assert all(0 <= s <= e <= len(t) for s, e in offs) and [s for s, _ in offs] == sorted(s for s, _ in offs)
    assert ours.encode(texts[-6]).input_ids != load_v5(spm_tokenizer_dir).encode(texts[-6]).input_ids
    for a, b in zip(texts[:6], texts[-6:]):
        e, h = ours.encode(a, b), hf(a, b)
        assert (e.input_ids, e.token_type_ids) == (h["input_ids"], h["token_type_ids"])


def test_missing_files_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json nor spm.model"):
        load_tokenizer(tmp_path)


def test_train_tokenizer_loads_in_both(tmp_path, hf_tokenizer):
    data_path("sentiment/train.jsonl")  # corpus_lines reads it first; its first 1500 lines are all used here
    lines = list(itertools.islice(corpus_lines(SHARED_DATA), 1500))
    out1 = train_unigram_tokenizer(lines, tmp_path / "a", vocab_size=600)
    out2 = train_unigram_tokenizer(lines, tmp_path / "b", vocab_size=600)
    assert (out1 / "tokenizer.json").read_bytes() == (out2 / "tokenizer.json").read_bytes()  # deterministic
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out1 / f).is_file()
    ours, hf = load_tokenizer(out1), hf_tokenizer(out1)
    assert (ours.pad_token_id, ours.cls_token_id, ours.sep_token_id, ours.unk_token_id) == (0, 1, 2, 3)
    assert ours.model_max_length == 512
    for a, b in (("Hello, my dog is cute", None), ("ﬁne Ｔｅｓｔ  x", "a pair of words")):
        h = hf(a, b) if b is not None else hf(a)
        e = ours.encode(a, b)
        assert (e.input_ids, e.token_type_ids) == (h["input_ids"], h["token_type_ids"])


# ---- bounded work: whitespace-cut prefixes, is_blank, QA and translation limits -----------------------------

# separators that stress the cut rule: whitespace runs, exotic whitespace alone (not a word boundary before
# Metaspace), Python-only whitespace (\x1c), zero-width characters, combining marks after a space, and a
# character whose NFKC form starts with a space (U+00A8)
_SEPARATORS = [" ", "  ", "\n", "\t", "\r\n", "\u2028", "\u2028\u2028", "\u00a0", " \u00a0", "\u3000", "\x1c",
               "\u200b ", " \u0308", "\u00a8 ", " \u00a8", "\u1680", " \u2029 "]


def _mangled(rng: random.Random, text: str) -> str:
    return "".join(w + rng.choice(_SEPARATORS) for w in text.split(" "))


def _stress_texts() -> list[str]:
    rng = random.Random(7)
    base = [t for t in _texts() if t.strip()]
    out = []
    for i, t in enumerate(base):
        out.append(_mangled(rng, t) * (1 + i % 5))  # a few to several hundred tokens
    out.append("字" * 700)  # no whitespace at all: one word
    out.append("x" + " " * 5000 + "y " * 300)  # a long whitespace run before the words
    out.append(" ".join(["a"] * 900))
    return out


def _full_encode(tok, a, b, max_length):
    """The reference: tokenize the whole texts, then LongestFirst (what transformers does)."""
    ta = tok.tokenize(a)[0]
    tb = tok.tokenize(b)[0] if b is not None else None
    budget = max_length - (3 if tb is not None else 2)
    if tb is None:
        return [tok.cls_token_id, *ta[:budget], tok.sep_token_id], len(ta) > budget
    n1, n2 = _longest_first(len(ta), len(tb), budget)
    ids = [tok.cls_token_id, *ta[:n1], tok.sep_token_id, *tb[:n2], tok.sep_token_id]
    return ids, n1 < len(ta) or n2 < len(tb)


@pytest.fixture(params=["unigram_tokenizer_dir", "spm_tokenizer_dir", "spm_transformers5", "spm_punct",
                        "spm_punct_transformers5", "defaults_sentiment", "bare_metaspace", "no_pre_tokenizer"])
def any_tok(request, tmp_path_factory):
    """The two fixture tokenizers (the spm.model one with its own normaliser, as transformers 5 builds it, and both
    with split_by_punct), the default model's (NFKC), and two variants of the fixture tokenizer.json: Metaspace
    without the whitespace-run replacement (SPACE_CUT) and no pre-tokenizer (no cut: whole texts)."""
    if request.param in ("spm_punct", "spm_punct_transformers5"):
        src = request.getfixturevalue("spm_tokenizer_dir")
        d = tmp_path_factory.mktemp(request.param)
        (d / "spm.model").write_bytes((src / "spm.model").read_bytes())
        cfg = json.loads((src / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "split_by_punct": True}))
        return load_v5(d) if request.param.endswith("transformers5") else load_tokenizer(d)
    if request.param == "defaults_sentiment":
        return load_tokenizer(DEFAULTS / "sentiment")
    if request.param in ("bare_metaspace", "no_pre_tokenizer"):
        src = request.getfixturevalue("unigram_tokenizer_dir")
        d = tmp_path_factory.mktemp(request.param)
        for f in src.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        spec = json.loads((d / "tokenizer.json").read_text())
        if request.param == "bare_metaspace":
            spec["normalizer"] = {"type": "NFC"}
        else:
            spec["pre_tokenizer"] = None
        (d / "tokenizer.json").write_text(json.dumps(spec))
        return load_tokenizer(d)
    if request.param == "spm_transformers5":
        return load_v5(request.getfixturevalue("spm_tokenizer_dir"))
    return load_tokenizer(request.getfixturevalue(request.param))


def test_cut_patterns_chosen_per_pipeline(unigram_tokenizer_dir, spm_tokenizer_dir):
    from relserve.models.tokenization import SPACE_CUT, WORD_CUT
    from relserve.models.tokenization.prefix import _cut_pattern_for

    assert load_tokenizer(unigram_tokenizer_dir).backend.cut_pattern is WORD_CUT
    assert load_tokenizer(spm_tokenizer_dir).backend.cut_pattern is SPACE_CUT  # the model's own normaliser
    assert load_v5(spm_tokenizer_dir).backend.cut_pattern is WORD_CUT
    spec = json.loads((unigram_tokenizer_dir / "tokenizer.json").read_text())
    assert _cut_pattern_for({**spec, "normalizer": {"type": "NFKC"}}) is SPACE_CUT
    assert _cut_pattern_for({**spec, "pre_tokenizer": None}) is None
    joins = {"type": "Replace", "pattern": {"Regex": r"\s+"}, "content": ""}  # would join words: not exact
    assert _cut_pattern_for({**spec, "normalizer": joins}) is None
    spaced = {**spec, "added_tokens": [*spec["added_tokens"], {"content": "new york", "special": False}]}
    assert _cut_pattern_for(spaced) is None


@pytest.mark.parametrize("max_length", [5, 6, 7, 8, 33, 64, 128, 301])
def test_prefix_encoding_equals_whole_text_tokenization(any_tok, max_length):
    """input_ids and truncated of batch_encode (prefix tokenization) == whole-text tokenization + LongestFirst,
    for single texts and pairs, odd and even budgets (pairs where both are over an odd budget need the order)."""
    texts = _stress_texts()
    singles = any_tok.batch_encode(texts, max_length=max_length)
    for t, e in zip(texts, singles):
        assert (e.input_ids, e.truncated) == _full_encode(any_tok, t, None, max_length), repr(t[:60])
    rng = random.Random(max_length)
    firsts = texts + [t[: len(t) // 2] for t in texts]
    seconds = [rng.choice(texts) for _ in firsts]
    pairs = any_tok.batch_encode(firsts, seconds, max_length=max_length)
    for a, b, e in zip(firsts, seconds, pairs):
        assert (e.input_ids, e.truncated) == _full_encode(any_tok, a, b, max_length), (repr(a[:40]), repr(b[:40]))
        assert len(e.input_ids) <= max_length


def test_every_safe_cut_gives_a_prefix_of_the_whole_tokenization(any_tok):
    """The invariant the prefix scheme rests on, checked at every cut the tokenizer's pattern allows: the
    tokens of text[:k] are the first tokens of text (ids and offsets)."""
    pattern = any_tok.backend.cut_pattern
    if pattern is None:  # no safe cut: the whole text is always tokenized
        assert any_tok.leading_tokens(["a b c " * 100], [2])[0].complete
        return
    rng = random.Random(11)
    checked = 0
    for text in _stress_texts():
        text = text[:3000]
        ids, offs = any_tok.tokenize(text)
        cuts = [m.start() for m in pattern.finditer(text)]
        for k in rng.sample(cuts, min(len(cuts), 25)):
            p_ids, p_offs = any_tok.tokenize(text[:k])
            assert (p_ids, p_offs) == (ids[: len(p_ids)], offs[: len(p_offs)]), (repr(text[max(0, k - 20):k + 5]), k)
            checked += 1
    assert checked > 300


class _WordBackend:
    """One token per whitespace-separated word (id = its length): lengths of any size, cheaply."""

    def __init__(self) -> None:
        from relserve.models.tokenization import WORD_CUT

        self.cut_pattern = WORD_CUT
        self.calls: list[int] = []

    def tokenize_batch(self, texts, offsets):
        self.calls.extend(len(t) for t in texts)
        return [([len(w) for w in t.split()], []) for t in texts]

    def tokenize(self, text):
        return self.tokenize_batch([text], True)[0]


def test_pair_truncation_matches_longest_first_for_every_length_pair():
    from relserve.models.tokenization import Tokenizer

    tok = Tokenizer(backend=_WordBackend(), cls_token_id=1, sep_token_id=2, pad_token_id=0, unk_token_id=None,
                    model_max_length=None, source="words")
    for budget in range(2, 10):
        for n1 in range(0, 3 * budget + 3):
            for n2 in range(0, 3 * budget + 3):
                a, b = "w " * n1 + "x", "vv " * n2 + "y"  # n1 + 1 and n2 + 1 tokens
                e = tok.encode(a, b, max_length=budget + 3)
                assert (e.input_ids, e.truncated) == _full_encode(tok, a, b, budget + 3), (budget, n1, n2)


def test_prefix_work_is_bounded_by_the_budget_not_the_text(unigram_tokenizer_dir):
    """A 4 MiB text of prose is tokenized only as far as the budget needs; text without any whitespace has no
    safe cut and is tokenized whole (bounded by the request's character limit instead)."""
    tok = load_tokenizer(unigram_tokenizer_dir)
    prose = " ".join(_texts()[:20])
    big = (prose + " ") * (4 * 1024 * 1024 // (len(prose) + 1))
    (lead,) = tok.leading_tokens([big], [511])
    assert not lead.complete and len(lead.ids) >= 511
    assert lead.chars < 511 * 20  # a few characters per token, far from 4 MiB
    assert lead.ids[:511] == tok.tokenize(big[: lead.chars + 2000])[0][:511]
    e = tok.encode(big, max_length=512)
    assert len(e.input_ids) == 512 and e.truncated
    word = "abcdefghij" * 2000
    (whole,) = tok.leading_tokens([word], [10])
    assert whole.complete and whole.chars == len(word)


def test_is_blank_equals_the_per_character_definition():
    from relserve.models.tokenization import INVISIBLE, is_blank, is_blank_char

    def reference(text):
        return all(is_blank_char(ch) for ch in text)

    for cp in range(0x110000):  # every single character, surrogates included
        ch = chr(cp)
        assert is_blank(ch) == reference(ch), hex(cp)
    blanks = [c for c in map(chr, range(0x3100)) if c.isspace()] + sorted(INVISIBLE)
    others = ["a", "\x1c"[:0] or "x", "\u00a8", "字", "\u0308", "\u200e", "\U0001f600", "\ud800"]
    rng = random.Random(3)
    tricky = ["", " " * 100000, "\u200b" * 1000, " \u200b\ufeff\u2060 \n", "\ufeff" * 3 + "a", "a" + " " * 1000,
              " " * 1000 + "\u200b" + " " * 1000 + "x"]
    for _ in range(3000):
        n = rng.randint(1, 12)
        s = "".join(rng.choice(blanks) for _ in range(n))
        if rng.random() < 0.5:
            i = rng.randint(0, n)
            s = s[:i] + rng.choice(others) + s[i:]
        tricky.append(s)
    for s in tricky:
        assert is_blank(s) == reference(s), repr(s[:40])


def _room(tok, question, max_seq_len):
    q = tok.tokenize(question)[0][: (max_seq_len - 3) // 2]
    return max_seq_len - 3 - len(q)


def test_qa_doc_stride_over_half_the_room_is_refused_or_clamped(tok_dir):
    from relserve.models.tokenization import DocStrideTooLarge

    tok = load_tokenizer(tok_dir)
    question, context = "Who won the game?", qa_rows("xquad_en_dev.jsonl")[0]["context"]
    room = _room(tok, question, 64)
    limit = room // 2
    at_limit = tok.qa_windows(question, context, 64, limit)
    c0 = [o for o in at_limit[0].context_offsets if o is not None]
    c1 = [o for o in at_limit[1].context_offsets if o is not None]
    assert c0[len(c0) - limit:] == c1[:limit]  # overlap is exactly doc_stride tokens
    with pytest.raises(DocStrideTooLarge, match=f"doc_stride {limit + 1} is over the limit of {limit} tokens") as err:
        tok.qa_windows(question, context, 64, limit + 1)
    assert err.value.limit == limit and "max_seq_len 64" in str(err.value)
    clamped = tok.qa_windows(question, context, 64, room - 1, clamp_stride=True)
    assert [w.input_ids for w in clamped] == [w.input_ids for w in at_limit]


def test_qa_window_limit_counts_before_building_windows(tok_dir):
    from relserve.models.tokenization import TooManyWindows, qa_window_count

    tok = load_tokenizer(tok_dir)
    question, context = "Who won the game?", qa_rows("xquad_en_dev.jsonl")[0]["context"]
    windows = tok.qa_windows(question, context, 48, 8)
    room = _room(tok, question, 48)
    assert len(windows) == qa_window_count(len(tok.tokenize(context)[0]), room, room - 8) > 2
    assert len(tok.qa_windows(question, context, 48, 8, max_windows=len(windows))) == len(windows)
    with pytest.raises(TooManyWindows, match=f"the limit is {len(windows) - 1} windows") as err:
        tok.qa_windows(question, context, 48, 8, max_windows=len(windows) - 1)
    assert err.value.windows > len(windows) - 1
    huge = (context + " ") * (1_000_000 // len(context))  # 1 MB: refused from a prefix of it
    with pytest.raises(TooManyWindows, match="at least") as err:
        tok.qa_windows(question, huge, 384, 128, max_windows=64)
    assert not err.value.exact and err.value.tokens < len(huge) // 10


def test_translation_source_bounded_equals_whole_encoding(tmp_path):
    """encode_source_bounded == encode_source when the text fits, else a prefix of it with >= limit pieces; for a
    freshly trained source model and the default model's (when present)."""
    from relserve.models.tokenization import TranslationTokenizer
    from relserve.models.training.tokenizer import train_sentencepiece

    from fixtures.translation import sentence_pairs

    spm_path = train_sentencepiece([s for s, _ in sentence_pairs()], tmp_path / "source.spm", 160)
    toks = [TranslationTokenizer(spm_path, spm_path)]
    if (DEFAULTS / "translate-de-en" / "source.spm").is_file():
        toks.append(TranslationTokenizer.from_dir(DEFAULTS / "translate-de-en"))
    for tok in toks:
        _check_bounded_source(tok)


def _check_bounded_source(tok):
    from fixtures.translation import sentence_pairs

    rng = random.Random(5)
    sources = [s for s, _ in sentence_pairs(60)]
    texts = sources + [_mangled(rng, s) * (1 + i % 7) for i, s in enumerate(sources)] + ["Wort" * 300]
    for t in texts:
        whole = tok.encode_source(t)
        for limit in (3, 16, 40, 120):
            ids, complete = tok.encode_source_bounded(t, limit)
            if len(whole) <= limit:
                assert complete and ids == whole, repr(t[:40])
            else:
                assert not complete and len(ids) >= limit and ids == whole[: len(ids)], repr(t[:40])
    long_text = " ".join(sources) * 200
    ids, complete = tok.encode_source_bounded(long_text, 256)
    assert not complete and 256 <= len(ids) < 2000  # a prefix, not the whole text


def test_safe_cut_scans_in_chunks_without_missing_a_cut():
    from relserve.models.tokenization import SPACE_CUT, WORD_CUT, safe_cut
    from relserve.models.tokenization.prefix import _SCAN_CHUNK

    def reference(text, limit, pattern):
        if limit >= len(text):
            return len(text)
        starts = [m.start() for m in pattern.finditer(text)]
        before = [k for k in starts if k <= limit]
        after = [k for k in starts if k > limit]
        return before[-1] if before else after[0] if after else len(text)

    n = 3 * _SCAN_CHUNK + 10
    places = [1, 2, 255, 256, 257, _SCAN_CHUNK - 1, _SCAN_CHUNK, _SCAN_CHUNK + 1, 2 * _SCAN_CHUNK + 1, n - 2]
    for pattern in (WORD_CUT, SPACE_CUT):
        for cut_at in places:
            for sep in (" ", "\u2028\u2028"):
                text = "x" * cut_at + sep + "y" * (n - cut_at)
                for limit in (0, 300, cut_at - 1, cut_at, cut_at + 1, _SCAN_CHUNK + 5, 2 * _SCAN_CHUNK, n + 5):
                    assert safe_cut(text, limit, pattern) == reference(text, limit, pattern), (cut_at, sep, limit)
