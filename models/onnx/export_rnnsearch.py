"""ONNX export of RNNsearch translation checkpoints: an encoder graph and a decoder-step graph.

    relserve export CHECKPOINT_DIR OUT_DIR     # a translation checkpoint (config.json model_type "rnnsearch")

writes ``OUT_DIR/encoder.onnx``, ``OUT_DIR/decoder_step.onnx`` and ``OUT_DIR/export_report.json``. The two
graphs are the model's step API (:mod:`relserve.models.rnnsearch`), so any search (greedy, beam, iteration-level
batching) runs on them unchanged (:class:`relserve.models.onnx.runtime.OrtRNNSearch`):

``encoder.onnx``: ``src_ids`` Int64[batch, source_length], ``src_mask`` Int64[batch, source_length] (1 = real
token, right-padded) -> ``annotations`` Float[batch, source_length, A] (h_j, zero at pads),
``projected_annotations`` Float[batch, source_length, n'] (U_a h_j), ``init_state`` Float[batch, n] (s_0).

``decoder_step.onnx``: ``annotations``, ``projected_annotations``, ``src_mask`` (as above, over ``sources``
rows), ``source_index`` Int64[hypotheses] (the source row each hypothesis reads), ``prev_tokens``
Int64[hypotheses] (y_{i-1}), ``prev_hidden`` Float[hypotheses, n] (s_{i-1}) -> ``log_probs``
Float[hypotheses, K_y] (log p(y_i)), ``new_hidden`` Float[hypotheses, n] (s_i), ``alignment``
Float[hypotheses, source_length] (α_i, zero at pads).

The BiGRU encoder becomes one standard ONNX ``GRU`` node (``direction="bidirectional"``,
``linear_before_reset=0``, ``sequence_lens`` from the mask). ONNX's GRU with ``linear_before_reset=0`` is
exactly the paper's cell (the reset gate multiplies the state before ``U``, A.2.1); only the update gate's
sense differs (ONNX keeps ``z`` of the old state, the paper ``1 - z``), so ``W_z``, ``U_z`` and their bias are
negated on export: ``σ(-a) = 1 - σ(a)``. Per-sequence lengths give the paper's padding semantics (the
backward pass starts at each source's last real word). A DeBERTa-style encoder is exported as in
:mod:`relserve.models.onnx.export` (``com.relserve`` nodes with model-local functions).

Axes ``batch``, ``sources``, ``hypotheses`` and ``source_length`` are dynamic; opset >= 17;
``onnx.checker.check_model(full_check=True)``. The parity report runs both graphs on ONNX Runtime (CPU)
against torch: encoder outputs for several batches and lengths (up to 300 tokens, mixed-length padded
batches), decoder steps with several hypotheses per source, and a whole greedy and beam-4 decode whose
tokens must be identical.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from ..checkpoint import checkpoint_hash, encoder_kind, load_translation_checkpoint
from ..decoding import DecodeOptions, beam_search
from ..rnnsearch import BiGRUEncoder, RNNSearch
from . import ops as onnx_ops
from .export import (PARITY_RTOL, PARITY_TOLERANCE, ExportParityError, check_opset, dynamo_export, file_digests,
                     staged_dir)
from .runtime import (DECODER_GRAPH, ENCODER_GRAPH, EXPORT_VERSION, METADATA_CHECKPOINT, REPORT_DIGESTS, REPORT_NAME,
                      OrtRNNSearch, step_api_agreement)
from .tolerance import Agreement

ENCODER_INPUTS = ["src_ids", "src_mask"]
ENCODER_OUTPUTS = ["annotations", "projected_annotations", "init_state"]
DECODER_INPUTS = ["annotations", "projected_annotations", "src_mask", "source_index", "prev_tokens", "prev_hidden"]
DECODER_OUTPUTS = ["log_probs", "new_hidden", "alignment"]

__all__ = [
    "onnx_gru_weights",
    "onnx_bigru_reference",
    "export_translation_model",
    "translation_parity_report",
    "export_translation_checkpoint",
]


# ---------------------------------------------------------------------------------------------------------
# The BiGRU as one ONNX GRU node
# ---------------------------------------------------------------------------------------------------------


def onnx_gru_weights(encoder: BiGRUEncoder) -> tuple[Tensor, Tensor, Tensor]:
    """The BiGRU's weights in ONNX ``GRU`` layout (gates z, r, h; direction 0 forward, 1 reverse):
    W Float[2, 3n, m], R Float[2, 3n, n], B Float[2, 6n] (= [Wb; Rb], Rb zero). ``W_z``, ``U_z`` and ``b_z``
    are negated because ONNX's update gate weighs the old state (see the module docstring)."""
    Ws, Rs, Bs = [], [], []
    for cell in (encoder.forward_gru, encoder.backward_gru):
        n = cell.hidden_size
        sign = torch.ones(3 * n, 1)
        sign[:n] = -1.0
        w = cell.input_proj.weight.detach().float() * sign  # [W_z; W_r; W] -> [-W_z; W_r; W]
        b = cell.input_proj.bias.detach().float() * sign[:, 0]
        u_z, u_r = cell.state_gate_proj.weight.detach().float().chunk(2, dim=0)
        r = torch.cat([-u_z, u_r, cell.state_proj.weight.detach().float()], dim=0)
        Ws.append(w)
        Rs.append(r)
        Bs.append(torch.cat([b, torch.zeros_like(b)]))
    return torch.stack(Ws), torch.stack(Rs), torch.stack(Bs)


