"""ONNX Runtime encoder backend: the same contract as :class:`TorchBackend`, running an exported graph.

The graph (``model.onnx``) is found, checked (owner, mode, sha256, provenance) or exported on first load by
:mod:`.graph_cache`; the session is made from the verified bytes, on the providers :mod:`.onnx_session`
picks for the model's device.
Inputs and outputs go through IO binding as torch tensors on the session's device
(:func:`relserve.models.onnx.runtime.run_bound`): on CUDA no extra host copy, and the CPU runs the same code.

At load the graph and the torch checkpoint run the warm-up batch (a short sequence and a full-length one
striding through the vocabulary); when somewhere ``|graph - torch| > onnx_parity_tolerance + onnx_parity_rtol *
|torch|`` the model is refused with :class:`GraphMismatch`.

``dtype: int8`` (explicit only): after the float32 graph has loaded and passed that self-check, its int8 version
(:mod:`relserve.models.onnx.quantize`: dynamic quantization of the MatMul/Gemm weights) is found in, or written
to, its own cache entry (``<checkpoint sha256>-int8-q1``, sha256 recorded and verified like the float32 graph's)
and opened. The self-check does not apply to it (int8 differs from torch by far more than a float32 tolerance);
instead the agreement gate of :mod:`.precision` runs at load, warm-up or not: the float32 torch model and the
int8 graph run the gate text, and the int8 graph serves only when they agree (same argmax label / best QA span
on >= ``dtype_gate_agreement`` of the items, no probability apart by more than ``dtype_gate_max_prob_diff``);
otherwise the float32 graph serves, and ``dtype_reason`` and a WARNING say why, with the numbers. int8 runs on
the CPU provider; how much faster it is depends on the CPU (VNNI or not, see the quantize module).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from relserve.models.checkpoint import checkpoint_hash, load_checkpoint
from relserve.models.onnx.export import export_checkpoint, graph_io_names
from relserve.models.onnx.quantize import CACHE_VARIANT, RECIPE, quantize_graph
from relserve.models.onnx.runtime import EXPORT_VERSION, GRAPH_NAME, make_session, run_bound
from relserve.models.onnx.tolerance import Agreement

from ..config import ModelConfig
from ..errors import ConfigError
from . import precision
from .base import (TASK_CLASSIFICATION, TASK_QA, TASK_TOKEN_CLASSIFICATION, UNBUDGETED, CallBudget,
                   EncoderBackendDefaults, ModelMeta)
from .graph_cache import GraphMismatch, ParityMismatch, check_graph_origin, load_graphs
from .onnx_session import ONNX_DTYPE_REASON, open_with_native_fallback, provider_device, select_providers
from .padding import WarmupEncoding, pad_batch, probe_encodings

log = logging.getLogger(__name__)


class OnnxBackend(EncoderBackendDefaults):
    """Encoder backend over an exported ONNX graph; the contract is :class:`relserve.service.backends.base.Backend`."""

    name = "onnxruntime"
    is_padded = True
    max_batch_size: int | None = None
    can_probe = True

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
        if loaded.task not in (TASK_CLASSIFICATION, TASK_QA, TASK_TOKEN_CLASSIFICATION):
            raise ConfigError(f"model {name!r}: task {loaded.task!r} is not served")
        self._pad_id = int(getattr(tok, "pad_token_id", 0) or 0)
        self._vocab_size = int(cfg.vocab_size)
        labels: tuple[str, ...] = ()
        if loaded.task != TASK_QA:  # sequence and token classification: labels in id order
            labels = tuple(str(cfg.id2label.get(i, f"LABEL_{i}")) for i in range(cfg.num_labels))
        limits = [x for x in (getattr(tok, "model_max_length", None), cfg.max_position_embeddings) if x]
        max_positions = int(min(limits)) if limits else None
        self.max_seq_len = self.config.resolved_max_seq_len(max_positions)

        def export(tmp: Path) -> None:
            export_checkpoint(self.config.path, tmp, parity=False, loaded=loaded,
                              progress=lambda m: log.info("model %r: %s", name, m))

        want_in, want_out = graph_io_names(cfg, loaded.task)
        fp32_bytes: list[bytes] = []  # the verified float32 graph, which dtype: int8 quantizes

        def open_and_check(d: Path, digest: str, graphs: Mapping[str, bytes]) -> str | None:
            self.graph = d / GRAPH_NAME
            self.session, lib = self._open_session(graphs[GRAPH_NAME], providers, self.graph, digest, want_in,
                                                   want_out, loaded.task)
            self.provider = self.session.get_providers()[0]
            self.device, device = provider_device(providers, self.provider)
            self._inputs = [i.name for i in self.session.get_inputs()]
            self._outputs = [o.name for o in self.session.get_outputs()]
            fp32_bytes[:] = [graphs[GRAPH_NAME]]
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
        if self.config.dtype == "int8":
            self._load_int8(fp32_bytes[0], providers, loaded, want_in, want_out)
        return self.meta

    def _open_session(self, graph: bytes, providers: list, path: Path, digest: str, want_in: list[str],
                      want_out: list[str], task: str) -> tuple[Any, str | None]:
        """(session, native library or None) over verified graph bytes, checked for provenance and IO names.

        Raises:
            GraphMismatch: the graph names another checkpoint, or has other inputs / outputs than the task needs.
        """
        session, lib = open_with_native_fallback(self.config.name, lambda native: make_session(
            graph, providers=providers, intra_op_threads=self.config.onnx_intra_op_threads,
            graph_optimization=self.config.onnx_graph_optimization, native_library=native))
        check_graph_origin(self.config, session, path, digest)
        got_in, got_out = [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
        if got_in != want_in or got_out != want_out:
            raise GraphMismatch(f"model {self.config.name!r}: graph {path} has inputs {got_in} and outputs "
                                f"{got_out}, but the checkpoint's {task} model needs {want_in} -> {want_out}")
        return session, lib

    def _load_int8(self, fp32_graph: bytes, providers: list, loaded: Any, want_in: list[str],
                   want_out: list[str]) -> None:
        """``dtype: int8``: open the int8 graph (quantized from ``fp32_graph`` into its own cache entry on first
        load) and keep it only if it passes the agreement gate against the float32 torch model (module doc).

        Raises:
            GraphMismatch: the int8 cache entry is refused even after one re-quantization.
        """
        name = self.config.name
        fp32_session, fp32_graph_path = self.session, self.graph
        checkpoint_sha256 = checkpoint_hash(self.config.path, EXPORT_VERSION)  # what the graphs' metadata records

        def export(tmp: Path) -> None:
            log.info("model %r: quantizing %s to int8 (onnxruntime dynamic quantization)", name, fp32_graph_path)
            quantize_graph(fp32_graph, tmp, checkpoint_sha256=checkpoint_sha256)

        def open_and_check(d: Path, digest: str, graphs: Mapping[str, bytes]) -> Any:
            return self._open_session(graphs[GRAPH_NAME], providers, d / GRAPH_NAME, digest, want_in, want_out,
                                      loaded.task)[0]

        int8_session, entry = load_graphs(self.config, (GRAPH_NAME,), export, open_and_check, variant=CACHE_VARIANT)
        int8_graph = entry / GRAPH_NAME
        gate_run = [lambda batch: self._torch_run(loaded.model, batch)]  # the reference: float32 torch

        def outcomes(items: list[dict[str, str]]) -> list[precision.Outcome]:
            return precision.encoder_outcomes(self.meta.task, items, tokenizer=self.meta.tokenizer, run=gate_run[0],
                                              config=self.config, max_seq_len=self.max_seq_len,
                                              problem_type=self.meta.problem_type)

        def use_int8() -> None:
            self.session, self.graph = int8_session, int8_graph
            gate_run[0] = self.run

        def use_float32() -> None:
            self.session, self.graph = fp32_session, fp32_graph_path

        weights = ("per-channel" if RECIPE["per_channel"] else "per-tensor") + (" 7-bit" if RECIPE["reduce_range"]
                                                                                  else "")
        plan = precision.Plan("float32", f"int8 graph {int8_graph} (onnxruntime dynamic quantization, {weights} "
                                         f"QInt8 MatMul/Gemm weights) vs the float32 torch model", gate=True)
        dtype, reason = precision.decide(self.config, plan, self.meta.task, outcomes, use_int8, use_float32,
                                         candidate="int8")
        if dtype != "int8":
            use_float32()  # whatever the gate's path, the float32 graph (self-checked above) serves
            log.warning("model %r: %s; serving the float32 graph %s", name, reason, fp32_graph_path)
            reason += f"; serving the float32 graph {fp32_graph_path}"
        # (the runner logs the dtype and its reason once the model has loaded)
        self.meta = dataclasses.replace(self.meta, dtype=dtype, dtype_reason=reason,
                                        extra={**self.meta.extra, "graph": os.fspath(self.graph)})

    def _warmup_batch(self) -> list[Any]:
        tok = self.meta.tokenizer
        cls_id = int(getattr(tok, "cls_token_id", 1) or 1)
        sep_id = int(getattr(tok, "sep_token_id", 2) or 2)
        # The long item strides through the whole vocabulary, so the self-check reads embedding rows everywhere.
        span = max(1, self._vocab_size - 5)
        spread = [5 + (i * 7919) % span for i in range(self.max_seq_len - 2)]
        return [WarmupEncoding([cls_id, 5, 6, 7, sep_id]), WarmupEncoding([cls_id] + spread + [sep_id])]

    def _torch_run(self, model, batch: Sequence[Any]) -> list[Any]:
        """The float32 torch checkpoint on ``batch``, fed what the graph is fed; results as :meth:`run` gives
        them (the reference of the self-check and of the int8 agreement gate)."""
        feeds = self._feeds(batch)
        with torch.inference_mode():
            out = model(*(torch.from_numpy(feeds[k]) for k in self._inputs))
        if self.meta.task == TASK_CLASSIFICATION:
            logits = out.float().numpy()
            return [logits[i].copy() for i in range(len(batch))]
        if self.meta.task == TASK_TOKEN_CLASSIFICATION:
            per_token = out.float().numpy()  # [B, T, num_labels]
            return [per_token[i, :len(it.input_ids)].copy() for i, it in enumerate(batch)]
        start, end = (o.float().numpy() for o in out)
        return [(start[i, :len(it.input_ids)].copy(), end[i, :len(it.input_ids)].copy()) for i, it in enumerate(batch)]

    def _self_check(self, model) -> None:
        """Graph vs torch on the warm-up batch; raises GraphMismatch beyond the tolerance."""
        batch = self._warmup_batch()
        got = self.run(batch)
        want = self._torch_run(model, batch)
        agree = Agreement(self.config.onnx_parity_tolerance, self.config.onnx_parity_rtol)
        for g, w in zip(got, want):
            for a, b in (zip(g, w) if self.meta.task == TASK_QA else ((g, w),)):
                agree.add(a, b)
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
        return {k: all_feeds[k] for k in self._inputs}  # only what the graph declares

    def _run_session(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Inputs and outputs bound as torch tensors on the session's device (IO binding; the same path on
        CPU and CUDA, so the CPU tests exercise it)."""
        dev = torch.device(self.device)
        B, T = feeds["input_ids"].shape
        width = {TASK_CLASSIFICATION: (len(self.meta.labels),),
                 TASK_TOKEN_CLASSIFICATION: (T, len(self.meta.labels))}.get(self.meta.task, (T,))
        outs = {k: torch.empty((B,) + width, dtype=torch.float32, device=dev) for k in self._outputs}
        run_bound(self.session, {k: torch.from_numpy(v).to(dev) for k, v in feeds.items()}, outs)
        return [o.cpu().numpy() for o in outs.values()]

    def run(self, batch: Sequence[Any], budget: CallBudget = UNBUDGETED) -> list[Any]:
        """One batch; ``budget`` is not read (ONNX Runtime's pool is sized once, when the session is made)."""
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
        if self.meta.task == TASK_TOKEN_CLASSIFICATION:  # [B, T, num_labels] -> each item's own tokens
            return [logits[i, :n].copy() for i, n in enumerate(lengths)]
        return [logits[i].copy() for i in range(len(batch))]

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        return {}  # ONNX Runtime's arena is not observable from Python

    def close(self) -> None:
        self.session = None
