"""spm.model-only tokenizers with the model's own normaliser (``spm_normalization: spm``, the default) against
sentencepiece's own ``encode`` (the oracle: what transformers 4's sentencepiece-backed DebertaV2Tokenizer gave;
the pinned transformers 5 drops the normaliser, so it is not the oracle here).

The fixture ``spm_tokenizer_dir`` is trained with sentencepiece's default normaliser, ``nmt_nfkc`` (as
deberta-v3 and mdeberta); these checkpoint directories hold only ``spm.model`` + ``tokenizer_config.json``, the
hub layout of those models.
"""

from __future__ import annotations

import pytest

from fixtures.spm import oracle_ids, reference_punct_split, spm_checkpoint_dir
from relserve.models.tokenization import load_tokenizer

# full-width letters / punctuation / ideographic space, NBSP, ZWSP, BOM, ligatures, circled digit, trade mark,
# CJK with full-width punctuation, combining marks, ASCII punctuation (split_by_punct), tabs and line breaks
TEXTS = [
    "ＡＢＣ！？",
    "Ｔｈｅ　ｆｉｌｍ　ｗａｓ　ｇｒｅａｔ．",
    "The ﬁlm was ﬁne, ﬂawless™ ①",
    "no\u00a0break\u00a0space and zero\u200bwidth\u200bspace\ufeff here",
    "这部电影非常好看！我们明天见，好吗？",
    "路德的著作广为流传，早在 １５１９ 年就传到了法国。",
    "Hello, world! It's 3.5 (really) -- isn't it?",
    "Cafe\u0301 Café\ttab\nline  two   spaces ",
    "①②③ ™℠ ㈱ ｶﾀｶﾅ ﬃ",
    "x",
    "",
]
PAIRS = [("ＡＢＣ！？", "The ﬁlm was ﬁne."), ("谁赢得了比赛？", "丹佛野马队以24比10击败了卡罗莱纳黑豹队，赢得了第50届超级碗。")]


@pytest.fixture(scope="module")
def sp(spm_tokenizer_dir):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString((spm_tokenizer_dir / "spm.model").read_bytes())
    assert proto.normalizer_spec.name == "nmt_nfkc"  # the normaliser under test is really there
    return spm.SentencePieceProcessor(model_file=str(spm_tokenizer_dir / "spm.model"))


@pytest.mark.parametrize("split_by_punct", [False, True])
def test_ids_equal_sentencepiece_encode(spm_tokenizer_dir, sp, tmp_path, split_by_punct):
    d = spm_checkpoint_dir(spm_tokenizer_dir, tmp_path / "ckpt", split_by_punct)
    tok = load_tokenizer(d)
    cls, sep = sp.piece_to_id("[CLS]"), sp.piece_to_id("[SEP]")
    for t in TEXTS:
        ref = oracle_ids(sp, t, split_by_punct)
        assert tok.tokenize(t)[0] == ref, repr(t)
        e = tok.encode(t)
        assert e.input_ids == [cls, *ref, sep] and e.token_type_ids == [0] * (len(ref) + 2), repr(t)
    for a, b in PAIRS:
        ra, rb = oracle_ids(sp, a, split_by_punct), oracle_ids(sp, b, split_by_punct)
        e = tok.encode(a, b)
        assert e.input_ids == [cls, *ra, sep, *rb, sep]
        assert e.token_type_ids == [0] * (len(ra) + 2) + [1] * (len(rb) + 1)
    # truncation keeps the oracle's first tokens
    long = " ".join(TEXTS) * 4
    e = tok.encode(long, max_length=40)
    assert e.truncated and e.input_ids == [cls, *oracle_ids(sp, long, split_by_punct)[:38], sep]


def test_split_by_punct_is_honoured_and_normaliser_matters(spm_tokenizer_dir, sp, tmp_path):
    """The two settings give different ids on punctuated text, and the transformers 5 behaviour (kept behind
    spm_normalization: transformers5) differs from sentencepiece on exactly the characters the normaliser folds."""
    plain = load_tokenizer(spm_checkpoint_dir(spm_tokenizer_dir, tmp_path / "a", False))
    punct = load_tokenizer(spm_checkpoint_dir(spm_tokenizer_dir, tmp_path / "b", True))
    t = "Hello, world! It's 3.5"
    assert plain.tokenize(t)[0] != punct.tokenize(t)[0]
    v5 = load_tokenizer(tmp_path / "a", spm_normalization="transformers5")
    unk = sp.unk_id()
    for t in ("ＡＢＣ！？", "The ﬁlm", "①™"):
        assert unk not in plain.tokenize(t)[0], t  # NFKC folds them into known pieces
        assert unk in v5.tokenize(t)[0], t  # without the normaliser they are unknown
    with pytest.raises(ValueError, match="spm_normalization 'nfkc'"):
        load_tokenizer(tmp_path / "a", spm_normalization="nfkc")


