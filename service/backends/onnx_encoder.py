"""ONNX Runtime encoder backend: the same contract as :class:`TorchBackend`, running an exported graph.

The graph (``model.onnx``) is found, checked (owner, mode, sha256, provenance) or exported on first load by
:mod:`.graph_cache`; the session is made from the verified bytes, on the providers :mod:`.onnx_session`
picks for the model's device.
Inputs and outputs go through IO binding as torch tensors on the session's device
(:func:`relserve.models.onnx.runtime.run_bound`): on CUDA no extra host copy, and the CPU runs the same code.

At load the graph and the torch checkpoint run the warm-up batch (a short sequence and a full-length one
striding through the vocabulary); when somewhere ``|graph - torch| > onnx_parity_tolerance + onnx_parity_rtol *
|torch|`` the model is refused with :class:`GraphMismatch`.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from relserve.models.checkpoint import load_checkpoint
from relserve.models.onnx.export import export_checkpoint, graph_io_names
from relserve.models.onnx.runtime import GRAPH_NAME, make_session, run_bound
from relserve.models.onnx.tolerance import Agreement

from ..config import ModelConfig
from ..errors import ConfigError
from .base import TASK_CLASSIFICATION, TASK_QA, ModelMeta
from .graph_cache import GraphMismatch, ParityMismatch, check_graph_origin, load_graphs
from .onnx_session import ONNX_DTYPE_REASON, open_with_native_fallback, provider_device, select_providers
from .padding import WarmupEncoding, pad_batch, probe_encodings

log = logging.getLogger(__name__)


class OnnxBackend:
    """Encoder backend over an exported ONNX graph; the contract is :class:`relserve.service.backends.base.Backend`."""

    name = "onnxruntime"
    is_padded = True
    max_batch_size: int | None = None

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.session: Any = None
        self.meta: ModelMeta | None = None
        self.graph: Path | None = None
        self.provider = "CPUExecutionProvider"
        self.device = "cpu"
        self.max_seq_len = 0
        self.parity_diff: float | None = None
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        self._pad_id = 0
        self._vocab_size = 6
        self._lock = threading.Lock()

    # -------------------------------------------------------------- loading

    def load(self) -> ModelMeta:
        name = self.config.name
        providers = select_providers(self.config)
        loaded = load_checkpoint(self.config.path, device="cpu", spm_normalization=self.config.spm_normalization)
        cfg, tok = loaded.config, loaded.tokenizer
        if loaded.task not in (TASK_CLASSIFICATION, TASK_QA):
            raise ConfigError(f"model {name!r}: task {loaded.task!r} is not served")
        self._pad_id = int(getattr(tok, "pad_token_id", 0) or 0)
        self._vocab_size = int(cfg.vocab_size)
        labels: tuple[str, ...] = ()
        if loaded.task == TASK_CLASSIFICATION:
            labels = tuple(str(cfg.id2label.get(i, f"LABEL_{i}")) for i in range(cfg.num_labels))
        limits = [x for x in (getattr(tok, "model_max_length", None), cfg.max_position_embeddings) if x]
        max_positions = int(min(limits)) if limits else None
        self.max_seq_len = self.config.resolved_max_seq_len(max_positions)

        def export(tmp: Path) -> None:
            export_checkpoint(self.config.path, tmp, parity=False, loaded=loaded,
                              progress=lambda m: log.info("model %r: %s", name, m))

        def open_and_check(d: Path, digest: str, graphs: Mapping[str, bytes]) -> str | None:
            self.graph = d / GRAPH_NAME
            self.session, lib = open_with_native_fallback(name, lambda native: make_session(
                graphs[GRAPH_NAME], providers=providers, intra_op_threads=self.config.onnx_intra_op_threads,
                graph_optimization=self.config.onnx_graph_optimization, native_library=native))
            check_graph_origin(self.config, self.session, self.graph, digest)
            self.provider = self.session.get_providers()[0]
            self.device, device = provider_device(providers, self.provider)
            self._inputs = [i.name for i in self.session.get_inputs()]
            self._outputs = [o.name for o in self.session.get_outputs()]
            want_in, want_out = graph_io_names(cfg, loaded.task)
            if self._inputs != want_in or self._outputs != want_out:
                raise GraphMismatch(f"model {name!r}: graph {self.graph} has inputs {self._inputs} and outputs "
                                    f"{self._outputs}, but the checkpoint's {loaded.task} model needs {want_in} -> "
                                    f"{want_out}")
            self.meta = ModelMeta(
                task=loaded.task, family=cfg.model_type, backend=self.name, device=device, dtype="float32",
                dtype_reason=f"dtype: {self.config.dtype}; {ONNX_DTYPE_REASON}", tokenizer=tok, labels=labels,
                problem_type=cfg.problem_type, max_positions=max_positions,
                extra={"graph": os.fspath(self.graph), "native_ops": bool(lib)},
            )
            self._self_check(loaded.model)
            return lib

        lib, _ = load_graphs(self.config, (GRAPH_NAME,), export, open_and_check)
        log.info("model %r: ONNX Runtime %s on %s (%s custom ops), parity %.2e", name, self.graph, self.provider,
                 "native" if lib else "portable", self.parity_diff)
        return self.meta

    def _warmup_batch(self) -> list[Any]:
        tok = self.meta.tokenizer
        cls_id = int(getattr(tok, "cls_token_id", 1) or 1)
        sep_id = int(getattr(tok, "sep_token_id", 2) or 2)
        # The long item strides through the whole vocabulary, so the self-check reads embedding rows everywhere.
        span = max(1, self._vocab_size - 5)
        spread = [5 + (i * 7919) % span for i in range(self.max_seq_len - 2)]
        return [WarmupEncoding([cls_id, 5, 6, 7, sep_id]), WarmupEncoding([cls_id] + spread + [sep_id])]

    def _self_check(self, model) -> None:
        """Graph vs torch on the warm-up batch; raises GraphMismatch beyond the tolerance."""
        batch = self._warmup_batch()
        got = self.run(batch)
        feeds = self._feeds(batch)
        with torch.inference_mode():
            out = model(*(torch.from_numpy(feeds[k]) for k in self._inputs))
        outs = [out] if self.meta.task == TASK_CLASSIFICATION else list(out)
        want = [o.float().numpy() for o in outs]
        agree = Agreement(self.config.onnx_parity_tolerance, self.config.onnx_parity_rtol)
        for i, item in enumerate(batch):
            n = len(item.input_ids)
            if self.meta.task == TASK_CLASSIFICATION:
                agree.add(got[i], want[0][i])
            else:
                for k in range(2):
                    agree.add(got[i][k], want[k][i, :n])
        self.parity_diff = agree.max_abs_diff
        if not agree.passed:
            raise ParityMismatch(
                f"model {self.config.name!r}: ONNX graph {self.graph} differs from the torch checkpoint "
                f"{self.config.path} on the warm-up batch beyond |diff| <= onnx_parity_tolerance + "
                f"onnx_parity_rtol*|ref|: {agree.describe()}; refusing to serve it")

    # -------------------------------------------------------------- contract

    def warmup(self) -> None:
        if self.meta is None:
            raise RuntimeError("warmup() before load()")
        for res in self.run(self._warmup_batch()):
            if isinstance(res, Exception):
                raise res

    def probe_batch(self, lengths: Sequence[int]) -> list[Any]:
        """Synthetic items of exactly ``lengths`` tokens (the warm-up probes of the batch cost model)."""
        if self.meta is None:
            raise RuntimeError("probe_batch() before load()")
        return probe_encodings(self.meta.tokenizer, lengths)

    def _feeds(self, batch: Sequence[Any]) -> dict[str, np.ndarray]:
        ids, mask, types = pad_batch(batch, self._pad_id)
        all_feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return {k: all_feeds[k] for k in self._inputs}  # only what the graph declares (C02)

    def _run_session(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Inputs and outputs bound as torch tensors on the session's device (IO binding; the same path on
        CPU and CUDA, so the CPU tests exercise it)."""
        dev = torch.device(self.device)
        B, T = feeds["input_ids"].shape
        width = (len(self.meta.labels),) if self.meta.task == TASK_CLASSIFICATION else (T,)
        outs = {k: torch.empty((B,) + width, dtype=torch.float32, device=dev) for k in self._outputs}
        run_bound(self.session, {k: torch.from_numpy(v).to(dev) for k, v in feeds.items()}, outs)
        return [o.cpu().numpy() for o in outs.values()]

    def run(self, batch: Sequence[Any]) -> list[Any]:
        if self.session is None or self.meta is None:
            raise RuntimeError("run() before load()")
        lengths = [len(item.input_ids) for item in batch]
        feeds = self._feeds(batch)
        with self._lock:
            outs = self._run_session(feeds)
        if self.meta.task == TASK_QA:
            start, end = (np.asarray(o, dtype=np.float32) for o in outs)
            return [(start[i, :n].copy(), end[i, :n].copy()) for i, n in enumerate(lengths)]
        logits = np.asarray(outs[0], dtype=np.float32)
        return [logits[i].copy() for i in range(len(batch))]

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        return {}  # ONNX Runtime's arena is not observable from Python

    def close(self) -> None:
        self.session = None
