"""PyTorch encoder backend: a classification / QA / token-classification checkpoint from
``relserve.models.checkpoint`` run eagerly under inference_mode (the
:class:`relserve.service.backends.base.Backend` contract). ``dtype: auto`` loads float32 and lets the agreement
gate of :mod:`.precision` switch to bfloat16 after warm-up."""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import torch

from relserve.models.checkpoint import load_checkpoint
from relserve.models.deberta import set_unpadded
from relserve.models.onednn import set_onednn_linear

from ..config import ModelConfig, check_dtype_for_device
from ..errors import ConfigError
from .base import (TASK_CLASSIFICATION, TASK_QA, TASK_TOKEN_CLASSIFICATION, UNBUDGETED, CallBudget,
                   EncoderBackendDefaults, ModelMeta)
from . import precision
from .heap import HeapBound, keep_freed_blocks
from .padding import WarmupEncoding, pad_batch, probe_encodings
from .torch_device import (DTYPES, bound_kernel_caches, cuda_memory_stats, release_cuda_cache, resolve_device,
                           use_threads)
from .torch_yield import add_yield_points

log = logging.getLogger(__name__)


class TorchBackend(EncoderBackendDefaults):
    """Encoder backend over ``load_checkpoint``; the contract is :class:`relserve.service.backends.base.Backend`."""

    name = "torch"
    is_padded = True
    max_batch_size: int | None = None
    can_probe = True
    own_process = False  # set by the worker process that runs this backend alone (worker_child)

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.device = "cpu"
        self.dtype = torch.float32  # what the model runs in (load(): the plan; warmup(): the gate may change it)
        self.plan: precision.Plan | None = None
        self._float32_model: Any = None  # the float32 model while the gate runs its bfloat16 copy
        self.model: Any = None
        self.meta: ModelMeta | None = None
        self.max_seq_len = 0
        self._pad_id = 0
        self._use_token_type = False
        self._lock = threading.Lock()  # one batch at a time even if someone shares the instance
        self._budget = UNBUDGETED  # the running call's (its yield points read it)
        # each new input shape leaves freed heap held; trimmed once it exceeds heap_trim_mb (heap.HeapBound)
        self.heap = HeapBound(config.heap_trim_mb)

    # -------------------------------------------------------------- contract

    def load(self) -> ModelMeta:
        self.device = resolve_device(self.config.name, self.config.device)
        check_dtype_for_device(self.config.name, self.config.dtype, self.device)
        self.plan = precision.plan(self.config, self.device)
        if self.device == "cpu" and self.config.heap_trim_mb > 0:  # before the first forward (warm-up, the gate)
            capped = bound_kernel_caches()
            if capped:
                log.info("model %r: torch CPU kernel caches capped (%s)", self.config.name,
                         ", ".join(f"{k}={v}" for k, v in capped.items()))
            # a process of its own: large activations reused from its heap, which HeapBound keeps bounded (not the
            # server's process, whose gRPC threads and in-process translation models no HeapBound watches)
            if self.own_process and keep_freed_blocks():
                log.info("model %r: large blocks kept on the worker's heap (trimmed above heap_trim_mb %d)",
                         self.config.name, self.config.heap_trim_mb)
        self.dtype = DTYPES[self.plan.dtype]
        ckpt = load_checkpoint(self.config.path, device=self.device, dtype=self.dtype,
                               spm_normalization=self.config.spm_normalization)
        cfg = ckpt.config
        tok = ckpt.tokenizer
        self.model = ckpt.model
        # dense layers on the real tokens of padded batches (torch_unpadded; parity with padded <= 1e-5 fp32)
        if set_unpadded(self.model, self.config.torch_unpadded):
            log.info("model %r: DeBERTa unpadded execution %s (torch_unpadded)", self.config.name,
                     "on" if self.config.torch_unpadded else "off")
        if self.device == "cpu":  # float32 dense layers off MKL's generic sgemm (bfloat16 runs oneDNN already)
            n = set_onednn_linear(self.model, self.config.torch_onednn)
            log.info("model %r: %d dense layers through oneDNN (torch_onednn %s)", self.config.name, n,
                     "on" if self.config.torch_onednn else "off")
        # a long QA batch can hand the cores to another model (or shrink to its share) between sub-layers
        add_yield_points(self.model, lambda: self._budget, threads=self.config.torch_intra_op_threads)
        self._pad_id = int(getattr(tok, "pad_token_id", 0) or 0)
        self._use_token_type = int(getattr(cfg, "type_vocab_size", 0) or 0) > 0
        if ckpt.task not in (TASK_CLASSIFICATION, TASK_QA, TASK_TOKEN_CLASSIFICATION):
            raise ConfigError(f"model {self.config.name!r}: task {ckpt.task!r} is not served")
        labels: tuple[str, ...] = ()
        if ckpt.task != TASK_QA:  # sequence and token classification: labels in id order
            id2label = dict(getattr(cfg, "id2label", None) or {})
            n = int(getattr(cfg, "num_labels", 0) or len(id2label))
            labels = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(n))
        limits = [x for x in (getattr(tok, "model_max_length", None), getattr(cfg, "max_position_embeddings", None))
                  if x]
        max_positions = int(min(limits)) if limits else None
        self.max_seq_len = self.config.resolved_max_seq_len(max_positions)
        self.meta = ModelMeta(
            task=ckpt.task,
            family=str(getattr(cfg, "model_type", None) or "deberta-v2"),
            backend=self.name,
            device=self.device,
            dtype=self.plan.dtype,
            dtype_reason=self.plan.reason + ("; the bfloat16 agreement gate runs at warm-up" if self.plan.gate else ""),
            tokenizer=tok,
            labels=labels,
            problem_type=getattr(cfg, "problem_type", None),
            max_positions=max_positions,
        )
        log.info("model %r: loaded %s (%s) on %s as %s, max_seq_len %d", self.config.name, ckpt.path,
                 ckpt.task, self.device, self.plan.dtype, self.max_seq_len)
        return self.meta

    def warmup(self) -> ModelMeta:
        """A short single sequence, then a small batch at full length (allocates the big buffers); then, for
        ``dtype: auto`` where bfloat16 is native, the agreement gate (:func:`.precision.decide`). Returns the
        model's meta with the dtype that serves and why."""
        if self.meta is None:
            raise RuntimeError("warmup() before load()")
        tok = self.meta.tokenizer
        cls_id = int(getattr(tok, "cls_token_id", 1) or 1)
        sep_id = int(getattr(tok, "sep_token_id", 2) or 2)
        short = WarmupEncoding([cls_id, 5, 6, 7, sep_id])
        full = WarmupEncoding([cls_id] + [5] * (self.max_seq_len - 2) + [sep_id])
        n = max(1, min(2, self.config.max_batch_size, self.config.max_batch_tokens // self.max_seq_len))
        for batch in ([short], [full] * n):
            for res in self.run(batch):
                if isinstance(res, Exception):
                    raise res
        assert self.plan is not None
        precision.gate_torch_backend(self, self.meta.task)
        return self.meta

    def _gate_outcomes(self, items: list[dict[str, str]]) -> list[precision.Outcome]:
        assert self.meta is not None
        return precision.encoder_outcomes(self.meta.task, items, tokenizer=self.meta.tokenizer, run=self.run,
                                          config=self.config, max_seq_len=self.max_seq_len,
                                          problem_type=self.meta.problem_type)

    def _use_bfloat16(self) -> None:
        self._float32_model = self.model
        self.model = precision.to_bfloat16(self.model)
        self.dtype = torch.bfloat16

    def _use_float32(self) -> None:
        if self._float32_model is not None:
            self.model = self._float32_model
        self._float32_model = None
        self.dtype = torch.float32

    def probe_batch(self, lengths: Sequence[int]) -> list[Any]:
        """Synthetic items of exactly ``lengths`` tokens (the warm-up probes of the batch cost model)."""
        if self.meta is None:
            raise RuntimeError("probe_batch() before load()")
        return probe_encodings(self.meta.tokenizer, lengths)

    def run(self, batch: Sequence[Any], budget: CallBudget = UNBUDGETED) -> list[Any]:
        if self.model is None or self.meta is None:
            raise RuntimeError("run() before load()")
        ids, mask, types = pad_batch(batch, self._pad_id)
        lengths = [len(item.input_ids) for item in batch]
        use_threads(self.config.torch_intra_op_threads or budget.threads())
        with self._lock:
            with torch.inference_mode():
                self._budget = budget
                try:
                    out = self._forward(batch, ids, mask, types, lengths)
                finally:
                    self._budget = UNBUDGETED
            self.heap.after_batch()  # the batch's tensors are freed by now (results are numpy copies)
        return out

    def _forward(self, batch: Sequence[Any], ids: Any, mask: Any, types: Any,
                 lengths: list[int]) -> list[Any]:
        """One forward pass (inside ``run``: its lock, inference mode and budget held)."""
        assert self.meta is not None
        kwargs = {
            "input_ids": torch.from_numpy(ids).to(self.device),
            "attention_mask": torch.from_numpy(mask).to(self.device),
        }
        if self._use_token_type:
            kwargs["token_type_ids"] = torch.from_numpy(types).to(self.device)
        out = self.model(**kwargs)
        if self.meta.task == TASK_QA:
            start, end = out[0], out[1]
            start_np = start.float().cpu().numpy()
            end_np = end.float().cpu().numpy()
            return [(start_np[i, :n].copy(), end_np[i, :n].copy()) for i, n in enumerate(lengths)]
        if self.meta.task == TASK_TOKEN_CLASSIFICATION:
            per_token = out.float().cpu().numpy()  # [B, T, num_labels]
            return [per_token[i, :n].copy() for i, n in enumerate(lengths)]
        logits = (out[0] if isinstance(out, (tuple, list)) else out).float().cpu().numpy()
        return [logits[i].copy() for i in range(len(batch))]

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        return cuda_memory_stats(self.device)

    def close(self) -> None:
        self.model = None
        release_cuda_cache(self.device)
