"""Running exported graphs on ONNX Runtime: the session factory, IO binding, and RNNsearch's step API.

* :func:`make_session` opens a graph (portable functions; the native kernel library when given; T5 bias nodes
  re-homed to ``com.microsoft.RelativePositionBias`` when CUDA is asked for).
* :func:`run_bound` binds every input and every (pre-allocated) output of a session by device pointer, so a
  graph on the CUDA execution provider reads and writes torch's CUDA memory with no host round trip, and on the
  CPU provider writes straight into torch tensors (no copy of the outputs). The same code runs on both, so the
  CPU tests exercise the binding path the CUDA provider uses.
* :class:`OrtRNNSearch` has the methods search code uses on :class:`relserve.models.rnnsearch.RNNSearch`
  (``config``, ``encode``, ``decode_step``, ``eval``), with torch tensors in and out, so
  :mod:`relserve.models.decoding` and the server's decode loop run on it unchanged; on the CUDA provider the
  encoder state never leaves the device between steps. :func:`step_api_agreement` compares two such models.

The graph file names and metadata keys the exporters write are defined here, so this module imports no
exporter.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from . import ops
from .tolerance import Agreement
from ..rnnsearch import EncoderState, RNNSearchConfig, check_source_mask

GRAPH_NAME = "model.onnx"
ENCODER_GRAPH = "encoder.onnx"
DECODER_GRAPH = "decoder_step.onnx"
REPORT_NAME = "export_report.json"
# the kernels of models/onnx/native, where `make onnx-native` builds them
NATIVE_LIBRARY = Path(__file__).resolve().parent / "native" / "build" / "librelserve_onnx_ops.so"
# Layout of an export (graphs + report); part of the cache key: bump when it changes. 2: the report lists the
# sha256 of every file the export wrote (REPORT_DIGESTS), which the server checks before loading a graph. 3: the
# DisentangledAttentionBias function gathers whole rows (models/onnx/ops.py), so graphs exported before re-export.
EXPORT_VERSION = "3"
METADATA_CHECKPOINT = "relserve.checkpoint_sha256"  # graph metadata: the hash of the checkpoint it came from
REPORT_DIGESTS = "file_sha256"  # export report: {file name: sha256 hex} of every file the export wrote


def native_library() -> str | None:
    """The native custom-op library when it has been built (``make onnx-native``), else None."""
    return os.fspath(NATIVE_LIBRARY) if NATIVE_LIBRARY.is_file() else None


def make_session(path: str | os.PathLike | bytes, providers: Sequence = ("CPUExecutionProvider",),
                 intra_op_threads: int = 0, graph_optimization: str = "all", native_library: str | None = None):
    """An ONNX Runtime session for an exported graph (portable functions; ``native_library`` registers the
    custom-op kernels of ``models/onnx/native`` when given).

    ``path`` is a graph file, or the serialized graph itself (``bytes``: what the server verified is exactly
    what runs, with no second read of the file; a graph with external data cannot be opened that way).

    Sessions on the CPU provider run without ONNX Runtime's memory patterns (``enable_mem_pattern``), which are
    planned and kept per input shape: a server's batches seldom repeat one.

    When ``providers`` ask for CUDA and the graph has T5 bias nodes, they are first re-homed to ONNX Runtime's
    CUDA kernel (:func:`relserve.models.onnx.ops.to_cuda_contrib_ops`); if that session cannot be created or
    does not get the CUDA provider (ORT falls back to CPU silently when CUDA cannot start), the graph as
    exported is used."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if intra_op_threads:
        opts.intra_op_num_threads = int(intra_op_threads)
    opts.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[graph_optimization]
    if native_library:
        opts.register_custom_ops_library(os.fspath(native_library))
    providers = list(providers)
    wants_cuda = any((p[0] if isinstance(p, tuple) else p) == "CUDAExecutionProvider" for p in providers)
    if not wants_cuda:
        # A memory pattern is planned and kept per input shape; served batches rarely repeat a shape, so the
        # patterns only hold memory: off, a sentiment worker settled 150 MB lower (808 vs 958 MB after 150
        # requests of random shapes) with no throughput change (loadtest/bench/shape_soak.py --backend onnx)
        opts.enable_mem_pattern = False
    if wants_cuda:
        import onnx

        proto = onnx.load_from_string(path) if isinstance(path, bytes) else onnx.load(os.fspath(path))
        if ops.to_cuda_contrib_ops(proto):
            try:
                session = ort.InferenceSession(proto.SerializeToString(), sess_options=opts, providers=providers)
                if "CUDAExecutionProvider" in session.get_providers():
                    return session
            except Exception as exc:  # e.g. CUDA unusable: the contrib op has no CPU kernel
                logging.getLogger(__name__).info("CUDA contrib RelativePositionBias not usable (%s); running the "
                                                 "graph as exported", str(exc).splitlines()[0])
    return ort.InferenceSession(path if isinstance(path, bytes) else os.fspath(path), sess_options=opts,
                                providers=providers)