def onnx_bigru_reference(x: Tensor, lengths: Tensor, W: Tensor, R: Tensor, B: Tensor) -> Tensor:
    """ONNX ``GRU`` (bidirectional, ``linear_before_reset=0``, ``sequence_lens``) written from the operator
    spec: x Float[B, S, m], lengths Long[B] -> Float[B, S, 2n] = [forward; reverse] outputs, zero at t >=
    lengths[b]. (The ONNX spec's formulas, not our cell: it checks :func:`onnx_gru_weights`.)"""
    batch, S, _ = x.shape
    n = R.shape[-1]
    outs = []
    for d, steps in ((0, range(S)), (1, reversed(range(S)))):
        Wz, Wr, Wh = W[d].chunk(3)
        Rz, Rr, Rh = R[d].chunk(3)
        Wbz, Wbr, Wbh, Rbz, Rbr, Rbh = B[d].chunk(6)
        H = x.new_zeros(batch, n)
        y = x.new_zeros(batch, S, n)
        for t in steps:
            xt = x[:, t]
            z = torch.sigmoid(xt @ Wz.T + H @ Rz.T + Wbz + Rbz)
            r = torch.sigmoid(xt @ Wr.T + H @ Rr.T + Wbr + Rbr)
            h = torch.tanh(xt @ Wh.T + (r * H) @ Rh.T + Rbh + Wbh)
            live = (t < lengths)[:, None]
            H = torch.where(live, (1 - z) * h + z * H, H)
            y[:, t] = torch.where(live, H, torch.zeros_like(H))
        outs.append(y)
    return torch.cat(outs, dim=-1)


@torch.library.custom_op("relserve::onnx_bigru", mutates_args=())
def _bigru_op(x: Tensor, lengths: Tensor, W: Tensor, R: Tensor, B: Tensor, hidden_size: int) -> Tensor:
    return onnx_bigru_reference(x, lengths, W, R, B)


@_bigru_op.register_fake
def _(x, lengths, W, R, B, hidden_size):
    return x.new_empty((x.shape[0], x.shape[1], 2 * hidden_size))


def _gru_translation() -> dict:
    from onnxscript import opset18 as op
    from onnxscript import INT32

    def bigru(x, lengths, W, R, B, hidden_size):
        seq_major = op.Transpose(x, perm=[1, 0, 2])  # [S, B, m]
        y, _ = op.GRU(seq_major, W, R, B, op.Cast(lengths, to=INT32.dtype), direction="bidirectional",
                      hidden_size=int(hidden_size), linear_before_reset=0)  # [S, 2, B, n]
        y = op.Transpose(y, perm=[2, 0, 1, 3])  # [B, S, 2, n]
        return op.Reshape(y, op.Constant(value_ints=[0, 0, -1]))  # [B, S, 2n] = [→h; ←h]

    return {torch.ops.relserve.onnx_bigru.default: bigru}


# ---------------------------------------------------------------------------------------------------------
# Graph modules
# ---------------------------------------------------------------------------------------------------------