def test_tokenizer_json_directories_ignore_the_option(unigram_tokenizer_dir):
    """A tokenizer.json is used as written whatever spm_normalization says."""
    a = load_tokenizer(unigram_tokenizer_dir)
    b = load_tokenizer(unigram_tokenizer_dir, spm_normalization="transformers5")
    for t in TEXTS:
        assert a.tokenize(t) == b.tokenize(t)


def test_load_logs_which_normalisation_and_why(spm_tokenizer_dir, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="relserve.models.tokenization"):
        load_tokenizer(spm_tokenizer_dir)
        load_tokenizer(spm_tokenizer_dir, spm_normalization="transformers5")
    lines = [r.getMessage() for r in caplog.records if "spm.model" in r.getMessage()]
    assert len(lines) == 2
    assert "model's own normaliser 'nmt_nfkc'" in lines[0] and "spm_normalization: spm" in lines[0]
    assert "transformers 5's pipeline" in lines[1] and "spm_normalization is transformers5" in lines[1]


@pytest.mark.parametrize("split_by_punct,do_lower_case", [(False, False), (True, False), (True, True)])
def test_offsets_index_the_original_text(spm_tokenizer_dir, sp, tmp_path, split_by_punct, do_lower_case):
    """Offsets are ordered, inside the original text, cover every character the normaliser keeps, and each
    token's characters normalise to (a part of) its piece, where NFKC changes lengths (ligatures, ①, ™, ㈱)."""
    d = spm_checkpoint_dir(spm_tokenizer_dir, tmp_path / "ckpt", split_by_punct, do_lower_case)
    tok = load_tokenizer(d)
    for t in TEXTS + ["İstanbul ﬁ İİ ＡＢ"]:  # İ lower-cases to two characters
        ids, offs = tok.tokenize(t)
        ref_text = t.lower() if do_lower_case else t
        assert ids == oracle_ids(sp, ref_text, split_by_punct), repr(t)
        assert len(offs) == len(ids)
        covered = set()
        for s, e in offs:
            assert 0 <= s <= e <= len(t), (t, offs)
            covered.update(range(s, e))
        # in text order; two tokens share characters only when one character became several (İ -> i + U+0307)
        assert [s for s, _ in offs] == sorted(s for s, _ in offs) and [e for _, e in offs] == sorted(e for _, e in offs)
        for (s0, e0), (s1, e1) in zip(offs, offs[1:]):
            shared = range(s1, min(e0, e1))
            assert all(do_lower_case and len(t[i].lower()) > 1 for i in shared), (t, offs)
        for i, ch in enumerate(t):
            if sp.normalize(ch.lower() if do_lower_case else ch).strip("\u2581 "):
                assert i in covered, (t, i, ch)
        # the pieces' text, ▁ removed, is the normalised text of the covered characters, in order
        pieces = "".join(sp.id_to_piece(i) for i in ids).replace("\u2581", "")
        normal = "".join(sp.normalize(w) for w in
                         (reference_punct_split(ref_text) if split_by_punct else [ref_text])).replace("\u2581", "")
        assert pieces == normal or sp.unk_id() in ids, repr(t)


def test_prefix_tokenization_is_exact_with_the_normaliser(spm_tokenizer_dir, tmp_path):
    """Bounded tokenization (prefixes cut before a space) gives the whole text's first tokens, on text whose
    normal form changes lengths and whitespace (NBSP, ideographic space, ZWSP before a space)."""
    from relserve.models.tokenization import SPACE_CUT

    for punct in (False, True):
        tok = load_tokenizer(spm_checkpoint_dir(spm_tokenizer_dir, tmp_path / f"p{punct}", punct))
        assert tok.backend.cut_pattern is SPACE_CUT
        text = " ".join(TEXTS) * 30
        whole_ids, whole_offs = tok.tokenize(text)
        for k in [m.start() for m in SPACE_CUT.finditer(text)][::17]:
            ids, offs = tok.tokenize(text[:k])
            assert (ids, offs) == (whole_ids[: len(ids)], whole_offs[: len(offs)]), k
        for n in (8, 33, 200):
            e = tok.encode(text, max_length=n)
            assert e.input_ids[1:-1] == whole_ids[: n - 2] and e.truncated
