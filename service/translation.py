"""A served translation model: step backend + decode loop + pre/post-processing (no torch here).

``TranslationRunner`` has the lifecycle and surface of :class:`relserve.service.runner.ModelRunner`
(``load``, ``start``, ``close``, ``info``, ``ready``, ``task``, ``state``), so the registry and the server
treat both alike; the servicer calls :meth:`translate` and :meth:`translate_stream`.

Rules (documented in the proto):

* ``beam_size`` 0 -> the model's configured default; 1..16. ``n_best`` 0 -> 1; 1..beam_size.
* ``max_length`` 0 -> ``min(int(max_len_a * source_tokens + max_len_b), max_output_tokens)``; an explicit one
  must be <= ``max_output_tokens``. Counts the final EOS.
* A source longer than ``max_source_tokens`` (pieces + EOS) is INVALID_ARGUMENT, naming the limit.
* A blank text (empty or whitespace only) is not sent to the model: one hypothesis with text "" and
  score 0 (C10).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from . import metrics
from .backends import TASK_TRANSLATION, ModelMeta
from .config import MAX_BEAM_SIZE, ModelConfig
from .decode_loop import DecodeLoop, DecodeParams, HypothesisOut, LoopObserver, SeqUpdate
from .errors import ConfigError, DeadlineExceeded, InvalidArgument, Unavailable
from .runner import ModelInfo, Timings
from .tasks.text import is_blank

log = logging.getLogger(__name__)


@dataclass
class AlignmentItem:
    source_tokens: list[str]
    target_tokens: list[str]
    weights: list[float]  # row-major target x source


@dataclass
class HypothesisItem:
    text: str
    score: float
    log_prob: float
    tokens: list[str]
    token_ids: list[int]
    truncated: bool
    alignment: AlignmentItem | None = None


@dataclass
class TranslationItem:
    hypotheses: list[HypothesisItem]
    num_source_tokens: int


@dataclass
class StreamEvent:
    """A partial best hypothesis (``final`` False) or the final result."""

    text: str
    tokens: list[str]
    step: int
    final: bool = False
    result: TranslationItem | None = None


@dataclass(frozen=True)
class Request:
    beam_size: int
    n_best: int
    max_length: int  # 0 = per-text default formula
    return_alignment: bool


def blank(text: str) -> bool:
    """Whitespace or zero-width characters only: translated to "" without running the model (C10)."""
    return is_blank(text)


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


class TranslationRunner:
    """One translation model. Lifecycle: ``load()`` (blocking), ``await start()``, requests, ``await close()``."""

    def __init__(self, config: ModelConfig, backend: Any) -> None:
        self.config = config
        self.name = config.name
        self.backend = backend
        self.meta: ModelMeta | None = None
        self.max_seq_len = config.max_source_tokens
        self.state = "created"
        self.loop: DecodeLoop | None = None

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        try:
            self.state = "loading"
            meta = self.backend.load()
            if meta.task != TASK_TRANSLATION:
                raise ConfigError(f"model {self.name!r}: backend loaded a {meta.task} model, expected translation")
            if self.config.max_batch_tokens < self.config.max_source_tokens:
                raise ConfigError(
                    f"model {self.name!r}: max_batch_tokens {self.config.max_batch_tokens} must be >= "
                    f"max_source_tokens {self.config.max_source_tokens}"
                )
            self.meta = meta
            self.state = "warming"
            if self.config.warmup:
                t0 = time.monotonic()
                self.backend.warmup()
                log.info("model %r: warm-up took %.3f s", self.name, time.monotonic() - t0)
        except BaseException:
            self.state = "failed"
            raise

    async def start(self) -> None:
        if self.meta is None:
            raise RuntimeError(f"model {self.name!r}: start() before load()")
        c = self.config
        self.loop = DecodeLoop(
            self.name, self.backend, scheduling=c.scheduling, max_active_hypotheses=c.max_active_hypotheses,
            max_batch_size=c.max_batch_size, max_batch_tokens=c.max_batch_tokens, max_queue_delay=c.max_queue_delay,
            max_queue_size=c.max_queue_size, observer=_Observer(self.name, self.backend.name),
        )
        self.loop.start()
        m = self.meta
        metrics.set_model_info(self.name, m.family, m.task, m.backend, m.device, m.dtype)
        metrics.add_memory_source(self.backend.memory_stats)
        self.state = "ready"

    async def close(self) -> None:
        self.state = "closed"
        if self.loop is not None:
            await self.loop.close()
        metrics.remove_memory_source(self.backend.memory_stats)
        try:
            self.backend.close()
        except Exception:
            log.exception("model %r: backend close failed", self.name)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def task(self) -> str | None:
        return self.meta.task if self.meta else None

    def info(self) -> ModelInfo:
        m = self.meta
        return ModelInfo(
            name=self.name, task=m.task if m else "", family=m.family if m else "",
            backend=m.backend if m else self.config.backend, device=m.device if m else self.config.device,
            dtype=m.dtype if m else self.config.dtype, max_seq_len=self.config.max_source_tokens, labels=(),
            max_batch_size=self.config.max_batch_size,
        )

    # ------------------------------------------------------------------ validation

    def request(self, beam_size: int, n_best: int, max_length: int, return_alignment: bool) -> Request:
        """Resolve defaults and check ranges.

        Raises:
            InvalidArgument: naming the field, its value and the allowed range.
        """
        c = self.config
        beam = beam_size or c.beam_size
        if not 1 <= beam <= MAX_BEAM_SIZE:
            raise InvalidArgument(
                f"beam_size {beam_size} is out of range; allowed 1..{MAX_BEAM_SIZE} (0 = default {c.beam_size})"
            )
        nb = n_best or 1
        if not 1 <= nb <= beam:
            raise InvalidArgument(f"n_best {n_best} is out of range; allowed 1..beam_size ({beam})")
        if max_length > c.max_output_tokens:
            raise InvalidArgument(
                f"max_length {max_length} exceeds max_output_tokens {c.max_output_tokens} of model {self.name!r} "
                f"(0 = default min({c.max_len_a:g} x source tokens + {c.max_len_b}, {c.max_output_tokens}))"
            )
        return Request(beam, nb, int(max_length), bool(return_alignment))

    def _params(self, req: Request, source_len: int) -> DecodeParams:
        c = self.config
        max_length = req.max_length or max(1, min(int(c.max_len_a * source_len + c.max_len_b), c.max_output_tokens))
        return DecodeParams(beam_size=req.beam_size, n_best=req.n_best, max_length=max_length,
                            length_penalty=c.length_penalty, return_alignment=req.return_alignment)

    def _check_ready(self) -> DecodeLoop:
        if self.state != "ready" or self.loop is None:
            raise Unavailable(f"model {self.name!r} is not ready (state: {self.state}); retry later")
        return self.loop

    async def _encode(self, texts: Sequence[str]) -> tuple[list[list[int] | None], Timings]:
        """Source ids per text (None for blank ones), checked against max_source_tokens."""
        assert self.meta is not None
        tok = self.meta.tokenizer
        timings = Timings()
        t0 = time.monotonic()
        ids = await asyncio.to_thread(lambda: [None if blank(t) else list(tok.encode_source(t)) for t in texts])
        timings.tokenization_s = time.monotonic() - t0
        metrics.observe_tokenization(self.name, timings.tokenization_s)
        limit = self.config.max_source_tokens
        for i, src in enumerate(ids):
            if src is not None and len(src) > limit:
                raise InvalidArgument(
                    f"texts[{i}] has {len(src)} source tokens (pieces + EOS); model {self.name!r} has "
                    f"max_source_tokens {limit}; split the text"
                )
        return ids, timings

    # ------------------------------------------------------------------ requests

    async def translate(self, texts: Sequence[str], req: Request, deadline: float | None) -> list[TranslationItem]:
        loop = self._check_ready()
        sources, _timings = await self._encode(texts)
        work = [(i, src) for i, src in enumerate(sources) if src is not None]
        results: list[list[HypothesisOut] | None] = [None] * len(texts)
        if work:
            seqs = loop.submit([(src, self._params(req, len(src))) for _, src in work], deadline)
            await loop.wait(seqs, deadline)
            for (i, _), s in zip(work, seqs):
                results[i] = s.result
        return [self._item(src, hyps, req) for src, hyps in zip(sources, results)]

    async def translate_stream(self, text: str, req: Request, deadline: float | None) -> AsyncIterator[StreamEvent]:
        loop = self._check_ready()
        (src,), _timings = await self._encode([text])
        if src is None:
            yield StreamEvent(text="", tokens=[], step=0, final=True, result=self._item(None, None, req))
            return
        assert self.meta is not None
        tok = self.meta.tokenizer
        events: asyncio.Queue = asyncio.Queue()

        def on_update(update: SeqUpdate, step: int) -> None:
            events.put_nowait((step, update.best_tokens))

        (seq,) = loop.submit([(src, self._params(req, len(src)))], deadline, on_update=on_update)
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
                    item = self._item(src, hyps, req)
                    best = item.hypotheses[0]
                    yield StreamEvent(text=best.text, tokens=best.tokens, step=seq.steps, final=True, result=item)
                    return
                step, ids = event
                yield StreamEvent(text=tok.decode_target(ids), tokens=tok.target_pieces(ids), step=step)
        finally:
            loop.discard([seq])

    # ------------------------------------------------------------------ post-processing

    def _item(self, src: list[int] | None, hyps: list[HypothesisOut] | None, req: Request) -> TranslationItem:
        if src is None or hyps is None:  # blank text: "" without running the model
            align = AlignmentItem([], [], []) if req.return_alignment else None
            return TranslationItem([HypothesisItem("", 0.0, 0.0, [], [], False, align)], 0)
        assert self.meta is not None
        tok = self.meta.tokenizer
        src_pieces = tok.source_pieces(src) if req.return_alignment else []
        out = []
        for h in hyps:
            pieces = tok.target_pieces(h.token_ids)
            align = None
            if req.return_alignment and h.alignment is not None:
                rows = pieces + (tok.target_pieces([self.meta.extra.get("eos_token_id", 2)]) if h.finished else [])
                align = AlignmentItem(src_pieces, rows, [float(x) for x in h.alignment.reshape(-1)])
            out.append(HypothesisItem(
                text=tok.decode_target(h.token_ids), score=h.score, log_prob=h.log_prob, tokens=pieces,
                token_ids=list(h.token_ids), truncated=h.truncated, alignment=align,
            ))
        return TranslationItem(out, len(src))
