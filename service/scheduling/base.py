"""The scheduler base both policies share: a queue of *units* with deadlines, cancellation, admission
(reservations and the queue-full refusal with its retry hint), the worker task and the backend call.

A policy (``scheduling/batcher.py``: the encoder batcher; ``scheduling/decode_loop.py``: the translation decode
loop) subclasses :class:`QueueScheduler` and says what a unit is, how a batch is formed and what one round of
its worker does. Everything else is here, once:

* admission: :meth:`QueueScheduler.reserve` holds places for a request being tokenized and
  :meth:`QueueScheduler.submit` (through ``_enqueue``) enqueues all of a request's units or none; waiting units
  plus every reservation count against ``max_queue_size``, and a refusal carries ``retry_after_s`` from the
  queue's :class:`relserve.service.scheduling.pushback.DrainEstimate` (pushback);
* deadlines and cancellation: units whose reply slot is done or whose deadline passed leave the queue before
  they cost compute (:func:`drop_dead`), and again when their call finally gets the cores (:func:`live_only`);
  a request's waiter (:func:`wait_all`) takes the others out on the first failure, the deadline or its own
  cancellation;
* fairness between models: every backend call holds the process's compute slot through the model's
  :class:`relserve.service.scheduling.cores.Lane` and is given its :class:`relserve.service.backends.base.CallBudget`;
  fairness between requests of one model is the policy's (the batcher's per-request cap, the decode loop's
  strict FIFO);
* the worker: one asyncio task per model, woken by every submission, whose rounds the policy writes
  (``_round``); an error in a round is logged and the worker goes on.

Units are objects with a reply slot ``future`` (an asyncio future), a ``deadline`` (``time.monotonic()``
seconds or None) and ``enqueued_at``. No torch, no numpy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

from ..backends.base import CallBudget
from ..errors import DeadlineExceeded, Internal, RelserveError, ResourceExhausted, Unavailable
from .cores import ComputeScheduler, Lane
from .pushback import DrainEstimate


class QueuedUnit(Protocol):
    """What the helpers read of a unit."""

    future: asyncio.Future
    deadline: float | None
    enqueued_at: float


U = TypeVar("U", bound=QueuedUnit)


def fail(unit: QueuedUnit, exc: BaseException) -> None:
    """Set ``exc`` on the unit's reply slot unless it is already done."""
    if not unit.future.done():
        unit.future.set_exception(exc)


def check_open(name: str, accepting: bool, deadline: float | None, now: float) -> None:
    """Refuse a submission to a closed (or not started) queue, or one whose deadline already passed.

    Raises:
        Unavailable: not ``accepting``.
        DeadlineExceeded: ``deadline <= now``.
    """
    if not accepting:
        raise Unavailable(f"model {name!r} is not accepting requests (not started or shutting down)")
    if deadline is not None and deadline <= now:
        raise DeadlineExceeded(f"deadline passed before the request reached the queue of model {name!r}")


def drop_dead(queue: list[U], name: str, stage: str, on_depth: Callable[[int], None]) -> list[U]:
    """``queue`` without cancelled units (reply slot done) and expired ones (they get DeadlineExceeded,
    naming ``stage``); ``on_depth`` hears the new length if it changed."""
    now = time.monotonic()
    keep: list[U] = []
    for u in queue:
        if u.future.done():
            continue
        if u.deadline is not None and u.deadline <= now:
            fail(u, DeadlineExceeded(
                f"deadline passed after {now - u.enqueued_at:.3f} s in the queue of model {name!r}, "
                f"{stage}"
            ))
            continue
        keep.append(u)
    if len(keep) != len(queue):
        on_depth(len(keep))
    return keep


def discard(queue: list[U], units: Sequence[U], on_depth: Callable[[int], None]) -> list[U]:
    """Cancel the units' reply slots; returns ``queue`` without them (``on_depth`` hears a change)."""
    drop = {id(u) for u in units}
    keep = [u for u in queue if id(u) not in drop]
    for u in units:
        if not u.future.done():
            u.future.cancel()
    if len(keep) != len(queue):
        on_depth(len(keep))
    return keep


