"""models/relative_position.py: the CPU kernel of the disentangled-attention custom op (advanced indexing on the
flattened scores) gives the reference's numbers bit for bit (float32 and bfloat16, c2p / p2c / both, whole table
and centred window, Tq != Tk), and the op dispatches to it on CPU."""

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
    with torch.inference_mode():  # the custom op (no grad) runs the CPU kernel
        assert torch.equal(rp.disentangled_attention_bias(*args[:5], att_span=span, scale=args[6], c2p=c2p,
                                                          p2c=p2c), want)


def test_by_rows_refuses_what_the_reference_refuses():
    q = torch.zeros(1, 1, 2, 2)
    rel = rp.log_bucket_relative_position_reference(2, 2, -1, 8)
    with pytest.raises(ValueError, match="at least one of c2p, p2c"):
        rp.disentangled_attention_bias_by_rows(q, q, None, None, rel, 8, 1.0, False, False)
    with pytest.raises(ValueError, match="pos_key is required"):
        rp.disentangled_attention_bias_by_rows(q, q, None, None, rel, 8, 1.0, True, False)
