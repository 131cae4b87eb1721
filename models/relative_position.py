"""Relative positions for DeBERTa disentangled attention (He et al. 2021, sec. 3.1 and DeBERTa-v2 log buckets).

The relative position of query i to key j is ``δ = i - j``. DeBERTa-v2/v3 compress large distances into
logarithmic buckets: distances with ``|δ| <= bucket_size // 2`` keep their exact value, larger ones are
mapped to ``sign(δ) * (mid + ceil(log(|δ| / mid) / log((max_position - 1) / mid) * (mid - 1)))``, so
``max_position`` distances fit into ``bucket_size`` buckets per side. The result is a signed bucket id;
callers shift it by the table half-size ``att_span`` and clamp it into ``[0, 2 * att_span - 1]`` to index
the ``rel_embeddings`` table.

The float arithmetic below is done in float32 in the same order as the reference implementation so the
bucket ids are bit-identical (a different order can move a distance across a ``ceil`` boundary).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .capture import graph_capture, needs_grad

TORCH_NAMESPACE = "relserve"
# by_diagonals multiplies all heads in one bmm up to this many product values (4M: 8 MB in bfloat16), beyond
# it one head at a time (only one head's products alive: 401 MB of bfloat16 at 16 x 512 tokens for all 12)
BATCHED_PRODUCT_ELEMENTS = 1 << 22


def make_log_bucket_position(relative_pos: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    """Map signed distances to signed log-bucket ids.

    Args:
        relative_pos: Long[...] signed distances ``i - j``.
        bucket_size: number of buckets per side (``position_buckets``); ``mid = bucket_size // 2`` is the
            largest distance kept exactly.
        max_position: the largest distance the log scale is stretched to (``max_relative_positions``).

    Returns:
        Long[...] of the same shape: ``δ`` where ``|δ| <= mid``, else the signed log bucket.
    """
    mid = bucket_size // 2
    sign = torch.sign(relative_pos)
    # Inside (-mid, mid) the log branch is never used; feed it a harmless value (mid - 1) to avoid log(0).
    near = (relative_pos < mid) & (relative_pos > -mid)
    abs_pos = torch.where(near, torch.full_like(relative_pos, mid - 1), relative_pos.abs())
    log_ratio = torch.log(abs_pos / mid)  # float32
    log_base = torch.log(torch.tensor((max_position - 1) / mid, dtype=log_ratio.dtype, device=log_ratio.device))
    log_pos = torch.ceil(log_ratio / log_base * (mid - 1)) + mid
    bucket = torch.where(abs_pos <= mid, relative_pos.to(log_pos.dtype), log_pos * sign)
    return bucket.to(torch.long)


def build_relative_position(
    query_size: int,
    key_size: int,
    bucket_size: int = -1,
    max_position: int = -1,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Relative positions ``δ(i, j) = i - j`` of queries ``0..query_size-1`` to keys ``0..key_size-1``.

    Log buckets are applied only when both ``bucket_size > 0`` and ``max_position > 0`` (DeBERTa-v2 rule).

    Returns:
        Long[query_size, key_size] signed (bucketed) distances.
    """
    q = torch.arange(query_size, dtype=torch.long, device=device)
    k = torch.arange(key_size, dtype=torch.long, device=device)
    rel = q[:, None] - k[None, :]  # [Tq, Tk]
    if bucket_size > 0 and max_position > 0:
        rel = make_log_bucket_position(rel, bucket_size, max_position)
    return rel


def relative_index(relative_pos: torch.Tensor, att_span: int) -> torch.Tensor:
    """Signed (bucketed) distance -> row of the ``2 * att_span``-row ``rel_embeddings`` table (clamped)."""
    return torch.clamp(relative_pos + att_span, 0, 2 * att_span - 1)


# ---------------------------------------------------------------------------------------------------------------
# Torch references (the math; the eager model reaches them through the custom ops below)
# ---------------------------------------------------------------------------------------------------------------


def log_bucket_relative_position_reference(
    query_length: int, key_length: int, bucket_size: int = -1, max_position: int = -1, device=None
) -> Tensor:
    """Long[Tq, Tk] signed (bucketed) distances ``i - j`` (:func:`build_relative_position`)."""
    return build_relative_position(query_length, key_length, bucket_size, max_position, device=device)


