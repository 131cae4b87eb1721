"""How the models of one process share its cores (no torch, no numpy).

Each model has its own backend thread (``queueing.model_executor``). Left alone (``shared``), two models'
threads enter their backends at once, each with torch's default intra-op pool of one thread per core:
on 2 cores that is two OpenMP teams spin-waiting on each other, and a light model's 2 ms batch waits
behind whatever a 16-window QA batch of several seconds leaves it: on the 2-core machine sentiment's p99
grew 10.5x during a QA flood (issue 10), up to 7x in ``loadtest/bench_isolation.py``. The server key
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
* ``shared`` — no coordination, torch's default threads (before issue 10).

Each model gets a :class:`Lane` (its handle on the scheduler) with ``max_hold`` = the model's
``max_batch_time_ms``: the longest one of its backend calls should hold the cores. In every mode the
batcher splits a formed batch into consecutive pieces that :class:`CostModel` (a running fit of seconds
against padded tokens, per model, from the calls it measured) expects to take at most ``max_hold`` each;
on CPU, one 512-token window per piece is also faster than 16 at once (the attention scores of a full
8192-token batch are ~200 MB). Once a model's :class:`BatchCostModel` (per call, per real token, per padded
token, per n x L^2 of the attention core; fitted from warm-up probes, :func:`calibrate`) is fitted,
:func:`plan_batch` chooses the pieces instead: the partition of the formed batch with the least predicted
time, each within ``max_hold``. In ``fair`` mode each piece takes the slot anew, so other models run
between the pieces, and :func:`yield_point` (called by the torch backends between encoder sub-layers,
``service/backends/torch_yield.py``) hands the slot to a waiting model once a call has held it for
``max_hold``.

Threads: :meth:`Lane.run` is called in the model's backend thread and blocks there while it waits for the
slot (the event loop never waits on it). :meth:`Lane.close` (event loop) wakes a waiting call with
:class:`Unavailable` and hands the slot on, so a closing model never blocks the others or its own shutdown.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .config import COMPUTE_SCHEDULING as MODES
from .config import ModelConfig
from .errors import Unavailable

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
        """Called by the backend inside :meth:`run` (see :func:`yield_point`): if this call has held the
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
    """The intra-op threads the calling backend thread's current call should use (see
    :meth:`ComputeScheduler.thread_share`); 0 (the backend's default) outside :meth:`Lane.run` or unless
    the mode is ``partition``, except where :func:`set_thread_share` set one."""
    lane = getattr(_current, "lane", None)
    return lane.scheduler.thread_share() if lane is not None else getattr(_current, "share", 0)


def set_thread_share(threads: int) -> None:
    """What :func:`thread_share` answers in the calling thread outside :meth:`Lane.run`: a model's worker
    process (``backends/worker.py``) has no scheduler of its own and applies the share its parent's scheduler
    gave the call."""
    _current.share = max(0, int(threads))


def yield_point() -> None:
    """Where a long backend call may hand the cores to a waiting model (torch forward pre-hooks call it
    between encoder layers). A no-op outside :meth:`Lane.run` (warm-up, tests) and in shared mode.

    Raises:
        Unavailable: the calling model is shutting down.
    """
    lane = getattr(_current, "lane", None)
    if lane is not None:
        lane.yield_point()


def available_cores(environ: Mapping[str, str] | None = None) -> int:
    """The cores torch would size its pool for: ``OMP_NUM_THREADS`` when set, else the CPUs this process
    may run on (``sched_getaffinity``: a cpuset of a container counts, a CFS quota does not)."""
    env = os.environ if environ is None else environ
    try:
        n = int(env.get("OMP_NUM_THREADS", "") or 0)
    except ValueError:
        n = 0
    if n > 0:
        return n
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity
        return os.cpu_count() or 1