class EncoderGraph(nn.Module):
    """``(src_ids, src_mask) -> (annotations, projected_annotations, init_state)`` as in ``RNNSearch.encode``
    (without its input validation: the server checks masks before they reach a graph)."""

    def __init__(self, model: RNNSearch) -> None:
        super().__init__()
        self.model = model
        self.bigru = isinstance(model.encoder, BiGRUEncoder)
        if self.bigru:
            W, R, B = onnx_gru_weights(model.encoder)
            self.register_buffer("gru_W", W)
            self.register_buffer("gru_R", R)
            self.register_buffer("gru_B", B)

    def forward(self, src_ids: Tensor, src_mask: Tensor):
        mask = src_mask.bool()
        if self.bigru:
            enc = self.model.encoder
            emb = enc.embeddings(src_ids)
            annotations = torch.ops.relserve.onnx_bigru(emb, mask.long().sum(dim=1), self.gru_W, self.gru_R,
                                                        self.gru_B, enc.hidden_size)
        else:
            annotations = self.model.encoder(src_ids, mask)
        annotations = annotations.masked_fill(~mask.unsqueeze(-1), 0.0)
        decoder = self.model.decoder
        return annotations, decoder.alignment.project_annotations(annotations), decoder.initial_state(annotations, mask)


class DecoderStepGraph(nn.Module):
    """One ``RNNSearch.decode_step``: hypotheses read source rows ``source_index`` of the stacked sources."""

    def __init__(self, model: RNNSearch) -> None:
        super().__init__()
        self.model = model

    def forward(self, annotations, projected_annotations, src_mask, source_index, prev_tokens, prev_hidden):
        mask = src_mask.bool().index_select(0, source_index)
        logits, new_hidden, alignment = self.model.decoder.step(
            prev_tokens, prev_hidden, annotations.index_select(0, source_index),
            projected_annotations.index_select(0, source_index), mask)
        return torch.log_softmax(logits.float(), dim=-1), new_hidden, alignment


def _max_source_length(model: RNNSearch) -> int:
    cfg = getattr(model.encoder, "config", None)
    if cfg is not None and getattr(cfg, "position_biased_input", False):
        return int(cfg.max_position_embeddings)
    return 1 << 16


def _export(module: nn.Module, sample: dict[str, Tensor], outputs: list[str], dynamic: dict, opset: int,
            path: Path, metadata: dict[str, str] | None):
    import onnx

    proto = dynamo_export(module, sample, outputs, dynamic, opset, _gru_translation(), metadata)
    onnx.save_model(proto, os.fspath(path))
    return proto


