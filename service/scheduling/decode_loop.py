"""Iteration-level batching for translation: schedule -> execute -> update, as plain data (no torch).

A request is split into *sequences* (one source text each). A sequence waits in a FIFO queue, is encoded
together with other waiting sequences (the encoder phase), then joins the decode loop, where every live
beam hypothesis of every active sequence advances by one target token per step. Between two steps the
loop

1. drops what must not be computed any more: sequences whose reply slot is done (the client cancelled,
   or another text of the same request failed) and sequences whose deadline passed (they get
   :class:`DeadlineExceeded`); their backend state is released;
2. admits waiting sequences, oldest first, as long as the hypotheses they may grow to (``beam_size``
   each, reserved at admission) fit in ``max_active_hypotheses`` and the encoder batch fits
   ``max_batch_size`` sequences and ``max_batch_tokens`` padded tokens (a single sequence that does not
   fit an empty loop is still admitted, alone). Admission is strictly FIFO: a sequence never overtakes
   an older one. All sequences admitted together are encoded in one (padded) encoder call. While other
   sequences are decoding, newcomers are held for at most ``encode_batch_delay`` from the oldest one's
   arrival so that several are encoded together (an encoder call for one or two sources costs nearly as
   much as one for many: a recurrent encoder runs once per source position whatever the batch; measured
   in ``loadtest/bench/translation.py --capacity``); the loop keeps stepping meanwhile, so
   the hold never idles the cores, and it ends early once what waits fills an encoder batch
   (``max_batch_size`` / ``max_batch_tokens``; a full hypothesis budget does not end it, since the next
   step frees places for a fuller batch). At saturation, when more sequences wait than the freed places
   take, the freed places stay empty until ``REFILL_FRACTION`` of the budget is free (at most
   ``MAX_REFILL_HOLD_STEPS`` steps), so that the refill is one encoder call, not one per step
   (:meth:`DecodeLoop._refill_hold`). A held newcomer is an ordinary waiting sequence: cancelling it
   or its deadline frees its place at once;
3. runs one step: the plan (:class:`StepPlan`) is the ids of the active sequences and their live
   hypothesis counts; the backend executes it in the model's executor thread, off the event loop,
   holding the process's compute slot (``scheduling/cores.py``: with ``compute_scheduling: fair`` one
   model's backend call at a time, models in turn, so a step never shares the cores with another model);
4. updates: each sequence reads only its own :class:`SeqUpdate`; finished sequences leave and their
   reply slot gets the n-best list; streaming sequences get their best hypothesis so far.

A step that raises fails only the sequences in that step (waiting ones are untouched); an update that
is an Exception, or carries a non-finite score, fails only its own sequence. An encoder call over several
newcomers that raises is retried one newcomer at a time, so a source the backend cannot encode fails
only its own request.

The queue, admission, deadlines, cancellation and pushback are the scheduler base's
(:class:`relserve.service.scheduling.base.QueueScheduler`); this module is the iteration-level policy. Every
backend call is given the model's :class:`relserve.service.backends.base.CallBudget`.

``scheduling="request"`` is the classic request-level alternative used as the benchmark's baseline: a
group of sequences is admitted only when the loop is empty and decoded to completion before the next
group is admitted (no joining between steps).

The backend contract (:class:`relserve.service.backends.base.StepBackend`) is three calls over the plain
data of that module; each sequence carries its :class:`relserve.models.decode_types.DecodeOptions` and
finishes with a list of :class:`relserve.models.decode_types.Hypothesis`. Tests drive the loop with fakes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from relserve.models.decode_types import DecodeOptions, Hypothesis

from .. import tracing
from ..backends.base import SeqUpdate, StartItem, StepBackend, StepPlan
from ..config import SCHEDULING
from ..errors import DeadlineExceeded, Internal
from .base import QueueScheduler, Reservation, fail
from .cores import Lane

log = logging.getLogger(__name__)

# A saturated iteration-level loop refills freed places once this share of max_active_hypotheses is free, or
# after this many steps holding (DecodeLoop._refill_hold).
REFILL_FRACTION = 0.3
MAX_REFILL_HOLD_STEPS = 6


class LoopObserver:
    """Hooks the runner turns into metrics (no-ops here)."""

    def queue_depth(self, n: int) -> None: ...

    def encoded(self, size: int, real_tokens: int, padded_tokens: int, seconds: float,
                queue_s: Sequence[float]) -> None: ...

    def stepped(self, hypotheses: int, seconds: float) -> None: ...

    def active(self, hypotheses: int) -> None: ...


OnUpdate = Callable[[SeqUpdate, int], None]


@dataclass(eq=False)
class DecodeSeq:
    """One source in the loop: its size, knobs, deadline, reply slot and timings."""

    seq_id: int
    source_ids: list[int]
    options: DecodeOptions
    deadline: float | None
    future: asyncio.Future
    on_update: OnUpdate | None = None
    enqueued_at: float = field(default_factory=time.monotonic)
    queue_s: float = 0.0      # enqueue -> encoder batch start
    encode_s: float = 0.0     # the encoder batch it ran in
    decode_s: float = 0.0     # sum of the steps it took part in
    steps: int = 0
    live: int = 0
    trace: tracing.RequestTrace | None = None  # the request's call, with tracing on

    @property
    def tokens(self) -> int:
        return len(self.source_ids)

    @property
    def result(self) -> list[Hypothesis]:
        return self.future.result()


# ---------------------------------------------------------------------------------------------- the loop

class DecodeQueue(QueueScheduler[DecodeSeq]):
    """The submission side that :class:`DecodeLoop` and the decode process pool
    (:class:`.decode_pool.DecodePool`) share: a request's items become its sequences, numbered by the
    subclass's ``_ids`` counter; :meth:`run` submits and waits."""

    _ids: Iterator[int]
    # whether a request's sequences get a trace when tracing is on
    _traced: bool

    def submit(self, items: Sequence[tuple[list[int], DecodeOptions]], deadline: float | None = None,
               on_update: OnUpdate | None = None, reservation: Reservation | None = None
               ) -> list[DecodeSeq]:
        """Enqueue ``(source_ids, options)`` items as the sequences of one request (all or none); a
        ``reservation`` (:meth:`reserve`) counts as the request's own places and is consumed on success.

        Raises:
            Unavailable: closed, not started, or (the process pool) no decode process serves (names why).
            DeadlineExceeded: the deadline already passed.
            ResourceExhausted: the queue cannot take all the items (names max_queue_size).
        """

        def make(loop: asyncio.AbstractEventLoop, now: float) -> list[DecodeSeq]:
            trace = tracing.request(self.name, now) if self._traced and tracing.ENABLED else None
            return [DecodeSeq(seq_id=next(self._ids), source_ids=list(ids), options=options, deadline=deadline,
                              future=loop.create_future(), on_update=on_update, enqueued_at=now, trace=trace)
                    for ids, options in items]

        return self._enqueue(len(items), deadline, reservation, make)

    async def run(self, items: Sequence[tuple[list[int], DecodeOptions]], deadline: float | None = None
                  ) -> list[list[Hypothesis]]:
        """Submit and wait; one n-best list per item, in order.

        Raises:
            RelserveError: as ``submit`` and ``wait`` (queue full, deadline, closed, decode failure).
        """
        seqs = self.submit(items, deadline)
        await self.wait(seqs, deadline)
        return [s.result for s in seqs]


