"""Unpadded execution of relserve.models.deberta (v2/v3/v1): dense layers on the packed real tokens, attention
core padded. Checked against the padded path of the same model (fp32, <= 1e-5 on real tokens), plus: the
dense layers really see only the real tokens, no-padding batches take the padded path unchanged, graph capture
(torch.export) traces the padded path, and the torch backend's ``torch_unpadded`` key switches it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures.deberta import make_deberta_checkpoint
from relserve.models.deberta import (
    DebertaConfig,
    DebertaForQuestionAnswering,
    DebertaForSequenceClassification,
    TokenPacking,
    set_unpadded,
)
from relserve.models.deberta_v1 import (
    DebertaV1Config,
    DebertaV1ForQuestionAnswering,
    DebertaV1ForSequenceClassification,
)
from relserve.service.backends.torch_encoder import TorchBackend
from relserve.service.config import ConfigError, ModelConfig, load_config

TOL = 1e-5
VOCAB = 97
LENGTHS = [1, 7, 40, 300]
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, labels=None)

# (config class, overrides); every variant has relative attention on so the c2p/p2c gathers are exercised.
VARIANTS = {
    "v3": (DebertaConfig, dict(relative_attention=True, pos_att_type="p2c|c2p", position_buckets=32,
                               max_relative_positions=128, share_att_key=True, norm_rel_ebd="layer_norm",
                               position_biased_input=False)),
    "v2": (DebertaConfig, dict(relative_attention=True, pos_att_type="p2c|c2p", max_relative_positions=64,
                               type_vocab_size=2, embedding_size=24)),
    "v2_conv": (DebertaConfig, dict(relative_attention=True, pos_att_type="p2c|c2p", position_buckets=32,
                                    max_relative_positions=128, conv_kernel_size=3, conv_act="gelu",
                                    norm_rel_ebd="layer_norm")),
    "t5": (DebertaConfig, dict(relative_attention=True, relative_attention_type="t5")),
    "v1": (DebertaV1Config, dict(relative_attention=True, pos_att_type="c2p|p2c", max_relative_positions=64)),
    "v1_talking": (DebertaV1Config, dict(relative_attention=True, pos_att_type="c2p|p2c", max_relative_positions=64,
                                         talking_head=True)),
}
HEADS = {
    (DebertaConfig, "classification"): DebertaForSequenceClassification,
    (DebertaConfig, "question-answering"): DebertaForQuestionAnswering,
    (DebertaV1Config, "classification"): DebertaV1ForSequenceClassification,
    (DebertaV1Config, "question-answering"): DebertaV1ForQuestionAnswering,
}
TASKS = ("classification", "question-answering")


def _model(name: str, task: str) -> torch.nn.Module:
    cls, overrides = VARIANTS[name]
    kw = {k: v for k, v in _SMALL.items() if k != "labels"}
    cfg = cls(**kw, **overrides, id2label={i: f"L{i}" for i in range(3 if task == "classification" else 2)})
    torch.manual_seed(list(VARIANTS).index(name) * 10 + TASKS.index(task))
    model = HEADS[(cls, task)](cfg).eval()
    with torch.no_grad():  # biases and LayerNorms away from their 0 / 1 init so a mix-up cannot hide
        for n, p in model.named_parameters():
            if n.endswith("bias") or "LayerNorm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _inputs(lengths, seed=0, type_vocab=0, left=False):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left:
            mask[b, T - n:] = 1
        else:
            mask[b, :n] = 1
    ids = ids * mask  # pad id 0 at padding
    tt = torch.randint(0, type_vocab, (len(lengths), T), generator=g) if type_vocab > 0 else None
    return ids, mask, tt


def _both(model, ids, mask, tt):
    outs = []
    for flag in (False, True):
        assert set_unpadded(model, flag) == 1
        with torch.inference_mode():
            outs.append(model(ids, mask, tt))
    set_unpadded(model, True)
    return outs


def _max_diff(task, a, b, mask):
    if task == "classification":
        return (a - b).abs().max().item()
    m = mask.bool()
    return max((a[i] - b[i])[m].abs().max().item() for i in (0, 1))


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_unpadded_equals_padded_on_mixed_lengths(name, task):
    model = _model(name, task)
    ids, mask, tt = _inputs(LENGTHS, seed=1, type_vocab=model.config.type_vocab_size)
    padded, unpadded = _both(model, ids, mask, tt)
    diff = _max_diff(task, padded, unpadded, mask)
    assert diff <= TOL, f"{name}/{task}: unpadded differs from padded by {diff}"
    # the outputs carry signal (a constant model would pass trivially)
    ref = padded if task == "classification" else padded[0][mask.bool()]
    assert ref.std().item() > 1e-2


@pytest.mark.parametrize("name", list(VARIANTS))
def test_encoder_hidden_states_left_padding(name):
    """Any mask pattern packs: left padding, the last hidden state on real tokens; zeros at padding."""
    model = _model(name, "question-answering")
    ids, mask, tt = _inputs([5, 33, 2], seed=2, type_vocab=model.config.type_vocab_size, left=True)
    m = mask.bool()
    padded, unpadded = (out for out in _both(model.deberta, ids, mask, tt))
    assert (padded[m] - unpadded[m]).abs().max().item() <= TOL
    assert torch.count_nonzero(unpadded[~m]) == 0  # the packed path ran: padded rows never computed
    assert torch.count_nonzero(padded[~m]) > 0


@pytest.mark.parametrize("name", ["v3", "v2_conv", "v1"])
def test_dense_layers_see_only_real_tokens(name):
    model = _model(name, "classification")
    ids, mask, tt = _inputs(LENGTHS, seed=3)
    rows: dict[str, list[int]] = {}
    hooks = []
    for n, mod in model.deberta.named_modules():
        # every dense layer of the blocks except the relative-table projections (pos_*: table rows only)
        if isinstance(mod, torch.nn.Linear) and ".layer." in f".{n}" and "pos_" not in n:
            hooks.append(mod.register_forward_hook(
                lambda m, args, out, n=n: rows.setdefault(n, []).append(args[0].shape[:-1].numel())))
    try:
        _both(model, ids, mask, tt)
    finally:
        for h in hooks:
            h.remove()
    B, T = ids.shape
    rel = model.deberta.encoder.relative_context(T, ids.device)
    table_rows = rel.rel_embeddings.shape[0] if rel is not None and rel.rel_embeddings is not None else -1
    # v3 shares query_proj / key_proj with the relative table: those calls project R table rows, not tokens
    token_rows = {n: [r for r in v if r != table_rows] for n, v in rows.items()}
    per_layer = 4 if name.startswith("v1") else 6  # (in_proj | q, k, v), attention output, FFN in and out
    assert len(token_rows) == per_layer * model.config.num_hidden_layers
    assert all(v == [B * T, sum(LENGTHS)] for v in token_rows.values()), rows


@pytest.mark.parametrize("lengths", [[40, 40, 40], [7]], ids=["no_padding", "batch_of_1"])
@pytest.mark.parametrize("name", ["v3", "v2_conv", "v1"])
def test_batches_without_padding_take_the_padded_path(name, lengths):
    model = _model(name, "question-answering")
    ids, mask, tt = _inputs(lengths, seed=4)
    assert model.deberta.packing(mask.bool()) is None
    padded, unpadded = _both(model, ids, mask, tt)
    assert torch.equal(padded[0], unpadded[0]) and torch.equal(padded[1], unpadded[1])


def test_batch_of_1_inside_a_padded_batch_matches_it_alone():
    model = _model("v3", "classification")
    ids, mask, _ = _inputs(LENGTHS, seed=5)
    with torch.inference_mode():
        batched = model(ids, mask)
        solo = torch.cat([model(ids[i:i + 1, :n], mask[i:i + 1, :n]) for i, n in enumerate(LENGTHS)])
    assert (batched - solo).abs().max().item() <= TOL


def test_token_packing_round_trip():
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 1, 0]], dtype=torch.bool)
    pack = TokenPacking.from_mask(mask)
    assert pack.num_tokens == 7 and pack.batch.tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert pack.pos.tolist() == [0, 1, 1, 2, 3, 0, 2]
    x = torch.arange(3 * 4 * 2, dtype=torch.float32).view(3, 4, 2)
    back = pack.scatter(pack.gather(x))
    assert torch.equal(back[mask], x[mask]) and torch.count_nonzero(back[~mask]) == 0
    # gather of a non-contiguous view (the attention context is gathered from a transpose)
    y = torch.randn(3, 5, 4, 2).transpose(1, 2)  # [B, T, n, d] view of [B, n, T, d]
    assert torch.equal(pack.gather(y), y.contiguous()[mask])


def test_export_traces_the_padded_path():
    """torch.export (what the ONNX exporter runs) with dynamic batch and length: no data-dependent packing."""
    model = _model("v3", "classification")
    ids, mask, _ = _inputs([8, 8], seed=6)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=512)
    program = torch.export.export(model, (ids, mask), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("nonzero" in op or "index_copy" in op for op in ops), ops
    ids2, mask2, _ = _inputs([3, 9, 20], seed=7)  # the padded graph on a padded batch equals eager (unpadded)
    with torch.inference_mode():
        eager = model(ids2, mask2)
    assert (program.module()(ids2, mask2) - eager).abs().max().item() <= TOL


# -- torch backend ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cls_checkpoint(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("unpadded-ckpt")
    return make_deberta_checkpoint(root / "cls", tokenizer_dir=unigram_tokenizer_dir, labels=("a", "b", "c")).path


def test_backend_torch_unpadded_key(cls_checkpoint):
    outs = {}
    for flag in (True, False):
        be = TorchBackend(ModelConfig(name="m", path=cls_checkpoint, device="cpu", torch_unpadded=flag))
        be.load()
        assert be.model.deberta.unpadded is flag
        tok = be.meta.tokenizer
        encs = [tok.encode(t, max_length=200) for t in ["a", "some longer text here", "word " * 150]]
        outs[flag] = be.run(encs)
        be.close()
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)


def test_config_torch_unpadded_must_be_bool(tmp_path):
    def models(extra: str):
        spec = f"m={tmp_path}{extra}"
        return load_config(model_specs=[spec], defaults_dir=tmp_path / "none").models

    assert models("")[0].torch_unpadded is True
    assert models(",torch_unpadded=false")[0].torch_unpadded is False
    with pytest.raises(ConfigError, match="torch_unpadded must be true or false"):
        models(",torch_unpadded=maybe")


def test_translation_backend_torch_unpadded_key(tmp_path, caplog):
    # was: only the torch encoder backend applied the key; a translation model's DeBERTa encoder stayed unpadded
    from fixtures.translation import make_tiny_checkpoint
    from relserve.models.deberta import DebertaModel
    from relserve.service.backends.torch_translation import TorchTranslationBackend

    ckpt = make_tiny_checkpoint(tmp_path / "tr", encoder="deberta")
    for flag in (False, True):
        caplog.clear()
        be = TorchTranslationBackend(ModelConfig(name="tr", path=ckpt, device="cpu", torch_unpadded=flag))
        with caplog.at_level("INFO", logger="relserve.service.backends.torch_translation"):
            be.load()
        encoders = [m for m in be.model.modules() if isinstance(m, DebertaModel)]
        assert encoders and all(m.unpadded is flag for m in encoders)
        lines = [r.getMessage() for r in caplog.records if "unpadded execution" in r.getMessage()]
        assert lines == [f"model 'tr': DeBERTa encoder unpadded execution {'on' if flag else 'off'} (torch_unpadded)"]
        be.close()
