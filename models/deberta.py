"""DeBERTa-v2/v3 encoder with disentangled attention, plus classification, token-classification and extractive-QA
heads.

Our own implementation of He et al. 2021, "DeBERTa: Decoding-enhanced BERT with Disentangled Attention"
(sec. 3.1, eq. 2-4) and the v2/v3 refinements (log-bucket relative positions, shared position projections,
layer-normed relative embeddings, the optional convolution after the first layer). Semantics match
Hugging Face ``transformers`` ``DebertaV2*`` modules, which the parity tests use as the oracle; module and
parameter names equal HF checkpoint keys so a checkpoint loads by name.

Inference-oriented choices (numerically equivalent on real tokens):

* Relative positions are built once per forward and shared by all layers; only the window of
  ``rel_embeddings`` rows that a sequence of length T can reach (``2T - 1`` rows centred on ``att_span``, or
  the whole table once ``T > att_span``) is projected (for T=128 with 256 buckets that is 255 of 512 rows),
  which shrinks the c2p/p2c matmuls. The window is plain shape arithmetic, so an exported graph keeps it
  symbolic in T.
* The relative-position work runs through the custom ops of :mod:`relserve.models.relative_position`
  (``LogBucketRelativePosition``, ``DisentangledAttentionBias``, ``RelativePositionBias``): eager mode calls
  their torch kernels, ONNX export emits one custom-domain node each.
* The attention mask hides padded *keys* only (``[B, 1, 1, T]``). HF additionally hides every key from padded
  *queries*; that changes only the (meaningless) outputs at padded positions, never those of real tokens.
* Attention runs through ``torch.nn.functional.scaled_dot_product_attention`` with the relative-position
  bias as its additive mask.
* Unpadded execution (eager mode, batches with padding, :attr:`DebertaModel.unpadded`): the real tokens are
  gathered once per forward into a packed ``[N, H]`` tensor (N = real tokens; FasterTransformer's "remove
  padding", TEI's ragged batches) on which embeddings, the Q/K/V projections, attention output, feed-forward
  and every LayerNorm run, so their FLOPs follow N rather than B·T. Only the attention core (scores, c2p/p2c,
  softmax, context) scatters Q/K/V into the padded ``[B, n, T, d]`` layout (zeros at padding, which the key
  mask hides), and so does v2's convolution; the model returns the padded ``[B, T, H]`` state with zeros at
  padded positions. Real-token outputs equal the padded path's up to float rounding. Exports, traces and
  batches without padding run the padded path (no data-dependent shapes in a graph; nothing to save).

``relative_attention_type: "t5"`` swaps disentangled attention for the T5 relative position bias (Raffel et
al. 2020): a learned scalar per (bucket, head), table ``encoder.relative_attention_bias``, added to the
logits of every layer.

:class:`DebertaConfig` is field-compatible with Hugging Face ``deberta-v2`` ``config.json``: defaults follow
``transformers.DebertaV2Config`` plus the ``getattr(config, name, default)`` fallbacks its modeling code uses for
keys the config class does not declare (``position_buckets``, ``share_att_key``, ``norm_rel_ebd``, ``conv_*``,
``embedding_size``, ``pooler_hidden_size``), so a checkpoint's config means the same here as in transformers
and ``to_dict()`` writes a dict transformers loads. Unknown keys are kept in ``extra`` and written back.
Reading and writing the file is :mod:`relserve.models.checkpoint`'s.

Shapes: B batch, T sequence length, H hidden size, n heads, d = H / n head size, R rows of the relative
embedding table in use.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import relative_position
from .capture import graph_capture
from .relative_position import make_log_bucket_position

MODEL_TYPE = "deberta-v2"
RELATIVE_ATTENTION_TYPES = ("deberta", "t5")

__all__ = [
    "DebertaConfig",
    "TokenPacking",
    "set_unpadded",
    "normalise_pos_att_type",
    "DebertaEmbeddings",
    "DisentangledSelfAttention",
    "DebertaLayer",
    "ConvLayer",
    "DebertaEncoder",
    "DebertaModel",
    "ContextPooler",
    "DebertaForSequenceClassification",
    "DebertaForQuestionAnswering",
    "activation",
]


# Keys HF writes that carry no meaning for inference here; dropped on read, not written back.
_IGNORED_KEYS = {"model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype"}


def normalise_pos_att_type(value: Any) -> list[str]:
    """``"p2c|c2p"`` / ``["p2c", "c2p"]`` / ``None`` -> ``["p2c", "c2p"]`` / ``[]`` (lower-case, stripped).

    Unknown terms raise ``ValueError``; the only terms DeBERTa defines are ``c2p`` and ``p2c``.
    """
    if value is None:
        return []
    if isinstance(value, str):
        items = [x.strip().lower() for x in value.split("|")]
    else:
        items = [str(x).strip().lower() for x in value]
    items = [x for x in items if x and x != "none"]
    bad = [x for x in items if x not in ("c2p", "p2c")]
    if bad:
        raise ValueError(f"pos_att_type: unknown term(s) {bad}; allowed are 'c2p' and 'p2c'")
    return items


@dataclass
class DebertaConfig:
    """Hyper-parameters of a DeBERTa-v2/v3 encoder and its task head (HF ``deberta-v2`` field names).

    :class:`relserve.models.deberta_v1.DebertaV1Config` (HF ``deberta``) subclasses it and swaps the attention.
    """

    model_type = MODEL_TYPE  # class attribute, not a field: what config.json's ``model_type`` says

    vocab_size: int = 128100
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 24
    intermediate_size: int = 6144
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 0
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-7
    # Relative (disentangled) attention.
    relative_attention: bool = False
    max_relative_positions: int = -1  # < 1 means "use max_position_embeddings"
    position_buckets: int = -1  # > 0 enables log buckets and sets the table to 2 * position_buckets rows
    pos_att_type: list[str] = field(default_factory=list)  # subset of ["p2c", "c2p"]
    share_att_key: bool = False  # v3: project relative embeddings with query_proj/key_proj
    norm_rel_ebd: str = "none"  # "layer_norm" applies encoder.LayerNorm to rel_embeddings
    position_biased_input: bool = True  # add absolute position embeddings to the input
    # "deberta": disentangled c2p/p2c attention (above). "t5": a learned scalar per (bucket, head) added to the
    # logits instead (Raffel et al. 2020), table ``encoder.relative_attention_bias`` [num_buckets, heads],
    # shared by all layers; pos_att_type / position_buckets are then unused. (relserve extension: transformers'
    # DebertaV2 ignores these keys.)
    relative_attention_type: str = "deberta"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    relative_attention_bidirectional: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    embedding_size: int | None = None  # None -> hidden_size; otherwise embed_proj maps to hidden_size
    # Optional convolution after the first layer (v2 xlarge/xxlarge).
    conv_kernel_size: int = 0
    conv_act: str = "tanh"
    conv_groups: int = 1
    # Heads.
    pooler_hidden_size: int | None = None  # None -> hidden_size
    pooler_hidden_act: str = "gelu"
    pooler_dropout: float = 0.0
    cls_dropout: float | None = None
    architectures: list[str] | None = None
    id2label: dict[int, str] = field(default_factory=lambda: {0: "LABEL_0", 1: "LABEL_1"})
    label2id: dict[str, int] = field(default_factory=lambda: {"LABEL_0": 0, "LABEL_1": 1})
    problem_type: str | None = None
    legacy: bool = True
    tie_word_embeddings: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pos_att_type = normalise_pos_att_type(self.pos_att_type)
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        if self.pooler_hidden_size is None:
            self.pooler_hidden_size = self.hidden_size
        self.id2label = {int(k): str(v) for k, v in (self.id2label or {}).items()}
        if not self.label2id or set(self.label2id.values()) != set(self.id2label):
            self.label2id = {v: k for k, v in self.id2label.items()}
        else:
            self.label2id = {str(k): int(v) for k, v in self.label2id.items()}
        if self.relative_attention_type not in RELATIVE_ATTENTION_TYPES:
            raise ValueError(
                f"relative_attention_type {self.relative_attention_type!r} is not one of {list(RELATIVE_ATTENTION_TYPES)}"
            )
        if self.relative_attention_type == "t5":
            nb = self.relative_attention_num_buckets // (2 if self.relative_attention_bidirectional else 1)
            if nb < 2 or self.relative_attention_max_distance <= nb // 2:
                raise ValueError(
                    f"relative_attention_num_buckets {self.relative_attention_num_buckets} / max_distance "
                    f"{self.relative_attention_max_distance}: need >= 2 buckets per side and max_distance > "
                    f"num_buckets // 2 (per side)"
                )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )

    # -- derived quantities (the same rules HF's modeling code applies) --------------------------------------

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @num_labels.setter
    def num_labels(self, n: int) -> None:
        if n != len(self.id2label):
            self.id2label = {i: f"LABEL_{i}" for i in range(n)}
            self.label2id = {v: k for k, v in self.id2label.items()}

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def effective_max_relative_positions(self) -> int:
        """``max_relative_positions``, or ``max_position_embeddings`` when it is < 1 (HF rule)."""
        return self.max_relative_positions if self.max_relative_positions >= 1 else self.max_position_embeddings

    @property
    def att_span(self) -> int:
        """Half the number of rows of ``rel_embeddings``: ``position_buckets`` if > 0, else the max distance."""
        return self.position_buckets if self.position_buckets > 0 else self.effective_max_relative_positions

    @property
    def norm_rel_ebd_terms(self) -> list[str]:
        return [x.strip() for x in (self.norm_rel_ebd or "none").lower().split("|")]

    def make_self_attention(self) -> nn.Module:
        """The per-layer self-attention module of this variant (v2/v3: :class:`DisentangledSelfAttention`)."""
        return DisentangledSelfAttention(self)

    # -- I/O ---------------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DebertaConfig":
        """Build from an HF-style dict. ``num_labels`` without ``id2label`` makes ``LABEL_i`` names."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        num_labels = d.pop("num_labels", None)
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = dict(d.pop("extra", {}) or {})
        for k, v in d.items():
            if k in known:
                kwargs[k] = v
            elif k not in _IGNORED_KEYS:
                extra[k] = v
        if "id2label" not in kwargs and num_labels is not None:
            kwargs["id2label"] = {i: f"LABEL_{i}" for i in range(int(num_labels))}
            kwargs.pop("label2id", None)
        cfg = cls(**kwargs, extra=extra)
        if num_labels is not None and int(num_labels) != cfg.num_labels:
            raise ValueError(f"num_labels={num_labels} disagrees with id2label ({cfg.num_labels} entries)")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """HF-compatible dict (``model_type`` "deberta-v2", string keys in ``id2label``)."""
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            d[f.name] = getattr(self, f.name)
        d["pos_att_type"] = list(self.pos_att_type)
        d["id2label"] = {str(k): v for k, v in self.id2label.items()}
        d["label2id"] = dict(self.label2id)
        d["num_labels"] = self.num_labels
        if d["cls_dropout"] is None:
            del d["cls_dropout"]
        if self.relative_attention_type == "deberta":  # keep HF-style files free of the T5 extension keys
            for k in ("relative_attention_type", "relative_attention_num_buckets",
                      "relative_attention_max_distance", "relative_attention_bidirectional"):
                del d[k]
        for k, v in self.extra.items():
            d.setdefault(k, v)
        d["model_type"] = self.model_type
        return d


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_python": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "swish": F.silu,
    "linear": lambda x: x,
}