def partition(models: Sequence[ModelConfig], cores: int | None = None) -> tuple[ModelConfig, ...]:
    """``compute_scheduling: partition`` for ONNX Runtime, whose session pools are sized once: every model
    whose ``onnx_intra_op_threads`` is 0 (the default) gets ``max(1, cores // len(models))`` instead;
    explicit values are kept. (Torch threads follow :func:`thread_share` call by call.) ``cores`` defaults
    to :func:`available_cores`."""
    if not models:
        return ()
    share = max(1, (cores or available_cores()) // len(models))
    return tuple(dataclasses.replace(m, onnx_intra_op_threads=m.onnx_intra_op_threads or share) for m in models)


MIN_PIECE_TOKENS = 512  # CostModel: pieces up to this many padded tokens are never cut (one 512-token window)


class CostModel:
    """How long a backend call of one model takes, as ``a + b x padded_tokens`` seconds, fitted to the
    calls it observed by exponentially weighted least squares (weight ``alpha`` for the newest call; with
    too little spread in sizes, or a fit that goes negative, it is the EWMA of seconds per padded token,
    ``a = 0``). :meth:`split` cuts a batch into pieces expected to take at most ``max_batch_time``.

    A piece is never cut while it costs at most ``min_piece_tokens`` padded tokens: that small, a call's
    time is mostly fixed overhead, and when clients share the cores the measured seconds swell, so without
    the floor the estimate would cut a queue of short texts into one-text calls exactly when the server is
    busiest (measured: 64 clients retrying every 50 ms, batches of 1.0 text, goodput 0.13 of capacity).

    Args:
        max_batch_time: seconds; 0 disables splitting.
        alpha: weight of the newest observation, 0 < alpha <= 1.
        min_piece_tokens: padded tokens below which a piece is not cut.
    """

    def __init__(self, max_batch_time: float, alpha: float = 0.2, min_piece_tokens: int = MIN_PIECE_TOKENS) -> None:
        if max_batch_time < 0 or not 0 < alpha <= 1 or min_piece_tokens < 0:
            raise ValueError("max_batch_time and min_piece_tokens must be >= 0 and 0 < alpha <= 1")
        self.max_batch_time = max_batch_time
        self.alpha = alpha
        self.min_piece_tokens = min_piece_tokens
        self.observations = 0
        self._mx = self._my = self._mxx = self._mxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One backend call: ``tokens`` padded tokens (real ones for unpadded backends) took ``seconds``
        of compute. Ignored when either is not positive."""
        if tokens <= 0 or seconds <= 0:
            return
        x, y = float(tokens), float(seconds)
        w = 1.0 if self.observations == 0 else self.alpha
        self._mx += w * (x - self._mx)
        self._my += w * (y - self._my)
        self._mxx += w * (x * x - self._mxx)
        self._mxy += w * (x * y - self._mxy)
        self.observations += 1

    def coefficients(self) -> tuple[float, float] | None:
        """``(a seconds, b seconds per token)``, or None before the first observation."""
        if self.observations == 0:
            return None
        per_token = self._my / self._mx
        var = self._mxx - self._mx * self._mx
        if var <= 1e-9 * self._mx * self._mx:  # (nearly) one size seen: no slope to fit
            return 0.0, per_token
        b = (self._mxy - self._mx * self._my) / var
        a = self._my - b * self._mx
        if b <= 0 or a < 0:
            return 0.0, per_token
        return a, b

    def estimate(self, tokens: int) -> float | None:
        """Expected seconds for a call of ``tokens`` padded tokens (None before any observation)."""
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * tokens

    def split(self, tokens: Sequence[int], is_padded: bool = True) -> list[list[int]]:
        """Indices of ``tokens`` (unit sizes, in batch order) grouped into consecutive pieces, each expected
        to take at most ``max_batch_time`` (a piece always has at least one unit). One piece with every
        index when splitting is off or nothing was observed yet. A piece's cost is size x longest when
        ``is_padded``, else the sum."""
        everything = list(range(len(tokens)))
        coef = self.coefficients()
        if self.max_batch_time <= 0 or coef is None or len(tokens) <= 1:
            return [everything] if tokens else []
        a, b = coef
        pieces: list[list[int]] = []
        piece: list[int] = []
        longest = total = 0
        for i, t in enumerate(tokens):
            n_longest, n_total = max(longest, t), total + t
            cost = (len(piece) + 1) * n_longest if is_padded else n_total
            if piece and cost > self.min_piece_tokens and a + b * cost > self.max_batch_time:
                pieces.append(piece)
                piece, n_longest, n_total = [], t, t
            piece.append(i)
            longest, total = n_longest, n_total
        pieces.append(piece)
        return pieces


# ---------------------------------------------------------------------------------------------- batch forming

# The terms of one backend call's time, in :meth:`BatchCostModel.features` order. Dense layers (projections,
# FFN, LayerNorm) cost per real token on an unpadded backend and per padded token on a padded one; the
# attention core (scores, c2p/p2c, softmax, context) sees the padded [n, heads, L, L] layout, so it has a
# per-padded-token part (scatter, masks) and a quadratic part n x L^2; every call pays a fixed overhead.
COST_TERMS = ("call", "real_tokens", "padded_tokens", "attention")
COST_TERM_UNITS = ("s per call", "s per real token", "s per padded token", "s per n x L^2")  # logs
PRIOR_WEIGHT = 0.25  # BatchCostModel: share of the warm-up probes in the fit once live calls were observed


def cost_features(lengths: Sequence[int], is_padded: bool = True) -> tuple[float, float, float, float]:
    """The :data:`COST_TERMS` of one backend call over sequences of ``lengths`` tokens: ``(1, sum l_i,
    n x L, n x L^2)`` with L the longest (what the attention core sees); for a backend that does not pad,
    ``(1, sum l_i, sum l_i, sum l_i^2)``."""
    n, longest = len(lengths), max(lengths, default=0)
    real = float(sum(lengths))
    if is_padded:
        return 1.0, real, float(n * longest), float(n * longest * longest)
    return 1.0, real, real, float(sum(x * x for x in lengths))


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``m x = v`` by Gaussian elimination with partial pivoting (m is small and symmetric positive
    semi-definite); None when (nearly) singular."""
    k = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = max(abs(a[i][i]) for i in range(k)) or 1.0
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) <= 1e-10 * scale:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(k):
            if r != col and a[r][col]:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] for i in range(k)]


