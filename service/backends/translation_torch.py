"""PyTorch step backend for RNNsearch translation checkpoints (the decode loop's model side).

Implements :class:`relserve.service.decode_loop.StepBackend` over ``relserve.models.decoding``: ``start``
pads a batch of sources, runs ``model.encode`` once and creates one ``BeamState`` per source (kept here,
by sequence id); ``step`` stacks the planned beams' encoder states (cached while the set of sequences is
unchanged), runs one ``model.decode_step`` and lets ``apply_step`` update each beam from its own rows, so a
sequence decodes the same whatever else is in the step. Rows with NaN log-probabilities fail only their
own sequence. Everything returned is plain Python / numpy.

``loader`` is a seam for tests: ``(path, device=, dtype=) -> (model, config, tokenizer)``; default
``relserve.models.checkpoint.load_translation_checkpoint``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import numpy as np
import torch

from relserve.models.decoding import BeamState, DecodeOptions, Hypothesis, StepBatch, apply_step, build_step, start_beams
from relserve.models.rnnsearch import EncoderState

from ..config import ModelConfig, check_dtype_for_device
from ..decode_loop import DecodeParams, HypothesisOut, SeqUpdate, StartItem, StepPlan
from ..errors import Internal
from . import TASK_TRANSLATION, ModelMeta
from .torch_backend import _DTYPES, resolve_device

log = logging.getLogger(__name__)

Loader = Callable[..., tuple[Any, Any, Any]]


def decode_options(p: DecodeParams) -> DecodeOptions:
    """A fixed ``max_length`` expressed in the decoding module's formula (a = 0, b = cap = max_length)."""
    return DecodeOptions(beam_size=p.beam_size, n_best=p.n_best, length_penalty=p.length_penalty,
                         max_len_a=0.0, max_len_b=p.max_length, max_len_cap=p.max_length,
                         return_alignment=p.return_alignment)