_ELEMENT_TYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
}

__all__ = ["run_bound"]


def _where(t: Tensor) -> tuple[str, int]:
    if t.device.type == "cuda":
        return "cuda", int(t.device.index or 0)
    if t.device.type == "cpu":
        return "cpu", 0
    raise ValueError(f"ONNX Runtime binding: unsupported device {t.device}")


def run_bound(session, inputs: Mapping[str, Tensor], outputs: Mapping[str, Tensor]) -> None:
    """Run ``session`` with every input and output bound to a torch tensor's memory (shapes and dtypes must
    be exactly the graph's; outputs are written in place).

    Raises:
        ValueError: a tensor of an unsupported dtype or device.
        onnxruntime's errors for a shape or type the graph does not accept.
    """
    io = session.io_binding()
    keep = []  # contiguous copies must outlive the run
    for name, t in inputs.items():
        t = t.contiguous()
        keep.append(t)
        kind, index = _where(t)
        if t.dtype not in _ELEMENT_TYPES:
            raise ValueError(f"input {name!r}: dtype {t.dtype} cannot be bound")
        io.bind_input(name, kind, index, _ELEMENT_TYPES[t.dtype], tuple(t.shape), t.data_ptr())
    for name, t in outputs.items():
        if not t.is_contiguous():
            raise ValueError(f"output {name!r} must be contiguous")
        kind, index = _where(t)
        if t.dtype not in _ELEMENT_TYPES:
            raise ValueError(f"output {name!r}: dtype {t.dtype} cannot be bound")
        io.bind_output(name, kind, index, _ELEMENT_TYPES[t.dtype], tuple(t.shape), t.data_ptr())
    session.run_with_iobinding(io)
    if any(_where(t)[0] == "cuda" for t in outputs.values()):
        io.synchronize_outputs()


