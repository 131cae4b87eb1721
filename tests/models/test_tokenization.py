"""relserve.models.tokenization against transformers' AutoTokenizer on the same directories (the oracle)."""

from __future__ import annotations

import itertools
import json
import unicodedata

import pytest

from fixtures.data import SHARED_DATA, data_path, jsonl, qa_rows
from relserve.models.tokenization import _longest_first, load_tokenizer, train_unigram_tokenizer
from relserve.models.training.tokenizer import corpus_lines

TOKENIZER_DIRS = ["unigram_tokenizer_dir", "spm_tokenizer_dir"]


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
        ours, hf = load_tokenizer(d), hf_tokenizer(d)
        assert (ours.cls_token_id, ours.sep_token_id, ours.pad_token_id, ours.unk_token_id) == (1, 2, 0, 3)
        assert (hf.cls_token_id, hf.sep_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 0, 3)
        assert ours.model_max_length == max_len


def test_ids_and_type_ids_match_transformers(tok_dir, hf_tokenizer):
    ours, hf = load_tokenizer(tok_dir), hf_tokenizer(tok_dir)
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
    ours, hf = load_tokenizer(tok_dir), hf_tokenizer(tok_dir)
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
    ours, hf = load_tokenizer(tok_dir), hf_tokenizer(tok_dir)
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
    ours, hf = load_tokenizer(tok_dir), hf_tokenizer(tok_dir)
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
    ours, hf = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    for t in ("The PANTHERS Defense", "Ärger İstanbul ΣΑΣ"):
        assert ours.encode(t).input_ids == hf(t)["input_ids"]
        ids, offs = ours.tokenize(t)
        assert all(0 <= s <= e <= len(t) for s, e in offs)


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
