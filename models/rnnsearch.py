"""RNNsearch: the attention encoder-decoder of Bahdanau, Cho & Bengio (2014), "Neural Machine Translation
by Jointly Learning to Align and Translate", appendix A.

Equation references ("A.1.x", "A.2.x") point at the paper's appendix. Symbols: ``m`` embedding size
(``embedding_size``, paper 620), ``n`` hidden size (``hidden_size``, 1000), ``n'`` alignment size
(``alignment_size``, 1000), ``l`` maxout size (``maxout_size``, 500), ``K_y`` target vocabulary.

* Encoder (A.2.1): a bidirectional GRU over source embeddings ``E x_j``; the annotation of source word j is
  ``h_j = [→h_j; ←h_j]`` (dimension ``annotation_size`` = 2n).
* Alignment model (A.1.2): ``e_ij = v_aᵀ tanh(W_a s_{i-1} + U_a h_j)``, ``α_ij = softmax_j(e_ij)`` over the
  real (non-pad) source positions. ``U_a h_j`` does not depend on i and is computed once per source.
* Context: ``c_i = Σ_j α_ij h_j``.
* Decoder (A.2.2): the GRU state with context inputs
      z_i = σ(W_z E y_{i-1} + U_z s_{i-1} + C_z c_i)            (update gate)
      r_i = σ(W_r E y_{i-1} + U_r s_{i-1} + C_r c_i)            (reset gate)
      s̃_i = tanh(W E y_{i-1} + U [r_i ∘ s_{i-1}] + C c_i)
      s_i = (1 - z_i) ∘ s_{i-1} + z_i ∘ s̃_i
  initial state ``s_0 = tanh(W_s ←h_1)``; deep output
      t̃_i = U_o s_{i-1} + V_o E y_{i-1} + C_o c_i,   t_i,k = max(t̃_i,2k-1, t̃_i,2k)   (maxout, k = 1..l)
      p(y_i | y_<i, x) = softmax(W_o t_i).

Departures from the paper, all deliberate:

* Biases: the paper omits them "to make the equations less cluttered"; every input projection here has one
  (``W·`` terms, ``W_a``, ``W_s``, the deep-output sum and ``W_o``); recurrent (``U·``), context (``C·``) and
  ``U_a``/``v_a`` terms have none, so no bias is counted twice.
* ``y_0`` is the embedding of ``bos_token_id`` (GroundHog used a zero vector).
* The GRU is the paper's (Cho et al. 2014): the reset gate multiplies the state *before* ``U``
  (``U [r ∘ s]``). cuDNN / ``torch.nn.GRU`` apply it after (``r ∘ (U s + b)``), a different function, so the
  recurrences here are explicit loops over time steps (``PaperGRUCell``); padded steps carry the state over
  unchanged, so padding never changes a result.
* The decoder is a head over *any* encoder's annotations (``annotation_size``). The paper's initial state
  reads ``←h_1``, which only a backward RNN has; ``init_state`` chooses:
  ``"backward_first"`` (paper; the second half of the first annotation, BiGRU only), ``"mean"`` (``W_s``
  applied to the mean of the real annotations — the choice for non-recurrent encoders such as a
  DeBERTa-style encoder: it uses every position, is padding invariant and does not depend on a [CLS]
  convention), or ``"first"`` (``W_s`` applied to the whole first annotation, e.g. a [CLS] vector).

Step API for iteration-level batching (``relserve.models.decoding`` builds beams on it):
``encode(src_ids, src_mask) -> EncoderState`` and
``decode_step(state, source_index, prev_tokens, prev_hidden) -> (log_probs, new_hidden, alignment)``, where
hypothesis n reads source row ``source_index[n]`` of ``state``: hypotheses of different requests share one
step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .deberta import DebertaConfig, DebertaModel

MODEL_TYPE = "rnnsearch"
INIT_STATE_CHOICES = ("backward_first", "mean", "first")
ENCODER_TYPES = ("bigru", "external")


@dataclass
class RNNSearchConfig:
    """Hyper-parameters of RNNsearch (defaults: the paper's RNNsearch-50 sizes)."""

    src_vocab_size: int = 30000
    tgt_vocab_size: int = 30000
    embedding_size: int = 620  # m
    hidden_size: int = 1000  # n (encoder GRU per direction and decoder GRU)
    alignment_size: int | None = None  # n'; None -> hidden_size
    maxout_size: int = 500  # l
    annotation_size: int | None = None  # dimension of h_j; None -> 2 * hidden_size (BiGRU)
    encoder_type: str = "bigru"  # "bigru" or "external" (annotations come from another encoder)
    init_state: str | None = None  # see module docstring; None -> "backward_first" (bigru) / "mean"
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    dropout: float = 0.0  # on embeddings and on t_i before W_o (training only)
    architectures: list[str] = field(default_factory=lambda: ["RNNSearch"])
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.alignment_size is None:
            self.alignment_size = self.hidden_size
        if self.annotation_size is None:
            self.annotation_size = 2 * self.hidden_size
        if self.encoder_type not in ENCODER_TYPES:
            raise ValueError(f"encoder_type {self.encoder_type!r}: expected one of {ENCODER_TYPES}")
        if self.init_state is None:
            self.init_state = "backward_first" if self.encoder_type == "bigru" else "mean"
        if self.init_state not in INIT_STATE_CHOICES:
            raise ValueError(f"init_state {self.init_state!r}: expected one of {INIT_STATE_CHOICES}")
        if self.encoder_type == "bigru" and self.annotation_size != 2 * self.hidden_size:
            raise ValueError(
                f"annotation_size ({self.annotation_size}) must be 2 * hidden_size ({2 * self.hidden_size}) "
                "with the BiGRU encoder"
            )
        if self.init_state == "backward_first" and self.annotation_size % 2:
            raise ValueError("init_state 'backward_first' needs annotations [→h; ←h] of even size")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if not 0 <= v < self.tgt_vocab_size:
                raise ValueError(f"{name}={v} outside the target vocabulary (size {self.tgt_vocab_size})")

    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RNNSearchConfig":
        d = dict(d)
        mt = d.pop("model_type", MODEL_TYPE)
        if mt != MODEL_TYPE:
            raise ValueError(f"model_type {mt!r} is not {MODEL_TYPE!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        extra = dict(d.pop("extra", {}) or {})
        kwargs = {}
        for k, v in d.items():
            (kwargs if k in known else extra)[k] = v
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        for k, v in self.extra.items():
            d.setdefault(k, v)
        d["model_type"] = MODEL_TYPE
        return d



# ---------------------------------------------------------------------------------------------------------
# Encoder state: everything the decoder needs from one batch of sources, computed once.
# ---------------------------------------------------------------------------------------------------------


@dataclass
class EncoderState:
    """Per-source tensors the decoder reads at every step (rows = sources, right-padded to ``S``).

    ``annotations`` Float[B,S,A] (h_j; zero at pads), ``projected_annotations`` Float[B,S,n'] (U_a h_j),
    ``mask`` Bool[B,S] (True at real positions), ``init_state`` Float[B,n] (s_0).
    """

    annotations: Tensor
    projected_annotations: Tensor
    mask: Tensor
    init_state: Tensor

    @property
    def num_sources(self) -> int:
        return self.annotations.shape[0]

    @property
    def lengths(self) -> Tensor:
        """Long[B]: real source positions per row."""
        return self.mask.sum(dim=1)

    def select(self, rows: Tensor) -> "EncoderState":
        """Rows ``rows`` (Long[N]) of every tensor; N may repeat rows (one per hypothesis)."""
        return EncoderState(
            self.annotations.index_select(0, rows),
            self.projected_annotations.index_select(0, rows),
            self.mask.index_select(0, rows),
            self.init_state.index_select(0, rows),
        )

    def split(self) -> list["EncoderState"]:
        """One single-row state per source, trimmed to its real length (what a request keeps)."""
        out = []
        for b, n in enumerate(self.lengths.tolist()):
            out.append(
                EncoderState(
                    self.annotations[b : b + 1, :n],
                    self.projected_annotations[b : b + 1, :n],
                    self.mask[b : b + 1, :n],
                    self.init_state[b : b + 1],
                )
            )
        return out

    @staticmethod
    def cat(states: list["EncoderState"]) -> "EncoderState":
        """Stack states (any widths) into one, right-padding to the longest; pads are masked out."""
        if not states:
            raise ValueError("EncoderState.cat needs at least one state")
        width = max(s.mask.shape[1] for s in states)

        def pad(t: Tensor, value: float | bool = 0) -> Tensor:
            extra = width - t.shape[1]
            if extra == 0:
                return t
            shape = (t.shape[0], extra) + tuple(t.shape[2:])
            return torch.cat([t, t.new_full(shape, value)], dim=1)

        return EncoderState(
            torch.cat([pad(s.annotations) for s in states]),
            torch.cat([pad(s.projected_annotations) for s in states]),
            torch.cat([pad(s.mask, False) for s in states]),
            torch.cat([s.init_state for s in states]),
        )


def check_source_mask(src_mask: Tensor) -> Tensor:
    """Bool[B,S] mask; raises ``ValueError`` unless every row is a non-empty prefix (right padding)."""
    mask = src_mask.bool()
    lengths = mask.sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError("every source needs at least one token (append eos_token_id to empty sources)")
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    if not torch.equal(prefix, mask):
        raise ValueError("source mask must be right-padded: real tokens first, then padding")
    return mask


# ---------------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------------


class PaperGRUCell(nn.Module):
    """GRU of Cho et al. (2014) as written in A.2.1/A.2.2, with optional context inputs (C, C_z, C_r).

    ``input_proj`` holds [W_z; W_r; W] (with bias), ``state_gate_proj`` [U_z; U_r], ``state_proj`` U,
    ``context_proj`` [C_z; C_r; C] (decoder only). The reset gate multiplies the state before U.
    """

    def __init__(self, input_size: int, hidden_size: int, context_size: int = 0) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.input_proj = nn.Linear(input_size, 3 * hidden_size)
        self.state_gate_proj = nn.Linear(hidden_size, 2 * hidden_size, bias=False)
        self.state_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.context_proj = nn.Linear(context_size, 3 * hidden_size, bias=False) if context_size else None

    def forward(self, projected_input: Tensor, prev_state: Tensor, context: Tensor | None = None) -> Tensor:
        """One step. ``projected_input`` = ``input_proj(x)`` Float[N,3n] (precomputable for all steps),
        ``prev_state`` Float[N,n], ``context`` Float[N,A] -> new state Float[N,n]."""
        x = projected_input
        if self.context_proj is not None:
            x = x + self.context_proj(context)
        x_z, x_r, x_cand = x.chunk(3, dim=-1)  # 3 x Float[N,n]
        g_z, g_r = self.state_gate_proj(prev_state).chunk(2, dim=-1)
        update = torch.sigmoid(x_z + g_z)  # z_i
        reset = torch.sigmoid(x_r + g_r)  # r_i
        candidate = torch.tanh(x_cand + self.state_proj(reset * prev_state))  # s̃_i = tanh(W E y + U[r∘s] + C c)
        return (1 - update) * prev_state + update * candidate  # s_i


class BiGRUEncoder(nn.Module):
    """Source embeddings E and a bidirectional GRU; annotations ``h_j = [→h_j; ←h_j]`` (A.2.1)."""

    def __init__(self, config: RNNSearchConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.src_vocab_size, config.embedding_size, padding_idx=config.pad_token_id)
        self.forward_gru = PaperGRUCell(config.embedding_size, config.hidden_size)
        self.backward_gru = PaperGRUCell(config.embedding_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.hidden_size = config.hidden_size

    def forward(self, src_ids: Tensor, src_mask: Tensor) -> Tensor:
        """``src_ids`` Long[B,S], ``src_mask`` Bool[B,S] -> annotations Float[B,S,2n] (zero at pads).

        Pad steps keep the previous state, so the forward pass never sees them and the backward pass starts
        at the last real word with ←h = 0 (padding invariant for any padding pattern)."""
        B, S = src_ids.shape
        n = self.hidden_size
        emb = self.dropout(self.embeddings(src_ids))  # Float[B,S,m]
        # Both directions advance together as one batched recurrence over loop step t (forward reads position
        # t, backward position S-1-t): the loop is bound by per-op overhead on CPU (short sources, small
        # batches), and this issues 7 ops per step for both directions instead of ~17 per direction.
        fwd, bwd = self.forward_gru, self.backward_gru
        inputs = torch.stack([fwd.input_proj(emb), bwd.input_proj(emb).flip(1)])  # [2,B,S,3n]
        inputs = inputs.transpose(1, 2).contiguous()  # [2,S,B,3n]: one slice per loop step
        gates_in, cand_in = inputs[..., : 2 * n], inputs[..., 2 * n :]
        real = src_mask.to(emb.dtype)  # pads keep the state: their update gate is forced to 0
        keep = torch.stack([real, real.flip(1)]).transpose(1, 2).unsqueeze(-1)  # [2,S,B,1]
        gate_w = torch.stack([fwd.state_gate_proj.weight.t(), bwd.state_gate_proj.weight.t()])  # [2,n,2n]
        state_w = torch.stack([fwd.state_proj.weight.t(), bwd.state_proj.weight.t()])  # [2,n,n]
        h = emb.new_zeros(2, B, n)
        states = []
        for t in range(S):
            zr = torch.sigmoid(torch.baddbmm(gates_in[:, t], h, gate_w))  # [z_i; r_i]
            candidate = torch.tanh(torch.baddbmm(cand_in[:, t], zr[..., n:] * h, state_w))  # tanh(W x + U[r∘h])
            # (1-z) h + z h̃ with z = 0 at pads; under autocast the gates come back in the lower precision
            h = torch.lerp(h, candidate.to(h.dtype), (zr[..., :n] * keep[:, t]).to(h.dtype))
            states.append(h)
        stacked = torch.stack(states, 2)  # [2,B,S,n]; direction 1 in reversed positions
        annotations = torch.cat([stacked[0], stacked[1].flip(1)], dim=-1)
        mask = src_mask.bool().unsqueeze(-1)  # Bool[B,S,1]
        return annotations.masked_fill(~mask, 0.0)  # Float[B,S,2n]


class AdditiveAlignment(nn.Module):
    """Alignment model (A.1.2): ``e_ij = v_aᵀ tanh(W_a s_{i-1} + U_a h_j)``, α = masked softmax over j."""

    def __init__(self, hidden_size: int, annotation_size: int, alignment_size: int) -> None:
        super().__init__()
        self.state_proj = nn.Linear(hidden_size, alignment_size)  # W_a (with the bias)
        self.annotation_proj = nn.Linear(annotation_size, alignment_size, bias=False)  # U_a
        self.energy = nn.Linear(alignment_size, 1, bias=False)  # v_a

    def project_annotations(self, annotations: Tensor) -> Tensor:
        """U_a h_j for all j: Float[B,S,A] -> Float[B,S,n'] (once per source)."""
        return self.annotation_proj(annotations)

    def forward(self, prev_state: Tensor, annotations: Tensor, projected_annotations: Tensor, mask: Tensor):
        """``prev_state`` Float[N,n], ``annotations`` Float[N,S,A], ``projected_annotations`` Float[N,S,n'],
        ``mask`` Bool[N,S] -> (context c_i Float[N,A], alignment α_i Float[N,S], exactly 0 at pads)."""
        energies = self.energy(torch.tanh(self.state_proj(prev_state).unsqueeze(1) + projected_annotations))
        energies = energies.squeeze(-1).masked_fill(~mask, float("-inf"))  # e_ij: Float[N,S]
        alignment = torch.softmax(energies, dim=-1)  # α_ij
        context = torch.bmm(alignment.unsqueeze(1), annotations).squeeze(1)  # c_i = Σ_j α_ij h_j: Float[N,A]
        return context, alignment


class AttentionDecoder(nn.Module):
    """The decoder head (A.2.2): target embeddings, alignment model, conditional GRU, maxout deep output."""

    def __init__(self, config: RNNSearchConfig) -> None:
        super().__init__()
        n, m, A, l = config.hidden_size, config.embedding_size, config.annotation_size, config.maxout_size
        self.config = config
        self.embeddings = nn.Embedding(config.tgt_vocab_size, m, padding_idx=config.pad_token_id)  # E
        self.alignment = AdditiveAlignment(n, A, config.alignment_size)
        init_in = A // 2 if config.init_state == "backward_first" else A
        self.init_state_proj = nn.Linear(init_in, n)  # W_s
        self.gru = PaperGRUCell(m, n, context_size=A)
        self.out_state_proj = nn.Linear(n, 2 * l)  # U_o (with the deep-output bias)
        self.out_embedding_proj = nn.Linear(m, 2 * l, bias=False)  # V_o
        self.out_context_proj = nn.Linear(A, 2 * l, bias=False)  # C_o
        self.output_proj = nn.Linear(l, config.tgt_vocab_size)  # W_o
        self.dropout = nn.Dropout(config.dropout)

    def initial_state(self, annotations: Tensor, mask: Tensor) -> Tensor:
        """s_0 Float[B,n] from annotations Float[B,S,A] (right-padded) per ``config.init_state``."""
        mode = self.config.init_state
        if mode == "backward_first":  # paper: tanh(W_s ←h_1), ←h_1 = second half of h_1
            source = annotations[:, 0, annotations.shape[-1] // 2 :]
        elif mode == "first":
            source = annotations[:, 0]
        else:  # "mean" over real positions
            m = mask.to(annotations.dtype).unsqueeze(-1)
            source = (annotations * m).sum(1) / m.sum(1)
        return torch.tanh(self.init_state_proj(source))

    def step(
        self,
        prev_tokens: Tensor,
        prev_state: Tensor,
        annotations: Tensor,
        projected_annotations: Tensor,
        mask: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One target position for N rows: y_{i-1} Long[N], s_{i-1} Float[N,n], and each row's source
        -> (logits Float[N,K_y] of y_i, s_i Float[N,n], α_i Float[N,S])."""
        prev_embedding = self.dropout(self.embeddings(prev_tokens))  # E y_{i-1}: Float[N,m]
        context, alignment = self.alignment(prev_state, annotations, projected_annotations, mask)
        logits = self.deep_output(prev_state, prev_embedding, context)
        new_state = self.gru(self.gru.input_proj(prev_embedding), prev_state, context)  # s_i
        return logits, new_state, alignment

    def deep_output(self, prev_state: Tensor, prev_embedding: Tensor, context: Tensor) -> Tensor:
        """Deep output with maxout (A.2.2): ``t̃_i = U_o s_{i-1} + V_o E y_{i-1} + C_o c_i``,
        ``t_i,k = max(t̃_i,2k-1, t̃_i,2k)``, logits ``W_o t_i``. Any leading dims ``[...]``: s_{i-1}
        Float[...,n], E y_{i-1} Float[...,m], c_i Float[...,A] -> logits Float[...,K_y]."""
        t_tilde = (
            self.out_state_proj(prev_state) + self.out_embedding_proj(prev_embedding) + self.out_context_proj(context)
        )  # Float[...,2l]
        t = t_tilde.unflatten(-1, (-1, 2)).max(dim=-1).values  # Float[...,l]
        return self.output_proj(self.dropout(t))  # Float[...,K_y]


class RNNSearch(nn.Module):
    """RNNsearch = encoder (BiGRU, or annotations from elsewhere) + ``AttentionDecoder`` head."""

    def __init__(self, config: RNNSearchConfig, encoder: nn.Module | None = None) -> None:
        """``encoder``: any module ``(src_ids, src_mask) -> Float[B,S,annotation_size]``; the BiGRU when
        omitted and ``config.encoder_type == "bigru"``."""
        super().__init__()
        self.config = config
        if encoder is None:
            if config.encoder_type != "bigru":
                raise ValueError("encoder_type 'external' needs an encoder module")
            encoder = BiGRUEncoder(config)
        self.encoder = encoder
        self.decoder = AttentionDecoder(config)

    def encode(self, src_ids: Tensor, src_mask: Tensor) -> EncoderState:
        """``src_ids`` Long[B,S], ``src_mask`` [B,S] (1 = real, right-padded) -> ``EncoderState``."""
        mask = check_source_mask(src_mask)
        annotations = self.encoder(src_ids, mask)  # Float[B,S,A]
        annotations = annotations.masked_fill(~mask.unsqueeze(-1), 0.0)
        return EncoderState(
            annotations=annotations,
            projected_annotations=self.decoder.alignment.project_annotations(annotations),  # U_a h_j
            mask=mask,
            init_state=self.decoder.initial_state(annotations, mask),
        )

    def decode_step(
        self, state: EncoderState, source_index: Tensor | None, prev_tokens: Tensor, prev_hidden: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder step for N hypotheses; hypothesis n reads source row ``source_index[n]`` of ``state``
        (``None``: row n, or row 0 for every hypothesis when ``state`` has one source).
        ``prev_tokens`` Long[N] (y_{i-1}), ``prev_hidden`` Float[N,n] (s_{i-1})
        -> (log_probs Float[N,K_y] of y_i, new_hidden s_i Float[N,n], alignment α_i Float[N,S])."""
        if source_index is None and state.num_sources == 1 and prev_tokens.shape[0] != 1:
            source_index = torch.zeros_like(prev_tokens)
        rows = state if source_index is None else state.select(source_index)
        logits, new_hidden, alignment = self.decoder.step(
            prev_tokens, prev_hidden, rows.annotations, rows.projected_annotations, rows.mask
        )
        return torch.log_softmax(logits.float(), dim=-1), new_hidden, alignment

    def forward(self, src_ids: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing (training): ``src_ids`` Long[B,S], ``src_mask`` [B,S] (right-padded),
        ``tgt_in`` Long[B,T] = [bos, y_1, ..., y_{T-1}] -> logits Float[B,T,K_y] of y_1..y_T.

        The same maths as ``encode`` + ``decode_step`` fed the reference tokens (``decode_step``'s log-probs
        are ``log_softmax`` of these logits). Only the recurrence (alignment, GRU) is stepped; the target
        embeddings, the GRU input projections and the deep output run once over all T positions."""
        state = self.encode(src_ids, src_mask)
        dec = self.decoder
        prev_embedding = dec.dropout(dec.embeddings(tgt_in))  # E y_{i-1}: Float[B,T,m]
        gru_in = dec.gru.input_proj(prev_embedding)  # Float[B,T,3n]
        hidden = state.init_state  # s_0: Float[B,n]
        prev_states, contexts = [], []
        for i in range(tgt_in.shape[1]):
            context, _ = dec.alignment(hidden, state.annotations, state.projected_annotations, state.mask)
            prev_states.append(hidden)
            contexts.append(context)
            hidden = dec.gru(gru_in[:, i], hidden, context)  # s_i
        # s_{i-1} Float[B,T,n], c_i Float[B,T,A] -> Float[B,T,K_y]
        return dec.deep_output(torch.stack(prev_states, 1), prev_embedding, torch.stack(contexts, 1))


# ---------------------------------------------------------------------------------------------------------
# A DeBERTa-style annotation encoder, and the model builder for both encoders
# ---------------------------------------------------------------------------------------------------------


class DebertaAnnotationEncoder(DebertaModel):
    """Our DeBERTa-style encoder as an RNNsearch encoder: ``(src_ids, src_mask) -> Float[B,S,hidden_size]``.

    Parameter names are those of ``DebertaModel`` (``embeddings.*``, ``encoder.*``), so inside ``RNNSearch``
    they read ``encoder.embeddings.*`` / ``encoder.encoder.*``."""

    def forward(self, src_ids: Tensor, src_mask: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(src_ids, src_mask)


def encoder_kind(model: RNNSearch) -> str:
    """``"deberta"`` or ``"bigru"``."""
    if isinstance(model.encoder, DebertaAnnotationEncoder):
        return "deberta"
    if model.config.encoder_type == "bigru":
        return "bigru"
    raise ValueError(f"unsupported encoder module {type(model.encoder).__name__}")


def build_translation_model(config: RNNSearchConfig, encoder_config: DebertaConfig | None = None) -> RNNSearch:
    """RNNsearch with the BiGRU encoder (``encoder_config`` None) or a DeBERTa-style encoder whose
    ``hidden_size`` must equal ``config.annotation_size`` and ``vocab_size`` ``config.src_vocab_size``."""
    if encoder_config is None:
        if config.encoder_type != "bigru":
            raise ValueError("an 'external' encoder needs encoder_config")
        return RNNSearch(config)
    if config.encoder_type != "external":
        raise ValueError("a DeBERTa encoder needs RNNSearchConfig(encoder_type='external')")
    if encoder_config.hidden_size != config.annotation_size:
        raise ValueError(
            f"encoder hidden_size {encoder_config.hidden_size} != annotation_size {config.annotation_size}"
        )
    if encoder_config.vocab_size != config.src_vocab_size:
        raise ValueError(f"encoder vocab_size {encoder_config.vocab_size} != src_vocab_size {config.src_vocab_size}")
    return RNNSearch(config, encoder=DebertaAnnotationEncoder(encoder_config))