class OrtRNNSearch:
    """RNNsearch on ONNX Runtime: ``graph_dir`` holds ``encoder.onnx`` and ``decoder_step.onnx``.

    ``device`` is where tensors live (``"cpu"`` or ``"cuda:N"``, matching ``providers``); float32 only.
    ``graphs`` (``{file name: serialized graph}``) opens the sessions from bytes already read (and verified)
    by the caller instead of reading the files in ``graph_dir``.

    Raises (constructor):
        FileNotFoundError: a graph is missing.
    """

    def __init__(self, graph_dir: str | os.PathLike, config: RNNSearchConfig, *,
                 providers: Sequence = ("CPUExecutionProvider",), intra_op_threads: int = 0,
                 graph_optimization: str = "all", native_library: str | None = None, device: str = "cpu",
                 graphs: Mapping[str, bytes] | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        d = Path(graph_dir)
        for name in (ENCODER_GRAPH, DECODER_GRAPH):
            if (name not in graphs) if graphs is not None else not (d / name).is_file():
                raise FileNotFoundError(f"{d / name}: missing (export the checkpoint with `relserve export`)")
        kwargs = dict(providers=providers, intra_op_threads=intra_op_threads, graph_optimization=graph_optimization,
                      native_library=native_library)
        self._mask_cache: tuple[Tensor, Tensor] | None = None
        source = graphs if graphs is not None else {n: d / n for n in (ENCODER_GRAPH, DECODER_GRAPH)}
        self.encoder_session = make_session(source[ENCODER_GRAPH], **kwargs)
        self.decoder_session = make_session(source[DECODER_GRAPH], **kwargs)

    def _long_mask(self, mask: Tensor) -> Tensor:
        """The graph's Int64 mask; a decode loop passes the same stacked mask step after step, so it is
        converted once per stack, not once per step."""
        if self._mask_cache is None or self._mask_cache[0] is not mask:
            self._mask_cache = (mask, mask.to(self.device).long())
        return self._mask_cache[1]

    @property
    def providers(self) -> list[str]:
        return list(self.encoder_session.get_providers())

    def eval(self) -> "OrtRNNSearch":
        return self

    def encode(self, src_ids: Tensor, src_mask: Tensor) -> EncoderState:
        """``src_ids`` Long[B,S], ``src_mask`` [B,S] (right-padded) -> ``EncoderState`` (as ``RNNSearch.encode``).

        Raises:
            ValueError: an empty source or a mask that is not right padding.
        """
        mask = check_source_mask(src_mask.to(self.device))
        B, S = mask.shape
        cfg = self.config
        out = {
            "annotations": torch.empty(B, S, cfg.annotation_size, device=self.device),
            "projected_annotations": torch.empty(B, S, cfg.alignment_size, device=self.device),
            "init_state": torch.empty(B, cfg.hidden_size, device=self.device),
        }
        run_bound(self.encoder_session, {"src_ids": src_ids.to(self.device, torch.long),
                                         "src_mask": mask.long()}, out)
        return EncoderState(out["annotations"], out["projected_annotations"], mask, out["init_state"])

    def decode_step(self, state: EncoderState, source_index: Tensor | None, prev_tokens: Tensor,
                    prev_hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder step (as ``RNNSearch.decode_step``): -> (log_probs Float[N,K_y], new_hidden Float[N,n],
        alignment Float[N,S])."""
        N = prev_tokens.shape[0]
        if source_index is None:
            source_index = (torch.zeros(N, dtype=torch.long) if state.num_sources == 1
                            else torch.arange(N, dtype=torch.long))
        cfg = self.config
        dev = self.device
        out = {
            "log_probs": torch.empty(N, cfg.tgt_vocab_size, device=dev),
            "new_hidden": torch.empty(N, cfg.hidden_size, device=dev),
            "alignment": torch.empty(N, state.mask.shape[1], device=dev),
        }
        run_bound(self.decoder_session, {
            "annotations": state.annotations.to(dev, torch.float32),
            "projected_annotations": state.projected_annotations.to(dev, torch.float32),
            "src_mask": self._long_mask(state.mask),
            "source_index": source_index.to(dev, torch.long),
            "prev_tokens": prev_tokens.to(dev, torch.long),
            "prev_hidden": prev_hidden.to(dev, torch.float32),
        }, out)
        return out["log_probs"], out["new_hidden"], out["alignment"]


@torch.inference_mode()
def step_api_agreement(reference, candidate, ids: Tensor, mask: Tensor, rows: Tensor, tokens: Tensor, *,
                       atol: float, rtol: float) -> tuple[Agreement, Agreement]:
    """How two step-API models (``encode`` / ``decode_step``) agree on the same sources, against
    ``|candidate - reference| <= atol + rtol * |reference|``: (encoder outputs over real positions, one decoder
    step whose hypotheses read source ``rows`` with previous ``tokens`` from the reference's initial states).
    Used by the export report and the server's self-check."""
    def np_(t: Tensor) -> np.ndarray:
        return t.float().cpu().numpy()

    want = reference.encode(ids, mask)
    got = candidate.encode(ids, mask)
    lengths = mask.sum(dim=1).tolist()
    enc = Agreement(atol, rtol).add(np_(got.init_state), np_(want.init_state))
    for name in ("annotations", "projected_annotations"):
        w, g = np_(getattr(want, name)), np_(getattr(got, name))
        for b, n in enumerate(lengths):
            enc.add(g[b, :n], w[b, :n])
    hidden = want.init_state.index_select(0, rows)
    dec = Agreement(atol, rtol)
    for a, b in zip(reference.decode_step(want, rows, tokens, hidden),
                    candidate.decode_step(want, rows, tokens, hidden)):
        dec.add(np_(b), np_(a))
    return enc, dec


def step_api_diff(reference, candidate, ids: Tensor, mask: Tensor, rows: Tensor, tokens: Tensor) -> tuple[float, float]:
    """Max |difference| of two step-API models: (encoder outputs, one decoder step); see
    :func:`step_api_agreement`."""
    enc, dec = step_api_agreement(reference, candidate, ids, mask, rows, tokens, atol=1.0, rtol=0.0)
    return enc.max_abs_diff, dec.max_abs_diff
