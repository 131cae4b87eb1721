"""models/relative_position.py: the CPU kernels of the disentangled-attention custom op. Strided views where the
table index is linear in the distance and advanced indexing on the flattened scores give the reference's numbers bit
for bit (float32 and bfloat16, c2p / p2c / both, whole table and centred window, Tq != Tk); the diagonal kernel
(self-attention: the table row depends on the distance only) gives them within rounding (its scale rides on the
table) and is what the op runs on CPU for square blocks; the in-place key mask equals ``torch.where``."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from relserve.models import relative_position as rp  # noqa: E402


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_by_rows_is_the_reference_bit_for_bit(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    B, n, d = 1 + seed % 3, 1 + (seed * 5) % 4, 4 + seed
    Tq = int(torch.randint(1, 180, (1,), generator=g))
    Tk = Tq if seed < 4 else int(torch.randint(1, 180, (1,), generator=g))
    buckets, max_pos = [(256, 512), (32, 128), (-1, 64), (16, 40), (32, 128), (-1, 64)][seed]
    span = buckets if buckets > 0 else max_pos
    c2p, p2c = [(True, True), (True, False), (False, True), (True, True), (True, True), (False, True)][seed]
    R = 2 * span if seed % 2 else max(1, min(2 * span, 2 * max(Tq, Tk) - 1))
    q = torch.randn(B, n, Tq, d, generator=g).to(dtype)
    k = torch.randn(B, n, Tk, d, generator=g).to(dtype)
    pq, pk = torch.randn(n, R, d, generator=g).to(dtype), torch.randn(n, R, d, generator=g).to(dtype)
    rel = rp.log_bucket_relative_position_reference(Tq, Tk, buckets, max_pos)
    args = (q, k, pq if p2c else None, pk if c2p else None, rel, span, 1 / math.sqrt(d * 3), c2p, p2c)
    want = rp.disentangled_attention_bias_reference(*args)
    got = rp.disentangled_attention_bias_by_rows(*args)
    assert got.shape == (B, n, Tq, Tk) and got.dtype == dtype
    assert torch.equal(got, want)
    with torch.inference_mode():  # the custom op (no grad) runs the CPU kernel: the diagonal one where square
        torch.testing.assert_close(rp.disentangled_attention_bias(*args[:5], att_span=span, scale=args[6], c2p=c2p,
                                                                  p2c=p2c), want, **_tol(dtype))


def _tol(dtype) -> dict[str, float]:
    """Rounding of a scale applied before the sum instead of after: float32's last bits, bfloat16's 8-bit mantissa
    (one rounding step of each term, values up to ~20)."""
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=6e-2)


@pytest.mark.parametrize("kernel", ["reference", "by_rows", "by_shift", "by_diagonals"])
def test_every_kernel_refuses_the_same_calls(kernel):
    fn = getattr(rp, f"disentangled_attention_bias_{kernel}")
    q = torch.zeros(1, 1, 2, 2)
    rel = rp.log_bucket_relative_position_reference(2, 2, -1, 8)
    with pytest.raises(ValueError, match="at least one of c2p, p2c"):
        fn(q, q, None, None, rel, 8, 1.0, False, False)
    with pytest.raises(ValueError, match="pos_key is required"):
        fn(q, q, None, None, rel, 8, 1.0, True, False)


def _case(seed: int, dtype, T: int | None = None):
    g = torch.Generator().manual_seed(seed)
    B, n, d = 1 + seed % 3, 1 + (seed * 5) % 4, 4 + seed % 13
    Tq = T or int(torch.randint(1, 300, (1,), generator=g))
    Tk = Tq if (seed % 3 or T) else int(torch.randint(1, 300, (1,), generator=g))  # T given: self-attention
    buckets, max_pos = [(256, 512), (32, 128), (-1, 64), (16, 40), (-1, 512)][seed % 5]
    span = buckets if buckets > 0 else max_pos
    c2p, p2c = [(True, True), (True, False), (False, True)][seed % 3]
    R = 2 * span if seed % 4 == 1 else max(1, min(2 * span, 2 * max(Tq, Tk) - 1))
    q = torch.randn(B, n, Tq, d, generator=g).to(dtype)
    k = torch.randn(B, n, Tk, d, generator=g).to(dtype)
    pq, pk = torch.randn(n, R, d, generator=g).to(dtype), torch.randn(n, R, d, generator=g).to(dtype)
    rel = rp.log_bucket_relative_position_reference(Tq, Tk, buckets, max_pos)
    return (q, k, pq if p2c else None, pk if c2p else None, rel, span, 1 / math.sqrt(d * 3), c2p, p2c), R


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_by_shift_is_the_reference_bit_for_bit_where_the_index_is_linear(dtype):
    shifted = 0
    for seed in range(60):
        args, R = _case(seed, dtype)
        idx = rp._relative_index(args[4], args[5], R)
        Tq, Tk = idx.shape
        linear = bool((idx == idx[0, 0] + torch.arange(Tq)[:, None] - torch.arange(Tk)[None, :]).all())
        got = rp.disentangled_attention_bias_by_shift(*args)
        assert (got is not None) == linear, seed  # None exactly where a bucket or a clamp bends the index
        if got is None:
            continue
        shifted += 1
        want = rp.disentangled_attention_bias_reference(*args)
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.equal(got, want), seed
    assert 15 <= shifted <= 55  # both kinds of case were drawn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_by_diagonals_is_the_reference_wherever_the_block_is_square(dtype):
    square = 0
    for seed in range(60):
        args, R = _case(seed, dtype)
        Tq, Tk = args[0].shape[2], args[1].shape[2]
        with torch.inference_mode():
            got = rp.disentangled_attention_bias_by_diagonals(*args)
        assert (got is not None) == (Tq == Tk), seed  # buckets and clamps included: only Tq != Tk falls back
        if got is None:
            continue
        square += 1
        want = rp.disentangled_attention_bias_reference(*args)
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        torch.testing.assert_close(got, want, **_tol(dtype))
    assert 30 <= square <= 50


def test_by_diagonals_refuses_an_index_that_is_not_constant_along_diagonals():
    args, R = _case(0, torch.float32, T=6)
    idx = rp._relative_index(args[4], args[5], R)
    assert rp._diagonal_rows(idx) is not None
    bent = args[4].clone()
    bent[2, 4] += 1  # one entry off its diagonal
    assert rp._diagonal_rows(rp._relative_index(bent, args[5], R)) is None
    assert rp.disentangled_attention_bias_by_diagonals(*args[:4], bent, *args[5:]) is None
    assert rp._diagonal_rows(idx[None]) is None and rp._diagonal_rows(idx[:0, :0]) is None


def test_the_op_takes_the_diagonals_for_self_attention_and_the_older_kernels_otherwise(monkeypatch):
    from relserve.models import onednn

    calls = []
    for name in ("by_rows", "by_shift", "by_diagonals"):
        fn = getattr(rp, f"disentangled_attention_bias_{name}")
        monkeypatch.setattr(rp, f"disentangled_attention_bias_{name}",
                            lambda *a, _n=name, _f=fn: calls.append(_n) or _f(*a))
    head = onednn.head_product
    monkeypatch.setattr(onednn, "head_product", lambda *a: calls.append("onednn") or head(*a))
    with torch.inference_mode():
        for T in (5, 128, 133, 300):
            for dtype in (torch.float32, torch.bfloat16):
                args, _ = _case(0, dtype, T=T)  # seed 0: 256 buckets, c2p and p2c, centred window
                calls.clear()
                out = rp.disentangled_attention_bias(*args[:5], att_span=args[5], scale=args[6], c2p=args[7],
                                                     p2c=args[8])
                torch.testing.assert_close(out, rp.disentangled_attention_bias_reference(*args), **_tol(dtype))
                # float32 runs each head's two products through oneDNN (where this torch has it); bfloat16 torch.mm
                fp32_onednn = dtype == torch.float32 and onednn.available()
                assert calls == ["by_diagonals"] + ["onednn"] * (2 * args[0].shape[1] if fp32_onednn else 0), (T, dtype)
        # Tq != Tk (no diagonal kernel): strided views where the index is linear, else float32's gather or
        # bfloat16's advanced indexing, bit for bit
        for seed, dtype in ((3, torch.float32), (3, torch.bfloat16), (6, torch.bfloat16)):
            args, _ = _case(seed, dtype)
            assert args[0].shape[2] != args[1].shape[2]
            calls.clear()
            out = rp.disentangled_attention_bias(*args[:5], att_span=args[5], scale=args[6], c2p=args[7], p2c=args[8])
            assert torch.equal(out, rp.disentangled_attention_bias_reference(*args))
            assert calls[:2] == ["by_diagonals", "by_shift"] and set(calls[2:]) <= {"by_rows"}, (seed, calls)


def test_by_diagonals_called_with_gradients_gives_the_references():
    """Outside inference the kernel must stay differentiable (no out= sum, no oneDNN op)."""
    for seed, dtype in ((1, torch.float32), (2, torch.float32)):
        args, _ = _case(seed, dtype, T=9)
        leaves = [a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                  for a in args]
        got = rp.disentangled_attention_bias_by_diagonals(*leaves)
        want_leaves = [a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.requires_grad
                       else a for a in leaves]
        want = rp.disentangled_attention_bias_reference(*want_leaves)
        weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed))
        (got * weights).sum().backward()
        (want * weights).sum().backward()
        for a, b in zip(leaves, want_leaves):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_an_empty_batch_gives_an_empty_bias():
    for dtype in (torch.float32, torch.bfloat16):
        args, _ = _case(0, dtype, T=5)
        args = (args[0][:0], args[1][:0], *args[2:])
        with torch.inference_mode():
            out = rp.disentangled_attention_bias(*args[:5], att_span=args[5], scale=args[6], c2p=args[7], p2c=args[8])
        assert out.shape == (0, args[0].shape[1], 5, 5)


def test_mask_keys_in_place_equals_torch_where():
    from relserve.models.deberta import mask_keys_

    g = torch.Generator().manual_seed(0)
    B, n, T = 3, 2, 6
    for pattern in ("none", "right", "left", "holes"):
        km = torch.ones(B, T, dtype=torch.bool)
        if pattern == "right":
            km[1, 4:] = False
            km[2, 1:] = False
        elif pattern == "left":
            km[0, :2] = False
        elif pattern == "holes":
            km[2, 1] = km[2, 3] = False
        key_mask = km[:, None, None, :]
        for shape in ((B, n, T, T), (B, 1, 1, T)):
            bias = torch.randn(*shape, generator=g)
            want = torch.where(key_mask, bias, -1e30)
            got = mask_keys_(bias, key_mask, -1e30)
            assert got is bias and torch.equal(got, want), (pattern, shape)
    with pytest.raises(ValueError, match="expanded view"):  # one row written would be every row
        mask_keys_(torch.zeros(1, n, T, T).expand(B, n, T, T), key_mask, -1e30)


def test_the_op_answers_empty_single_row_and_batched_index_inputs_as_the_reference():
    """A fresh tester's cases: an empty sequence (the linear check read idx[0, 0] and raised), one query over
    many keys (the flipped table changes the float32 matmul's rounding: equal within the last bits, not bit for
    bit), and a [1, T, T] relative position (not [Tq, Tk]: the strided views do not apply)."""
    with torch.inference_mode():
        for Tq, Tk in ((0, 0), (0, 5)):
            q, k = torch.zeros(1, 2, Tq, 8), torch.zeros(1, 2, Tk, 8)
            pk = torch.zeros(2, 1, 8)
            rel = rp.log_bucket_relative_position_reference(Tq, Tk, 256, 512)
            assert rp.disentangled_attention_bias_by_shift(q, k, pk, pk, rel, 256, 1.0, True, True) is None
            out = rp.disentangled_attention_bias(q, k, pk, pk, rel, att_span=256, scale=1.0, c2p=True, p2c=True)
            assert out.shape == (1, 2, Tq, Tk)
        g = torch.Generator().manual_seed(0)
        q, k = torch.randn(2, 3, 1, 64, generator=g), torch.randn(2, 3, 128, 64, generator=g)
        pk = torch.randn(3, 255, 64, generator=g)
        rel = rp.log_bucket_relative_position_reference(1, 128, 256, 512)
        want = rp.disentangled_attention_bias_reference(q, k, None, pk, rel, 256, 0.125, True, False)
        got = rp.disentangled_attention_bias(q, k, None, pk, rel, att_span=256, scale=0.125, c2p=True, p2c=False)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        idx3 = rp._relative_index(rel, 256, 255)[None]
        assert rp._linear_offset(idx3) is None


def test_eager_forward_runs_the_kernels_without_importing_dynamo():
    """An eager DeBERTa forward (what a serving process runs) calls the ops' kernels directly: dispatching through
    ``torch.ops`` imports TorchDynamo, sympy and the inductor on the first call, 65-70 MB in every process."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from relserve.models.deberta import DebertaConfig, DebertaModel\n"
        "cfg = DebertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,\n"
        "                    intermediate_size=32, relative_attention=True, position_buckets=8,\n"
        "                    max_relative_positions=32, pos_att_type=['c2p', 'p2c'])\n"
        "model = DebertaModel(cfg).eval()\n"
        "with torch.inference_mode():\n"
        "    out = model(torch.randint(0, 50, (2, 7)), torch.ones(2, 7, dtype=torch.long))\n"
        "print(tuple(out.shape) if hasattr(out, 'shape') else type(out).__name__,\n"
        "      'torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "False"], out.stdout