def activation(name: str):
    """HF activation name (``ACT2FN`` key) -> function. Unknown names raise ``ValueError``."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}") from None


# ---------------------------------------------------------------------------------------------------------------
# Unpadded (packed) execution
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TokenPacking:
    """Where the N real tokens of a padded ``[B, T]`` batch sit, computed once per forward from the mask.

    ``batch``, ``pos``: Long[N], the (row, position) of each real token in row-major order; ``flat``: Long[N],
    ``batch * T + pos``. :meth:`gather` takes ``[B, T, ...]`` to the packed ``[N, ...]``, :meth:`scatter` the
    reverse with zeros at padded positions.
    """

    batch: torch.Tensor
    pos: torch.Tensor
    flat: torch.Tensor
    B: int
    T: int

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "TokenPacking":
        """mask Bool[B, T] (True = real token; any pattern, not only right padding)."""
        B, T = mask.shape
        flat = mask.reshape(-1).nonzero().squeeze(1)  # one host sync per forward (N is data-dependent)
        return cls(batch=flat // T, pos=flat % T, flat=flat, B=B, T=T)

    @property
    def num_tokens(self) -> int:
        return int(self.flat.numel())

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Float[B, T, ...] (any strides) -> Float[N, ...]."""
        return x[self.batch, self.pos]

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Float[N, ...] -> Float[B, T, ...], zeros at padded positions."""
        out = x.new_zeros((self.B * self.T, *x.shape[1:]))
        return out.index_copy_(0, self.flat, x).view(self.B, self.T, *x.shape[1:])


def mask_keys_(bias: torch.Tensor, key_mask: torch.Tensor, neg: float) -> torch.Tensor:
    """Set ``bias[b, ..., j] = neg`` for every key j that ``key_mask[b, 0, 0, j]`` masks, in place, so padded
    keys get exactly zero attention weight. bias Float[B, n | 1, T | 1, T], key_mask Bool[B, 1, 1, T] (True =
    attend); returns ``bias``.

    The same as ``torch.where(key_mask, bias, neg)`` without a new [B, n, T, T] tensor, and without a pass over it
    when nothing is padded or the padding is on the right (the usual batch): then only the padded columns are
    written.

    Raises:
        ValueError: ``bias`` is an expanded view (a zero stride over more than one element): writing one row
            would write them all.
    """
    if any(st == 0 and size > 1 for st, size in zip(bias.stride(), bias.shape)):
        raise ValueError(f"mask_keys_: bias {tuple(bias.shape)} is an expanded view (strides {bias.stride()})")
    B, T = key_mask.shape[0], key_mask.shape[-1]
    km = key_mask.reshape(B, T)
    lengths = km.sum(1)
    if bool((lengths == T).all()):
        return bias
    if torch.equal(km, torch.arange(T, device=km.device)[None, :] < lengths[:, None]):
        for b, n in enumerate(lengths.tolist()):
            if n < T:
                bias[b, ..., n:] = neg
        return bias
    return bias.masked_fill_(~key_mask, neg)


def set_unpadded(model: nn.Module, enabled: bool) -> int:
    """Switch unpadded execution on or off for every :class:`DebertaModel` inside ``model``; returns how many
    were set (0: the model has no DeBERTa encoder, nothing changes)."""
    n = 0
    for m in model.modules():
        if isinstance(m, DebertaModel):
            m.unpadded = bool(enabled)
            n += 1
    return n


# ---------------------------------------------------------------------------------------------------------------
# Embeddings
# ---------------------------------------------------------------------------------------------------------------


class DebertaEmbeddings(nn.Module):
    """Token (+ absolute position if ``position_biased_input``) (+ token type if ``type_vocab_size > 0``)
    embeddings, optional ``embed_proj`` (embedding_size -> hidden_size), LayerNorm, then zero at padding."""

    def __init__(self, config: DebertaConfig):
        super().__init__()
        e = config.embedding_size
        self.word_embeddings = nn.Embedding(config.vocab_size, e, padding_idx=config.pad_token_id)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, e) if config.position_biased_input else None
        )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, e) if config.type_vocab_size > 0 else None
        self.embed_proj = nn.Linear(e, config.hidden_size, bias=False) if e != config.hidden_size else None
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.max_position_embeddings = config.max_position_embeddings

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        pack: TokenPacking | None = None,
    ) -> torch.Tensor:
        """input_ids Long[B,T], mask Bool[B,T] (True = real token), token_type_ids Long[B,T] -> Float[B,T,H],
        or with ``pack`` the real tokens only, Float[N,H].

        Raises:
            ValueError: T > ``max_position_embeddings`` (absolute positions on).
        """
        T = input_ids.shape[1]
        if pack is not None:  # look up only the real tokens: everything below is per token
            input_ids = pack.gather(input_ids)  # [N]
            token_type_ids = pack.gather(token_type_ids) if token_type_ids is not None else None
        x = self.word_embeddings(input_ids)  # [B, T, E] | [N, E]
        if self.position_embeddings is not None:
            if T > self.max_position_embeddings:
                raise ValueError(
                    f"sequence length {T} exceeds max_position_embeddings={self.max_position_embeddings}"
                )
            if pack is None:
                x = x + self.position_embeddings.weight[:T]  # [T, E] broadcast over B
            else:
                x = x + self.position_embeddings.weight[pack.pos]  # [N, E]
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(token_type_ids)
        if self.embed_proj is not None:
            x = self.embed_proj(x)  # [B, T, E] -> [B, T, H]
        x = self.LayerNorm(x)
        if pack is None:  # packed rows are all real tokens: nothing to zero
            x = x * mask.unsqueeze(-1).to(x.dtype)
        return self.dropout(x)


# ---------------------------------------------------------------------------------------------------------------
# Disentangled attention
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RelativeContext:
    """Per-forward relative-position data shared by all layers.

    rel_embeddings: Float[R, H], the (layer-normed) window of the table this T reaches: R = 2T - 1 rows
        centred on row ``att_span``, or all ``2·att_span`` rows (the layout ``DisentangledAttentionBias`` takes).
    relative_pos: Long[T, T], ``[i, j]`` -> signed (bucketed) δ(i, j) (query i looks at key j).
    position_bias: Float[1, n, T, T] T5 bias (``relative_attention_type: "t5"``), else None.
    """

    rel_embeddings: torch.Tensor | None
    relative_pos: torch.Tensor | None
    position_bias: torch.Tensor | None = None


class DisentangledSelfAttention(nn.Module):
    """Multi-head self-attention with content->position (c2p) and position->content (p2c) terms.

    He et al. 2021, sec. 3.1, eq. (4): with content projections Qc = H Wq, Kc = H Wk, V = H Wv and relative
    projections Kr = P Wk,r, Qr = P Wq,r of the relative embedding table P,

        Ã[i, j] = Qc_i·Kc_jᵀ  +  Qc_i·Kr_{δ(i,j)}ᵀ  +  Kc_j·Qr_{δ(j,i)}ᵀ          (content, c2p, p2c)
        H_o = softmax(Ã / sqrt(d · s)) V,   s = 1 + number of enabled position terms.

    v3 (``share_att_key``) uses Wk,r = Wk and Wq,r = Wq; v2 has separate ``pos_key_proj``/``pos_query_proj``.
    Note the flip: c2p indexes with δ(i, j) from the query's side, p2c with δ(j, i) from the key's side.
    """

    def __init__(self, config: DebertaConfig):
        super().__init__()
        H = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.query_proj = nn.Linear(H, H)
        self.key_proj = nn.Linear(H, H)
        self.value_proj = nn.Linear(H, H)
        self.relative_attention = config.relative_attention
        self.share_att_key = config.share_att_key
        disentangled = config.relative_attention_type == "deberta"
        self.c2p = disentangled and "c2p" in config.pos_att_type
        self.p2c = disentangled and "p2c" in config.pos_att_type
        self.att_span = config.att_span
        # HF counts the enabled terms in the scale even when relative_attention is off; so do we.
        self.scale_factor = 1 + int(self.c2p) + int(self.p2c)
        self.inv_scale = 1.0 / math.sqrt(self.head_size * self.scale_factor)
        if self.relative_attention and not self.share_att_key:
            if self.c2p:
                self.pos_key_proj = nn.Linear(H, H)
            if self.p2c:
                self.pos_query_proj = nn.Linear(H, H)
        self.attention_probs_dropout_prob = config.attention_probs_dropout_prob

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[..., L, H] -> [..., n, L, d]."""
        *lead, L, _ = x.shape
        return x.view(*lead, L, self.num_heads, self.head_size).transpose(-3, -2)

    def relative_bias(self, q: torch.Tensor, k: torch.Tensor, rel: RelativeContext) -> torch.Tensor | None:
        """c2p + p2c scores, already divided by sqrt(d·s).

        q, k: Float[B, n, T, d]; returns Float[B, n, T, T] or None when no term is enabled.
        """
        if rel.position_bias is not None:  # T5: one learned scalar per (bucket, head), unscaled
            return rel.position_bias  # [1, n, T, T]
        if not (self.relative_attention and (self.c2p or self.p2c)):
            return None
        P = rel.rel_embeddings  # [R, H]
        pos_key = pos_query = None
        if self.c2p:  # Kr = P Wk,r for eq. (4) second term, Qc_i · Kr_{δ(i,j)}
            pos_key = self._heads(self.key_proj(P) if self.share_att_key else self.pos_key_proj(P))  # [n, R, d]
        if self.p2c:  # Qr = P Wq,r for eq. (4) third term, Kc_j · Qr_{δ(j,i)}
            pos_query = self._heads(self.query_proj(P) if self.share_att_key else self.pos_query_proj(P))
        # gathers at the clamped relative index, p2c per key row then transposed, sum, divide by sqrt(d·s)
        return relative_position.disentangled_attention_bias(
            q, k, pos_query, pos_key, rel.relative_pos, att_span=self.att_span, scale=self.inv_scale,
            c2p=self.c2p, p2c=self.p2c,
        )  # [B, n, T, T]

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_mask: torch.Tensor,
        rel: RelativeContext | None,
        pack: TokenPacking | None = None,
    ) -> torch.Tensor:
        """hidden_states Float[B,T,H], key_mask Bool[B,1,1,T] (True = attend) -> context Float[B,T,H].

        With ``pack``: hidden_states and the result are the packed Float[N,H]; the projections run packed and
        only Q/K/V are scattered to the padded layout for the attention core (zeros at padding, masked keys).
        """
        if pack is None:
            B, T, H = hidden_states.shape
            q = self._heads(self.query_proj(hidden_states))  # [B, n, T, d]
            k = self._heads(self.key_proj(hidden_states))
            v = self._heads(self.value_proj(hidden_states))
        else:
            B, T, H = pack.B, pack.T, hidden_states.shape[-1]
            q = self._heads(pack.scatter(self.query_proj(hidden_states)))  # [N, H] -> [B, n, T, d]
            k = self._heads(pack.scatter(self.key_proj(hidden_states)))
            v = self._heads(pack.scatter(self.value_proj(hidden_states)))
        bias = self.relative_bias(q, k, rel) if rel is not None else None
        neg = torch.finfo(q.dtype).min
        if bias is None:
            bias = torch.zeros(key_mask.shape, dtype=q.dtype, device=q.device)  # [B, 1, 1, T]
        owned = not (bias is (rel.position_bias if rel is not None else None) or graph_capture()
                     or torch.is_grad_enabled())
        if owned:
            mask_keys_(bias, key_mask, neg)  # this layer's own [B, n, T, T] (or zeros): in place
        else:
            bias = torch.where(key_mask, bias, neg)  # shared by every layer (T5), traced or trained: a new tensor
        ctx = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=bias,
            dropout_p=self.attention_probs_dropout_prob if self.training else 0.0,
            scale=self.inv_scale,
        )  # [B, n, T, d]
        if pack is not None:
            return pack.gather(ctx.transpose(1, 2)).reshape(-1, H)  # [N, n, d] -> [N, H]
        return ctx.transpose(1, 2).reshape(B, T, H)


