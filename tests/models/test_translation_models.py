"""Translation checkpoints, default de→en models, tokenizers and the training CLI (fast: tiny models)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fixtures.translation import sentence_pairs, tiny_translation_model
from relserve.models.decoding import DecodeOptions, beam_search, greedy_search
from relserve.models.checkpoint import (
    TranslationCheckpointError,
    load_translation_checkpoint,
    save_translation_checkpoint,
)
from relserve.models.tokenization import TranslationTokenizer
from relserve.models.training.translation import (
    collate,
    encode_pairs,
    load_train_pairs,
    main as train_main,
    pad_sources,
    translate,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = {
    "bigru": REPO / "defaults" / "translate-de-en",
    "deberta": REPO / "defaults" / "translate-de-en-deberta",
}


def _pairs(split: str, limit: int, *, targets: bool = False) -> list[tuple[str, str]]:
    """German/English pairs (``fixtures.translation.sentence_pairs``: without ../shared the German side stands in
    for the target unless ``targets``)."""
    return sentence_pairs(limit, split=split, targets=targets)


@pytest.fixture(scope="module")
def tokenizer() -> TranslationTokenizer:
    return TranslationTokenizer.from_dir(DEFAULTS["bigru"])


def _batch(tok, pairs):
    ex = encode_pairs(tok, pairs, 64)
    return collate(ex, list(range(len(ex))), tok.pad_token_id, tok.bos_token_id)


# --- tokenizer ----------------------------------------------------------------------------------------------


def test_tokenizer_round_trip(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    pairs = _pairs("dev", 200, targets=True)  # English decoding is checked
    ok = 0
    for src, tgt in pairs:
        ids = tokenizer.encode_source(src)
        assert ids[-1] == tokenizer.eos_token_id and len(ids) >= 2
        assert tokenizer.decode_source(ids).strip()
        pieces = tokenizer.source_pieces(ids)
        assert len(pieces) == len(ids) and pieces[-1] == "</s>"
        t_ids = tokenizer.encode_target(tgt)
        assert tokenizer.target_pieces(t_ids)[-1] == "</s>"
        ok += tokenizer.decode_target(t_ids) == tgt
    assert ok >= 0.98 * len(pairs)  # NFKC normalisation / unseen characters may change a rare sentence
    # decode_target stops at EOS and drops pad/bos
    ids = tokenizer.encode_target("I enjoyed my supper.")
    assert tokenizer.decode_target([1] + ids + [5, 6, 0]) == "I enjoyed my supper."
    assert tokenizer.encode_source("") == [tokenizer.eos_token_id]
    assert len(tokenizer.encode_source("Das ist ein sehr langer Satz mit vielen Wörtern.", max_length=4)) == 4


# --- checkpoint round trip ----------------------------------------------------------------------------------


@pytest.mark.parametrize("encoder", ["bigru", "deberta"])
def test_checkpoint_round_trip(tmp_path, tokenizer, encoder):
    model = tiny_translation_model(tokenizer, encoder)
    out = save_translation_checkpoint(model, tokenizer, tmp_path / "ckpt")
    files = sorted(p.name for p in Path(out).iterdir())
    assert files == ["config.json", "model.safetensors", "source.spm", "target.spm"]
    cfg = json.loads((Path(out) / "config.json").read_text())
    assert cfg["model_type"] == "rnnsearch" and cfg["encoder_type"] == encoder
    assert ("encoder_config" in cfg) == (encoder == "deberta")

    loaded, config, tok2 = load_translation_checkpoint(out)
    assert not loaded.training and config.to_dict() == model.config.to_dict()
    pairs = _pairs("dev", 6)
    src, mask, tgt_in, _ = _batch(tokenizer, pairs)
    with torch.no_grad():
        assert torch.equal(model(src, mask, tgt_in), loaded(src, mask, tgt_in))
    opts = DecodeOptions(beam_size=3, max_len_cap=12)
    a = [h[0].tokens for h in beam_search(model, src, mask, opts)]
    b = [h[0].tokens for h in beam_search(loaded, src, mask, opts)]
    assert a == b
    assert tok2.encode_source(pairs[0][0]) == tokenizer.encode_source(pairs[0][0])

    # float16 storage: loading gives exactly the rounded weights
    out16 = save_translation_checkpoint(model, tokenizer, tmp_path / "ckpt16", dtype=torch.float16)
    loaded16, _, _ = load_translation_checkpoint(out16)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded16.state_dict().items()):
        assert k == k2 and v2.dtype == v.dtype
        assert torch.equal(v.half().to(v.dtype), v2) if v.is_floating_point() else torch.equal(v, v2)


@pytest.mark.parametrize("encoder", ["bigru", "deberta"])
def test_teacher_forcing_matches_step_decoding(tokenizer, encoder):
    """The training forward (teacher forcing) equals serving's encode + decode_step fed the same tokens."""
    model = tiny_translation_model(tokenizer, encoder)
    src, mask, tgt_in, _ = _batch(tokenizer, _pairs("train", 5))
    with torch.no_grad():
        forced = torch.log_softmax(model(src, mask, tgt_in).float(), dim=-1)  # Float[B,T,K_y]
        state = model.encode(src, mask)
        hidden = state.init_state
        for i in range(tgt_in.shape[1]):
            log_probs, hidden, _ = model.decode_step(state, None, tgt_in[:, i], hidden)
            torch.testing.assert_close(forced[:, i], log_probs)


