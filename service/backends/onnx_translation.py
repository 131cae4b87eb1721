"""ONNX Runtime step backend for RNNsearch translation checkpoints (``backend: onnx``).

Follows :class:`relserve.service.backends.base.StepBackend`: the model is an
:class:`relserve.models.onnx.runtime.OrtRNNSearch` over ``encoder.onnx`` + ``decoder_step.onnx``, found,
checked (owner, mode, sha256, provenance) or exported on first load by :mod:`.graph_cache` (checkpoint dir,
its ``onnx/`` folder, else the export cache keyed by checkpoint hash) and opened from the verified bytes; the
beams over it are kept by its own
:class:`.translation_steps.BeamStepper`, exactly as the torch backend keeps its. At load, the graphs and the
torch checkpoint encode the warm-up sources and take one decoder step; a difference above
``onnx_parity_tolerance + onnx_parity_rtol * |torch|`` refuses the model (:class:`GraphMismatch`). The provider in use is
``ModelMeta.device``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from relserve.models.checkpoint import load_translation_checkpoint
from relserve.models.onnx.export_rnnsearch import export_translation_checkpoint
from relserve.models.onnx.runtime import DECODER_GRAPH, ENCODER_GRAPH, OrtRNNSearch, step_api_agreement
from relserve.models.rnnsearch import encoder_kind

from ..config import ModelConfig
from .base import TASK_TRANSLATION, ModelMeta
from .graph_cache import GraphMismatch, ParityMismatch, check_graph_origin, load_graphs
from .onnx_session import ONNX_DTYPE_REASON, open_with_native_fallback, provider_device, select_providers
from .translation_steps import BeamStepper, SteppedBackend

log = logging.getLogger(__name__)

Loader = Callable[..., tuple[Any, Any, Any]]


class OnnxTranslationBackend(SteppedBackend):
    """Translation backend over the exported encoder and decoder-step graphs of an RNNsearch checkpoint.

    ``loader`` (a test seam) loads the torch checkpoint the graphs are checked against (and exported from).
    """

    name = "onnxruntime"

    def __init__(self, config: ModelConfig, loader: Loader | None = None) -> None:
        self.config = config
        self._loader = loader or load_translation_checkpoint
        self.device = "cpu"
        self.model: Any = None
        self.model_config: Any = None
        self.tokenizer: Any = None
        self.meta: ModelMeta | None = None
        self.stepper: BeamStepper | None = None
        self.graph_dir: Path | None = None
        self._device_label = "CPUExecutionProvider"
        self.parity_diff: float | None = None

    # -------------------------------------------------------------- lifecycle

    def load(self) -> ModelMeta:
        name = self.config.name
        providers = select_providers(self.config)
        loaded = self._loader(self.config.path, device="cpu", dtype=torch.float32)
        reference, model_config, tokenizer = loaded

        def export(tmp: Path) -> None:
            export_translation_checkpoint(self.config.path, tmp, parity=False, loaded=loaded,
                                          progress=lambda m: log.info("model %r: %s", name, m))

        def open_and_check(d: Path, digest: str, graphs: Mapping[str, bytes]) -> str | None:
            self.graph_dir = d
            model, lib = open_with_native_fallback(name, lambda native: OrtRNNSearch(
                d, model_config, providers=providers, intra_op_threads=self.config.onnx_intra_op_threads,
                graph_optimization=self.config.onnx_graph_optimization, native_library=native, graphs=graphs))
            check_graph_origin(self.config, model.encoder_session, d / ENCODER_GRAPH, digest)
            check_graph_origin(self.config, model.decoder_session, d / DECODER_GRAPH, digest)
            self.device, self._device_label = provider_device(providers, model.providers[0])
            model.device = torch.device(self.device)  # where the session really runs (ORT may fall back to CPU)
            self.model, self.model_config, self.tokenizer = model, model_config, tokenizer
            self.stepper = BeamStepper(name, model, self.device)
            self._self_check(reference.eval())
            return lib

        lib, _ = load_graphs(self.config, (ENCODER_GRAPH, DECODER_GRAPH), export, open_and_check)
        kind = encoder_kind(reference)
        self.meta = ModelMeta(
            task=TASK_TRANSLATION, family=f"rnnsearch-{kind}", backend=self.name, device=self._device_label,
            dtype="float32", dtype_reason=f"dtype: {self.config.dtype}; {ONNX_DTYPE_REASON}", tokenizer=tokenizer,
            max_positions=None,
            extra={"eos_token_id": int(model_config.eos_token_id), "graph": os.fspath(self.graph_dir),
                   "native_ops": bool(lib)},
        )
        log.info("model %r: ONNX Runtime translation graphs in %s on %s (%s custom ops), parity %.2e", name,
                 self.graph_dir, self._device_label, "native" if lib else "portable", self.parity_diff)
        return self.meta

    def _self_check(self, reference) -> None:
        """Encoder outputs and one decoder step vs torch: a short source and one that strides through the
        whole source vocabulary; hypotheses whose previous tokens stride through the target vocabulary (so
        the check reads embedding rows everywhere, not just a few)."""
        cfg = self.model_config
        v, eos, pad = int(cfg.src_vocab_size), int(cfg.eos_token_id), int(cfg.pad_token_id)
        width = 64
        ids = torch.full((2, width), pad, dtype=torch.long)
        mask = torch.zeros(2, width, dtype=torch.bool)
        ids[0, :3] = torch.tensor([min(4, v - 1), min(5, v - 1), eos])
        mask[0, :3] = True
        ids[1, : width - 1] = torch.tensor([(i * 7919) % v for i in range(width - 1)])
        ids[1, width - 1] = eos
        mask[1] = True
        k = int(cfg.tgt_vocab_size)
        tokens = torch.tensor([(i * 7919) % k for i in range(64)])
        enc, dec = step_api_agreement(reference, self.model, ids, mask, torch.arange(64) % 2, tokens,
                                      atol=self.config.onnx_parity_tolerance, rtol=self.config.onnx_parity_rtol)
        agree = enc.merge(dec)
        self.parity_diff = agree.max_abs_diff
        if not agree.passed:
            raise ParityMismatch(
                f"model {self.config.name!r}: ONNX graphs in {self.graph_dir} differ from the torch checkpoint "
                f"{self.config.path} on the warm-up sources beyond |diff| <= onnx_parity_tolerance + "
                f"onnx_parity_rtol*|ref|: {agree.describe()}; refusing to serve them")
