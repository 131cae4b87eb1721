"""Parity of relserve.models.deberta against the transformers DebertaV2 oracle (random weights, no hub).

Each oracle model (``fixtures.deberta.make_deberta_checkpoint(oracle=True, init="spread")``) is random-initialised
from a ``DebertaV2Config``, its weights are re-drawn with larger scales (the HF init of std 0.02 makes attention
almost uniform, which would hide a c2p/p2c mix-up), saved with ``save_pretrained`` and loaded back through our
``load_checkpoint``.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from relserve.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402
from relserve.models.deberta import DebertaConfig  # noqa: E402
from relserve.models.onednn import set_onednn_linear  # noqa: E402
from relserve.models.relative_position import build_relative_position  # noqa: E402
from transformers import DebertaV2Config, DebertaV2ForQuestionAnswering  # noqa: E402

TOL = 1e-4
VOCAB = 97
LENGTHS = (1, 7, 300, 600)

# (fixtures.deberta version, overrides). v3 / v2: the two presets (see fixtures/deberta.py).
CONFIGS = {
    "v3": ("v3", {}),
    "v2": ("v2", {}),
    # c2p only, small log buckets (32 per side stretched to 128).
    "c2p_only": ("v3", dict(pos_att_type=["c2p"], position_buckets=32, max_relative_positions=128, share_att_key=False)),
}
TASKS = ("classification", "question-answering")

_CACHE: dict[tuple[str, str], tuple] = {}


def _pair(name: str, task: str, tmp_path_factory):
    """(oracle model, our LoadedCheckpoint, checkpoint dir), built once per (config, task)."""
    key = (name, task)
    if key not in _CACHE:
        version, overrides = CONFIGS[name]
        tiny = make_deberta_checkpoint(tmp_path_factory.mktemp(f"{name}-{task}"), task=task, version=version,
                                       oracle=True, vocab_size=VOCAB, labels=3, init="spread",
                                       seed=list(CONFIGS).index(name) * 10 + TASKS.index(task), **overrides)
        ours = load_checkpoint(tiny.path, load_tokenizer=False)
        # as the torch backend serves on CPU: dense layers through oneDNN (tests/models/test_onednn.py: off == on)
        assert set_onednn_linear(ours.model, True) > 0
        _CACHE[key] = (tiny.model, ours, tiny.path)
    return _CACHE[key]


def _inputs(lengths: list[int], seed: int, type_vocab: int):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    tt = torch.randint(0, max(type_vocab, 1), (len(lengths), T), generator=g) if type_vocab > 0 else None
    return ids, mask, tt


def _run_hf(hf, task, ids, mask, tt):
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt)
    return out.logits if task == "classification" else (out.start_logits, out.end_logits)


def _run_ours(model, ids, mask, tt):
    with torch.inference_mode():
        return model(ids, mask, tt)


def _check(task, a, b, lengths, tol=TOL):
    if task == "classification":
        diff = (a - b).abs().max().item()
        assert diff <= tol, f"classification logits differ by {diff}"
        return
    for x, y, what in ((a[0], b[0], "start"), (a[1], b[1], "end")):
        for i, n in enumerate(lengths):  # padded positions are meaningless; compare real tokens only
            diff = (x[i, :n] - y[i, :n]).abs().max().item()
            assert diff <= tol, f"{what} logits of sequence {i} (len {n}) differ by {diff}"


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_unpadded(name, task, tmp_path_factory):
    hf, ours, _ = _pair(name, task, tmp_path_factory)
    assert ours.task == task
    tv = hf.config.type_vocab_size
    for T in LENGTHS:
        lengths = [T, T]
        ids, mask, tt = _inputs(lengths, seed=T, type_vocab=tv)
        _check(task, _run_hf(hf, task, ids, mask, tt), _run_ours(ours.model, ids, mask, tt), lengths)
    # the encoder output itself, the most sensitive place
    ids, mask, tt = _inputs([300], seed=1, type_vocab=tv)
    with torch.no_grad():
        a = hf.deberta(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
    b = _run_ours(ours.model.deberta, ids, mask, tt)
    assert (a - b).abs().max().item() <= TOL


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_padded_batch(name, task, tmp_path_factory):
    hf, ours, _ = _pair(name, task, tmp_path_factory)
    lengths = [600, 7, 300, 1]
    ids, mask, tt = _inputs(lengths, seed=5, type_vocab=hf.config.type_vocab_size)
    _check(task, _run_hf(hf, task, ids, mask, tt), _run_ours(ours.model, ids, mask, tt), lengths)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("name", ["v3", "v2"])
def test_padding_never_changes_outputs(name, task, tmp_path_factory):
    """A sequence gives the same result alone and padded inside a batch, whatever sits in the padding."""
    _, ours, _ = _pair(name, task, tmp_path_factory)
    tv = ours.config.type_vocab_size
    lengths = [300, 7, 1, 45]
    ids, mask, tt = _inputs(lengths, seed=11, type_vocab=tv)  # padding holds random ids / token types
    batched = _run_ours(ours.model, ids, mask, tt)
    for i, n in enumerate(lengths):
        solo = _run_ours(ours.model, ids[i : i + 1, :n], mask[i : i + 1, :n], None if tt is None else tt[i : i + 1, :n])
        if task == "classification":
            assert (batched[i] - solo[0]).abs().max().item() <= 1e-5
        else:
            for k in range(2):
                assert (batched[k][i, :n] - solo[k][0]).abs().max().item() <= 1e-5


def test_pytorch_bin_with_legacy_keys_loads(tmp_path, tmp_path_factory):
    hf, ours, _ = _pair("v3", "classification", tmp_path_factory)
    sd = {}
    for k, v in hf.state_dict().items():
        k = k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        sd[k] = v.clone()
    sd["deberta.embeddings.position_ids"] = torch.arange(512)[None]
    sd["deberta.embeddings.position_embeddings.weight"] = torch.zeros(512, 32)  # v3 hub checkpoints carry it
    sd["lm_predictions.lm_head.bias"] = torch.zeros(VOCAB)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    hf.config.to_json_file(tmp_path / "config.json")
    loaded = load_checkpoint(tmp_path, load_tokenizer=False)
    ids, mask, tt = _inputs([7, 3], seed=3, type_vocab=0)
    _check("classification", _run_hf(hf, "classification", ids, mask, tt), _run_ours(loaded.model, ids, mask, tt), [7, 3])


def test_save_checkpoint_is_hf_loadable(tmp_path, tmp_path_factory):
    hf, ours, _ = _pair("v2", "question-answering", tmp_path_factory)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    out = save_checkpoint(ours.model, ours.config, tmp_path / "out", tokenizer_dir=tok)
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "deberta-v2" and cfg["architectures"] == ["DebertaV2ForQuestionAnswering"]
    hf2 = DebertaV2ForQuestionAnswering.from_pretrained(out).eval()
    ids, mask, tt = _inputs([50], seed=4, type_vocab=2)
    _check("question-answering", _run_hf(hf, "question-answering", ids, mask, tt), _run_hf(hf2, "question-answering", ids, mask, tt), [50], tol=0)
    again = load_checkpoint(out, load_tokenizer=False)
    assert again.config.to_dict() == ours.config.to_dict() | {"architectures": ["DebertaV2ForQuestionAnswering"]}


def test_checkpoint_errors(tmp_path, tmp_path_factory):
    hf, _, d = _pair("v3", "classification", tmp_path_factory)
    cfg = json.loads((d / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg | {"architectures": ["DebertaV2ForMaskedLM"]}))
    with pytest.raises(CheckpointError, match="DebertaV2ForSequenceClassification"):
        load_checkpoint(bad, load_tokenizer=False)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no weights file"):
        load_checkpoint(bad, load_tokenizer=False)
    sd = {k: v for k, v in hf.state_dict().items() if not k.startswith("classifier.")}
    torch.save(sd, bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"missing keys \['classifier.bias', 'classifier.weight'\]"):
        load_checkpoint(bad, load_tokenizer=False)


def test_config_semantics():
    c = DebertaConfig.from_dict({"pos_att_type": "p2c|c2p", "num_labels": 3, "hidden_size": 64, "num_attention_heads": 4})
    assert c.pos_att_type == ["p2c", "c2p"] and c.num_labels == 3 and c.embedding_size == 64
    assert c.att_span == 512  # max_relative_positions -1 -> max_position_embeddings
    c = DebertaConfig.from_dict({"position_buckets": 256, "max_relative_positions": -1, "num_attention_heads": 4})
    assert c.att_span == 256 and c.effective_max_relative_positions == 512
    hc = DebertaV2Config(**c.to_dict())
    assert hc.position_buckets == 256 and hc.num_labels == 2


def test_relative_positions_match_reference():
    from transformers.models.deberta_v2 import modeling_deberta_v2 as ref

    for buckets, max_pos in ((256, 512), (32, 128), (-1, 64)):
        x = torch.zeros(1, 700, 4)
        want = ref.build_relative_position(x, x, bucket_size=buckets, max_position=max_pos)[0]
        got = build_relative_position(700, 700, buckets, max_pos)
        assert torch.equal(want, got)
