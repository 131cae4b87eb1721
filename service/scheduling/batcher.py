"""Per-model dynamic batcher. It knows sizes, never models (no torch, no numpy).

A request is split into *units* (one sequence: a text, a text pair, a QA window). Each unit carries its
token count, the request's deadline, its enqueue time, one reply slot (an asyncio future), its payload
(opaque here) and, once done, its timings. One worker task per model forms batches and runs the
backend in the model's own executor thread, so the event loop stays free.

Batch forming, every time the worker is free:

1. drop what must not be computed: cancelled units (their future is done) and units whose deadline
   passed (they get :class:`DeadlineExceeded` now, before compute);
2. if ``max_queue_delay`` > 0, wait until the oldest unit has waited that long or a full batch is
   waiting; with 0 do not wait. Either way everything that arrived while the previous batch ran is
   available at once (five requests arriving during one batch are served by one next batch);
3. the oldest unit anchors the batch (no starvation); the others join closest length bucket first, then
   oldest first, while ``max_batch_size`` and ``max_batch_tokens`` hold. The token budget counts padded
   tokens (batch size x longest) for padded backends and real tokens otherwise. A single unit longer
   than the budget still runs, alone;
4. fairness between requests: one request (all the units one :meth:`Batcher.submit` enqueued, e.g. the
   64 windows of a long QA context) places at most ``ceil(max_request_batch_share x max_batch_size)``
   units in a batch while units of other requests can take the places, so a short request that arrives
   behind a long one runs in the next batch instead of after all of it. The cap is work-conserving: places
   nobody else can take (no other request waits, or its units do not fit the token budget) are filled from
   the capped requests, in the same bucket order, so a lone request still gets full batches;
5. the batch runs in sub-batches, back to back, each taking the process's compute slot (so another
   model's batch runs between two of them); units cancelled or expired while a sub-batch waited for the
   cores are left out. Once the model's :class:`relserve.service.scheduling.cost_model.BatchCostModel` is
   fitted (warm-up probes at load, refined by every call; seconds = per call + per real token + per padded
   token + per n x L^2 of the attention core), the sub-batches are the partition of the formed batch with the
   least predicted time (:func:`relserve.service.scheduling.cost_model.plan_batch`: sorted by length, exact
   dynamic programme),
   each predicted within ``max_batch_time_ms``, and the one holding the oldest unit runs first. Sub-batches
   only split what step 3 formed, so they keep its limits and the fairness cap and wait no longer than
   ``max_queue_delay`` for company. Without warm-up probes (warm-up off, a backend without
   ``probe_batch``), or with ``cost_batching`` off, the batch runs in consecutive pieces the per-token
   :class:`CostModel` expects to take at most ``max_batch_time_ms`` each.

The queue, admission, deadlines, cancellation and pushback are the scheduler base's
(:class:`relserve.service.scheduling.base.QueueScheduler`); this module is the batching policy.

The backend's ``run(payloads)`` returns one result or one Exception per payload; each goes to its own
unit. If ``run`` raises, or returns the wrong number of items, every unit of *that* batch gets the error
and no other unit is touched.

A full queue raises :class:`ResourceExhausted` with ``retry_after_s`` from the queue's drain estimate
(``scheduling/pushback.py``: units per second of the recent batches formed at a full queue, and a virtual
queue of the requests already told to come back), which the servicer sends as the ``grpc-retry-pushback-ms`` trailer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .. import tracing
from ..errors import ResourceExhausted
from .base import QueueScheduler, Reservation
from .cores import Lane
from .cost_model import BatchCostModel, CostModel, plan_batch

log = logging.getLogger(__name__)

RunBatch = Callable[[list[Any]], Sequence[Any]]

_request_ids = itertools.count(1)  # one id per submitted request (its units share it)


@dataclass(eq=False)
class Unit:
    """One sequence in the queue: its size, deadline, reply slot, payload and timings."""

    tokens: int
    payload: Any
    deadline: float | None  # time.monotonic() seconds, None = no deadline
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.monotonic)
    queue_s: float = 0.0       # enqueue -> batch start
    inference_s: float = 0.0   # backend time of the batch it ran in
    batch_size: int = 0        # size of the batch it ran in
    # the request the unit belongs to (the fairness cap counts units per request); the default gives every
    # unit its own id, i.e. no cap applies to units created outside submit()
    request: int = field(default_factory=lambda: next(_request_ids))
    trace: tracing.RequestTrace | None = None  # the request's call, with tracing on (shared by its units)

    @property
    def result(self) -> Any:
        return self.future.result()


@dataclass(frozen=True)
class BatchStats:
    """What one execution looked like (the batcher's observer turns this into metrics)."""

    size: int
    real_tokens: int
    padded_tokens: int   # tokens the backend computed: size x longest if padded, else real
    inference_s: float
    queue_s: tuple[float, ...]
    failed: bool
    compute_s: float = 0.0  # of inference_s, the seconds the call held the cores (not waiting for them)


def _noop(*_args: Any) -> None:
    return None


class Batcher(QueueScheduler[Unit]):
    """Dynamic batcher of one model (a :class:`relserve.service.scheduling.base.QueueScheduler` policy).

    Args:
        name: model name (used in messages and the executor thread name).
        run_batch: blocking callable ``payloads -> [result | Exception per payload]`` (the backend).
        max_batch_size: units per execution.
        max_batch_tokens: token budget per execution (padded tokens when ``is_padded``).
        max_queue_delay: seconds the oldest unit may wait for company; 0 = never wait.
        max_queue_size: units allowed to wait; beyond it submissions raise ResourceExhausted.
        is_padded: whether the backend pads a batch to its longest member.
        bucket_width: tokens per length bucket when grouping similar lengths.
        length_bucketing: group similar lengths (default); False takes units in arrival order, which
            pads more (the switch exists to measure what bucketing saves).
        max_request_batch_share: at most ``ceil(share x max_batch_size)`` units of one request per batch
            while other requests' units can take the places (0 < share <= 1; 1.0, the default here, is no
            cap; the server passes the model's ``max_request_batch_share``, default 0.5).
        on_queue_depth: called with the number of waiting units whenever it changes.
        on_batch: called with a :class:`BatchStats` after each execution.
        compute: the model's :class:`relserve.service.scheduling.cores.Lane`: backend calls take the
            process's compute slot through it, and a formed batch runs in pieces expected to take at most
            its ``max_hold`` seconds each (a :class:`relserve.service.scheduling.cost_model.CostModel`
            fitted to this model's calls). None: a lane of its own (no coordination, no splitting).
        cost_batching: split formed batches into the sub-batches of least predicted time (step 5 of the
            module docstring); False runs them as formed (the switch exists to measure what it saves).
        batch_cost: the model's :class:`relserve.service.scheduling.cost_model.BatchCostModel`, typically fitted at warm-up
            (``ModelRunner`` passes the one its load calibrated); None: a new one, fitted from live calls.
        budgeted: ``run_batch`` takes ``(payloads, budget)``: the lane's
            :class:`relserve.service.backends.base.CallBudget` with the seconds the cost models predict for
            that call (:meth:`predict`), which a worker process's watchdog multiplies into its timeout.
    """

    worker_kind = "batcher"
    worker_error = "batcher worker error"
    purge_stage = "before compute"
    waiting_noun = "sequences"
    request_verb = "needs"
    log = log

    def __init__(
        self,
        name: str,
        run_batch: RunBatch,
        *,
        max_batch_size: int = 32,
        max_batch_tokens: int = 8192,
        max_queue_delay: float = 0.005,
        max_queue_size: int = 1024,
        is_padded: bool = True,
        bucket_width: int = 32,
        length_bucketing: bool = True,
        max_request_batch_share: float = 1.0,
        on_queue_depth: Callable[[int], None] = _noop,
        on_batch: Callable[[BatchStats], None] = _noop,
        compute: Lane | None = None,
        cost_batching: bool = True,
        batch_cost: BatchCostModel | None = None,
        budgeted: bool = False,
    ) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1 or max_queue_size < 1 or max_queue_delay < 0:
            raise ValueError("batcher limits must be positive (max_queue_delay >= 0)")
        if not 0 < max_request_batch_share <= 1:
            raise ValueError("max_request_batch_share must be in (0, 1]")
        super().__init__(name, max_queue_size=max_queue_size, max_queue_delay=max_queue_delay,
                         on_depth=on_queue_depth, compute=compute)
        self._run_batch = run_batch
        self._budgeted = budgeted
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.is_padded = is_padded
        self.bucket_width = max(1, bucket_width)
        self.length_bucketing = length_bucketing
        self.request_batch_cap = max(1, math.ceil(max_request_batch_share * max_batch_size))
        self._formed_full = False  # the batch being executed took all its limits allowed (see _take_batch)

        def observe_batch(stats: BatchStats) -> None:  # every executed piece also feeds the drain rate
            self.drain.drained(stats.size, stats.inference_s, full=self._formed_full)
            on_batch(stats)

        self._on_batch = observe_batch
        self.cost_model = CostModel(self._lane.max_hold)
        self.cost_batching = cost_batching
        self.batch_cost = batch_cost if batch_cost is not None else BatchCostModel()
        self.executions = 0  # number of backend calls so far (tests and logs)

    # ------------------------------------------------------------------ submission

    def submit(self, items: Sequence[tuple[int, Any]], deadline: float | None = None,
               reservation: Reservation | None = None) -> list[Unit]:
        """Enqueue ``(tokens, payload)`` items as units of one request (all or none).

        With a ``reservation`` (:meth:`reserve`) its places count as the request's own; they are consumed
        on success and stay held (for the caller to release) on a refusal.

        Raises:
            Unavailable: the batcher is closed or not started.
            DeadlineExceeded: the deadline already passed.
            ResourceExhausted: the queue cannot take all the items (message names max_queue_size).
        """

        def make(loop: asyncio.AbstractEventLoop, now: float) -> list[Unit]:
            request = next(_request_ids)
            trace = tracing.request(self.name, now) if tracing.ENABLED else None
            return [Unit(tokens=int(tokens), payload=payload, deadline=deadline, future=loop.create_future(),
                         enqueued_at=now, request=request, trace=trace)
                    for tokens, payload in items]

        return self._enqueue(len(items), deadline, reservation, make)

    def _check_size(self, needed: int) -> None:
        if needed > self.max_queue_size:
            raise ResourceExhausted(
                f"request needs {needed} sequences but model {self.name!r} has max_queue_size "
                f"{self.max_queue_size}; send a shorter request"
            )

    def _retry_hint(self, needed: int, others: int) -> float | None:
        return self.retry_after(needed)

    def retry_after(self, needed: int) -> float:
        """Seconds a request of ``needed`` units refused now should wait before retrying (the queue's drain
        estimate; the request joins its virtual queue). Give it to the queue-full :class:`ResourceExhausted`."""
        return self.drain.retry_after(len(self._queue) + self._reserved, needed)

    async def run(self, items: Sequence[tuple[int, Any]], deadline: float | None = None,
                  reservation: Reservation | None = None) -> list[Unit]:
        """Submit the items and wait for all their results; returns the units in order (``unit.result``).

        On the first failing unit, on the deadline, or when the calling task is cancelled, the request's
        other units leave the queue (their reply slots are cancelled) and the error propagates.

        Raises:
            RelserveError: as :meth:`submit`, or the first unit's error; DeadlineExceeded on the deadline.
            asyncio.CancelledError: the caller was cancelled.
        """
        units = self.submit(items, deadline, reservation)
        return await self.wait(units, deadline)

    def _where_late(self, units: Sequence[Unit]) -> str:
        running = any(u.batch_size for u in units)
        return "while the model was computing" if running else "while waiting in the queue"

    # ------------------------------------------------------------------ worker

    async def _round(self) -> None:
        self._purge()
        if not self._queue:
            return
        if self.max_queue_delay > 0:
            # at most max_queue_delay from the oldest unit's arrival, for a fuller batch
            until = self._queue[0].enqueued_at + self.max_queue_delay
            await self._linger(lambda: until)
            self._purge()
            if not self._queue:
                return
        batch = self._take_batch()
        await self._execute(batch)

    def _full(self) -> bool:
        return self._full_batch_waiting()

    def _full_batch_waiting(self) -> bool:
        if len(self._queue) >= self.max_batch_size:
            return True
        if self.is_padded:
            return len(self._queue) * max(u.tokens for u in self._queue) >= self.max_batch_tokens
        return sum(u.tokens for u in self._queue) >= self.max_batch_tokens

    def _cost(self, size: int, longest: int, total: int) -> int:
        return size * longest if self.is_padded else total

    def _take_batch(self) -> list[Unit]:
        """Oldest unit first, then the closest length buckets (or arrival order), within both limits and the
        per-request cap; then, work-conserving, the units the cap held back fill what is left (same order)."""
        anchor = self._queue[0]
        bucket = anchor.tokens // self.bucket_width
        if self.length_bucketing:
            order = sorted(
                range(1, len(self._queue)),
                key=lambda i: (abs(self._queue[i].tokens // self.bucket_width - bucket), i),
            )
        else:
            order = list(range(1, len(self._queue)))
        chosen = [0]
        longest, total = anchor.tokens, anchor.tokens
        per_request = {anchor.request: 1}
        held_back: list[int] = []
        for capped in (True, False):
            for i in order if capped else held_back:
                if len(chosen) >= self.max_batch_size:
                    break
                u = self._queue[i]
                if self._cost(len(chosen) + 1, max(longest, u.tokens), total + u.tokens) > self.max_batch_tokens:
                    continue
                if capped and per_request.get(u.request, 0) >= self.request_batch_cap:
                    held_back.append(i)  # taken in the second pass only if no other request's unit fits
                    continue
                chosen.append(i)
                per_request[u.request] = per_request.get(u.request, 0) + 1
                longest, total = max(longest, u.tokens), total + u.tokens
        picked = set(chosen)
        batch = [self._queue[i] for i in sorted(chosen)]
        # limited by the batch limits, not by what happened to wait: its rate is a full queue's drain rate
        self._formed_full = len(chosen) < len(self._queue) or len(chosen) >= min(self.max_batch_size,
                                                                                  self.max_queue_size)
        self._queue = [u for i, u in enumerate(self._queue) if i not in picked]
        self._on_depth(len(self._queue))
        return batch

    def plan(self, formed: Sequence[Unit]) -> list[list[int]]:
        """The sub-batches (indices into ``formed``, in the order they run) of a formed batch: the least
        predicted total time once the batch cost model is fitted (see the module docstring, step 5), else
        consecutive pieces within the lane's ``max_hold``."""
        lengths = [u.tokens for u in formed]
        coef = self.batch_cost.coefficients() if self.cost_batching and self.batch_cost.fitted else None
        if coef is None:
            return self.cost_model.split(lengths, self.is_padded)
        # max_batch_time_ms exists for the other models' sake: alone, the least predicted time is all that counts
        max_time = self._lane.max_hold if self._lane.contended else 0.0
        return plan_batch(lengths, coef, is_padded=self.is_padded, max_batch_size=self.max_batch_size,
                          max_batch_time=max_time, min_piece_tokens=self.cost_model.min_piece_tokens)

    def predict(self, lengths: Sequence[int]) -> float | None:
        """Seconds one backend call over units of ``lengths`` tokens is expected to take: the batch cost model
        once fitted, else the per-token one; None before either has seen a call."""
        if self.batch_cost.fitted:
            predicted = self.batch_cost.predict(lengths, self.is_padded)
            if predicted is not None:
                return predicted
        if not lengths:
            return None
        return self.cost_model.estimate(self._cost(len(lengths), max(lengths), sum(lengths)))

    async def _execute(self, formed: list[Unit]) -> None:
        """Run a formed batch as the sub-batches of :meth:`plan`, back to back, each a backend call of its
        own."""
        for piece in self.plan(formed):
            await self._execute_piece([formed[i] for i in piece])

    async def _execute_piece(self, batch: list[Unit]) -> None:
        start = time.monotonic()
        for u in batch:
            u.queue_s = start - u.enqueued_at
            u.batch_size = len(batch)
        self.executions += 1
        # units cancelled or expired while the piece waited for the cores (earlier pieces, other models)
        # are left out when it gets them; a failing batch: only its own units hear about it
        run = self._run_batch
        if self._budgeted:  # the call's budget carries its predicted seconds (a worker's watchdog reads them)
            budget = self.budget.expecting(self.predict([u.tokens for u in batch]))
            run = lambda payloads: self._run_batch(payloads, budget)  # noqa: E731
        results, failed = await self._call(
            batch, run, [u.payload for u in batch], lambda payloads, live: [payloads[i] for i in live],
            what=f"a batch of {len(batch)}",
            mismatch=lambda n: f"backend of model {self.name!r} returned {n} results for a batch of {len(batch)}",
        )
        elapsed = time.monotonic() - start
        timing = self._lane.take_timing()
        compute_s = timing.compute_s if timing is not None else elapsed
        for u, res in zip(batch, results):
            u.inference_s = elapsed
            if u.future.done():  # cancelled or timed out while computing
                continue
            if isinstance(res, BaseException):
                u.future.set_exception(res)
            else:
                u.future.set_result(res)
        longest = max(u.tokens for u in batch)
        real = sum(u.tokens for u in batch)
        padded = self._cost(len(batch), longest, real)
        if tracing.ENABLED:
            tracing.backend_call((u.trace for u in batch), start, start + elapsed, {
                **self.trace_attributes, "relserve.batch.size": len(batch), "relserve.batch.real_tokens": real,
                "relserve.batch.padded_tokens": padded}, failed)
        if not failed:
            self.cost_model.observe(padded, compute_s)
            self.batch_cost.observe([u.tokens for u in batch], compute_s, is_padded=self.is_padded)
        try:
            self._on_batch(BatchStats(
                size=len(batch), real_tokens=real, padded_tokens=padded,
                inference_s=elapsed, queue_s=tuple(u.queue_s for u in batch), failed=failed, compute_s=compute_s,
            ))
        except Exception:  # an observer must never stop the worker
            log.exception("model %r: batch observer failed", self.name)
