"""The translation task's one validation and the one decode-options type (no model, no torch): defaults from
the model's config, ranges named in the messages, the length rule resolved in one place, blank texts."""

from __future__ import annotations

from pathlib import Path

import pytest

from relserve.models.decode_types import DecodeOptions, Hypothesis
from relserve.service.config import ModelConfig
from relserve.service.errors import InvalidArgument
from relserve.service.tasks import qa, translate

CFG = ModelConfig(name="tr", path=Path("."), beam_size=4, max_len_a=1.5, max_len_b=3, max_output_tokens=40,
                  length_penalty=0.5)


def _validate(**kw):
    args = dict(beam_size=0, n_best=0, max_length=0, return_alignment=False)
    args.update(kw)
    return translate.validate_translate(["x"], config=CFG, **args)


def test_defaults_come_from_the_config_and_the_length_rule_is_resolved_once():
    opts = _validate()
    assert (opts.beam_size, opts.n_best, opts.length_penalty, opts.max_len_cap) == (4, 1, 0.5, 40)
    assert opts.max_length_for(6) == int(1.5 * 6 + 3) and opts.max_length_for(100) == 40
    explicit = _validate(max_length=7)
    assert explicit.max_length_for(1) == explicit.max_length_for(100) == 7
    assert DecodeOptions(max_len_a=0.0, max_len_b=0).max_length_for(5) == 1  # never below one token


@pytest.mark.parametrize("kw, fragment", [
    ({"beam_size": 17}, "beam_size 17 is out of range; allowed 1..16 (0 = default 4)"),
    ({"beam_size": 2, "n_best": 3}, "n_best 3 is out of range; allowed 1..beam_size (2)"),
    ({"max_length": 41}, "max_length 41 is out of range; allowed 1..max_output_tokens 40 of model 'tr'"),
])
def test_out_of_range_fields_name_the_limit(kw, fragment):
    with pytest.raises(InvalidArgument) as err:
        _validate(**kw)
    assert fragment in str(err.value)
    with pytest.raises(InvalidArgument, match="texts is empty"):
        translate.validate_translate([], beam_size=0, n_best=0, max_length=0, return_alignment=False, config=CFG)


def test_options_type_guards_direct_callers():
    for kw in ({"beam_size": 0}, {"beam_size": 2, "n_best": 3}, {"max_len_cap": 0}, {"max_length": 300}):
        with pytest.raises(ValueError):
            DecodeOptions(**kw)


def test_blank_text_is_one_empty_hypothesis_and_output_views():
    item = translate.postprocess(None, None, None, _validate(return_alignment=True))
    (h,) = item.hypotheses
    assert (h.text, h.score, h.log_prob, h.output_tokens, h.output_pieces) == ("", 0.0, 0.0, [], ())
    assert h.alignment == () and item.num_source_tokens == 0
    finished = Hypothesis([5, 6, 2], -1.0, -0.5, True, False, pieces=("a", "b", "</s>"))
    assert finished.output_tokens == [5, 6] and finished.output_pieces == ("a", "b")
    truncated = Hypothesis([5, 6], -1.0, -0.5, False, True, pieces=("a", "b"))
    assert truncated.output_tokens == [5, 6] and truncated.output_pieces == ("a", "b")


def test_answer_options_defaults_and_limits():
    common = dict(allow_impossible=False, max_seq_len=64, default_max_answer_len=30, default_doc_stride=16)
    opts = qa.validate_answer("q", "c", top_k=0, max_answer_len=0, doc_stride=0, null_threshold=None, **common)
    assert (opts.top_k, opts.max_answer_len, opts.doc_stride, opts.null_threshold) == (1, 30, 16, 0.0)
    for kw, fragment in ((dict(top_k=21), "the limit is 20 answers"), (dict(max_answer_len=65), "max_seq_len 64"),
                         (dict(doc_stride=64), "doc_stride 64"), (dict(null_threshold=float("nan")), "NaN")):
        args = dict(top_k=0, max_answer_len=0, doc_stride=0, null_threshold=None)
        args.update(kw)
        with pytest.raises(InvalidArgument, match=fragment):
            qa.validate_answer("q", "c", **args, **common)


def test_request_size_limits_name_the_keys():
    from dataclasses import replace

    import pytest

    from relserve.service.errors import InvalidArgument

    cfg = replace(CFG, max_request_texts=3, max_request_chars=20)
    opts = dict(beam_size=0, n_best=0, max_length=0, return_alignment=False, config=cfg)
    with pytest.raises(InvalidArgument, match=r"4 texts; model 'tr' takes at most 3 per request \(max_request_texts\)"):
        translate.validate_translate(["a"] * 4, **opts)
    with pytest.raises(InvalidArgument, match=r"21 characters; .* at most 20 per request \(max_request_chars\)"):
        translate.validate_translate(["a" * 11, "b" * 10], **opts)
    assert translate.validate_translate(["a" * 10, "b" * 10], **opts).beam_size == 4


def test_too_long_source_is_refused_from_a_prefix(tmp_path):
    import pytest

    from fixtures.translation import sentence_pairs
    from relserve.models.tokenization import TranslationTokenizer
    from relserve.models.training.tokenizer import train_sentencepiece
    from relserve.service.errors import InvalidArgument

    spm_path = train_sentencepiece([s for s, _ in sentence_pairs()], tmp_path / "s.spm", 160)
    tok = TranslationTokenizer(spm_path, spm_path)
    fits = "Guten Morgen."
    (ids,) = translate.preprocess(tok, [fits], 64, "tr")
    assert ids == tok.encode_source(fits)
    assert translate.preprocess(tok, [" \u200b"], 64, "tr") == [None]
    long_text = "Das ist ein Satz. " * 20000
    with pytest.raises(InvalidArgument, match=r"texts\[1\] has more than 64 source tokens .* max_source_tokens 64"):
        translate.preprocess(tok, [fits, long_text], 64, "tr")