class DebertaSelfOutput(nn.Module):
    """dense + residual + LayerNorm after attention (HF ``attention.output``)."""

    def __init__(self, config: DebertaConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class DebertaAttention(nn.Module):
    def __init__(self, config: DebertaConfig):
        super().__init__()
        self.self = config.make_self_attention()
        self.output = DebertaSelfOutput(config)

    def forward(
        self, x: torch.Tensor, key_mask: torch.Tensor, rel: RelativeContext | None, pack: TokenPacking | None = None
    ) -> torch.Tensor:
        """x Float[B,T,H] (or packed Float[N,H] with ``pack``) -> the same shape."""
        if pack is None:  # keep the 3-argument call for self-attention modules without packing support
            return self.output(self.self(x, key_mask, rel), x)
        return self.output(self.self(x, key_mask, rel, pack), x)


class DebertaIntermediate(nn.Module):
    """dense + activation (HF ``intermediate``). ``fusable_activation``: F.gelu's ``approximate`` when the activation
    is a GELU that :func:`relserve.models.onednn.set_onednn_linear` can fuse into ``dense``; while
    ``fused_activation`` is set, ``dense`` applies it."""

    fused_activation = False

    def __init__(self, config: DebertaConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)
        self.fusable_activation = {F.gelu: "none", _gelu_tanh: "tanh"}.get(self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)  # [B, T, I]
        return h if self.fused_activation else self.act(h)


class DebertaOutput(nn.Module):
    def __init__(self, config: DebertaConfig):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)  # [B, T, I] -> [B, T, H]