class _Moments:
    """Weighted second moments of (features, seconds): E[x x^T], E[x y], E[y^2] and a count."""

    def __init__(self) -> None:
        d = len(COST_TERMS)
        self.xx = [[0.0] * d for _ in range(d)]
        self.xy = [0.0] * d
        self.yy = 0.0
        self.count = 0

    def add(self, x: Sequence[float], y: float, w: float) -> None:
        d = len(x)
        for i in range(d):
            self.xy[i] += w * (x[i] * y - self.xy[i])
            row = self.xx[i]
            for j in range(d):
                row[j] += w * (x[i] * x[j] - row[j])
        self.yy += w * (y * y - self.yy)
        self.count += 1


class BatchCostModel:
    """Seconds one backend call of a model takes, as a non-negative combination of :data:`COST_TERMS`::

        seconds = c + a x sum(real tokens) + d x sum(n x L) + b x sum(n x L^2)

    (one call; n rows, L the longest row; ``c`` the per-call overhead, ``a`` the dense layers per real token
    where the backend runs them unpadded, ``d`` per padded token, ``b`` the attention core's quadratic term).
    Which of ``a``/``d`` carries the dense layers is not assumed: the fit finds it, so the same model serves
    the unpadded torch backend (dense follows real tokens) and padded ones such as ONNX Runtime (dense
    follows padded tokens, ``a`` ~ 0) as long as the observations mix lengths within a call.

    Fitted by non-negative least squares on relative errors (exact: every subset of the terms is solved and
    the best feasible one kept, :meth:`coefficients`) over two sets of observations: the warm-up probes (``warmup=True``,
    equal weights; :func:`calibrate` measures them at load on the model's own device) and the live calls,
    exponentially weighted (``alpha`` for the newest). Once live calls exist the probes keep
    ``prior_weight`` of the fit, so the shapes live traffic never shows (a long window while only short texts
    arrive) stay predicted from measurement instead of extrapolated from one operating point.

    Args:
        alpha: weight of the newest live call, 0 < alpha <= 1.
        prior_weight: share of the warm-up probes once live calls were observed, 0 <= w <= 1.

    Raises:
        ValueError: alpha or prior_weight out of range.
    """

    def __init__(self, alpha: float = 0.05, prior_weight: float = PRIOR_WEIGHT) -> None:
        if not 0 < alpha <= 1 or not 0 <= prior_weight <= 1:
            raise ValueError("0 < alpha <= 1 and 0 <= prior_weight <= 1 are required")
        self.alpha = alpha
        self.prior_weight = prior_weight
        self._warm = _Moments()
        self._live = _Moments()
        self._coef: tuple[float, ...] | None = None
        self._dirty = False

    @property
    def observations(self) -> int:
        """Observed calls (warm-up probes and live calls)."""
        return self._warm.count + self._live.count

    @property
    def fitted(self) -> bool:
        """Whether the fit may plan batches: at least one warm-up probe per term. Live calls alone do not
        qualify: they come from one operating point (the traffic's shapes), which leaves the terms
        confounded, and timings of a few microseconds (test fakes) are noise."""
        return self._warm.count >= len(COST_TERMS) and self.coefficients() is not None

    def observe(self, lengths: Sequence[int], seconds: float, *, is_padded: bool = True,
                warmup: bool = False) -> None:
        """One backend call over sequences of ``lengths`` tokens took ``seconds`` of compute (a warm-up
        probe when ``warmup``). Ignored when empty or ``seconds`` is not positive."""
        if not lengths or not seconds > 0:
            return
        self.observe_features(cost_features(lengths, is_padded), seconds, warmup=warmup)

    def observe_features(self, x: Sequence[float], seconds: float, *, warmup: bool = False) -> None:
        """As :meth:`observe` with the :func:`cost_features` already computed."""
        if len(x) != len(COST_TERMS) or not seconds > 0:
            return
        m = self._warm if warmup else self._live
        w = 1.0 / (m.count + 1) if warmup else (1.0 if m.count == 0 else self.alpha)
        # relative errors: each call weighted by 1 / seconds^2 (timing noise grows with the call), so the
        # small calls that decide whether splitting pays are fitted as well as the large ones
        y = float(seconds)
        m.add([xi / y for xi in x], 1.0, w)
        self._dirty = True

    def _moments(self) -> tuple[list[list[float]], list[float], float] | None:
        warm, live = self._warm, self._live
        if not warm.count and not live.count:
            return None
        p = 1.0 if not live.count else (0.0 if not warm.count else self.prior_weight)
        d = len(COST_TERMS)
        xx = [[p * warm.xx[i][j] + (1 - p) * live.xx[i][j] for j in range(d)] for i in range(d)]
        xy = [p * warm.xy[i] + (1 - p) * live.xy[i] for i in range(d)]
        return xx, xy, p * warm.yy + (1 - p) * live.yy

    def coefficients(self) -> tuple[float, ...] | None:
        """``(c, a, d, b)`` (seconds per call, per real token, per padded token, per n x L^2 unit), all >= 0,
        or None before the first observation. Terms the observations cannot tell apart (e.g. real and padded
        tokens when no call mixed lengths) are not split arbitrarily: the subset that leaves one out wins."""
        if not self._dirty:
            return self._coef
        self._dirty = False
        mom = self._moments()
        if mom is None:
            self._coef = None
            return None
        xx, xy, yy = mom
        d = len(COST_TERMS)
        # columns scaled to unit second moment: the terms differ by ~10 orders of magnitude (1 vs n x L^2)
        s = [math.sqrt(xx[i][i]) if xx[i][i] > 0 else 0.0 for i in range(d)]
        best: tuple[float, list[float]] | None = None
        for mask in range(1, 1 << d):
            idx = [i for i in range(d) if mask >> i & 1 and s[i] > 0]
            if len(idx) != bin(mask).count("1"):
                continue
            m = [[xx[i][j] / (s[i] * s[j]) for j in idx] for i in idx]
            v = [xy[i] / s[i] for i in idx]
            theta = _solve(m, v)
            if theta is None or any(t < 0 for t in theta):
                continue
            # residual of the least-squares solution: E[y^2] - theta . E[x y]
            resid = yy - sum(t * vi for t, vi in zip(theta, v))
            if best is None or resid < best[0] - 1e-15 * max(yy, 1e-30):
                coef = [0.0] * d
                for t, i in zip(theta, idx):
                    coef[i] = t / s[i]
                best = (resid, coef)
        self._coef = tuple(best[1]) if best is not None else None
        return self._coef

    def predict(self, lengths: Sequence[int], is_padded: bool = True) -> float | None:
        """Expected seconds of one call over ``lengths`` (None before any observation)."""
        coef = self.coefficients()
        if coef is None:
            return None
        return sum(c * x for c, x in zip(coef, cost_features(lengths, is_padded)))


