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
   available at once (case C11: five requests arriving during one batch are served by one next batch);
3. the oldest unit anchors the batch (no starvation); the others join closest length bucket first, then
   oldest first, while ``max_batch_size`` and ``max_batch_tokens`` hold. The token budget counts padded
   tokens (batch size x longest) for padded backends and real tokens otherwise. A single unit longer
   than the budget still runs, alone.

The backend's ``run(payloads)`` returns one result or one Exception per payload; each goes to its own
unit. If ``run`` raises, or returns the wrong number of items, every unit of *that* batch gets the error
and no other unit is touched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from . import queueing
from .errors import ResourceExhausted, Unavailable

log = logging.getLogger(__name__)

RunBatch = Callable[[list[Any]], Sequence[Any]]


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


def _noop(*_args: Any) -> None:
    return None


class Batcher:
    """Dynamic batcher of one model.

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
        on_queue_depth: called with the number of waiting units whenever it changes.
        on_batch: called with a :class:`BatchStats` after each execution.
    """

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
        on_queue_depth: Callable[[int], None] = _noop,
        on_batch: Callable[[BatchStats], None] = _noop,
    ) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1 or max_queue_size < 1 or max_queue_delay < 0:
            raise ValueError("batcher limits must be positive (max_queue_delay >= 0)")
        self.name = name
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_delay = max_queue_delay
        self.max_queue_size = max_queue_size
        self.is_padded = is_padded
        self.bucket_width = max(1, bucket_width)
        self.length_bucketing = length_bucketing
        self._on_queue_depth = on_queue_depth
        self._on_batch = on_batch
        self._queue: list[Unit] = []
        self._arrival: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self.executions = 0  # number of backend calls so far (tests and logs)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the worker on the running event loop (idempotent)."""
        if self._worker is not None:
            return
        self._arrival = asyncio.Event()
        self._executor = queueing.model_executor(self.name)
        self._worker = asyncio.get_running_loop().create_task(
            self._work(), name=f"relserve-batcher-{self.name}"
        )

    async def close(self) -> None:
        """Stop the worker; waiting units fail with UNAVAILABLE. A hung backend thread is abandoned."""
        self._closed = True
        for unit in self._queue:
            queueing.fail(unit, Unavailable(f"model {self.name!r} is shutting down"))
        self._queue.clear()
        self._on_queue_depth(0)
        if self._worker is not None:
            await queueing.cancel_worker(self._worker)
            self._worker = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ submission

    def submit(self, items: Sequence[tuple[int, Any]], deadline: float | None = None) -> list[Unit]:
        """Enqueue ``(tokens, payload)`` items as units of one request (all or none).

        Raises:
            Unavailable: the batcher is closed or not started.
            DeadlineExceeded: the deadline already passed.
            ResourceExhausted: the queue cannot take all the items (message names max_queue_size).
        """
        now = time.monotonic()
        queueing.check_open(self.name, not (self._closed or self._worker is None or self._arrival is None),
                            deadline, now)
        assert self._arrival is not None
        if len(items) > self.max_queue_size:
            raise ResourceExhausted(
                f"request needs {len(items)} sequences but model {self.name!r} has max_queue_size "
                f"{self.max_queue_size}; send a shorter request"
            )
        if len(self._queue) + len(items) > self.max_queue_size:
            self._purge()  # expired or cancelled units must not hold places
        if len(self._queue) + len(items) > self.max_queue_size:
            raise ResourceExhausted(
                f"queue of model {self.name!r} is full: {len(self._queue)} sequences waiting, "
                f"request needs {len(items)}, max_queue_size is {self.max_queue_size}; retry later"
            )
        loop = asyncio.get_running_loop()
        units = [
            Unit(tokens=int(tokens), payload=payload, deadline=deadline, future=loop.create_future(), enqueued_at=now)
            for tokens, payload in items
        ]
        self._queue.extend(units)
        self._on_queue_depth(len(self._queue))
        self._arrival.set()
        return units

    async def run(self, items: Sequence[tuple[int, Any]], deadline: float | None = None) -> list[Unit]:
        """Submit the items and wait for all their results; returns the units in order (``unit.result``).

        On the first failing unit, on the deadline, or when the calling task is cancelled, the request's
        other units leave the queue (their reply slots are cancelled) and the error propagates.

        Raises:
            RelserveError: as :meth:`submit`, or the first unit's error; DeadlineExceeded on the deadline.
            asyncio.CancelledError: the caller was cancelled.
        """
        units = self.submit(items, deadline)
        return await self.wait(units, deadline)

    async def wait(self, units: list[Unit], deadline: float | None = None) -> list[Unit]:
        """Wait for submitted units (see :meth:`run`)."""

        def where() -> str:
            running = any(u.batch_size for u in units)
            return "while the model was computing" if running else "while waiting in the queue"

        return await queueing.wait_all(units, deadline, self.name, self.discard, where)

    def discard(self, units: Sequence[Unit]) -> None:
        """Cancel the units' reply slots and take the waiting ones out of the queue."""
        self._queue = queueing.discard(self._queue, units, self._on_queue_depth)

    # ------------------------------------------------------------------ worker

    async def _work(self) -> None:
        assert self._arrival is not None
        while True:
            await self._arrival.wait()
            self._arrival.clear()
            while self._queue:
                try:
                    self._purge()
                    if not self._queue:
                        break
                    if self.max_queue_delay > 0:
                        await self._linger()
                        self._purge()
                        if not self._queue:
                            break
                    batch = self._take_batch()
                    await self._execute(batch)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug here must not leave every later request hanging
                    log.exception("model %r: batcher worker error; continuing", self.name)
                    await asyncio.sleep(0.01)

    def _purge(self) -> None:
        """Drop cancelled units and fail expired ones before they cost compute."""
        self._queue = queueing.drop_dead(self._queue, self.name, "before compute", self._on_queue_depth)

    async def _linger(self) -> None:
        """Wait (at most max_queue_delay from the oldest unit's arrival) for a fuller batch."""
        assert self._arrival is not None
        until = self._queue[0].enqueued_at + self.max_queue_delay
        await queueing.linger(self._arrival, lambda: until, self._full_batch_waiting)

    def _full_batch_waiting(self) -> bool:
        if len(self._queue) >= self.max_batch_size:
            return True
        if self.is_padded:
            return len(self._queue) * max(u.tokens for u in self._queue) >= self.max_batch_tokens
        return sum(u.tokens for u in self._queue) >= self.max_batch_tokens

    def _cost(self, size: int, longest: int, total: int) -> int:
        return size * longest if self.is_padded else total

    def _take_batch(self) -> list[Unit]:
        """Oldest unit first, then the closest length buckets (or arrival order), within both limits."""
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
        for i in order:
            if len(chosen) >= self.max_batch_size:
                break
            t = self._queue[i].tokens
            if self._cost(len(chosen) + 1, max(longest, t), total + t) > self.max_batch_tokens:
                continue
            chosen.append(i)
            longest, total = max(longest, t), total + t
        picked = set(chosen)
        batch = [self._queue[i] for i in sorted(chosen)]
        self._queue = [u for i, u in enumerate(self._queue) if i not in picked]
        self._on_queue_depth(len(self._queue))
        return batch

    async def _execute(self, batch: list[Unit]) -> None:
        assert self._executor is not None
        start = time.monotonic()
        for u in batch:
            u.queue_s = start - u.enqueued_at
            u.batch_size = len(batch)
        self.executions += 1
        # a failing batch: only its own units hear about it
        results, failed = await queueing.call_backend(
            self._executor, self._run_batch, [u.payload for u in batch], batch,
            name=self.name, what=f"a batch of {len(batch)}", log=log,
            mismatch=lambda n: f"backend of model {self.name!r} returned {n} results for a batch of {len(batch)}",
        )
        elapsed = time.monotonic() - start
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
        try:
            self._on_batch(BatchStats(
                size=len(batch), real_tokens=real, padded_tokens=self._cost(len(batch), longest, real),
                inference_s=elapsed, queue_s=tuple(u.queue_s for u in batch), failed=failed,
            ))
        except Exception:  # an observer must never stop the worker
            log.exception("model %r: batch observer failed", self.name)