class DebertaLayer(nn.Module):
    """Post-LN transformer block: disentangled attention, then feed-forward."""

    def __init__(self, config: DebertaConfig):
        super().__init__()
        self.attention = DebertaAttention(config)
        self.intermediate = DebertaIntermediate(config)
        self.output = DebertaOutput(config)

    def forward(
        self, x: torch.Tensor, key_mask: torch.Tensor, rel: RelativeContext | None, pack: TokenPacking | None = None
    ) -> torch.Tensor:
        """x Float[B,T,H] (or packed Float[N,H] with ``pack``: the dense layers then see real tokens only)."""
        a = self.attention(x, key_mask, rel, pack)
        return self.output(self.intermediate(a), a)


class ConvLayer(nn.Module):
    """DeBERTa-v2 n-gram convolution applied beside the first layer (``conv_kernel_size > 0``).

    out = LayerNorm(layer0_output + act(mask ⊙ Conv1d(embeddings))) ⊙ mask.
    """

    def __init__(self, config: DebertaConfig):
        super().__init__()
        k = config.conv_kernel_size
        H = config.hidden_size
        self.conv = nn.Conv1d(H, H, k, padding=(k - 1) // 2, groups=config.conv_groups)
        self.LayerNorm = nn.LayerNorm(H, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.act = activation(config.conv_act)

    def forward(self, embeddings: torch.Tensor, residual: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """embeddings, residual Float[B,T,H]; mask Bool[B,T] -> Float[B,T,H]."""
        m = mask.unsqueeze(-1)  # [B, T, 1]
        out = self.conv(embeddings.transpose(1, 2)).transpose(1, 2)  # [B, H, T] conv -> [B, T, H]
        out = out.masked_fill(~m, 0.0)
        out = self.act(self.dropout(out))
        return self.LayerNorm(residual + out) * m.to(residual.dtype)


class DebertaEncoder(nn.Module):
    """Stack of ``DebertaLayer`` with the shared relative embedding table (``rel_embeddings``, 2·att_span rows),
    its optional LayerNorm (``norm_rel_ebd = "layer_norm"``) and the optional ``ConvLayer``."""

    def __init__(self, config: DebertaConfig):
        super().__init__()
        self.layer = nn.ModuleList(DebertaLayer(config) for _ in range(config.num_hidden_layers))
        self.relative_attention = config.relative_attention
        self.t5 = config.relative_attention and config.relative_attention_type == "t5"
        self.position_buckets = config.position_buckets
        self.max_relative_positions = config.effective_max_relative_positions
        self.att_span = config.att_span
        self.c2p = not self.t5 and "c2p" in config.pos_att_type
        self.p2c = not self.t5 and "p2c" in config.pos_att_type
        if self.t5:
            self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets,
                                                        config.num_attention_heads)
            self.t5_max_distance = config.relative_attention_max_distance
            self.t5_bidirectional = config.relative_attention_bidirectional
        elif self.relative_attention:
            self.rel_embeddings = nn.Embedding(2 * self.att_span, config.hidden_size)
        # The window trick in relative_context needs |bucket(δ)| <= |δ| below att_span (true for the usual
        # configs: buckets compress distances); otherwise every forward projects the whole table.
        self._window = self.relative_attention and not self.t5 and self._buckets_never_stretch()
        self.norm_rel_ebd = "layer_norm" in config.norm_rel_ebd_terms
        if self.norm_rel_ebd:
            self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.conv = ConvLayer(config) if config.conv_kernel_size > 0 else None

    def _buckets_never_stretch(self) -> bool:
        if self.position_buckets <= 0:
            return True
        d = torch.arange(1, self.att_span + 1)
        return bool((make_log_bucket_position(d, self.position_buckets, self.max_relative_positions) <= d).all())

    def relative_context(self, T: int, device: torch.device) -> RelativeContext | None:
        """Relative positions and the reachable window of the relative table for self-attention over T positions.

        ``T`` may be symbolic (export): everything here is shape arithmetic or a custom op.
        """
        if self.t5:
            bias = relative_position.relative_position_bias(
                self.relative_attention_bias.weight, T, T, max_distance=self.t5_max_distance,
                is_bidirectional=self.t5_bidirectional,
            )  # [1, n, T, T]
            return RelativeContext(rel_embeddings=None, relative_pos=None, position_bias=bias)
        if not (self.relative_attention and (self.c2p or self.p2c)):
            return None
        rel = relative_position.log_bucket_relative_position(T, T, self.position_buckets, self.max_relative_positions,
                                                    device)  # [T, T] signed δ(i, j)
        span = self.att_span
        if self._window:
            # |δ| <= T - 1, so rows clamp(δ + span) lie in [span - T + 1, span + T - 1] ∩ [0, 2·span - 1]
            lo = torch.sym_max(span - T + 1, 0)
            hi = torch.sym_min(span + T - 1, 2 * span - 1)
            table = self.rel_embeddings.weight[lo : hi + 1]  # [R, H]; LayerNorm is per row, so slice first
        else:
            table = self.rel_embeddings.weight
        if self.norm_rel_ebd:
            table = self.LayerNorm(table)
        return RelativeContext(rel_embeddings=table, relative_pos=rel)

    def forward(self, embeddings: torch.Tensor, mask: torch.Tensor, pack: TokenPacking | None = None) -> torch.Tensor:
        """embeddings Float[B,T,H], mask Bool[B,T] -> last hidden state Float[B,T,H]; with ``pack`` the
        embeddings and the result are the packed Float[N,H]."""
        T = mask.shape[1]
        key_mask = mask[:, None, None, :]  # [B, 1, 1, T]
        rel = self.relative_context(T, embeddings.device)
        h = embeddings
        for i, layer in enumerate(self.layer):
            out = layer(h, key_mask, rel, pack)
            if i == 0 and self.conv is not None:
                if pack is None:
                    out = self.conv(h, out, mask)
                else:  # the convolution mixes neighbouring positions: it needs the padded layout
                    out = pack.gather(self.conv(pack.scatter(h), pack.scatter(out), mask))
            h = out
        return h


class DebertaModel(nn.Module):
    """The encoder: ``embeddings`` + ``encoder``. Returns the last hidden state Float[B, T, H].

    ``unpadded`` (default True; :func:`set_unpadded`): batches with padding run the dense layers on the real
    tokens only (see the module docstring); hidden states at padded positions are then zero. False: always
    the padded path. Graph capture (export, tracing) always takes the padded path.
    """

    def __init__(self, config: DebertaConfig):
        super().__init__()
        self.config = config
        self.embeddings = DebertaEmbeddings(config)
        self.encoder = DebertaEncoder(config)
        self.unpadded = True

    def packing(self, mask: torch.Tensor) -> TokenPacking | None:
        """The packing the forward uses for mask Bool[B,T], or None for the padded path (``unpadded`` off,
        graph capture, or no padding in the batch: packing would only add copies)."""
        if not self.unpadded or graph_capture():
            return None
        pack = TokenPacking.from_mask(mask)
        return pack if pack.num_tokens < pack.B * pack.T else None

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids Long[B,T]; attention_mask [B,T] (1 real, 0 pad; default all real);
        token_type_ids Long[B,T] or None (zeros) -> Float[B,T,H]."""
        if attention_mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            mask = attention_mask.to(torch.bool)
        pack = self.packing(mask)
        x = self.embeddings(input_ids, mask, token_type_ids, pack)
        h = self.encoder(x, mask, pack)
        return h if pack is None else pack.scatter(h)


class ContextPooler(nn.Module):
    """First-token pooling: act(dense(h[:, 0])) (HF ``pooler``)."""

    def __init__(self, config: DebertaConfig):
        super().__init__()
        self.dense = nn.Linear(config.pooler_hidden_size, config.pooler_hidden_size)
        self.dropout = nn.Dropout(config.pooler_dropout)
        self.act = activation(config.pooler_hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(self.dropout(hidden_states[:, 0])))  # [B, T, H] -> [B, H]


class DebertaHeadModel(nn.Module):
    """The encoder (``deberta``) with a task head on top: forward runs the encoder, then the subclass's
    :meth:`head` on its hidden states Float[B, T, H]."""

    def __init__(self, config: DebertaConfig):
        super().__init__()
        self.config = config
        self.deberta = DebertaModel(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> Any:
        """input_ids Long[B,T]; attention_mask [B,T] (1 real, 0 pad; default all real); token_type_ids Long[B,T]
        or None (zeros) -> the head's output (the subclass's docstring)."""
        return self.head(self.deberta(input_ids, attention_mask, token_type_ids))

    def head(self, h: torch.Tensor) -> Any:
        raise NotImplementedError


class DebertaForSequenceClassification(DebertaHeadModel):
    """Encoder + ContextPooler + linear ``classifier``; forward returns logits Float[B, num_labels]."""

    hf_architecture = "DebertaV2ForSequenceClassification"
    task = "classification"

    def __init__(self, config: DebertaConfig):
        super().__init__(config)
        self.pooler = ContextPooler(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        p = config.cls_dropout if config.cls_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(p)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(h)))  # [B, T, H] -> [B, num_labels]


class DebertaForQuestionAnswering(DebertaHeadModel):
    """Encoder + ``qa_outputs`` (H -> 2); forward returns (start_logits, end_logits), each Float[B, T]."""

    hf_architecture = "DebertaV2ForQuestionAnswering"
    task = "question-answering"

    def __init__(self, config: DebertaConfig):
        if config.num_labels != 2:
            raise ValueError(f"question answering needs num_labels == 2 (start, end), got {config.num_labels}")
        super().__init__(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)

    def head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.qa_outputs(h)  # [B, T, H] -> [B, T, 2]
        return logits[..., 0].contiguous(), logits[..., 1].contiguous()


class DebertaForTokenClassification(DebertaHeadModel):
    """Encoder + dropout + linear ``classifier`` over every token (HF ``DebertaV2ForTokenClassification``).

    Forward returns logits Float[B, T, num_labels]; positions past a row's attention mask carry meaningless values.
    """

    hf_architecture = "DebertaV2ForTokenClassification"
    task = "token-classification"

    def __init__(self, config: DebertaConfig):
        super().__init__(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(h))  # [B, T, H] -> [B, T, num_labels]