class DecodeLoop(DecodeQueue):
    """The decode loop of one translation model (a :class:`relserve.service.scheduling.base.QueueScheduler`
    policy).

    Args:
        name: model name (messages, executor thread name).
        backend: a :class:`StepBackend`.
        scheduling: ``"iteration"`` (join/leave between steps) or ``"request"`` (groups run to completion).
        max_active_hypotheses: hypotheses per step; each active sequence reserves ``beam_size``.
        max_batch_size: sequences per encoder batch.
        max_batch_tokens: padded source tokens per encoder batch (size x longest).
        max_queue_delay: seconds an idle loop waits for company before encoding the first arrival.
        encode_batch_delay: seconds (from the oldest newcomer's arrival) newcomers are held while other
            sequences decode, so that several share one encoder call; 0: admitted at the next step.
            Iteration scheduling only (request-level admits only into an empty loop).
        max_queue_size: sequences allowed to wait; beyond it submissions raise ResourceExhausted.
        observer: metrics hooks.
        compute: the model's :class:`relserve.service.scheduling.cores.Lane`: encoder batches and decoder steps take
            the process's compute slot through it (sequences cancelled or expired while waiting for it are
            left out of the call). None: a lane of its own (no coordination).
    """

    _traced = True

    worker_kind = "decode"
    worker_error = "decode loop error"
    purge_stage = "before decoding started"
    waiting_noun = "texts"
    request_verb = "has"
    log = log

    def __init__(
        self,
        name: str,
        backend: StepBackend,
        *,
        scheduling: str = "iteration",
        max_active_hypotheses: int = 256,
        max_batch_size: int = 32,
        max_batch_tokens: int = 8192,
        max_queue_delay: float = 0.0,
        encode_batch_delay: float = 0.0,
        max_queue_size: int = 1024,
        observer: LoopObserver | None = None,
        compute: Lane | None = None,
    ) -> None:
        if scheduling not in SCHEDULING:
            raise ValueError(f"scheduling {scheduling!r} is not one of {SCHEDULING}")
        if (min(max_active_hypotheses, max_batch_size, max_batch_tokens, max_queue_size) < 1 or max_queue_delay < 0
                or encode_batch_delay < 0):
            raise ValueError("decode loop limits must be positive (max_queue_delay, encode_batch_delay >= 0)")
        self.observer = observer or LoopObserver()
        # drain estimate (base): sequences admitted per second while a backlog waited
        super().__init__(name, max_queue_size=max_queue_size, max_queue_delay=max_queue_delay,
                         on_depth=self.observer.queue_depth, compute=compute)
        self.backend = backend
        self.scheduling = scheduling
        self.max_active_hypotheses = max_active_hypotheses
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.encode_batch_delay = encode_batch_delay
        self._active: list[DecodeSeq] = []
        self._ids = itertools.count()
        self._dropped_on_close: list[int] = []
        self._backlog_at: float | None = None  # last admission that left sequences waiting
        # counters for tests and logs
        self.steps = 0
        self.encoder_batches = 0
        self.encoded_sequences = 0
        self.held_steps = 0  # decoder steps run while newcomers were held for a fuller encoder batch
        self._refill_held = 0  # steps in a row the saturated loop left freed places empty (_refill_hold)
        self.plans: list[StepPlan] = []  # the last few plans (bounded), for tests
        self.max_plans_kept = 1000

    # ------------------------------------------------------------------ lifecycle

    def _running(self) -> list[DecodeSeq]:
        return list(self._active)

    def _closing(self) -> None:
        self._dropped_on_close = [s.seq_id for s in self._active]
        self._active.clear()
        self.observer.active(0)

    def _stopped(self) -> None:
        dropped, self._dropped_on_close = self._dropped_on_close, []
        if dropped:
            try:
                self.backend.release(dropped)
            except Exception:
                log.exception("model %r: release on close failed", self.name)

    @property
    def reserved_places(self) -> int:
        """Queue places held by requests that are still being tokenized (:meth:`reserve`)."""
        return self._reserved

    @property
    def active_sequences(self) -> int:
        return len(self._active)

    @property
    def active_hypotheses(self) -> int:
        return sum(s.live for s in self._active)

    # ------------------------------------------------------------------ submission

    def _retry_hint(self, needed: int, others: int) -> float | None:
        # no retry advice for a request that can never fit
        return super()._retry_hint(needed, others) if needed <= self.max_queue_size else None

    def _where_late(self, seqs: Sequence[DecodeSeq]) -> str:
        started = any(s.steps for s in seqs)
        return "while decoding" if started else "while waiting in the queue"

    # ------------------------------------------------------------------ worker

    def _has_work(self) -> bool:
        return bool(self._queue or self._active)

    async def _round(self) -> None:
        self._purge()
        await self._drop_dead_active()
        if self._queue and (self.scheduling == "iteration" or not self._active):
            if not self._active and self.max_queue_delay > 0:
                # an idle loop waits (at most max_queue_delay from the oldest arrival) for a fuller encoder batch
                await self._linger(lambda: self._queue[0].enqueued_at + self.max_queue_delay)
                self._purge()
            batch = [] if self._holding() else self._take_admissions()
            if batch:
                await self._encode(batch)
        if self._active:
            await self._step()

    async def _drop_dead_active(self) -> None:
        now = time.monotonic()
        keep, dropped = [], []
        for s in self._active:
            if s.future.done():
                dropped.append(s)
            elif s.deadline is not None and s.deadline <= now:
                # worded as base.wait_all's own deadline message: whichever of the two fires first under
                # load, the client reads the same phase
                fail(s, DeadlineExceeded(
                    f"deadline exceeded while decoding (model {self.name!r}), after {s.steps} decoder steps; the "
                    f"text's hypotheses were dropped"
                ))
                dropped.append(s)
            else:
                keep.append(s)
        if dropped:
            self._active = keep
            await self._release(dropped)
            self.observer.active(self.active_hypotheses)

    async def _release(self, seqs: Sequence[DecodeSeq]) -> None:
        if not seqs or self._executor is None:
            return
        ids = [s.seq_id for s in seqs]
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.backend.release, ids)
        except Exception:
            log.exception("model %r: releasing %d sequences failed", self.name, len(ids))

    def _full(self) -> bool:
        return not self._queue or self._full_admission_waiting()

    def _full_admission_waiting(self) -> bool:
        if len(self._queue) >= self.max_batch_size:
            return True
        if sum(s.options.beam_size for s in self._queue) >= self.max_active_hypotheses:
            return True
        return len(self._queue) * max(s.tokens for s in self._queue) >= self.max_batch_tokens

    def _reserved_hypotheses(self) -> int:
        return sum(s.options.beam_size for s in self._active)

    def _holding(self) -> bool:
        """Whether the newcomers wait one more step for company (see ``encode_batch_delay``): only while other
        sequences decode (an idle loop lingers with max_queue_delay instead), until the oldest newcomer
        has waited encode_batch_delay, and not once what waits fills an encoder batch (holding could only
        add latency then); at saturation, also while :meth:`_refill_hold` says so. Counts the steps it holds
        for (``held_steps``)."""
        if not (self._active and self._queue):
            return False
        chosen, full = self._admissible()
        if full:
            return False  # the encoder batch is full (max_batch_size / max_batch_tokens): nothing to wait for
        if self.encode_batch_delay > 0 and time.monotonic() < self._queue[0].enqueued_at + self.encode_batch_delay:
            # a hypothesis budget that blocks is no reason to stop: the next step frees places for a fuller batch
            self.held_steps += 1
            return True
        if self._refill_hold(chosen):
            self.held_steps += 1
            return True
        return False

    def _refill_hold(self, admissible: int) -> bool:
        """At saturation (more waiting than the free places take), whether the freed places stay empty for one
        more step so that the refill is one encoder call over several newcomers, not one per step: held until
        ``REFILL_FRACTION`` of the hypothesis budget is free, at most ``MAX_REFILL_HOLD_STEPS`` steps in a
        row. On CPU a decoder step costs about the same per hypothesis at 100 or 215 of them, while an
        encoder call for 5 short sources costs about a third of one for 47 (``bench.translation --capacity``
        measures both), so trading a few steps' occupancy for fewer encoder calls is a gain. Below
        saturation (the whole queue fits) it never holds, so latency there is unchanged."""
        if admissible >= len(self._queue):
            self._refill_held = 0
            return False
        free = self.max_active_hypotheses - self._reserved_hypotheses()
        if free >= REFILL_FRACTION * self.max_active_hypotheses or self._refill_held >= MAX_REFILL_HOLD_STEPS:
            self._refill_held = 0
            return False
        self._refill_held += 1
        return True

    def _admissible(self) -> tuple[int, bool]:
        """How many waiting sequences the next admission takes (oldest first, stopping at the first that does not
        fit: strict FIFO), and whether it stopped because the encoder batch is full (max_batch_size or
        max_batch_tokens) rather than the hypothesis budget or the end of the queue."""
        reserved = self._reserved_hypotheses()
        chosen = 0
        longest = 0
        for s in self._queue:
            if chosen >= self.max_batch_size:
                return chosen, True
            empty = not chosen and not self._active
            if reserved + s.options.beam_size > self.max_active_hypotheses and not empty:
                return chosen, False
            if (chosen + 1) * max(longest, s.tokens) > self.max_batch_tokens and chosen:
                return chosen, True
            chosen += 1
            reserved += s.options.beam_size
            longest = max(longest, s.tokens)
        return chosen, chosen >= self.max_batch_size

    def _take_admissions(self) -> list[DecodeSeq]:
        """The next admission (:meth:`_admissible`), taken out of the queue."""
        chosen = self._queue[: self._admissible()[0]]
        if chosen:
            self._queue = self._queue[len(chosen):]
            self._on_depth(len(self._queue))
            # only an interval during which sequences kept waiting is all drain time (an idle loop admits at once)
            now = time.monotonic()
            if self._backlog_at is not None:
                self.drain.drained(len(chosen), now - self._backlog_at)
            self._backlog_at = now if self._queue else None
        return chosen

    async def _encode(self, batch: list[DecodeSeq]) -> None:
        start = time.monotonic()
        for s in batch:
            s.queue_s = start - s.enqueued_at
        self.encoder_batches += 1
        self.encoded_sequences += len(batch)
        results, failed = await self._start(batch)
        if failed and len(batch) > 1:
            # the call raised as a whole: one source may be what broke it, so each newcomer is encoded alone
            # and only the culprit's request fails (a started beam is released first, in case it was kept)
            await self._release(batch)
            results = []
            for s in batch:
                results.extend((await self._start([s]))[0])
        elapsed = time.monotonic() - start
        joined, dropped = [], []
        for s, res in zip(batch, results):
            s.encode_s = elapsed
            if isinstance(res, BaseException):
                fail(s, res)
                dropped.append(s)
            elif s.future.done():  # cancelled while encoding
                dropped.append(s)
            else:
                s.live = int(res)
                joined.append(s)
        self._active.extend(joined)
        await self._release(dropped)
        longest = max(s.tokens for s in batch)
        if tracing.ENABLED:
            tracing.backend_call((s.trace for s in batch), start, start + elapsed, {
                **self.trace_attributes, "relserve.phase": "encode", "relserve.batch.size": len(batch),
                "relserve.batch.real_tokens": sum(s.tokens for s in batch),
                "relserve.batch.padded_tokens": len(batch) * longest}, failed)
        try:
            self.observer.encoded(len(batch), sum(s.tokens for s in batch), len(batch) * longest, elapsed,
                                  [s.queue_s for s in batch])
            self.observer.active(self.active_hypotheses)
        except Exception:
            log.exception("model %r: observer failed", self.name)

    async def _start(self, batch: list[DecodeSeq]) -> tuple[list, bool]:
        """One encoder call over ``batch`` (members gone by the time it runs are left out); one result per
        member and whether the call failed as a whole."""
        items = [StartItem(s.seq_id, s.source_ids, s.options) for s in batch]
        budget = self.budget
        return await self._call(
            batch, lambda its: self.backend.start(its, budget), items, lambda its, live: [its[i] for i in live],
            what=f"encoding a batch of {len(batch)}",
            mismatch=lambda n: f"backend of model {self.name!r} started {n} of {len(batch)} sources",
        )

    async def _step(self) -> None:
        seqs = list(self._active)
        plan = StepPlan(tuple(s.seq_id for s in seqs), tuple(s.live for s in seqs))
        self.plans.append(plan)
        if len(self.plans) > self.max_plans_kept:
            del self.plans[: len(self.plans) - self.max_plans_kept]
        start = time.monotonic()
        self.steps += 1
        budget = self.budget
        # texts dropped while the step waited for the cores are left out; a failed step: only the sequences in it
        # hear about it
        updates, _ = await self._call(
            seqs, lambda p: self.backend.step(p, budget), plan,
            lambda p, live: StepPlan(tuple(p.seq_ids[i] for i in live), tuple(p.hypotheses[i] for i in live)),
            what=f"a decoder step over {len(seqs)} texts",
            mismatch=lambda n: f"backend of model {self.name!r} returned {n} updates for {len(seqs)} texts",
        )
        elapsed = time.monotonic() - start
        finished, dropped = set(), []
        for s, up in zip(seqs, updates):
            s.decode_s += elapsed
            s.steps += 1
            if isinstance(up, BaseException):
                fail(s, up)
                dropped.append(s)
                continue
            bad = not math.isfinite(up.best_score) or any(not math.isfinite(h.log_prob) or not math.isfinite(h.score)
                                                         for h in up.results or ())
            if bad:
                fail(s, Internal(f"model {self.name!r} produced non-finite scores at decoder step {s.steps}"))
                dropped.append(s)
                continue
            if s.future.done():  # cancelled or failed elsewhere while the step ran
                if up.results is None:
                    dropped.append(s)
                else:
                    finished.add(id(s))
                continue
            if up.results is not None:
                if not up.results:
                    fail(s, Internal(f"model {self.name!r} finished a text with no hypotheses"))
                else:
                    s.future.set_result(up.results)
                if s.trace is not None:  # the text's decoder steps, summarised: never a span per step
                    tracing.record_for(s.trace, "relserve.decode", s.enqueued_at + s.queue_s + s.encode_s,
                                       time.monotonic(), {"relserve.decode.steps": s.steps,
                                                          "relserve.decode.step_seconds": s.decode_s})
                s.live = 0
                finished.add(id(s))
                continue
            s.live = up.live
            if s.on_update is not None:
                try:
                    s.on_update(up, s.steps)
                except Exception:
                    log.exception("model %r: stream update failed", self.name)
        gone = finished | {id(s) for s in dropped}
        self._active = [s for s in self._active if id(s) not in gone]
        await self._release(dropped)
        try:
            self.observer.stepped(plan.total, elapsed)
            self.observer.active(self.active_hypotheses)
        except Exception:
            log.exception("model %r: observer failed", self.name)