def plan_batch(lengths: Sequence[int], coefficients: Sequence[float], *, is_padded: bool = True,
               max_batch_size: int = 0, max_batch_time: float = 0.0,
               min_piece_tokens: int = MIN_PIECE_TOKENS) -> list[list[int]]:
    """Split a formed batch into the sub-batches of least total predicted time, oldest first.

    The units are sorted by length and an exact dynamic programme over the contiguous runs of that order
    finds the partition minimising ``sum over sub-batches of coefficients . cost_features(sub-batch)``
    (contiguous runs suffice: a sub-batch's cost grows with its longest member and its size, so putting
    shorter units with shorter ones never costs more; ``tests/unit/test_batch_planner.py`` checks it against
    every set partition). A sub-batch has at most ``max_batch_size`` units (0: no cap) and, when
    ``max_batch_time`` > 0, a predicted time of at most ``max_batch_time`` seconds unless it is one unit or
    at most ``min_piece_tokens`` padded tokens (as :meth:`CostModel.split`).

    Args:
        lengths: tokens of each unit, in queue order (index 0 = the oldest).
        coefficients: ``(c, a, d, b)`` of :meth:`BatchCostModel.coefficients`.

    Returns:
        Lists of indices into ``lengths``, each in queue order; the sub-batch holding index 0 first, then by
        each one's oldest unit (so the oldest waiting request runs first). [] for no units.
    """
    n = len(lengths)
    if n == 0:
        return []
    cap = max_batch_size if max_batch_size > 0 else n
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    srt = [lengths[i] for i in order]
    real = [0] * (n + 1)
    square = [0] * (n + 1)
    for k, x in enumerate(srt):
        real[k + 1] = real[k] + x
        square[k + 1] = square[k] + x * x
    c0, ca, cd, cb = (float(x) for x in coefficients)
    inf = float("inf")
    best: list[tuple[float, int]] = [(0.0, 0)] + [(inf, 0)] * n  # (cost, pieces) of the first j sorted units
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = srt[j - 1]  # sorted: the run i..j-1 is padded to its last unit
        for i in range(j - 1, max(0, j - cap) - 1, -1):
            rows = j - i
            r = real[j] - real[i]
            if is_padded:
                padded, att = rows * longest, rows * longest * longest
            else:
                padded, att = r, square[j] - square[i]
            cost = c0 + ca * r + cd * padded + cb * att
            if rows > 1 and max_batch_time > 0 and padded > min_piece_tokens and cost > max_batch_time:
                break  # a longer run only costs more
            cand, pieces = best[i][0] + cost, best[i][1] + 1
            here, fewest = best[j]
            tol = 1e-9 * abs(here) if here < inf else 0.0
            # equal within rounding: fewer calls win (a per-token-only fit must not split for a 1e-18 gain)
            if cand < here - tol or (cand <= here + tol and pieces < fewest):
                best[j], cut[j] = (cand, pieces), i
    pieces: list[list[int]] = []
    j = n
    while j > 0:
        i = cut[j]
        pieces.append(sorted(order[i:j]))
        j = i
    pieces.sort(key=lambda p: p[0])
    return pieces