def export_translation_model(model: RNNSearch, out_dir: str | os.PathLike, *, opset: int = 18,
                             check: bool = True, metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Export ``model`` (moved to CPU float32, eval) to ``out_dir/encoder.onnx`` and ``out_dir/decoder_step.onnx``.

    Returns ``{"encoder": ModelProto, "decoder_step": ModelProto}``.

    Raises:
        ValueError: an opset outside 17..newest, or one the exporter cannot produce for these graphs.
    """
    import onnx

    model = model.to("cpu", torch.float32).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    # Sample sizes all differ and exceed 1, so the exporter specialises none of the dynamic axes.
    batch, length, hyps = 2, 7, 3
    ids = torch.randint(3, max(4, cfg.src_vocab_size), (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, 5:] = 0
    B = torch.export.Dim("batch", min=1, max=1 << 16)
    S = torch.export.Dim("source_length", min=1, max=_max_source_length(model))
    encoder = EncoderGraph(model).eval()
    enc_proto = _export(encoder, {"src_ids": ids, "src_mask": mask}, ENCODER_OUTPUTS,
                        {"src_ids": {0: B, 1: S}, "src_mask": {0: B, 1: S}}, opset, out / ENCODER_GRAPH, metadata)
    with torch.no_grad():
        annotations, projected, init_state = encoder(ids, mask)
    R = torch.export.Dim("sources", min=1, max=1 << 16)
    N = torch.export.Dim("hypotheses", min=1, max=1 << 20)
    sample = {
        "annotations": annotations, "projected_annotations": projected, "src_mask": mask,
        "source_index": torch.tensor([0, 1, 1]), "prev_tokens": torch.randint(3, cfg.tgt_vocab_size, (hyps,), generator=g),
        "prev_hidden": init_state[torch.tensor([0, 1, 1])].clone(),
    }
    dynamic = {"annotations": {0: R, 1: S}, "projected_annotations": {0: R, 1: S}, "src_mask": {0: R, 1: S},
               "source_index": {0: N}, "prev_tokens": {0: N}, "prev_hidden": {0: N}}
    dec_proto = _export(DecoderStepGraph(model).eval(), sample, DECODER_OUTPUTS, dynamic, opset, out / DECODER_GRAPH,
                        metadata)
    if check:
        for name in (ENCODER_GRAPH, DECODER_GRAPH):
            onnx.checker.check_model(os.fspath(out / name), full_check=True)
    return {"encoder": enc_proto, "decoder_step": dec_proto}


# ---------------------------------------------------------------------------------------------------------
# Parity against torch
# ---------------------------------------------------------------------------------------------------------


def parity_cases(model: RNNSearch) -> list[list[int]]:
    """Source lengths per encoder case: single sources of 1, 9 and 300 tokens (capped at the encoder's maximum),
    a batch of equal lengths, and a padded batch of mixed lengths."""
    cap = _max_source_length(model)
    lengths = sorted({min(n, cap) for n in (1, 9, 300)})
    return [[n] for n in lengths] + [[12, 12, 12], [min(40, cap), 3, 17, 1]]


def _sources(model: RNNSearch, lengths: list[int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    cfg = model.config
    ids = np.full((len(lengths), max(lengths)), cfg.pad_token_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(3, max(4, cfg.src_vocab_size), n)
        ids[b, n - 1] = cfg.eos_token_id
        mask[b, :n] = 1
    return ids, mask


def translation_parity_report(ort_model, model: RNNSearch, *, tolerance: float = PARITY_TOLERANCE,
                              rtol: float = PARITY_RTOL, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Graphs (``ort_model``, an :class:`~relserve.models.onnx.runtime.OrtRNNSearch`) vs torch ``model``.

    Encoder cases compare the three encoder outputs over real positions; each case then runs one decoder step
    with two hypotheses per source (different tokens, source rows in reverse order) and compares log-probs,
    states and alignments, passing where ``|diff| <= tolerance + rtol * |torch|``; finally greedy and beam-4
    searches over the mixed batch must give identical tokens. Returns ``{"passed", "tolerance" (= "atol"),
    "atol", "rtol", "max_abs_diff", "max_scaled_diff", "providers", "cases": [...], "search": {...}}``."""
    say = progress or (lambda _m: None)
    model = model.to("cpu", torch.float32).eval()
    cases = []
    total = Agreement(tolerance, rtol)
    for k, lengths in enumerate(parity_cases(model)):
        ids, mask = _sources(model, lengths, seed=k)
        rows = torch.arange(len(lengths) - 1, -1, -1).repeat_interleave(2)
        tokens = torch.from_numpy(np.random.default_rng(100 + k).integers(3, model.config.tgt_vocab_size, len(rows)))
        enc, dec = step_api_agreement(model, ort_model, torch.from_numpy(ids), torch.from_numpy(mask), rows,
                                      tokens, atol=tolerance, rtol=rtol)
        total.merge(enc).merge(dec)
        ok = enc.passed and dec.passed
        cases.append({"batch": len(lengths), "lengths": lengths, "encoder_max_abs_diff": enc.max_abs_diff,
                      "decoder_step_max_abs_diff": dec.max_abs_diff,
                      "max_scaled_diff": max(enc.max_scaled_diff, dec.max_scaled_diff), "passed": ok})
        say(f"  parity batch={len(lengths)} lengths={lengths}: encoder {enc.max_abs_diff:.2e}, decoder step "
            f"{dec.max_abs_diff:.2e}, scaled {cases[-1]['max_scaled_diff']:.3g} {'ok' if ok else 'FAIL'}")
    ids, mask = _sources(model, parity_cases(model)[-1], seed=99)
    search = {}
    with torch.inference_mode():
        for label, beam in (("greedy", 1), ("beam4", 4)):
            opts = DecodeOptions(beam_size=beam, n_best=beam, max_len_cap=12)
            want = [[h.tokens for h in r] for r in beam_search(model, torch.from_numpy(ids), torch.from_numpy(mask), opts)]
            got = [[h.tokens for h in r] for r in beam_search(ort_model, torch.from_numpy(ids), torch.from_numpy(mask), opts)]
            search[label] = {"identical_tokens": want == got}
            say(f"  {label} search over {len(want)} sources: tokens {'identical' if want == got else 'DIFFER'}")
    passed = all(c["passed"] for c in cases) and all(s["identical_tokens"] for s in search.values())
    return {"passed": passed, "tolerance": tolerance, **total.as_dict(), "providers": ort_model.providers,
            "cases": cases,
            "search": search}


def export_translation_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                                  opset: int = 18, parity: bool = True,
                                  progress: Callable[[str], None] | None = print, loaded=None,
                                  atol: float = PARITY_TOLERANCE, rtol: float = PARITY_RTOL) -> dict[str, Any]:
    """Load a translation checkpoint, export both graphs into ``out_dir``, check them, write the report.

    ``loaded``: an already loaded ``(model, config, tokenizer)`` (the server's ONNX backend passes one).
    Returns the report dict.

    Raises:
        relserve.models.checkpoint.TranslationCheckpointError: the checkpoint cannot be loaded.
        ValueError: an opset outside what the exporter can produce.
        RuntimeError: the parity check failed (graphs and report are left in the staging folder it names;
            ``out_dir`` is unchanged).

    Both graphs record the checkpoint hash in their metadata (``relserve.checkpoint_sha256``); the report
    records it and the sha256 of both graph files (``file_sha256``); files are written through
    :func:`relserve.models.onnx.export.staged_dir`.
    """
    import onnx


    check_opset(opset)
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    if loaded is None:
        say(f"[1/4] loading {checkpoint_dir}")
        loaded = load_translation_checkpoint(checkpoint_dir)
    model = loaded[0].to("cpu", torch.float32).eval()
    kind = encoder_kind(model)
    digest = checkpoint_hash(checkpoint_dir, EXPORT_VERSION)
    with staged_dir(out_dir) as out:
        say(f"[2/4] exporting the RNNsearch encoder ({kind}) and decoder step with the dynamo exporter, "
            f"opset {opset}")
        t1 = time.perf_counter()
        protos = export_translation_model(model, out, opset=opset, check=False,
                                          metadata={METADATA_CHECKPOINT: digest})
        t_export = time.perf_counter() - t1
        say(f"[3/4] onnx.checker.check_model(full_check=True) on {ENCODER_GRAPH} and {DECODER_GRAPH}")
        for name in (ENCODER_GRAPH, DECODER_GRAPH):
            onnx.checker.check_model(os.fspath(out / name), full_check=True)

        def ops(proto) -> list[str]:
            return sorted({f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in proto.graph.node})

        report: dict[str, Any] = {
            "checkpoint": os.fspath(checkpoint_dir),
            "checkpoint_sha256": digest,
            "export_version": EXPORT_VERSION,
            "task": "translation",
            "encoder_type": kind,
            "opset": opset,
            "graphs": {
                "encoder": {"file": ENCODER_GRAPH, "inputs": ENCODER_INPUTS, "outputs": ENCODER_OUTPUTS,
                            "dynamic_axes": {"batch": 0, "source_length": 1}, "ops": ops(protos["encoder"]),
                            "bytes": (out / ENCODER_GRAPH).stat().st_size},
                "decoder_step": {"file": DECODER_GRAPH, "inputs": DECODER_INPUTS, "outputs": DECODER_OUTPUTS,
                                 "dynamic_axes": {"sources": 0, "source_length": 1, "hypotheses": 0},
                                 "ops": ops(protos["decoder_step"]), "bytes": (out / DECODER_GRAPH).stat().st_size},
            },
            "custom_domain": onnx_ops.DOMAIN,
            REPORT_DIGESTS: file_digests(out),
            "export_seconds": round(t_export, 2),
        }
        if parity:
            say("[4/4] parity against torch (ONNX Runtime CPU)")
            ort_model = OrtRNNSearch(out, model.config)
            report["parity"] = translation_parity_report(ort_model, model, tolerance=atol, rtol=rtol, progress=say)
        report["total_seconds"] = round(time.perf_counter() - t0, 2)
        (out / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        if parity and not report["parity"]["passed"]:
            p = report["parity"]
            raise ExportParityError(f"exported graphs differ from torch (max |diff| {p['max_abs_diff']:.3g}, max "
                                    f"|diff|/(atol + rtol*|ref|) {p['max_scaled_diff']:.3g}, atol {p['atol']:g}, "
                                    f"rtol {p['rtol']:g}; searches "
                                    + ", ".join(f"{k} {'identical' if v['identical_tokens'] else 'DIFFER'}"
                                                for k, v in p["search"].items())
                                    + f"); {out_dir} is unchanged, the graphs and {REPORT_NAME} are in {out}")
    final = Path(out_dir)
    say(f"wrote {final / ENCODER_GRAPH}, {final / DECODER_GRAPH} and {final / REPORT_NAME}")
    return report