class TorchTranslationBackend:
    name = "torch"
    is_padded = True
    max_batch_size: int | None = None

    def __init__(self, config: ModelConfig, loader: Loader | None = None) -> None:
        self.config = config
        self._loader = loader
        self.device = "cpu"
        self.dtype = _DTYPES[config.dtype]
        self.model: Any = None
        self.model_config: Any = None
        self.tokenizer: Any = None
        self.meta: ModelMeta | None = None
        self._beams: dict[int, BeamState] = {}
        self._stack: tuple[tuple[int, ...], EncoderState] | None = None
        self._lock = threading.Lock()

    # -------------------------------------------------------------- lifecycle

    def load(self) -> ModelMeta:
        loader = self._loader
        if loader is None:
            from relserve.models.checkpoint import load_translation_checkpoint as loader
        self.device = resolve_device(self.config.name, self.config.device)
        check_dtype_for_device(self.config.name, self.config.dtype, self.device)
        self.model, self.model_config, self.tokenizer = loader(self.config.path, device=self.device, dtype=self.dtype)
        self.model.eval()
        kind = "bigru" if getattr(self.model_config, "encoder_type", "bigru") == "bigru" else "deberta"
        self.meta = ModelMeta(
            task=TASK_TRANSLATION, family=f"rnnsearch-{kind}", backend=self.name, device=self.device,
            dtype=self.config.dtype, tokenizer=self.tokenizer, max_positions=None,
            extra={"eos_token_id": int(self.model_config.eos_token_id)},
        )
        log.info("model %r: loaded translation model %s (%s encoder) on %s as %s", self.config.name,
                 self.config.path, kind, self.device, self.config.dtype)
        return self.meta

    def warmup(self) -> None:
        """Encode two short sources and decode them a few steps with a beam of 2."""
        eos = int(self.model_config.eos_token_id)
        v = int(self.model_config.src_vocab_size)
        params = DecodeParams(beam_size=2, n_best=1, max_length=4)
        items = [StartItem(-1, [min(i, v - 1) for i in (4, 5, 6)] + [eos], params), StartItem(-2, [min(7, v - 1), eos], params)]
        for r in self.start(items):
            if isinstance(r, Exception):
                raise r
        live = [-1, -2]
        try:
            while live:
                plan = StepPlan(tuple(live), tuple(self._beams[i].num_live for i in live))
                ups = self.step(plan)
                for u in ups:
                    if isinstance(u, Exception):
                        raise u
                live = [i for i, u in zip(live, ups) if u.results is None]
        finally:
            self.release([-1, -2])

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        if not self.device.startswith("cuda"):
            return {}
        dev = torch.device(self.device)
        return {self.device: (int(torch.cuda.memory_allocated(dev)), int(torch.cuda.memory_reserved(dev)),
                              int(torch.cuda.max_memory_allocated(dev)))}

    def close(self) -> None:
        with self._lock:
            self._beams.clear()
            self._stack = None
            self.model = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    # -------------------------------------------------------------- step contract

    @torch.inference_mode()
    def start(self, items: Sequence[StartItem]) -> list[int | Exception]:
        if self.model is None:
            raise RuntimeError("start() before load()")
        cfg = self.model_config
        lengths = [len(it.source_ids) for it in items]
        longest = max(lengths)
        ids = np.full((len(items), longest), int(cfg.pad_token_id), dtype=np.int64)
        mask = np.zeros((len(items), longest), dtype=bool)
        for i, it in enumerate(items):
            ids[i, : lengths[i]] = it.source_ids
            mask[i, : lengths[i]] = True
        with self._lock:
            state = self.model.encode(torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device))
            beams = start_beams(self.model, state, [decode_options(it.params) for it in items],
                                request_ids=[it.seq_id for it in items])
            for it, beam in zip(items, beams):
                self._beams[it.seq_id] = beam
        return [b.num_live for b in beams]

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> list[SeqUpdate | Exception]:
        if self.model is None:
            raise RuntimeError("step() before load()")
        with self._lock:
            out: list[SeqUpdate | Exception | None] = [None] * len(plan.seq_ids)
            beams, where = [], []
            for i, sid in enumerate(plan.seq_ids):
                beam = self._beams.get(sid)
                if beam is None or beam.done:
                    out[i] = Internal(f"model {self.config.name!r}: text {sid} is not being decoded")
                else:
                    beams.append(beam)
                    where.append(i)
            if beams:
                key = tuple(b.request_id for b in beams)
                encoder = self._stack[1] if self._stack is not None and self._stack[0] == key else None
                if encoder is None:
                    encoder = EncoderState.cat([b.encoder for b in beams])
                    self._stack = (key, encoder)
                batch = build_step(beams, encoder)
                log_probs, new_hidden, alignment = self.model.decode_step(
                    batch.encoder, batch.source_index, batch.prev_tokens, batch.prev_hidden
                )
                row_nan = torch.isnan(log_probs).any(dim=1).tolist()
                good = [r for r, (lo, hi) in enumerate(batch.spans) if not any(row_nan[lo:hi])]
                for r, (beam, i) in enumerate(zip(beams, where)):
                    if r not in good:
                        out[i] = Internal(f"model {self.config.name!r} produced NaN log-probabilities")
                        self._beams.pop(beam.request_id, None)
                if good:
                    sub = StepBatch(beams=[beams[r] for r in good], encoder=batch.encoder,
                                    source_index=batch.source_index, prev_tokens=batch.prev_tokens,
                                    prev_hidden=batch.prev_hidden, spans=[batch.spans[r] for r in good])
                    apply_step(sub, log_probs, new_hidden, alignment)
                for r in good:
                    beam, i = beams[r], where[r]
                    out[i] = self._update(beam)
                    if beam.done:
                        self._beams.pop(beam.request_id, None)
            return out  # type: ignore[return-value]

    def release(self, seq_ids: Sequence[int]) -> None:
        with self._lock:
            for sid in seq_ids:
                self._beams.pop(sid, None)
            if self._stack is not None and not set(self._stack[0]) <= set(self._beams):
                self._stack = None

    # -------------------------------------------------------------- conversion to plain data

    def _update(self, beam: BeamState) -> SeqUpdate:
        if beam.done:
            results = [self._hypothesis(h, beam.eos_token_id) for h in beam.results or []]
            best = results[0] if results else None
            return SeqUpdate(live=0, best_tokens=list(best.token_ids) if best else [],
                             best_score=best.log_prob if best else 0.0, results=results)
        return SeqUpdate(live=beam.num_live, best_tokens=beam.tokens[0].tolist(), best_score=float(beam.scores[0]))

    @staticmethod
    def _hypothesis(h: Hypothesis, eos: int) -> HypothesisOut:
        alignment = None
        if h.alignment is not None:
            alignment = h.alignment.float().cpu().numpy().astype(np.float32)
        return HypothesisOut(token_ids=h.output_tokens(eos), log_prob=float(h.score), score=float(h.normalized_score),
                             finished=bool(h.finished), truncated=bool(h.truncated), alignment=alignment)
