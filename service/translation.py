"""A served translation model: step backend + decode loop + pre/post-processing (no torch here).

:class:`TranslationRunner` shares the lifecycle of every runner (:class:`relserve.service.runner.Runner`:
``load``, ``start``, ``close``, ``info``, ``ready``, ``task``, ``state``), so the registry and the server
treat all runners alike; the servicer validates a request once
(:func:`relserve.service.tasks.translate.validate_translate`, which gives the
:class:`relserve.models.decode_types.DecodeOptions` every text is decoded with) and calls :meth:`translate`
or :meth:`translate_stream`. The request rules are in :mod:`relserve.service.tasks.translate`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from relserve.models.decode_types import DecodeOptions, Hypothesis

from . import metrics
from .backends.base import TASK_TRANSLATION, ModelMeta, SeqUpdate, StepBackend
from .config import ModelConfig
from .decode_loop import DecodeLoop, LoopObserver
from .errors import ConfigError, DeadlineExceeded
from .runner import Runner
from .tasks import translate as task
from .tasks.translate import TranslationItem

log = logging.getLogger(__name__)


@dataclass
class StreamEvent:
    """A partial best hypothesis (``final`` False) or the final result."""

    text: str
    tokens: list[str]
    step: int
    final: bool = False
    result: TranslationItem | None = None


class _Observer(LoopObserver):
    def __init__(self, model: str, backend: str) -> None:
        self.model, self.backend = model, backend

    def queue_depth(self, n: int) -> None:
        metrics.set_queue_depth(self.model, n)

    def encoded(self, size, real_tokens, padded_tokens, seconds, queue_s) -> None:
        metrics.observe_batch(self.model, self.backend, size, real_tokens, padded_tokens, seconds, queue_s)

    def stepped(self, hypotheses, seconds) -> None:
        metrics.observe_decode_step(self.model, self.backend, hypotheses, seconds)

    def active(self, hypotheses) -> None:
        metrics.set_active_hypotheses(self.model, hypotheses)


class TranslationRunner(Runner):
    """One translation model behind the decode loop (iteration-level batching)."""

    def __init__(self, config: ModelConfig, backend: StepBackend) -> None:
        super().__init__(config, backend)
        self.max_seq_len = config.max_source_tokens

    @property
    def loop(self) -> DecodeLoop | None:
        return self.scheduler

    def _check_loaded(self, meta: ModelMeta) -> None:
        if meta.task != TASK_TRANSLATION:
            raise ConfigError(f"model {self.name!r}: backend loaded a {meta.task} model, expected translation")
        if self.config.max_batch_tokens < self.config.max_source_tokens:
            raise ConfigError(
                f"model {self.name!r}: max_batch_tokens {self.config.max_batch_tokens} must be >= "
                f"max_source_tokens {self.config.max_source_tokens}"
            )

    def _make_scheduler(self) -> DecodeLoop:
        c = self.config
        return DecodeLoop(
            self.name, self.backend, scheduling=c.scheduling, max_active_hypotheses=c.max_active_hypotheses,
            max_batch_size=c.max_batch_size, max_batch_tokens=c.max_batch_tokens, max_queue_delay=c.max_queue_delay,
            encode_batch_delay=c.encode_batch_delay_ms / 1000, max_queue_size=c.max_queue_size, observer=_Observer(self.name, self.backend.name),
            compute=self._compute_lane(),
        )

    async def _encode(self, texts: Sequence[str]) -> list[list[int] | None]:
        """Source ids per text (None for blank ones), checked against max_source_tokens, encoded in this model's
        tokenization threads (only as much of a text as it takes to know it is too long)."""
        assert self.meta is not None
        sources, _seconds = await self._tokenize(task.preprocess, self.meta.tokenizer, list(texts),
                                                 self.config.max_source_tokens, self.name)
        return sources

    # ------------------------------------------------------------------ requests

    async def translate(self, texts: Sequence[str], options: DecodeOptions,
                        deadline: float | None) -> list[TranslationItem]:
        """Translate ``texts`` (already validated) with ``options``; one item per text, in order.

        Raises:
            InvalidArgument: a text over max_source_tokens.
            RelserveError: from the decode loop (deadline, queue full, shutting down, model failure).
        """
        loop = self._check_ready()
        with loop.reserve(len(texts), deadline) as reservation:  # admission before encoding: one place per text
            sources = await self._encode(texts)
            work = [(i, src) for i, src in enumerate(sources) if src is not None]
            seqs = loop.submit([(src, options) for _, src in work], deadline, reservation=reservation) if work else []
        results: list[list[Hypothesis] | None] = [None] * len(texts)
        if work:
            await loop.wait(seqs, deadline)
            for (i, _), s in zip(work, seqs):
                results[i] = s.result
        return [self._item(src, hyps, options) for src, hyps in zip(sources, results)]

    async def translate_stream(self, text: str, options: DecodeOptions,
                               deadline: float | None) -> AsyncIterator[StreamEvent]:
        """The best live hypothesis after each decoder step (a slow reader gets the latest only), then the
        final result; same errors as :meth:`translate`."""
        loop = self._check_ready()
        events: asyncio.Queue = asyncio.Queue()

        def on_update(update: SeqUpdate, step: int) -> None:
            events.put_nowait((step, update.best_tokens))

        with loop.reserve(1, deadline) as reservation:  # admission before encoding
            (src,) = await self._encode([text])
            if src is not None:
                (seq,) = loop.submit([(src, options)], deadline, on_update=on_update, reservation=reservation)
        if src is None:
            yield StreamEvent(text="", tokens=[], step=0, final=True, result=self._item(None, None, options))
            return
        assert self.meta is not None
        tok = self.meta.tokenizer
        seq.future.add_done_callback(lambda _f: events.put_nowait(None))
        try:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    event = await asyncio.wait_for(events.get(), timeout)
                except asyncio.TimeoutError:
                    raise DeadlineExceeded(f"deadline exceeded while decoding (model {self.name!r})") from None
                while event is not None and not events.empty():  # a slow reader gets the latest only
                    event = events.get_nowait()
                if event is None:
                    hyps = seq.result  # raises the sequence's error
                    item = self._item(src, hyps, options)
                    best = item.hypotheses[0]
                    yield StreamEvent(text=best.text, tokens=list(best.output_pieces), step=seq.steps, final=True,
                                      result=item)
                    return
                step, ids = event
                yield StreamEvent(text=tok.decode_target(ids), tokens=tok.target_pieces(ids), step=step)
        finally:
            loop.discard([seq])

    # ------------------------------------------------------------------ post-processing

    def _item(self, src: list[int] | None, hyps: list[Hypothesis] | None, options: DecodeOptions) -> TranslationItem:
        assert self.meta is not None
        return task.postprocess(self.meta.tokenizer, src, hyps, options)
