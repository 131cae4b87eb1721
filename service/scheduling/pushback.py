"""Retry guidance for queue-full rejections: when could a rejected request be taken?

A queue-full RESOURCE_EXHAUSTED carries the ``grpc-retry-pushback-ms`` trailer (gRFC A6, "gRPC Retry
Design": a client whose service config has a ``retryPolicy`` for the status retries after exactly that many
milliseconds instead of its own exponential back-off; a client without one can read the trailer itself). The
value comes from :class:`DrainEstimate`, one per queue (the batcher and the decode loop each own one):

* the drain rate is units (sequences, QA windows, source texts) leaving the queue per second of work, over
  the last few batches (or batch pieces, or admissions). Samples taken while the queue was *full* — the
  batch took as many units as its limits allow, not just everything that happened to wait — are preferred
  when there are any: a refusal happens at a full queue, and the small batches of a lightly used queue
  drain fewer units per second than full ones (counting them would make the advised delays grow and keep
  the clients away, a loop that feeds itself);
* a rejected request is told to come back once the units waiting now have left the queue and the
  requests already told to come back before it have had their turn, then its own: a *virtual queue*.
  Clients rejected in the same instant are spread out instead of all returning together and colliding
  again (a retry storm that spends the cores on refusals);
* the virtual queue is served at ``retry_share`` (a quarter) of the drain rate, not all of it: the
  admission does not hold places for the clients told to come back, and in a closed-loop population the
  clients whose requests just completed send their next one at once and take most of the places first. A
  virtual queue served at the full drain rate brings the refused clients back faster than places open
  for them, and the refusals that follow cost the server's cores (64 retrying clients against a queue of 8,
  two A/B rounds on a 2-core machine shared with other jobs, so noisy: share 1.0 drew 94-142 refusals/s
  and 96-144 req/s goodput, 0.5 72-98 and 148-196, 0.25 52-61 and 188-194). The price: a refused client
  waits longer (median advice ~0.9 s at 0.25 in those runs);
* the delay is clamped to ``[MIN_RETRY_S, MAX_RETRY_S]`` (a client must not spin; a long estimate is a
  guess, better re-checked); with no rate measured yet it is ``UNKNOWN_RATE_RETRY_S``.

Standard library only (the schedulers import it; no torch).
"""

from __future__ import annotations

import collections
import time
from typing import Callable

PUSHBACK_TRAILER = "grpc-retry-pushback-ms"  # gRFC A6; an integer number of milliseconds
# gRFC A6: a negative pushback tells a client's retry policy not to retry. Sent with a RESOURCE_EXHAUSTED
# that no retry can help (a request or reply over a size limit), which the documented policy would otherwise
# retry up to maxAttempts times, each attempt redoing the whole inference.
NO_RETRY_PUSHBACK = "-1"
MIN_RETRY_S = 0.010
MAX_RETRY_S = 2.0
UNKNOWN_RATE_RETRY_S = 0.050  # no batch measured yet (e.g. the first seconds after start)
RATE_SAMPLES = 16             # batches / admissions the drain rate is averaged over
RETRY_SHARE = 0.25            # of the drain rate, the share the virtual queue of refused requests is served at


def pushback_ms(retry_after_s: float) -> str:
    """The trailer value for a delay in seconds: whole milliseconds, at least 0 (gRFC A6: a negative or
    unparseable value tells the client not to retry)."""
    return str(max(0, int(round(retry_after_s * 1000))))


class DrainEstimate:
    """How fast one queue drains, and when a rejected request should retry.

    Args:
        min_s, max_s: clamp of the advised delay, seconds.
        unknown_s: the delay while no drain rate is known.
        samples: how many recent drain samples the rate averages over (per kind: full, any).
        retry_share: the share of the drain rate the virtual queue of refused requests is served at.
        clock: monotonic seconds (tests pass a fake).

    Feed it with :meth:`drained` (the batcher: each executed batch piece's size and duration; the decode loop:
    each admission during a backlog and the time since the previous one); ask :meth:`retry_after` when
    refusing. Not thread-safe: call it from the event loop only.
    """

    def __init__(self, *, min_s: float = MIN_RETRY_S, max_s: float = MAX_RETRY_S,
                 unknown_s: float = UNKNOWN_RATE_RETRY_S, samples: int = RATE_SAMPLES,
                 retry_share: float = RETRY_SHARE, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError("need 0 < min_s <= max_s")
        if not 0 < retry_share <= 1:
            raise ValueError("retry_share must be in (0, 1]")
        self.min_s, self.max_s = min_s, max_s
        self.unknown_s = min(max(unknown_s, min_s), max_s)
        self.retry_share = retry_share
        self._clock = clock
        self._full = _Window(samples)  # samples taken at a full queue
        self._any = _Window(samples)
        self._promised_until = 0.0  # when the last request told to come back will have had its turn

    def drained(self, units: int, seconds: float, full: bool = False) -> None:
        """``units`` left the queue for compute over ``seconds`` of work (ignored unless both are > 0);
        ``full``: the batch took as many units as its limits allow (the queue was not drained dry)."""
        if units <= 0 or not seconds > 0:
            return
        self._any.add(units, seconds)
        if full:
            self._full.add(units, seconds)

    def rate(self) -> float | None:
        """Units per second over the recent full-queue samples, else over all recent samples; None before the
        first one."""
        return self._full.rate() or self._any.rate()

    def retry_after(self, waiting: int, needed: int) -> float:
        """Seconds after which a request of ``needed`` units, refused with ``waiting`` units queued, could be
        taken; the request joins the virtual queue (the next refusal is told a later time)."""
        rate = self.rate()
        now = self._clock()
        if rate is None:
            return self.unknown_s
        # after the real queue and after everyone already told to come back, then its own units
        ready = max(now + max(0, waiting) / rate, self._promised_until) + max(1, needed) / (rate * self.retry_share)
        delay = min(max(ready - now, self.min_s), self.max_s)
        self._promised_until = now + delay
        return delay


class _Window:
    """The last ``n`` (units, seconds) samples and their sums."""

    def __init__(self, n: int) -> None:
        self._samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=max(1, n))
        self._units = 0
        self._seconds = 0.0

    def add(self, units: int, seconds: float) -> None:
        if len(self._samples) == self._samples.maxlen:
            old_units, old_seconds = self._samples[0]
            self._units -= old_units
            self._seconds -= old_seconds
        self._samples.append((units, seconds))
        self._units += units
        self._seconds += seconds

    def rate(self) -> float | None:
        return self._units / self._seconds if self._samples and self._seconds > 0 else None
