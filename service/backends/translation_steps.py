"""Beam-step bookkeeping of a translation backend: the step contract over any model with the RNNsearch
step API (``encode`` / ``decode_step``: :class:`relserve.models.rnnsearch.RNNSearch` or
:class:`relserve.models.onnx.runtime.OrtRNNSearch`). Both translation backends own one :class:`BeamStepper`;
only the model they give it differs.

``start`` pads a batch of sources, runs ``model.encode`` once and creates one ``BeamState`` per source
(kept here, by sequence id); ``step`` stacks the planned beams' encoder states (cached while the set of
sequences is unchanged), runs one ``model.decode_step`` and lets ``apply_step`` update each beam from its
own rows (:mod:`relserve.models.decoding`), so a sequence decodes the same whatever else is in the step.
Rows with NaN log-probabilities fail only their own sequence. Everything returned is plain Python / numpy.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

import numpy as np
import torch

from relserve.models.decode_types import DecodeOptions, Hypothesis
from relserve.models.decoding import BeamState, StepBatch, apply_step, build_step, start_beams
from relserve.models.rnnsearch import EncoderState

from ..errors import Internal
from .base import UNBUDGETED, BackendDefaults, CallBudget, SeqUpdate, StartItem, StepPlan
from .torch_device import cuda_memory_stats, release_cuda_cache, use_threads


class BeamStepper:
    """The live beams of one translation model, by sequence id (the decode loop's ``StartItem.seq_id``).

    Args:
        name: the served model's name (error messages).
        model: anything with ``config`` (pad / bos / eos ids), ``encode(src_ids Long[B,S], src_mask Bool[B,S])
            -> EncoderState`` and ``decode_step(state, source_index Long[N], prev_tokens Long[N],
            prev_hidden Float[N,n]) -> (log_probs Float[N,V], new_hidden Float[N,n], alignment Float[N,S])``.
        device: where the model's input tensors go (``"cpu"``, ``"cuda:N"``).

    Calls may come from the executor thread and from ``close`` on the event loop; a lock serialises them.
    """

    def __init__(self, name: str, model: Any, device: str) -> None:
        self.name = name
        self.model = model
        self.device = device
        self.beams: dict[int, BeamState] = {}
        self._stack: tuple[tuple[int, ...], EncoderState] | None = None  # (seq ids, their stacked encoders)
        self._lock = threading.Lock()

    @torch.inference_mode()
    def start(self, items: Sequence[StartItem]) -> list[int | Exception]:
        """Encode ``items`` as one right-padded batch; per item its live hypotheses (1)."""
        cfg = self.model.config
        lengths = [len(it.source_ids) for it in items]
        ids = np.full((len(items), max(lengths)), int(cfg.pad_token_id), dtype=np.int64)
        mask = np.zeros(ids.shape, dtype=bool)
        for i, it in enumerate(items):
            ids[i, : lengths[i]] = it.source_ids
            mask[i, : lengths[i]] = True
        with self._lock:
            state = self.model.encode(torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device))
            beams = start_beams(self.model, state, [it.options for it in items],
                                request_ids=[it.seq_id for it in items])
            for it, beam in zip(items, beams):
                self.beams[it.seq_id] = beam
        return [b.num_live for b in beams]

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> list[SeqUpdate | Exception]:
        """One decoder step over the planned sequences; one update (or Exception) per sequence, in order."""
        with self._lock:
            out: list[SeqUpdate | Exception | None] = [None] * len(plan.seq_ids)
            beams, where = [], []
            for i, sid in enumerate(plan.seq_ids):
                beam = self.beams.get(sid)
                if beam is None or beam.done:
                    out[i] = Internal(f"model {self.name!r}: text {sid} is not being decoded")
                else:
                    beams.append(beam)
                    where.append(i)
            if beams:
                self._advance(beams, where, out)
            return out  # type: ignore[return-value]

    def _advance(self, beams: list[BeamState], where: list[int], out: list) -> None:
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
                out[i] = Internal(f"model {self.name!r} produced NaN log-probabilities")
                self.beams.pop(beam.request_id, None)
        if good:  # the NaN sequences' rows are skipped, not read
            sub = StepBatch(beams=[beams[r] for r in good], encoder=batch.encoder, source_index=batch.source_index,
                            prev_tokens=batch.prev_tokens, prev_hidden=batch.prev_hidden,
                            spans=[batch.spans[r] for r in good])
            apply_step(sub, log_probs, new_hidden, alignment)
        for r in good:
            beam, i = beams[r], where[r]
            out[i] = _update(beam)
            if beam.done:
                self.beams.pop(beam.request_id, None)

    def release(self, seq_ids: Sequence[int]) -> None:
        """Forget these sequences; unknown ids are ignored."""
        with self._lock:
            for sid in seq_ids:
                self.beams.pop(sid, None)
            if self._stack is not None and not set(self._stack[0]) <= set(self.beams):
                self._stack = None

    def clear(self) -> None:
        """Forget every sequence (the backend is closing)."""
        with self._lock:
            self.beams.clear()
            self._stack = None

    def warmup(self) -> None:
        """Encode two short sources and decode them to the end with a beam of 2 (at most 4 tokens).

        Raises:
            Exception: whatever a start or a step reported for the warm-up sources.
        """
        cfg = self.model.config
        eos, v = int(cfg.eos_token_id), int(cfg.src_vocab_size)
        options = DecodeOptions(beam_size=2, n_best=1, max_length=4)
        items = [StartItem(-1, [min(i, v - 1) for i in (4, 5, 6)] + [eos], options),
                 StartItem(-2, [min(7, v - 1), eos], options)]
        for r in self.start(items):
            if isinstance(r, Exception):
                raise r
        live = [-1, -2]
        try:
            while live:
                ups = self.step(StepPlan(tuple(live), tuple(self.beams[i].num_live for i in live)))
                for u in ups:
                    if isinstance(u, Exception):
                        raise u
                live = [i for i, u in zip(live, ups) if u.results is None]
        finally:
            self.release([-1, -2])


def _update(beam: BeamState) -> SeqUpdate:
    """The plain-data view of one beam after a step."""
    if beam.done:
        results = [_plain(h) for h in beam.results or []]
        best = results[0] if results else None
        return SeqUpdate(live=0, best_tokens=best.output_tokens if best else [],
                         best_score=best.log_prob if best else 0.0, results=results)
    return SeqUpdate(live=beam.num_live, best_tokens=list(beam.tokens[0]), best_score=float(beam.scores[0]))


def _plain(h: Hypothesis) -> Hypothesis:
    """The hypothesis with its alignment as a float32 numpy array (off the model's device)."""
    if h.alignment is None:
        return h
    return dataclasses.replace(h, alignment=h.alignment.float().cpu().numpy().astype(np.float32))


class SteppedBackend(BackendDefaults):
    """The step contract and lifecycle tail both translation backends share, over their :class:`BeamStepper`.

    A backend sets ``config`` (its ``ModelConfig``), ``device``, ``model`` and, in ``load()``, ``stepper``;
    this class adds ``warmup`` / ``memory_stats`` / ``close`` and ``start`` / ``step`` / ``release``
    (:class:`relserve.service.backends.base.StepBackend`). Only loading differs between torch and ONNX Runtime.
    """

    config: Any
    device: Any
    model: Any
    stepper: BeamStepper | None

    def warmup(self) -> None:
        """Encode two short sources and decode them a few steps with a beam of 2."""
        self._stepper().warmup()

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        # the tensors torch holds (ONNX Runtime binds them by pointer; its own arena is not observable)
        return cuda_memory_stats(self.device)

    def close(self) -> None:
        if self.stepper is not None:
            self.stepper.clear()
        self.stepper = None
        self.model = None
        release_cuda_cache(self.device)

    def _stepper(self) -> BeamStepper:
        if self.stepper is None:
            raise RuntimeError(f"model {self.config.name!r}: translation backend used before load()")
        return self.stepper

    def start(self, items: Sequence[StartItem], budget: CallBudget = UNBUDGETED) -> list[int | Exception]:
        use_threads(self.config.torch_intra_op_threads or budget.threads())
        return self._stepper().start(items)

    def step(self, plan: StepPlan, budget: CallBudget = UNBUDGETED) -> list[SeqUpdate | Exception]:
        use_threads(self.config.torch_intra_op_threads or budget.threads())
        return self._stepper().step(plan)

    def release(self, seq_ids: Sequence[int]) -> None:
        if self.stepper is not None:
            self.stepper.release(seq_ids)
