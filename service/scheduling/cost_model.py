"""What one backend call of a model costs, and how a formed batch is cut into the calls that cost least
(no torch, no numpy).

Two fits per model, both fed the compute seconds of every call the batcher makes:

* :class:`CostModel`, seconds against padded tokens: in every compute mode the batcher splits a formed batch
  into consecutive pieces it expects to take at most the lane's ``max_hold`` (``max_batch_time_ms``) each;
  on CPU, one 512-token window per piece is also faster than 16 at once (the attention scores of a full
  8192-token batch are ~200 MB);
* :class:`BatchCostModel`, per call, per real token, per padded token and per n x L^2 of the attention
  core, fitted from warm-up probes (:func:`calibrate` over :func:`calibration_shapes`): once fitted,
  :func:`plan_batch` chooses the pieces instead, the partition of the formed batch with the least predicted
  time, each within ``max_hold``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence


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