def _relative_index(relative_pos: Tensor, att_span: int, rows: int) -> Tensor:
    """The ``idx`` of DisentangledAttentionBias: clamp into the table, shift to the window, clamp again."""
    offset = att_span - rows // 2
    idx = relative_index(relative_pos, att_span) - offset
    return torch.clamp(idx, 0, rows - 1)


def _bias_shapes(query_layer: Tensor, key_layer: Tensor, pos_query: Optional[Tensor], pos_key: Optional[Tensor],
                 c2p: bool, p2c: bool) -> tuple[int, int, int, int, int]:
    """``(B, n, Tq, Tk, R)`` of a disentangled-attention bias call (R: rows of the projected table).

    Raises:
        ValueError: neither term is set, or the projected table a term needs is missing.
    """
    if not (c2p or p2c):
        raise ValueError("disentangled_attention_bias: at least one of c2p, p2c must be set")
    ref = pos_key if c2p else pos_query
    if ref is None:
        raise ValueError("disentangled_attention_bias: pos_key is required for c2p, pos_query for p2c")
    B, n, Tq, _ = query_layer.shape
    return B, n, Tq, key_layer.shape[2], ref.shape[1]


def disentangled_attention_bias_reference(
    query_layer: Tensor,
    key_layer: Tensor,
    pos_query: Optional[Tensor],
    pos_key: Optional[Tensor],
    relative_pos: Tensor,
    att_span: int,
    scale: float,
    c2p: bool,
    p2c: bool,
) -> Tensor:
    """c2p + p2cᵀ scores times ``scale``: Float[B, n, Tq, Tk] (see the module docstring)."""
    B, n, Tq, Tk, R = _bias_shapes(query_layer, key_layer, pos_query, pos_key, c2p, p2c)
    idx = _relative_index(relative_pos, att_span, R)  # [Tq, Tk]
    bias = None
    if c2p:
        # eq. (4) second term: Qc_i · Kr_{δ(i,j)}
        scores = torch.matmul(query_layer, pos_key.transpose(-1, -2))  # [B, n, Tq, R]
        bias = torch.gather(scores, -1, idx.expand(B, n, Tq, Tk))
    if p2c:
        # eq. (4) third term: Kc_j · Qr_{δ(j,i)}, gathered per key row j then transposed to [i, j]
        scores = torch.matmul(key_layer, pos_query.transpose(-1, -2))  # [B, n, Tk, R]
        term = torch.gather(scores, -1, idx.transpose(0, 1).expand(B, n, Tk, Tq)).transpose(-1, -2)
        bias = term if bias is None else bias + term
    return bias * scale


def disentangled_attention_bias_by_rows(
    query_layer: Tensor,
    key_layer: Tensor,
    pos_query: Optional[Tensor],
    pos_key: Optional[Tensor],
    relative_pos: Tensor,
    att_span: int,
    scale: float,
    c2p: bool,
    p2c: bool,
) -> Tensor:
    """:func:`disentangled_attention_bias_reference`, bit for bit, with the gathers as one advanced-indexing
    read per term: the scores flattened to [B, n, X·R] and read at ``i·R + idx[i, j]`` (c2p) or
    ``j·R + idx[i, j]`` (p2c), a [Tq, Tk] index shared by every batch row and head, so p2c needs no transpose.
    The CPU kernel for bfloat16 beyond the exact bucket range (``torch.gather`` with an expanded index is slow in
    bfloat16 there: 8 x 12 heads x 512 tokens, 2 threads, 508-537 -> 146 ms in one run, 323 -> 232 ms in
    ``loadtest/bench/relpos.py`` on another machine); in float32 the gather is faster (269 against 299 ms).
    Float[B, n, Tq, Tk]."""
    B, n, Tq, Tk, R = _bias_shapes(query_layer, key_layer, pos_query, pos_key, c2p, p2c)
    idx = _relative_index(relative_pos, att_span, R)  # [Tq, Tk]
    bias = None
    if c2p:
        scores = torch.matmul(query_layer, pos_key.transpose(-1, -2)).reshape(B, n, Tq * R)
        at = torch.arange(Tq, device=idx.device)[:, None] * R + idx
        bias = scores[:, :, at]
    if p2c:
        scores = torch.matmul(key_layer, pos_query.transpose(-1, -2)).reshape(B, n, Tk * R)
        at = torch.arange(Tk, device=idx.device)[None, :] * R + idx
        term = scores[:, :, at]
        bias = term if bias is None else bias + term
    return bias * scale