async def wait_all(
    units: list[U],
    deadline: float | None,
    name: str,
    on_give_up: Callable[[list[U]], None],
    where_late: Callable[[], str],
) -> list[U]:
    """Wait for every unit of one request.

    On the first failing unit, on the deadline, or when the caller is cancelled, ``on_give_up(units)``
    takes the others out and the error propagates; ``where_late()`` names the phase for the deadline message.

    Raises:
        RelserveError: the first unit's error; DeadlineExceeded on the deadline.
        asyncio.CancelledError: the caller was cancelled.
    """
    futures = [u.future for u in units]
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        done, pending = await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # cancelled: the RPC is gone, its units leave the queue
        on_give_up(units)
        raise
    errors = [f.exception() for f in futures if f in done and not f.cancelled()]  # marks all retrieved
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        on_give_up(units)
        raise first
    if pending:
        where = where_late()
        on_give_up(units)
        raise DeadlineExceeded(f"deadline exceeded {where} (model {name!r})")
    return units


class Reservation:
    """Queue places a request holds while it is being tokenized (``Batcher.reserve``, ``DecodeLoop.reserve``).

    They count against ``max_queue_size`` as if the request's units were already waiting, so concurrent
    requests that are still tokenizing cannot all be admitted into one free place, and a request the queue
    cannot take is refused before any tokenizing. ``submit(..., reservation=r)`` consumes them; ``release()``
    gives them back (idempotent), as does leaving a ``with`` block, so an error or a cancellation while
    tokenizing frees them.
    """

    __slots__ = ("places", "_give_back")

    def __init__(self, places: int, give_back: Callable[[int], None]) -> None:
        self.places = places
        self._give_back = give_back

    def release(self) -> None:
        if self.places:
            n, self.places = self.places, 0
            self._give_back(n)

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def model_executor(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """The model's own single backend thread (the event loop never runs the backend)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"relserve-{name}")


async def cancel_worker(worker: asyncio.Task) -> None:
    """Cancel a worker task and wait for it, swallowing what it ends with."""
    worker.cancel()
    try:
        await worker
    except (asyncio.CancelledError, Exception):
        pass


async def call_backend(
    executor: concurrent.futures.Executor,
    fn: Callable[[Any], Sequence[Any]],
    arg: Any,
    members: Sequence[QueuedUnit],
    *,
    name: str,
    what: str,
    mismatch: Callable[[int], str],
    log: logging.Logger,
    lane: Lane | None = None,
) -> tuple[list[Any], bool]:
    """Run ``fn(arg)`` in the model's thread; returns (one result or Exception per member, whether it failed).

    With a ``lane`` (``scheduling/cores.py``) the call runs holding the process's compute slot: in the
    thread it first waits for its turn. If ``fn`` raises, or returns a number of results other than
    ``len(members)`` (``mismatch(n)`` is the message), every member gets the same error and no other unit
    is touched; an unexpected exception becomes :class:`Internal` naming ``what`` and is logged. When the
    caller is cancelled (shutdown) the members fail with UNAVAILABLE and the cancellation propagates.
    """
    call: Callable[[Any], Any] = fn if lane is None else (lambda a: lane.run(fn, a))
    try:
        results = list(await asyncio.get_running_loop().run_in_executor(executor, call, arg))
        if len(results) != len(members):
            raise Internal(mismatch(len(results)))
    except asyncio.CancelledError:
        for m in members:
            fail(m, Unavailable(f"model {name!r} is shutting down"))
        raise
    except Exception as exc:
        return [as_error(exc, name, what, log)] * len(members), True
    return results, False


def live_only(
    members: Sequence[QueuedUnit],
    fn: Callable[[Any], Sequence[Any]],
    select: Callable[[Any, list[int]], Any],
    name: str,
) -> Callable[[Any], Sequence[Any]]:
    """``fn`` for members that may have waited for the compute slot: when it runs (in the model's thread,
    holding the slot), members whose reply slot is done (cancelled, or another unit of the request failed)
    are left out and expired ones get :class:`DeadlineExceeded`; ``fn`` gets ``select(arg, live indices)``
    and its results are spread back to one per member (the left-out ones get an error nobody reads). With
    no live member ``fn`` is not called. Reading ``future.done()`` from the backend thread is a plain
    attribute read; a cancellation that lands just after it costs one computation, as before.
    """

    def call(arg: Any) -> Sequence[Any]:
        now = time.monotonic()
        out: list[Any] = [None] * len(members)
        live: list[int] = []
        for i, u in enumerate(members):
            if u.future.done():
                out[i] = Unavailable(f"model {name!r}: request gone before compute")
            elif u.deadline is not None and u.deadline <= now:
                out[i] = DeadlineExceeded(
                    f"deadline passed after {now - u.enqueued_at:.3f} s in the queue of model {name!r}, "
                    f"while waiting for the cores"
                )
            else:
                live.append(i)
        if len(live) == len(members):
            return fn(arg)
        if live:
            results = list(fn(select(arg, live)))
            if len(results) != len(live):
                raise Internal(f"backend of model {name!r} returned {len(results)} results for {len(live)} inputs")
            for i, res in zip(live, results):
                out[i] = res
        return out

    return call


def as_error(exc: BaseException, name: str, what: str, log: logging.Logger) -> RelserveError:
    """A domain error as it is; anything else logged with its traceback and turned into Internal."""
    if isinstance(exc, RelserveError):
        return exc
    log.error("model %r: %s failed: %s: %s", name, what, type(exc).__name__, exc,
              exc_info=(type(exc), exc, exc.__traceback__))
    return Internal(f"model {name!r} failed on {what}: {type(exc).__name__}: {exc}")


class QueueScheduler(Generic[U]):
    """What the batcher and the decode loop share (see the module docstring): the queue, its admission and
    pushback, the worker task, the model's executor thread and compute lane, and their lifecycle.

    Args:
        name: model name (messages, executor thread and worker task names).
        max_queue_size: units allowed to wait (reservations included); beyond it submissions raise
            ResourceExhausted.
        max_queue_delay: seconds the oldest unit may wait for company when nothing runs; 0 = never wait.
        on_depth: called with the number of waiting units whenever it changes.
        compute: the model's :class:`relserve.service.scheduling.cores.Lane`; None: a lane of its own (no
            coordination).

    Subclasses set :attr:`worker_kind`, :attr:`purge_stage`, :attr:`waiting_noun`, :attr:`request_verb` and
    :attr:`log`, and write :meth:`_round` (one round of the worker), :meth:`_full` (a full batch waits) and
    :meth:`_where_late`.
    """

    worker_kind = "scheduler"        # the worker task is named relserve-<worker_kind>-<name>
    worker_error = "scheduler error"  # logged when a round raises
    purge_stage = "before compute"   # named in the deadline message of units dropped while waiting
    waiting_noun = "units"           # queue-full message: "<n> <noun> waiting"
    request_verb = "needs"           # queue-full message: "request <verb> <n>"
    log = logging.getLogger(__name__)

    def __init__(self, name: str, *, max_queue_size: int, max_queue_delay: float,
                 on_depth: Callable[[int], None], compute: Lane | None) -> None:
        self.name = name
        self.max_queue_size = max_queue_size
        self.max_queue_delay = max_queue_delay
        self._on_depth = on_depth
        self._queue: list[U] = []
        self._reserved = 0  # places held by requests being tokenized (reserve)
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._suspended: str | None = None  # why the model cannot compute now (suspend); None: it can
        self._lane = compute if compute is not None else ComputeScheduler("shared").lane(name)
        self.drain = DrainEstimate()  # retry guidance for queue-full refusals
        # attributes of every backend call's span (service/tracing.py); the runner adds the backend and dtype
        self.trace_attributes: dict[str, Any] = {"relserve.model": name}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the worker on the running event loop (idempotent)."""
        if self._worker is not None:
            return
        self._wake = asyncio.Event()
        self._executor = model_executor(self.name)
        self._worker = asyncio.get_running_loop().create_task(
            self._work(), name=f"relserve-{self.worker_kind}-{self.name}")

    async def close(self) -> None:
        """Stop the worker; waiting (and running) units fail with UNAVAILABLE. A hung backend thread is
        abandoned."""
        self._closed = True
        for unit in self._queue + self._running():
            fail(unit, Unavailable(f"model {self.name!r} is shutting down"))
        self._queue.clear()
        self._on_depth(0)
        self._closing()
        self._lane.close()  # a call waiting for the cores gives up now
        if self._worker is not None:
            await cancel_worker(self._worker)
            self._worker = None
        self._stopped()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def suspend(self, reason: str) -> None:
        """The model cannot compute for now (its worker process is being replaced): every waiting unit fails
        with :class:`Unavailable` naming ``reason`` at once instead of waiting out its deadline, and so does
        every submission until :meth:`resume`. Reservations stay held (their submissions are refused)."""
        self._suspended = reason
        error = self._suspension()
        for unit in self._queue:
            fail(unit, Unavailable(str(error)))
        self._queue.clear()
        self._on_depth(0)

    def resume(self) -> None:
        """Accept and compute again (after :meth:`suspend`)."""
        self._suspended = None

    def _suspension(self) -> Unavailable:
        return Unavailable(f"model {self.name!r} is not ready: {self._suspended}; retry later")

    def _running(self) -> list[U]:
        """Units past the queue that a close must fail too (none unless the policy keeps some)."""
        return []

    def _closing(self) -> None:
        """Policy hook of :meth:`close`, after the units failed and before the lane closes."""

    def _stopped(self) -> None:
        """Policy hook of :meth:`close`, once the worker stopped and before the executor goes."""

    @property
    def queue_depth(self) -> int:
        """Units waiting in the queue."""
        return len(self._queue)

    @property
    def reserved(self) -> int:
        """Queue places held by requests that are still being tokenized (:meth:`reserve`)."""
        return self._reserved

    @property
    def budget(self) -> CallBudget:
        """What every backend call of this model is given (its lane's :attr:`relserve.service.scheduling.cores.Lane.budget`):
        the calls run holding that lane's compute slot."""
        return self._lane.budget

    # ------------------------------------------------------------------ admission

    def reserve(self, places: int, deadline: float | None = None) -> Reservation:
        """Admission before work: hold ``places`` queue places for a request about to be tokenized.

        ``places`` is a cheap estimate of its units (the number of texts; for QA a window count estimated
        from the context's length). Waiting units plus every reservation count against ``max_queue_size``,
        so a request refused here costs no tokenizing. Give the reservation to ``submit`` (which takes the
        places over, checking only the difference when the exact count is larger) or release it.

        Raises:
            as ``submit``.
        """
        self._admit(places, 0, deadline)
        self._reserved += places
        return Reservation(places, self._unreserve)

    def _unreserve(self, places: int) -> None:
        self._reserved -= places

    def _admit(self, needed: int, held: int, deadline: float | None) -> None:
        """Check that ``needed`` more units fit, ``held`` of the reserved places being the request's own."""
        check_open(self.name, not (self._closed or self._worker is None or self._wake is None),
                   deadline, time.monotonic())
        if self._suspended is not None:
            raise self._suspension()
        self._check_size(needed)
        others = self._reserved - held
        if len(self._queue) + others + needed > self.max_queue_size:
            self._purge()  # expired or cancelled units must not hold places
        if len(self._queue) + others + needed > self.max_queue_size:
            also = f" and {others} held by requests being tokenized" if others else ""
            raise ResourceExhausted(
                f"queue of model {self.name!r} is full: {len(self._queue)} {self.waiting_noun} waiting{also}, "
                f"request {self.request_verb} {needed}, max_queue_size is {self.max_queue_size}; retry later",
                retry_after_s=self._retry_hint(needed, others),
            )

    def _check_size(self, needed: int) -> None:
        """Policy hook: refuse a request that can never fit before looking at the queue."""

    def _retry_hint(self, needed: int, others: int) -> float | None:
        """The refusal's ``retry_after_s`` (the request joins the drain estimate's virtual queue)."""
        return self.drain.retry_after(len(self._queue) + others, needed)

    def _enqueue(self, count: int, deadline: float | None, reservation: Reservation | None,
                 make: Callable[[asyncio.AbstractEventLoop, float], list[U]]) -> list[U]:
        """Admit ``count`` units of one request (all or none) and queue what ``make(loop, now)`` builds.

        With a ``reservation`` its places count as the request's own; they are consumed on success and stay
        held (for the caller to release) on a refusal.

        Raises:
            Unavailable: closed or not started.
            DeadlineExceeded: the deadline already passed.
            ResourceExhausted: the queue cannot take all the units (names max_queue_size).
        """
        now = time.monotonic()
        self._admit(count, reservation.places if reservation is not None else 0, deadline)
        assert self._wake is not None
        if reservation is not None:
            reservation.release()
        units = make(asyncio.get_running_loop(), now)
        self._queue.extend(units)
        self._on_depth(len(self._queue))
        self._wake.set()
        return units

    # ------------------------------------------------------------------ waiting and cancellation

    async def wait(self, units: list[U], deadline: float | None = None) -> list[U]:
        """Wait for all of a request's units. On the first failure, the deadline or cancellation of the
        caller, the others are dropped (:meth:`discard`).

        Raises:
            RelserveError: the first unit's error; DeadlineExceeded on the deadline.
            asyncio.CancelledError: the caller was cancelled.
        """
        return await wait_all(units, deadline, self.name, self.discard, lambda: self._where_late(units))

    def _where_late(self, units: Sequence[U]) -> str:
        """The phase a late request's units were in, for the deadline message."""
        raise NotImplementedError

    def discard(self, units: Sequence[U]) -> None:
        """Cancel the units' reply slots and take the waiting ones out of the queue."""
        self._queue = discard(self._queue, units, self._on_depth)

    def _purge(self) -> None:
        """Drop cancelled units and fail expired ones before they cost compute."""
        self._queue = drop_dead(self._queue, self.name, self.purge_stage, self._on_depth)

    # ------------------------------------------------------------------ worker

    async def _work(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._has_work():
                try:
                    await self._round()
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug here must not leave every later request hanging
                    self.log.exception("model %r: %s; continuing", self.name, self.worker_error)
                    await asyncio.sleep(0.01)

    def _has_work(self) -> bool:
        return bool(self._queue)

    async def _round(self) -> None:
        """One round of the worker (the policy's schedule -> execute -> update)."""
        raise NotImplementedError

    def _full(self) -> bool:
        """Whether what waits fills a batch (lingering for company stops)."""
        raise NotImplementedError

    async def _linger(self, until: Callable[[], float]) -> None:
        """Wait for company: return once :meth:`_full` or at the monotonic time ``until()``, checking on each
        arrival (every submission sets the wake event)."""
        assert self._wake is not None
        while not self._full():
            remaining = until() - time.monotonic()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:
                return

    async def _call(self, members: Sequence[U], fn: Callable[[Any], Sequence[Any]], arg: Any,
                    select: Callable[[Any, list[int]], Any], *, what: str,
                    mismatch: Callable[[int], str]) -> tuple[list[Any], bool]:
        """``fn(arg)`` for ``members`` in the model's thread, holding the compute slot, members gone by then
        left out (:func:`live_only`, :func:`call_backend`); one result or Exception per member and whether
        the call failed as a whole."""
        assert self._executor is not None
        return await call_backend(
            self._executor, live_only(members, fn, select, self.name), arg, members,
            name=self.name, what=what, log=self.log, mismatch=mismatch, lane=self._lane,
        )
