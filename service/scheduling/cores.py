"""How the models of one process share its cores (no torch, no numpy).

Each model has its own backend thread (``scheduling.base.model_executor``). Left alone (``shared``), two models'
threads enter their backends at once, each with torch's default intra-op pool of one thread per core:
on 2 cores that is two OpenMP teams spin-waiting on each other, and a light model's 2 ms batch waits
behind whatever a 16-window QA batch of several seconds leaves it: on the 2-core machine sentiment's p99
grew 10.5x during a QA flood, up to 7x in ``loadtest/bench/isolation.py``. The server key
``compute_scheduling`` picks one of:

* ``partition`` (default) — the models compute concurrently, each on its share of the cores: a torch
  model whose ``torch_intra_op_threads`` is 0 runs each call (and, from its yield points, each encoder
  sub-layer) with ``max(1, cores // active models)`` intra-op threads (:func:`thread_share`: a model is
  active while it computes and for a second after; OpenMP keeps the count per calling thread, so each
  model's backend thread has its own), so a model alone uses every core and two busy models one half
  each; an ONNX Runtime model whose ``onnx_intra_op_threads`` is 0 gets ``cores // models`` threads once
  (:func:`partition`: a session's pool is sized when it is made). A light model never waits for another
  model's compute, and no OpenMP team waits on threads the other model's team has taken;
* ``fair`` — one backend call at a time across the models (the *compute slot*), each with all the
  cores; models waiting for it are served in turn, first come first served, and a model that releases
  the slot and wants it again queues behind the others, so no model starves another. A waiting model
  still waits for the part of the holder's call that cannot be interrupted (one layer's attention of
  one piece: 190-310 ms for a 512-token QA window, measured on the busy 2-core machine), which is
  why it is not the default;
* ``shared`` — no coordination, torch's default threads (the original behaviour).

Each model gets a :class:`Lane` (its handle on the scheduler) with ``max_hold`` = the model's
``max_batch_time_ms``: the longest one of its backend calls should hold the cores. The batcher cuts a formed
batch into pieces of at most ``max_hold`` each by its cost models (``scheduling/cost_model.py``). In
``fair`` mode each piece takes the slot anew, so other models run between the pieces, and a call's
:attr:`Lane.budget` (the :class:`relserve.service.backends.base.CallBudget` the schedulers pass to every
backend call) hands the slot to a waiting model from its layer hook (run by the torch backends between
encoder sub-layers, ``service/backends/torch_yield.py``) once a call has held it for ``max_hold``; under
``partition`` its ``threads`` follows :meth:`ComputeScheduler.thread_share` call by call and layer by layer.

Threads: :meth:`Lane.run` is called in the model's backend thread and blocks there while it waits for the
slot (the event loop never waits on it). :meth:`Lane.close` (event loop) wakes a waiting call with
:class:`Unavailable` and hands the slot on, so a closing model never blocks the others or its own shutdown.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..backends.base import CallBudget
from ..config import COMPUTE_SCHEDULING as MODES
from ..config import ModelConfig
from ..cpu_features import available_cores
from ..errors import Unavailable

_current = threading.local()  # .lane: the Lane whose call runs in this thread (yield_point reads it)
# partition: a model counts as active this long after its last backend call (a light model's requests a
# few hundred ms apart keep their cores; an idle one hands them back within a second)
ACTIVE_WINDOW_S = 1.0


@dataclass(frozen=True)
class CallTiming:
    """One :meth:`Lane.run`: seconds waiting for the slot (before it and at yield points), seconds holding
    it, and the ``clock()`` time the call first got the slot."""

    wait_s: float
    compute_s: float
    started_at: float
    yields: int = 0


class ComputeScheduler:
    """The compute slot of one process (see the module docstring).

    Args:
        mode: ``"partition"`` or ``"shared"`` (no slot: calls never wait), or ``"fair"`` (one backend call
            at a time, models in turn).
        clock: monotonic seconds (tests pass a fake one; it decides when a holder must yield and which
            models count as active).
        cores: what ``partition`` divides (default :func:`available_cores`).

    Raises:
        ValueError: unknown mode.
    """

    def __init__(self, mode: str = "partition", *, clock: Callable[[], float] = time.monotonic,
                 cores: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"compute scheduling {mode!r} is not one of {list(MODES)}")
        self.mode = mode
        self.clock = clock
        self.cores = cores or available_cores()
        self._lanes: list[Lane] = []
        self._cond = threading.Condition()
        self._holder: Lane | None = None
        self._waiting: collections.deque[Lane] = collections.deque()
        self.grants = 0  # times the slot was given to a call (tests and logs)
        self.handovers = 0  # times a holder yielded the slot at a yield point

    @property
    def fair(self) -> bool:
        return self.mode == "fair"

    def lane(self, name: str, max_hold: float = 0.0) -> "Lane":
        """A model's handle. ``max_hold``: seconds one of its calls may hold the cores while another model
        waits (0 = no cap: pieces are not split and the call never yields)."""
        if max_hold < 0:
            raise ValueError("max_hold must be >= 0 seconds")
        lane = Lane(self, name, max_hold)
        with self._cond:
            self._lanes = [x for x in self._lanes if not x.closed] + [lane]
        return lane

    def thread_share(self) -> int:
        """``partition``: the intra-op threads a call should use now, ``max(1, cores // active models)``,
        where a model is active while a call of it runs and for :data:`ACTIVE_WINDOW_S` after its last one
        (so a model alone gets every core, and two busy models one half each). 0 in the other modes
        (the backend's default)."""
        if self.mode != "partition":
            return 0
        now = self.clock()
        active = sum(1 for lane in self._lanes if not lane.closed and (
            lane.running or now - lane.last_end < ACTIVE_WINDOW_S))
        return max(1, self.cores // max(1, active))

    def others_active(self, lane: "Lane") -> bool:
        """Whether a model other than ``lane``'s is active (a call running, or one ended within
        :data:`ACTIVE_WINDOW_S`), in any mode."""
        now = self.clock()
        return any(x is not lane and not x.closed and (x.running or now - x.last_end < ACTIVE_WINDOW_S)
                   for x in self._lanes)

    @property
    def holder(self) -> str | None:
        """Name of the model whose call holds the slot (None when free, and always unless ``fair``)."""
        with self._cond:
            return self._holder.name if self._holder else None

    @property
    def waiting(self) -> list[str]:
        """Names of the models waiting for the slot, in the order they will get it."""
        with self._cond:
            return [lane.name for lane in self._waiting]

    # ------------------------------------------------------------------ the slot (called with _cond held)

    def _pass_on(self) -> None:
        self._holder = self._waiting.popleft() if self._waiting else None
        if self._holder is not None:
            self.grants += 1
        self._cond.notify_all()

    def _wait_for_turn(self, lane: "Lane") -> None:
        """Queue ``lane`` (FIFO) unless the slot is free, and block until it holds the slot.

        Raises:
            Unavailable: the lane was closed while waiting (the slot goes on to the next model).
        """
        if self._holder is None and not self._waiting:
            self._holder = lane
            self.grants += 1
            return
        if lane not in self._waiting:
            self._waiting.append(lane)
        while self._holder is not lane and not lane.closed:
            self._cond.wait()
        if lane.closed:
            if lane in self._waiting:
                self._waiting.remove(lane)
            if self._holder is lane:
                self._pass_on()
            raise Unavailable(f"model {lane.name!r} is shutting down")

    def _release(self, lane: "Lane") -> None:
        if self._holder is lane:
            self._pass_on()


class Lane:
    """One model's handle on the :class:`ComputeScheduler` (made by :meth:`ComputeScheduler.lane`).

    One call at a time per lane: the model's single backend thread calls :meth:`run`.
    """

    def __init__(self, scheduler: ComputeScheduler, name: str, max_hold: float) -> None:
        self.scheduler = scheduler
        self.name = name
        self.max_hold = max_hold
        self.closed = False
        self.running = False  # a call is in run() (partition counts it as active)
        self.last_end = float("-inf")  # clock() when the last call ended
        self._held_since = 0.0
        self._compute = 0.0
        self._wait = 0.0
        self._yields = 0
        self._last: CallTiming | None = None
        # what every backend call of this model is given: the share of the cores now, and the layer hook
        self.budget = CallBudget(threads=scheduler.thread_share, layer_hook=self.yield_point)

    def run(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        """``fn(arg)`` holding the compute slot (blocking; in the model's backend thread). In fair mode it
        first waits for the slot; the slot is released when ``fn`` returns or raises. The call's
        :class:`CallTiming` is then available once from :meth:`take_timing`.

        Raises:
            Unavailable: the lane is closed (before or while waiting).
            Exception: whatever ``fn`` raises.
        """
        sched = self.scheduler
        clock = sched.clock
        if self.closed:
            raise Unavailable(f"model {self.name!r} is shutting down")
        t0 = clock()
        self._compute = self._wait = 0.0
        self._yields = 0
        if sched.fair:
            with sched._cond:
                sched._wait_for_turn(self)
        started = self._held_since = clock()
        self._wait = started - t0
        previous, _current.lane = getattr(_current, "lane", None), self
        self.running = True
        try:
            return fn(arg)
        finally:
            self.running = False
            self.last_end = clock()
            _current.lane = previous
            self._compute += clock() - self._held_since
            if sched.fair:
                with sched._cond:
                    sched._release(self)
            self._last = CallTiming(self._wait, self._compute, started, self._yields)

    @property
    def contended(self) -> bool:
        """Whether another model is active now (:meth:`ComputeScheduler.others_active`): only then does
        ``max_hold`` bound the pieces a formed batch is cut into, since with the cores to itself a model's
        pieces delay no one but its own queue, which waits for the whole formed batch anyway."""
        return self.scheduler.others_active(self)

    def take_timing(self) -> CallTiming | None:
        """The timing of the last finished :meth:`run` (None if already taken or none ran). Read it on the
        event loop after awaiting the call; the backend thread wrote it before the call completed."""
        timing, self._last = self._last, None
        return timing

    def yield_point(self) -> None:
        """The layer hook of :attr:`budget`, run by the backend inside :meth:`run`: if this call has held the
        slot for ``max_hold`` seconds and another model waits, hand the slot over and wait for the next
        turn.

        Raises:
            Unavailable: the lane was closed (stops a long batch of a model that is shutting down).
        """
        if self.closed:
            raise Unavailable(f"model {self.name!r} is shutting down")
        sched = self.scheduler
        # unlocked fast path: read on every layer of every batch, nearly always with nobody waiting
        if not sched.fair or self.max_hold <= 0 or not sched._waiting:
            return
        clock = sched.clock
        now = clock()
        if now - self._held_since < self.max_hold:
            return
        with sched._cond:
            if sched._holder is not self or not sched._waiting:
                return
            self._compute += now - self._held_since
            self._yields += 1
            sched.handovers += 1
            sched._waiting.append(self)  # behind every model waiting now
            sched._pass_on()
            sched._wait_for_turn(self)
        back = clock()
        self._wait += back - now
        self._held_since = back

    def close(self) -> None:
        """Refuse further calls; a call waiting for the slot raises :class:`Unavailable`, and the slot is
        handed on if this lane holds it (a backend thread still computing is abandoned, as the executor's
        shutdown abandons it). Idempotent; any thread."""
        self.closed = True
        sched = self.scheduler
        with sched._cond:
            if self in sched._waiting:
                sched._waiting.remove(self)
            sched._release(self)
            sched._cond.notify_all()


def thread_share() -> int:
    """The intra-op threads of the call running in this thread (its lane's :meth:`ComputeScheduler.thread_share`,
    as its :attr:`Lane.budget` grants); 0 (the backend's default) outside :meth:`Lane.run`."""
    lane = getattr(_current, "lane", None)
    return lane.scheduler.thread_share() if lane is not None else 0


def yield_point() -> None:
    """The layer hook of the call running in this thread (:meth:`Lane.yield_point`, as its :attr:`Lane.budget`
    runs it); a no-op outside :meth:`Lane.run` (warm-up, tests) and in shared mode.

    Raises:
        Unavailable: the calling model is shutting down.
    """
    lane = getattr(_current, "lane", None)
    if lane is not None:
        lane.yield_point()


def partition(models: Sequence[ModelConfig], cores: int | None = None) -> tuple[ModelConfig, ...]:
    """``compute_scheduling: partition`` for ONNX Runtime, whose session pools are sized once: every model
    whose ``onnx_intra_op_threads`` is 0 (the default) gets ``max(1, cores // len(models))`` instead;
    explicit values are kept. (Torch threads follow :attr:`Lane.budget` call by call.) ``cores`` defaults
    to :func:`available_cores`."""
    if not models:
        return ()
    share = max(1, (cores or available_cores()) // len(models))
    return tuple(dataclasses.replace(m, onnx_intra_op_threads=m.onnx_intra_op_threads or share) for m in models)
