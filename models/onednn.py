"""Dense layers and per-head products through oneDNN on CPU.

torch's CPU ``nn.Linear`` runs float32 through MKL's sgemm, which on AMD processors takes a generic code path:
on the 2-core AMD EPYC development machine (AVX512) it reached 54-92 GFLOP/s per thread where oneDNN's inner
product reached 107-230 on the same shapes ([3072, 768] x [768, 3072] and smaller), and the DeBERTa encoder
spent half its float32 time in ``addmm`` at 384 tokens. oneDNN (``torch.ops.mkldnn._linear_pointwise``, the
op torch's own inductor emits for CPU linears) dispatches on the instruction set, not the vendor, and can fuse
the activation that follows (GELU, exact or tanh) into the same pass over the output.

:func:`set_onednn_linear` switches every ``nn.Linear`` of a model to :class:`OneDnnLinear` (the same module,
parameters and state-dict keys; only ``forward`` differs) and fuses the feed-forward's GELU where the module
that applies it declares it (``fusable_activation``). The switch takes effect only where oneDNN can run the
call: float32 or bfloat16 CPU tensors, no autograd, no graph capture (export and tracing see ``F.linear``);
everywhere else the layer computes exactly what ``nn.Linear`` (and the unfused activation) does.

:func:`head_product` is the same for the product of one head's queries (or keys) with that head's relative
position table (disentangled attention's c2p / p2c scores), where ``torch.matmul`` of the [B, n, T, d] layout
would run MKL's batched sgemm (1.5-3.3x slower per thread at 8 x 24-512 tokens).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .capture import graph_capture, needs_grad

# dense layers: float32 (off MKL's sgemm) and bfloat16 (already oneDNN through F.linear's mkldnn_matmul, but the
# fused GELU and the inner product saved 2-5 % of the 6 x 768 classifier's forward on the AMD EPYC, kernel caches
# capped or not); the per-head products: float32 only (bfloat16 keeps one bmm with heads as its batch: per-head
# oneDNN products were no faster in the same comparison)
DTYPES = (torch.float32, torch.bfloat16)
HEAD_DTYPES = (torch.float32,)
# F.gelu's ``approximate`` -> oneDNN's algorithm name for its GELU post-op
GELU_ALGORITHMS = {"none": "none", "tanh": "tanh"}


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when this torch build has oneDNN and its fused linear op (``torch.ops.mkldnn._linear_pointwise``)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x = torch.ones(1, 2)
        return bool(torch.equal(op(x, torch.ones(3, 2), None, "none", [], ""), torch.full((1, 3), 2.0)))
    except (AttributeError, RuntimeError):
        return False


class OneDnnLinear(nn.Linear):
    """``nn.Linear`` whose inference forward on CPU (float32, bfloat16) runs oneDNN's inner product, optionally with
    GELU fused.

    x: Float[..., in_features] -> Float[..., out_features], ``act(x Wᵀ + b)`` where ``act`` is identity or
    ``F.gelu(·, approximate=gelu)`` (``gelu`` is None, "none" or "tanh"). Float32 results differ from MKL's by the
    summation order only (within 3e-6 on unit-scale activations).
    """

    gelu: str | None = None  # set by set_onednn_linear on the feed-forward's first layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.device.type == "cpu" and x.dtype in DTYPES and w.dtype == x.dtype and w.device.type == "cpu"
                and not needs_grad(x, w, self.bias) and not graph_capture()):
            if self.gelu is None:
                return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "gelu", [], GELU_ALGORITHMS[self.gelu])
        out = F.linear(x, w, self.bias)
        return out if self.gelu is None else F.gelu(out, approximate=self.gelu)


def set_onednn_linear(model: nn.Module, enabled: bool) -> int:
    """Switch every ``nn.Linear`` inside ``model`` to :class:`OneDnnLinear` (``enabled``) or back to
    ``nn.Linear``; returns how many layers run through oneDNN afterwards (0 when disabled, when this torch has no
    oneDNN, or when the model has no linear layer).

    A module whose ``fusable_activation`` names the GELU it applies after its ``dense`` layer (``"none"`` or
    ``"tanh"``, F.gelu's ``approximate``) gets it fused: the layer applies it and the module's ``fused_activation``
    flag tells it to skip its own. The class swap keeps parameters, buffers, hooks and state-dict keys, so a
    bfloat16 copy (``precision.to_bfloat16``'s deep copy) keeps the switch."""
    on = bool(enabled) and available()
    for m in model.modules():
        approx = getattr(m, "fusable_activation", None)
        # only layers this function swaps can fuse (a subclass of nn.Linear keeps its own forward)
        if approx in GELU_ALGORITHMS and type(getattr(m, "dense", None)) in (nn.Linear, OneDnnLinear):
            m.fused_activation = on
            m.dense.gelu = approx if on else None
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and on:
            m.__class__ = OneDnnLinear
        elif type(m) is OneDnnLinear and not on:
            m.__dict__.pop("gelu", None)
            m.__class__ = nn.Linear
        n += type(m) is OneDnnLinear
    return n


def runs_on_onednn(*tensors: torch.Tensor) -> bool:
    """Whether :func:`head_product` takes oneDNN's path for these tensors (all float32 on CPU, none recorded by
    autograd, no graph capture)."""
    return (all(t.device.type == "cpu" and t.dtype in HEAD_DTYPES for t in tensors) and available()
            and not needs_grad(*tensors) and not graph_capture())


def head_product(rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``rows @ tableᵀ`` through oneDNN: rows Float[N, d] (any row stride), table Float[M, d] of the same dtype ->
    Float[N, M], contiguous. One head's c2p or p2c scores (``rows``: that head's queries or keys of every
    sequence). For inference only: callers check :func:`runs_on_onednn` first and use ``torch.mm`` otherwise.

    Raises:
        ValueError: the shapes disagree, or the tensors are not on oneDNN's path.
    """
    if rows.dim() != 2 or table.dim() != 2 or rows.shape[1] != table.shape[1]:
        raise ValueError(f"head_product: rows {tuple(rows.shape)} and table {tuple(table.shape)} disagree")
    if not runs_on_onednn(rows, table):
        raise ValueError(f"head_product: {rows.dtype} on {rows.device} (table {table.dtype}) is not oneDNN's path")
    return torch.ops.mkldnn._linear_pointwise(rows, table, None, "none", [], "")
