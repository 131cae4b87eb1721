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

import torch


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


__all__ = ["make_log_bucket_position", "build_relative_position", "relative_index"]