def _linear_offset(idx: Tensor) -> Optional[int]:
    """``c`` when ``idx`` is [Tq, Tk], not empty, and ``idx[i, j] == c + i - j`` everywhere (every distance in the
    exact, unclamped range), else None."""
    if idx.dim() != 2 or idx.numel() == 0:
        return None
    Tq, Tk = idx.shape
    c = int(idx[0, 0])
    rows = torch.arange(Tq, device=idx.device)
    cols = torch.arange(Tk, device=idx.device)
    return c if torch.equal(idx, c + rows[:, None] - cols[None, :]) else None


def disentangled_attention_bias_by_shift(
    query_layer: Tensor,
    key_layer: Tensor,
    pos_query: Optional[Tensor],
    pos_key: Optional[Tensor],
    relative_pos: Tensor,
    att_span: int,
    scale: float,
    c2p: bool,
    p2c: bool,
) -> Optional[Tensor]:
    """:func:`disentangled_attention_bias_reference` without a gather, for the common case where the table
    index is linear in the distance: ``idx[i, j] = c + i - j`` for the whole [Tq, Tk] block (no log bucket and
    no clamp reached: with 256 position buckets and 512 positions every sequence of up to 132 tokens, the first
    distance whose bucket differs from it being 132; i.e. most classification traffic). Then each term is a
    strided view of its score matrix, the relative-attention "shift"
    (Dai et al. 2019, Transformer-XL, appendix B):

    * c2p reads ``S[i, c + i - j]`` of ``S = Qc · Krᵀ`` [B, n, Tq, R]; with the table's rows reversed
      (``S'[i, r] = S[i, R-1-r]``, a flip of the small [n, R, d] ``pos_key``) that is ``S'[i, (R-1-c) - i + j]``:
      row stride R - 1, column stride 1;
    * p2c reads ``S2[j, c + i - j]`` of ``S2 = Kc · Qrᵀ`` [B, n, Tk, R]: i stride 1, j stride R - 1.

    The score values are added and scaled in the same order as the reference. At the encoder's shapes and
    layouts (self-attention, T >= 2, heads split by view and transpose) the result equals the reference bit
    for bit (``tests/unit/test_disentangled_by_rows.py``; a fresh tester's 648 model-shaped cases). Where the
    float32 matmul's rounding depends on the order of its right operand's columns (a single query row; a
    query stored head-dim-major with a strided table) c2p differs by the last bits (up to 6e-7 seen). Returns
    None when the index is not linear (longer sequences with log buckets, clamped distances), empty, or not
    [Tq, Tk]: the caller falls back to a gather. Float[B, n, Tq, Tk].

    Raises:
        ValueError: as the reference (neither term, or the projected table a term needs is missing).
    """
    B, n, Tq, Tk, R = _bias_shapes(query_layer, key_layer, pos_query, pos_key, c2p, p2c)
    c = _linear_offset(_relative_index(relative_pos, att_span, R))
    if c is None:
        return None
    bias = None
    if c2p:
        flipped = torch.matmul(query_layer, pos_key.flip(-2).transpose(-1, -2)).contiguous()  # [B, n, Tq, R]
        bias = flipped.as_strided((B, n, Tq, Tk), (n * Tq * R, Tq * R, R - 1, 1),
                                  flipped.storage_offset() + R - 1 - c)
    if p2c:
        scores = torch.matmul(key_layer, pos_query.transpose(-1, -2)).contiguous()  # [B, n, Tk, R]
        term = scores.as_strided((B, n, Tq, Tk), (n * Tk * R, Tk * R, 1, R - 1), scores.storage_offset() + c)
        bias = term if bias is None else bias + term
    return bias * scale


