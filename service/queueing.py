"""What the batcher and the decode loop share: reply slots, deadlines, cancellation and the backend call.

Both queue *units* (``service.batcher.Unit``, ``service.decode_loop.DecodeSeq``): objects with a reply slot
``future`` (an asyncio future), a ``deadline`` (``time.monotonic()`` seconds or None) and ``enqueued_at``.
The helpers here know nothing else about them; no torch, no numpy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, TypeVar

from .errors import DeadlineExceeded, Internal, RelserveError, Unavailable

if TYPE_CHECKING:
    from .compute import Lane


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


async def linger(wake: asyncio.Event, until: Callable[[], float], full: Callable[[], bool]) -> None:
    """Wait for company: return once ``full()`` or at the monotonic time ``until()``, checking on each arrival
    (``wake`` is set by every submission)."""
    while not full():
        remaining = until() - time.monotonic()
        if remaining <= 0:
            return
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), remaining)
        except asyncio.TimeoutError:
            return


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
    lane: "Lane | None" = None,
) -> tuple[list[Any], bool]:
    """Run ``fn(arg)`` in the model's thread; returns (one result or Exception per member, whether it failed).

    With a ``lane`` (``service/compute.py``) the call runs holding the process's compute slot: in the
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
