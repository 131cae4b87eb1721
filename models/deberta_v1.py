"""DeBERTa v1 (HF ``model_type: deberta``): the v1 attention and config over the shared encoder of :mod:`.deberta`.

Our own implementation of He et al. 2021, sec. 3.1, as the original DeBERTa (v1) checkpoints lay it out;
semantics match Hugging Face ``transformers`` ``Deberta*`` modules (``modeling_deberta.py``), which the parity
tests use as the oracle. Parameter names equal the HF checkpoint keys.

What differs from v2/v3 (everything else — embeddings, feed-forward, post-LN blocks, pooler, heads — is the
code of :mod:`.deberta`):

* one fused content projection ``in_proj`` (H -> 3H, no bias) whose output is laid out *per head*
  ``[q_h | k_h | v_h]`` (HF views it as ``[B, T, n, 3d]`` and chunks the last axis), plus separate
  ``q_bias`` and ``v_bias`` vectors (keys have no bias);
* relative embeddings ``encoder.rel_embeddings`` with ``2 * max_relative_positions`` rows, no log buckets,
  no LayerNorm; the row of distance δ = i - j is ``clamp(δ + max_relative_positions, 0, 2k - 1)``. (HF slices
  the table to ``att_span = min(T, k)`` rows around the centre and clamps into the slice; the row reached
  is the same, which is what lets v1 run through the same ``DisentangledAttentionBias`` op as v2);
* ``pos_proj`` (no bias) projects the table for c2p (``Qc_i · Kr_{δ(i,j)}``), ``pos_q_proj`` (with bias)
  for p2c (``Kc_j · Qr_{δ(i,j)}`` as HF v1 indexes it, the same index the shared op uses);
* the scale is ``1 / sqrt(d * (1 + len(pos_att_type)))``, applied to content and position scores alike;
* optional ``talking_head`` (Shazeer et al. 2020): ``head_logits_proj`` mixes the heads' logits before the
  softmax, ``head_weights_proj`` mixes the heads' probabilities after it (both n x n, no bias);
* unpadded execution (:class:`relserve.models.deberta.TokenPacking`) runs ``in_proj`` on the packed real
  tokens and scatters its output once to the padded layout for the attention core;
* no convolution layer, no shared position keys; ``position_biased_input`` defaults to true (absolute
  positions are added to the input, as in v2's default).

Keys of a v1 ``config.json`` that only v2/v3 define (``position_buckets``, ``share_att_key``,
``norm_rel_ebd``, ``conv_*``, the T5 extension) are ignored by transformers' v1 code; here they are kept in
``extra`` (written back, never used), so the model computes what transformers computes.

Shapes: B batch, T sequence length, H hidden size, n heads, d = H / n head size, R rows of the table in use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import relative_position
from .deberta import (
    DebertaConfig,
    DebertaForQuestionAnswering,
    DebertaForSequenceClassification,
    DebertaForTokenClassification,
    RelativeContext,
    TokenPacking,
)

MODEL_TYPE = "deberta"

# Config keys only v2/v3 (or relserve's T5 extension) give a meaning; HF's v1 code never reads them.
V2_ONLY_KEYS = (
    "position_buckets",
    "share_att_key",
    "norm_rel_ebd",
    "conv_kernel_size",
    "conv_act",
    "conv_groups",
    "relative_attention_type",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "relative_attention_bidirectional",
)

__all__ = [
    "MODEL_TYPE",
    "DebertaV1Config",
    "DebertaV1SelfAttention",
    "DebertaV1ForSequenceClassification",
    "DebertaV1ForQuestionAnswering",
]


@dataclass
class DebertaV1Config(DebertaConfig):
    """Hyper-parameters of a DeBERTa v1 encoder and its task head (HF ``deberta`` field names and defaults,
    ``transformers.DebertaConfig``: deberta-base sizes, vocabulary 50265).

    Raises:
        ValueError: a v2/v3-only field set to a non-default value when built directly (``from_dict`` moves such
            keys into ``extra`` instead, as transformers' v1 code ignores them), plus :class:`DebertaConfig`'s checks.
    """

    model_type = MODEL_TYPE

    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    talking_head: bool = False  # v1 only: head_logits_proj / head_weights_proj mix the heads

    def __post_init__(self) -> None:
        super().__post_init__()
        defaults = DebertaConfig()
        bad = [k for k in V2_ONLY_KEYS if getattr(self, k) != getattr(defaults, k)]
        if bad:
            raise ValueError(f"DeBERTa v1 (model_type 'deberta') has no {bad}; these are v2/v3 settings")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DebertaV1Config":
        """Build from an HF ``deberta`` config dict; v2/v3-only keys are kept in ``extra`` and not used."""
        d = dict(d)
        extra = dict(d.pop("extra", {}) or {})
        for k in V2_ONLY_KEYS:
            if k in d:
                extra[k] = d.pop(k)
        d["extra"] = extra
        return super().from_dict(d)  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """HF-compatible dict (``model_type`` "deberta"; no v2/v3-only keys except those kept in ``extra``)."""
        d = super().to_dict()
        for k in V2_ONLY_KEYS:
            d.pop(k, None)
        for k, v in self.extra.items():
            d.setdefault(k, v)
        return d

    def make_self_attention(self) -> nn.Module:
        """Each layer's attention: :class:`DebertaV1SelfAttention`."""
        return DebertaV1SelfAttention(self)


class DebertaV1SelfAttention(nn.Module):
    """v1 disentangled self-attention (see the module docstring); same interface as
    :class:`relserve.models.deberta.DisentangledSelfAttention`."""

    def __init__(self, config: DebertaV1Config):
        super().__init__()
        H = config.hidden_size
        self.num_heads = n = config.num_attention_heads
        self.head_size = config.head_size
        self.in_proj = nn.Linear(H, 3 * H, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(H))
        self.v_bias = nn.Parameter(torch.zeros(H))
        self.relative_attention = config.relative_attention
        self.c2p = "c2p" in config.pos_att_type
        self.p2c = "p2c" in config.pos_att_type
        self.att_span = config.att_span  # = max_relative_positions (no buckets in v1)
        # HF v1 counts every listed term, whether or not relative attention is on
        self.inv_scale = 1.0 / math.sqrt(self.head_size * (1 + len(config.pos_att_type)))
        if self.relative_attention:
            if self.c2p:
                self.pos_proj = nn.Linear(H, H, bias=False)
            if self.p2c:
                self.pos_q_proj = nn.Linear(H, H)
        self.talking_head = bool(config.talking_head)
        if self.talking_head:
            self.head_logits_proj = nn.Linear(n, n, bias=False)
            self.head_weights_proj = nn.Linear(n, n, bias=False)
        self.attention_probs_dropout_prob = config.attention_probs_dropout_prob

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[..., L, H] -> [..., n, L, d]."""
        *lead, L, _ = x.shape
        return x.view(*lead, L, self.num_heads, self.head_size).transpose(-3, -2)

    def relative_bias(self, q: torch.Tensor, k: torch.Tensor, rel: RelativeContext) -> torch.Tensor | None:
        """c2p + p2c scores already times the scale: Float[B, n, T, T], or None when no term is enabled.

        q (with ``q_bias``), k: Float[B, n, T, d].
        """
        if not (self.relative_attention and (self.c2p or self.p2c)):
            return None
        P = rel.rel_embeddings  # [R, H]
        pos_key = self._heads(self.pos_proj(P)) if self.c2p else None  # [n, R, d]
        pos_query = self._heads(self.pos_q_proj(P)) if self.p2c else None
        return relative_position.disentangled_attention_bias(
            q, k, pos_query, pos_key, rel.relative_pos, att_span=self.att_span, scale=self.inv_scale,
            c2p=self.c2p, p2c=self.p2c,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_mask: torch.Tensor,
        rel: RelativeContext | None,
        pack: TokenPacking | None = None,
    ) -> torch.Tensor:
        """hidden_states Float[B,T,H], key_mask Bool[B,1,1,T] (True = attend) -> context Float[B,T,H].

        With ``pack``: hidden_states and the result are the packed Float[N,H]; ``in_proj`` runs packed and its
        output is scattered once to the padded layout for the attention core.
        """
        n, d = self.num_heads, self.head_size
        if pack is None:
            B, T, H = hidden_states.shape
            qkv = self.in_proj(hidden_states)  # [B, T, 3H]
        else:
            B, T, H = pack.B, pack.T, hidden_states.shape[-1]
            qkv = pack.scatter(self.in_proj(hidden_states))  # [N, 3H] -> [B, T, 3H], zeros at padding
        # in_proj rows are grouped per head as [q_h; k_h; v_h] (HF's view(B, T, n, 3d).chunk(3, -1))
        qkv = qkv.view(B, T, n, 3 * d).transpose(1, 2)  # [B, n, T, 3d]
        q, k, v = qkv.split(d, dim=-1)
        q = q + self.q_bias.view(n, 1, d)
        v = v + self.v_bias.view(n, 1, d)
        bias = self.relative_bias(q, k, rel) if rel is not None else None
        neg = torch.finfo(q.dtype).min
        if not self.talking_head:
            if bias is None:
                bias = torch.zeros(key_mask.shape, dtype=q.dtype, device=q.device)  # [B, 1, 1, T]
            bias = torch.where(key_mask, bias, neg)  # padded keys get exactly zero weight
            ctx = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias,
                dropout_p=self.attention_probs_dropout_prob if self.training else 0.0, scale=self.inv_scale,
            )  # [B, n, T, d]
        else:
            # talking heads mix logits across heads before the mask and softmax, probabilities after: no SDPA
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.inv_scale  # [B, n, T, T]
            if bias is not None:
                scores = scores + bias
            scores = torch.einsum("bhij,gh->bgij", scores, self.head_logits_proj.weight)
            probs = torch.softmax(scores.masked_fill(~key_mask, neg), dim=-1)
            probs = F.dropout(probs, self.attention_probs_dropout_prob, self.training)
            probs = torch.einsum("bhij,gh->bgij", probs, self.head_weights_proj.weight)
            ctx = torch.matmul(probs, v)  # [B, n, T, d]
        if pack is not None:
            return pack.gather(ctx.transpose(1, 2)).reshape(-1, H)  # [N, n, d] -> [N, H]
        return ctx.transpose(1, 2).reshape(B, T, H)


class DebertaV1ForSequenceClassification(DebertaForSequenceClassification):
    """v1 encoder + ContextPooler + ``classifier`` (HF ``DebertaForSequenceClassification``); logits [B, labels]."""

    hf_architecture = "DebertaForSequenceClassification"


class DebertaV1ForQuestionAnswering(DebertaForQuestionAnswering):
    """v1 encoder + ``qa_outputs`` (HF ``DebertaForQuestionAnswering``); (start, end) logits, each [B, T]."""

    hf_architecture = "DebertaForQuestionAnswering"


class DebertaV1ForTokenClassification(DebertaForTokenClassification):
    """v1 encoder + ``classifier`` over every token (HF ``DebertaForTokenClassification``); logits [B, T, labels]."""

    hf_architecture = "DebertaForTokenClassification"
