"""models/onednn.py: dense layers and per-head products through oneDNN on CPU. The switched layers compute what
``nn.Linear`` computes (float32 rounding apart), really run oneDNN's op (seen in the profiler), fuse the feed-forward's
GELU, run bfloat16 too, step aside for autograd and tracing, survive the bfloat16 copy, and the torch backend's
``torch_onednn`` key turns them on and off with the same answers."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from relserve.models import onednn  # noqa: E402
from relserve.models.checkpoint import load_checkpoint  # noqa: E402
from relserve.models.deberta import DebertaConfig, DebertaIntermediate  # noqa: E402
from relserve.service.backends.precision import to_bfloat16  # noqa: E402

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN linear op")
OP = "mkldnn::_linear_pointwise"


def _ops(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.key for e in prof.key_averages()]


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8, bias=False)).eval()


def test_switched_layers_compute_nn_linear_through_onednn_and_switch_back():
    model = _mlp()
    x = torch.randn(3, 5, 16)
    with torch.inference_mode():
        want = model(x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert onednn.set_onednn_linear(model, True) == 2
    assert all(type(m) is onednn.OneDnnLinear for m in (model[0], model[2]))
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    with torch.inference_mode():
        got = model(x)
        assert OP in _ops(lambda: model(x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert onednn.set_onednn_linear(model, False) == 0
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    with torch.inference_mode():
        assert torch.equal(model(x), want)
        assert OP not in _ops(lambda: model(x))


@pytest.mark.parametrize("act, fused", [("gelu", "none"), ("gelu_new", "tanh"), ("relu", None)])
def test_the_feed_forward_gelu_is_fused_where_it_is_a_gelu(act, fused):
    cfg = DebertaConfig(vocab_size=11, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=24, hidden_act=act)
    torch.manual_seed(1)
    ffn = DebertaIntermediate(cfg).eval()
    x = torch.randn(4, 16) * 3  # GELU's curved part, where the tanh form differs from the exact one
    with torch.inference_mode():
        want = ffn(x)
    onednn.set_onednn_linear(ffn, True)
    assert ffn.fused_activation is (fused is not None) and ffn.dense.gelu == fused
    with torch.inference_mode():
        torch.testing.assert_close(ffn(x), want, rtol=1e-5, atol=1e-5)
    onednn.set_onednn_linear(ffn, False)
    assert not ffn.fused_activation and type(ffn.dense) is nn.Linear and "gelu" not in ffn.dense.__dict__
    with torch.inference_mode():
        assert torch.equal(ffn(x), want)


def test_autograd_and_tracing_take_nn_linear_and_bfloat16_the_op():
    model = _mlp(2)
    ref = _mlp(2)
    onednn.set_onednn_linear(model, True)
    x = torch.randn(6, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    model(x).sum().backward()
    ref(xr).sum().backward()
    assert torch.equal(x.grad, xr.grad)
    assert torch.equal(model[0].weight.grad, ref[0].weight.grad)
    with torch.inference_mode():  # bfloat16 takes the op too, within bfloat16 rounding of F.linear
        xb = torch.randn(6, 16, dtype=torch.bfloat16)
        bf = to_bfloat16(model)
        assert OP in _ops(lambda: bf(xb))
        torch.testing.assert_close(bf(xb), to_bfloat16(ref)(xb), rtol=2e-2, atol=2e-2)
    traced = torch.jit.trace(model, torch.randn(2, 16))
    graph = str(traced.inlined_graph)
    assert "mkldnn" not in graph and "aten::linear" in graph


def test_the_bfloat16_copy_keeps_the_switch_and_the_float32_model_its_weights():
    model = _mlp(3)
    onednn.set_onednn_linear(model, True)
    copy = to_bfloat16(model)
    assert type(copy[0]) is onednn.OneDnnLinear and copy[0].weight.dtype == torch.bfloat16
    assert model[0].weight.dtype == torch.float32


def test_head_product_is_the_heads_matmul():
    g = torch.Generator().manual_seed(0)
    B, n, T, d, M = 2, 3, 5, 8, 9
    x = torch.randn(B, T, n, d, generator=g).transpose(1, 2)  # the encoder's layout: heads split by a view
    table = torch.randn(n, M, d, generator=g)
    want = torch.matmul(x, table.transpose(-1, -2))
    with torch.inference_mode():
        for h in range(n):
            rows = x[:, h].reshape(B * T, d)  # a strided view: row stride n·d
            got = onednn.head_product(rows, table[h])
            assert got.shape == (B * T, M) and got.is_contiguous()
            torch.testing.assert_close(got.view(B, T, M), want[:, h], rtol=1e-5, atol=1e-5)
        assert OP in _ops(lambda: onednn.head_product(rows, table[0]))
        with pytest.raises(ValueError, match="disagree"):
            onednn.head_product(rows, table[0, :, :4])
        with pytest.raises(ValueError, match="not oneDNN's path"):
            onednn.head_product(rows.bfloat16(), table[0].bfloat16())  # bfloat16 runs torch.mm (relative_position.py)


def test_backend_torch_onednn_key(unigram_tokenizer_dir, tmp_path):
    from relserve.service.backends.torch_encoder import TorchBackend
    from relserve.service.config import ModelConfig

    path = make_deberta_checkpoint(tmp_path / "cls", tokenizer_dir=unigram_tokenizer_dir, labels=("a", "b")).path
    outs = {}
    for flag in (True, False):
        be = TorchBackend(ModelConfig(name="m", path=path, device="cpu", dtype="float32", torch_onednn=flag))
        be.load()
        switched = sum(type(m) is onednn.OneDnnLinear for m in be.model.modules())
        linears = sum(isinstance(m, nn.Linear) for m in be.model.modules())
        assert switched == (linears if flag else 0) and linears > 0
        tok = be.meta.tokenizer
        encs = [tok.encode(t, max_length=200) for t in ["a", "some longer text here", "word " * 150]]
        outs[flag] = be.run(encs)
        be.close()
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_parity_with_transformers_through_onednn_at_served_lengths(tmp_path):
    """The switch on a v3 model of the served shape family (real GELU, 2 heads per 16 dims), long padded batch."""
    pytest.importorskip("transformers")
    tiny = make_deberta_checkpoint(tmp_path / "v3", oracle=True, vocab_size=97, labels=3, init="spread", seed=4)
    ours = load_checkpoint(tiny.path, load_tokenizer=False).model
    assert onednn.set_onednn_linear(ours, True) > 0
    g = torch.Generator().manual_seed(0)
    lengths = [300, 1, 45]
    ids = torch.randint(1, 97, (3, 300), generator=g)
    mask = (torch.arange(300)[None, :] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        want = tiny.model(input_ids=ids, attention_mask=mask).logits
    with torch.inference_mode():
        got = ours(ids, mask)
    assert (got - want).abs().max().item() <= 1e-4


def test_a_frozen_weight_with_a_trainable_bias_still_gets_its_gradient():
    """A fresh tester's case: bias-only tuning (frozen weights, inputs without grad) took oneDNN's op, which has no
    backward, and the bias got no gradient."""
    model, ref = _mlp(4), _mlp(4)
    onednn.set_onednn_linear(model, True)
    for m in (model, ref):
        for name, p in m.named_parameters():
            p.requires_grad_(name.endswith("bias"))
    x = torch.randn(5, 16)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert model[0].bias.grad is not None and torch.equal(model[0].bias.grad, ref[0].bias.grad)


def test_a_subclassed_dense_layer_keeps_its_activation():
    """set_onednn_linear swaps exactly nn.Linear; a subclass (an adapter wrapper, say) keeps its forward, so the
    module around it must keep applying its GELU."""
    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    cfg = DebertaConfig(vocab_size=11, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=24, hidden_act="gelu")
    torch.manual_seed(5)
    ffn = DebertaIntermediate(cfg).eval()
    dense = Scaled(16, 24)
    dense.load_state_dict(ffn.dense.state_dict())
    ffn.dense = dense
    x = torch.randn(3, 16) * 3
    with torch.inference_mode():
        want = ffn(x)
    assert onednn.set_onednn_linear(ffn, True) == 0
    assert not ffn.fused_activation
    with torch.inference_mode():
        assert torch.equal(ffn(x), want)


def test_an_empty_batch_gives_an_empty_answer(tmp_path):
    tiny = make_deberta_checkpoint(tmp_path / "v3", vocab_size=97, labels=3, seed=6)
    model = load_checkpoint(tiny.path, load_tokenizer=False).model
    onednn.set_onednn_linear(model, True)
    ids, mask = torch.zeros(0, 9, dtype=torch.long), torch.zeros(0, 9, dtype=torch.long)
    with torch.inference_mode():
        assert model(ids, mask).shape == (0, 3)
        assert to_bfloat16(model)(ids, mask).shape == (0, 3)