def _diagonal_rows(idx: Tensor) -> Optional[Tensor]:
    """``g``: Long[2T - 1] with ``idx[i, j] == g[i - j + T - 1]`` for the whole [T, T] block (the table row depends
    on the distance only, as in self-attention, log buckets and clamps included), else None (not square, empty,
    or not constant along its diagonals)."""
    if idx.dim() != 2 or idx.shape[0] != idx.shape[1] or idx.numel() == 0:
        return None
    T = idx.shape[0]
    g = torch.cat([idx[0].flip(0), idx[1:, 0]])  # δ = -(T-1) .. 0 from row 0, then 1 .. T-1 from column 0
    at = torch.arange(T, device=idx.device)
    return g if torch.equal(idx, g[at[:, None] - at[None, :] + (T - 1)]) else None


def disentangled_attention_bias_by_diagonals(
    query_layer: Tensor,
    key_layer: Tensor,
    pos_query: Optional[Tensor],
    pos_key: Optional[Tensor],
    relative_pos: Tensor,
    att_span: int,
    scale: float,
    c2p: bool,
    p2c: bool,
) -> Optional[Tensor]:
    """:func:`disentangled_attention_bias_reference` without a gather whenever the table row depends on the
    distance only (``idx[i, j] = g(i - j)``: self-attention, any length, log buckets and clamps included). Each
    term's table rows are first put in diagonal order (a gather of the small [n, R, d] table, scaled there), then
    multiplied once per head, and the [T, T] block is a strided view of the [T, 2T - 1] product: the
    relative-attention "shift" (Dai et al. 2019, Transformer-XL, appendix B) with the bucketing moved into the
    table:

    * c2p: ``S'[i, m] = Qc_i · Kr_{g(T-1-m)}`` read at ``m = T-1 - i + j`` (row stride 2T-2, column stride 1);
    * p2c: ``S2'[j, m] = Kc_j · Qr_{g(m-(T-1))}`` read at ``m = T-1 + i - j`` (i stride 1, j stride 2T-2).

    Against the gather this does 2T-1 columns of matmul instead of R (more work above T = R/2, none of the
    gather's scattered reads), one pass over [B, n, T, T] for the sum (the scale rides on the table), and in
    float32 on CPU the products run through oneDNN (:func:`relserve.models.onednn.head_product`). Beyond
    ``BATCHED_PRODUCT_ELEMENTS`` products (and always through oneDNN) head by head, so that only one head's
    products are alive at a time; smaller blocks take one bmm over the heads.
    Equal to the reference within float32 rounding (the scale is applied before the sum, not after). Returns None
    when the index is not diagonal-constant: the caller falls back to a gather. Float[B, n, T, T], contiguous.

    Raises:
        ValueError: as the reference (neither term, or the projected table a term needs is missing).
    """
    from . import onednn

    B, n, Tq, Tk, R = _bias_shapes(query_layer, key_layer, pos_query, pos_key, c2p, p2c)
    g = _diagonal_rows(_relative_index(relative_pos, att_span, R))
    if g is None or Tq != Tk:
        return None
    T, M = Tq, 2 * Tq - 1
    tables = []  # (rows of x, that term's table in diagonal order and scaled, the view's (i, j) strides)
    if c2p:
        tables.append((query_layer, pos_key.index_select(-2, g.flip(0)) * scale, (M - 1, 1)))
    if p2c:
        tables.append((key_layer, pos_query.index_select(-2, g) * scale, (1, M - 1)))
    operands = [t for x, table, _ in tables for t in (x, table)]
    use_onednn = onednn.runs_on_onednn(*operands)
    grad = needs_grad(*operands)
    if grad or (not use_onednn and B * n * T * M <= BATCHED_PRODUCT_ELEMENTS):
        # one batched matmul per term (heads as its batch), one sum: differentiable, and for small blocks fewer
        # calls than a loop over heads (bf16 32 x 32 tokens: 0.73 against 1.22 ms)
        views = []
        for x, table, (si, sj) in tables:
            s = torch.bmm(x.transpose(0, 1).reshape(n, B * T, x.shape[-1]), table.transpose(-1, -2))  # [n, B·T, M]
            views.append(s.as_strided((B, n, T, T), (T * M, B * T * M, si, sj), s.storage_offset() + T - 1))
        if grad:  # out= records no gradient
            return ((views[0] + views[1]) if len(views) == 2 else views[0]).contiguous()
        bias = query_layer.new_empty((B, n, T, T))  # the usual layout (a plain sum would follow the head-major one)
        return torch.add(views[0], views[1], out=bias) if len(views) == 2 else bias.copy_(views[0])
    # one head at a time, each head's [B·T, M] products summed into the bias at once: the products of every head
    # together are 2 x B·n·T·(2T-1) values (401 MB in bfloat16 for 16 x 512 tokens and 12 heads), one head's a
    # twelfth. float32 multiplies through oneDNN; [B, n, T, d] -> x[:, h] is one matrix of B·T rows (row stride n·d)
    bias = query_layer.new_empty((B, n, T, T))
    for h in range(n):
        views = []
        for x, table, (si, sj) in tables:
            rows = x[:, h].reshape(B * T, x.shape[-1])
            s = onednn.head_product(rows, table[h]) if use_onednn else torch.mm(rows, table[h].t())  # [B·T, M]
            views.append(s.as_strided((B, T, T), (T * M, si, sj), s.storage_offset() + T - 1))
        if len(views) == 2:
            torch.add(views[0], views[1], out=bias[:, h])
        else:
            bias[:, h].copy_(views[0])
    return bias