def test_bad_checkpoint_dirs(tmp_path, tokenizer):
    with pytest.raises(TranslationCheckpointError, match="not a directory"):
        load_translation_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TranslationCheckpointError, match="config.json: missing"):
        load_translation_checkpoint(tmp_path / "empty")

    good = Path(save_translation_checkpoint(tiny_translation_model(tokenizer, "bigru"), tokenizer, tmp_path / "good"))

    def variant(name, edit_config=None, remove=None):
        d = tmp_path / name
        d.mkdir()
        for p in good.iterdir():
            if p.name != remove:
                (d / p.name).write_bytes(p.read_bytes())
        if edit_config:
            cfg = json.loads((d / "config.json").read_text())
            edit_config(cfg)
            (d / "config.json").write_text(json.dumps(cfg))
        return d

    with pytest.raises(TranslationCheckpointError, match="model.safetensors: missing"):
        load_translation_checkpoint(variant("noweights", remove="model.safetensors"))
    with pytest.raises(TranslationCheckpointError, match="target.spm: missing"):
        load_translation_checkpoint(variant("nospm", remove="target.spm"))
    with pytest.raises(TranslationCheckpointError, match="model_type"):
        load_translation_checkpoint(variant("mt", lambda c: c.update(model_type="deberta-v2")))
    with pytest.raises(TranslationCheckpointError, match="encoder_type"):
        load_translation_checkpoint(variant("et", lambda c: c.update(encoder_type="lstm")))
    with pytest.raises(TranslationCheckpointError, match="encoder_config"):
        load_translation_checkpoint(variant("ec", lambda c: c.update(encoder_type="deberta")))
    with pytest.raises(TranslationCheckpointError, match="shape mismatch"):
        load_translation_checkpoint(variant("shape", lambda c: c.update(maxout_size=6)))
    with pytest.raises(TranslationCheckpointError, match="tgt_vocab_size"):
        load_translation_checkpoint(variant("vocab", lambda c: c.update(tgt_vocab_size=100)))
    bad = variant("badjson")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(TranslationCheckpointError, match="cannot read JSON"):
        load_translation_checkpoint(bad)
    bad = variant("badst")
    (bad / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(TranslationCheckpointError, match="safetensors"):
        load_translation_checkpoint(bad)


# --- the shipped defaults -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bigru", "deberta"])
def test_defaults_translate(name):
    model, config, tok = load_translation_checkpoint(DEFAULTS[name])
    assert config.model_type == "rnnsearch"
    assert (model.config.encoder_type == "bigru") == (name == "bigru")
    assert (DEFAULTS[name] / "README.md").is_file()
    sources = [s for s, _ in _pairs("dev", 4)]
    out = translate(model, tok, sources, beam_size=1)
    assert len(out) == len(sources) and all(o.strip() for o in out)
    out5 = translate(model, tok, sources[:2], beam_size=5)
    assert all(o.strip() for o in out5)
    # alignments come back over the real source pieces
    src, mask = pad_sources([tok.encode_source(sources[0])], tok.pad_token_id)
    hyp = greedy_search(model, src, mask, DecodeOptions(return_alignment=True))[0]
    assert hyp.alignment.shape == (len(hyp.tokens), len(tok.source_pieces(src[0].tolist())))
    torch.testing.assert_close(hyp.alignment.sum(-1), torch.ones(len(hyp.tokens)))


# --- training CLI -------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, pairs) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for s, t in pairs:
            f.write(json.dumps({"source": s, "target": t}, ensure_ascii=False) + "\n")
    return str(path)


def _train_args(tmp_path: Path, train: str, run: str, steps: int, *extra: str) -> list[str]:
    return [
        "--train", train, "--out", str(tmp_path / run / "out"), "--state-dir", str(tmp_path / run / "state"),
        "--tokenizer-from", str(DEFAULTS["bigru"]), "--embedding-size", "16", "--hidden-size", "16",
        "--maxout-size", "8", "--dropout", "0.1", "--lr", "0.01", "--batch-tokens", "400",
        "--max-steps", str(steps), "--eval-every", "0", "--seed", "3", "--no-progress", "--threads", "1",
        "--save-dtype", "float32", *extra,
    ]


def _state(tmp_path: Path, run: str) -> dict:
    return torch.load(tmp_path / run / "state" / "state.pt", weights_only=True)


def test_training_smoke_and_resume(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", _pairs("train", 50))
    # straight run: 12 steps
    assert train_main(_train_args(tmp_path, train, "a", 12)) == 0
    losses = _state(tmp_path, "a")["losses"]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3  # loss decreases
    model, _, tok = load_translation_checkpoint(tmp_path / "a" / "out")
    assert model.config.embedding_size == 16

    # interrupted run: 5 steps, then resume to 12 -> same step count and the same losses as the straight run
    assert train_main(_train_args(tmp_path, train, "b", 5)) == 0
    s = _state(tmp_path, "b")
    assert s["step"] == 5 and len(s["losses"]) == 5
    assert train_main(_train_args(tmp_path, train, "b", 12, "--resume")) == 0
    s = _state(tmp_path, "b")
    assert s["step"] == 12
    assert s["losses"][:5] == losses[:5]
    torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(losses), rtol=1e-4, atol=1e-4)

    with pytest.raises(SystemExit):
        train_main(_train_args(tmp_path, train, "c", 3, "--resume"))  # nothing to resume


def test_training_deberta_encoder_smoke(tmp_path):
    """The DeBERTa-style encoder trains (its relative-attention custom op is routed to a differentiable kernel)."""
    train = _write_jsonl(tmp_path / "train.jsonl", _pairs("train", 20))
    args = _train_args(tmp_path, train, "d", 3, "--encoder", "deberta", "--deberta-hidden", "16",
                       "--deberta-layers", "1", "--deberta-heads", "2", "--deberta-intermediate", "32")
    assert train_main(args) == 0
    s = _state(tmp_path, "d")
    assert s["step"] == 3 and all(x == x for x in s["losses"])  # finite, not NaN
    model, _, _ = load_translation_checkpoint(tmp_path / "d" / "out")
    assert type(model.encoder).__name__ == "DebertaAnnotationEncoder"


def test_load_train_pairs_dedups_exact_pairs_in_order(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [("s1", "t1"), ("s2", "t2"), ("s1", "t1"), ("s3", "t3")])
    b = _write_jsonl(tmp_path / "b.jsonl", [("s2", "t2"), ("s1", "other"), ("s4", "t4"), ("s3", "t3")])
    # exact (source, target) duplicates go, within a file and across files; the first occurrence keeps its place;
    # a pair sharing only its source with a kept one is a different pair
    assert load_train_pairs([a, b]) == [("s1", "t1"), ("s2", "t2"), ("s3", "t3"), ("s1", "other"), ("s4", "t4")]
    assert load_train_pairs([b, a]) == [("s2", "t2"), ("s1", "other"), ("s4", "t4"), ("s3", "t3"), ("s1", "t1")]
    # the limit counts each file's rows before deduplication: a -> s1, s2; b -> s2 (a duplicate), (s1, other)
    assert load_train_pairs([a, b], limit=2) == [("s1", "t1"), ("s2", "t2"), ("s1", "other")]


def test_training_two_train_files_and_exclude(tmp_path, capsys):
    """--train a,b (overlapping) --exclude c: the pairs trained on are the deduplicated union minus every pair
    whose source or target sentence occurs (on either side) in c; the run finishes and writes a checkpoint."""
    pairs = _pairs("train", 60)
    a_pairs, b_pairs = pairs[:40], pairs[25:]  # 15 pairs in both files
    held = pairs[5:8] + [(pairs[30][1], "a target used as a source"), ("unrelated source", pairs[50][0])]
    a = _write_jsonl(tmp_path / "a.jsonl", a_pairs)
    b = _write_jsonl(tmp_path / "b.jsonl", b_pairs)
    c = _write_jsonl(tmp_path / "c.jsonl", held)
    union = list(dict.fromkeys(a_pairs + b_pairs))
    sides = {x for pair in held for x in pair}
    kept = [p for p in union if p[0] not in sides and p[1] not in sides]
    assert len(union) == len(set(pairs)) and 5 <= len(union) - len(kept) < len(union)  # the oracle drops some
    assert load_train_pairs([a, b]) == union

    assert train_main(_train_args(tmp_path, f"{a},{b}", "x", 4, "--exclude", c)) == 0
    err = capsys.readouterr().err
    assert f"--exclude: dropped {len(union) - len(kept)} train pairs" in err
    assert f"train pairs={len(kept)} " in err
    s = _state(tmp_path, "x")
    assert s["step"] == 4 and all(x == x for x in s["losses"])
    model, _, _ = load_translation_checkpoint(tmp_path / "x" / "out")
    assert model.config.embedding_size == 16


def test_training_autocast_bf16_smoke(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", _pairs("train", 20))
    assert train_main(_train_args(tmp_path, train, "bf", 3, "--autocast", "bf16")) == 0
    s = _state(tmp_path, "bf")
    assert s["step"] == 3 and all(math.isfinite(x) for x in s["losses"])
    model, _, _ = load_translation_checkpoint(tmp_path / "bf" / "out")
    assert all(v.dtype == torch.float32 for v in model.state_dict().values() if v.is_floating_point())