def calibrate(run: Callable[[list[Any]], Sequence[Any]], make_batch: Callable[[list[int]], list[Any]],
              shapes: Sequence[Sequence[int]], model: BatchCostModel, *, is_padded: bool = True,
              repeats: int = 2, clock: Callable[[], float] = time.perf_counter) -> int:
    """Warm-up probes for a :class:`BatchCostModel`: time ``run(make_batch(lengths))`` for each shape of
    ``shapes`` (lists of sequence lengths), ``repeats`` times, and feed the fastest of each as a warm-up
    observation (the first run of a new shape also pays one-time allocations). Blocking; call it from the
    thread that loads the model, after its warm-up. Returns the probes observed.

    Raises:
        Exception: whatever ``run`` raises or returns as an item's result (a probe must compute).
    """
    done = 0
    for lengths in shapes:
        if not lengths:
            continue
        batch = make_batch(list(lengths))
        fastest = float("inf")
        for _ in range(max(1, repeats)):
            t0 = clock()
            results = run(batch)
            fastest = min(fastest, clock() - t0)
            for res in results:
                if isinstance(res, BaseException):
                    raise res
        model.observe(lengths, fastest, is_padded=is_padded, warmup=True)
        done += 1
    return done


def calibration_shapes(max_seq_len: int, max_batch_size: int, max_batch_tokens: int) -> list[list[int]]:
    """The warm-up probe shapes (lists of sequence lengths) of a model with these limits: uniform batches
    of several lengths and row counts (to separate the per-call, per-token and n x L^2 terms) and two mixed
    batches, one long row with short ones (to tell real tokens from padded ones), about 1,600 real tokens in
    all (each probe runs twice: on the busy 2-core machine the v3-small-shaped probes took 53 s with 2,300
    tokens), each within ``max_seq_len``, ``max_batch_size`` and ``max_batch_tokens``."""
    L = max(2, max_seq_len)
    wanted = [
        [8], [8] * 8, [32] * 4, [128], [64] * 4, [256], [32] * 8,
        [128] + [8] * 7, [256] + [16] * 3,
    ]
    out: list[list[int]] = []
    for shape in wanted:
        s = [min(L, x) for x in shape][:max(1, max_batch_size)]
        if len(s) * max(s) > max_batch_tokens or s in out:
            continue
        out.append(s)
    return out