def t5_relative_position_bucket(
    relative_position: Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucket of ``memory_position - context_position`` (same float32 arithmetic as transformers)."""
    relative_buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        relative_buckets = relative_buckets + (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2  # half of the buckets are for exact increments
    is_small = relative_position < max_exact
    # the other half grows logarithmically up to max_distance
    if_large = max_exact + (
        torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return relative_buckets + torch.where(is_small, relative_position, if_large)


def relative_position_bias_reference(
    bias_table: Tensor, query_length: int, key_length: int, max_distance: int, is_bidirectional: bool
) -> Tensor:
    """Float[1, num_heads, Tq, Tk]: ``bias_table[bucket(j - i), h]`` (T5 ``compute_bias``)."""
    ctx = torch.arange(query_length, dtype=torch.long, device=bias_table.device)[:, None]
    mem = torch.arange(key_length, dtype=torch.long, device=bias_table.device)[None, :]
    buckets = t5_relative_position_bucket(mem - ctx, bool(is_bidirectional), bias_table.shape[0], max_distance)
    values = torch.nn.functional.embedding(buckets, bias_table)  # [Tq, Tk, n]
    return values.permute(2, 0, 1).unsqueeze(0)  # [1, n, Tq, Tk]


# ---------------------------------------------------------------------------------------------------------------
# torch.library custom ops (what the eager model calls; export sees one node each)
# ---------------------------------------------------------------------------------------------------------------


def _log_bucket_kernel(query_length: int, key_length: int, bucket_size: int, max_position: int,
                   device: torch.device) -> Tensor:
    return log_bucket_relative_position_reference(query_length, key_length, bucket_size, max_position, device)


_log_bucket_op = torch.library.custom_op(f"{TORCH_NAMESPACE}::log_bucket_relative_position", _log_bucket_kernel,
                                         mutates_args=())


@_log_bucket_op.register_fake
def _(query_length, key_length, bucket_size, max_position, device):
    return torch.empty((query_length, key_length), dtype=torch.long, device=device)


def _disentangled_kernel(query_layer: Tensor, key_layer: Tensor, pos_query: Optional[Tensor], pos_key: Optional[Tensor],
                     relative_pos: Tensor, att_span: int, scale: float, c2p: bool, p2c: bool) -> Tensor:
    args = (query_layer, key_layer, pos_query, pos_key, relative_pos, att_span, scale, c2p, p2c)
    if query_layer.device.type != "cpu":
        return disentangled_attention_bias_reference(*args).contiguous()  # the fake's layout
    # CPU (loadtest/bench/relpos.py times them): self-attention's index is constant along diagonals, so no
    # gather at all (per thread, 8 x 384 tokens: fp32 272 -> 165 ms, bf16 81 -> 69 ms); otherwise strided views
    # where the index is linear in the distance; else, in bfloat16, advanced indexing (torch.gather with an
    # expanded index is slow there: 8 x 512 tokens 323 -> 232 ms), while in float32 the gather is the faster
    bias = disentangled_attention_bias_by_diagonals(*args)
    if bias is None:
        bias = disentangled_attention_bias_by_shift(*args)
    if bias is None:
        kernel = (disentangled_attention_bias_reference if query_layer.dtype == torch.float32
                  else disentangled_attention_bias_by_rows)
        bias = kernel(*args)
    return bias.contiguous()


_disentangled_op = torch.library.custom_op(f"{TORCH_NAMESPACE}::disentangled_attention_bias", _disentangled_kernel,
                                           mutates_args=())


@_disentangled_op.register_fake
def _(query_layer, key_layer, pos_query, pos_key, relative_pos, att_span, scale, c2p, p2c):
    B, n, Tq, _ = query_layer.shape
    return query_layer.new_empty((B, n, Tq, key_layer.shape[2]))


def _t5_bias_kernel(bias_table: Tensor, query_length: int, key_length: int, max_distance: int,
                is_bidirectional: bool) -> Tensor:
    return relative_position_bias_reference(bias_table, query_length, key_length, max_distance,
                                            is_bidirectional).contiguous()


_t5_bias_op = torch.library.custom_op(f"{TORCH_NAMESPACE}::relative_position_bias", _t5_bias_kernel, mutates_args=())


@_t5_bias_op.register_fake
def _(bias_table, query_length, key_length, max_distance, is_bidirectional):
    return bias_table.new_empty((1, bias_table.shape[1], query_length, key_length))


def log_bucket_relative_position(query_length: int, key_length: int, bucket_size: int, max_position: int,
                                 device: torch.device | str = "cpu") -> Tensor:
    """Long[Tq, Tk] (custom op ``relserve::log_bucket_relative_position``)."""
    if _eager():
        return _log_bucket_kernel(query_length, key_length, bucket_size, max_position, torch.device(device))
    return torch.ops.relserve.log_bucket_relative_position(query_length, key_length, bucket_size, max_position,
                                                           torch.device(device))


def _eager() -> bool:
    """Whether this call runs plain eager (no export, compile or trace): then the ops' kernels are called directly.

    Why: the first eager call through ``torch.ops`` of a ``torch.library.custom_op`` imports TorchDynamo, sympy
    and the inductor (about 830 modules, 65-70 MB of resident memory in every serving process); export, compile
    and tracing still see one node per op.
    """
    return not graph_capture()


def disentangled_attention_bias(query_layer: Tensor, key_layer: Tensor, pos_query: Tensor | None,
                                pos_key: Tensor | None, relative_pos: Tensor, *, att_span: int, scale: float,
                                c2p: bool, p2c: bool) -> Tensor:
    """Float[B, n, Tq, Tk] (custom op ``relserve::disentangled_attention_bias``).

    When gradients are wanted (training) the differentiable reference runs instead: the custom op has no
    autograd formula, and inference / export (no grad) are what it is for. Same numbers either way.
    """
    if needs_grad(query_layer, key_layer, pos_query, pos_key):
        return disentangled_attention_bias_reference(query_layer, key_layer, pos_query, pos_key, relative_pos,
                                                     att_span, float(scale), bool(c2p), bool(p2c))
    if _eager():
        return _disentangled_kernel(query_layer, key_layer, pos_query, pos_key, relative_pos, att_span, float(scale),
                                    bool(c2p), bool(p2c))
    return torch.ops.relserve.disentangled_attention_bias(query_layer, key_layer, pos_query, pos_key, relative_pos,
                                                          att_span, float(scale), bool(c2p), bool(p2c))


def relative_position_bias(bias_table: Tensor, query_length: int, key_length: int, *, max_distance: int,
                           is_bidirectional: bool = True) -> Tensor:
    """Float[1, n, Tq, Tk] (custom op ``relserve::relative_position_bias``; the reference when training)."""
    if needs_grad(bias_table):
        return relative_position_bias_reference(bias_table, query_length, key_length, max_distance,
                                                bool(is_bidirectional))
    if _eager():
        return _t5_bias_kernel(bias_table, query_length, key_length, max_distance, bool(is_bidirectional))
    return torch.ops.relserve.relative_position_bias(bias_table, query_length, key_length, max_distance,
                                                     bool(is_bidirectional))


__all__ = [
    "make_log_bucket_position",
    "build_relative_position",
    "relative_index",
    "log_bucket_relative_position",
    "disentangled_attention_bias",
    "relative_position_bias",
    "log_bucket_relative_position_reference",
    "disentangled_attention_bias_reference",
    "relative_position_bias_reference",
    "t5_relative_position_bucket",
]
