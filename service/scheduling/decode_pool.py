"""The serving process's side of a translation model whose decode loops run in worker processes
(``worker_process: true``; :mod:`.decode_workers`): admission, the queue, deadlines and cancellation are the
scheduler base's, as for the in-process loop; instead of stepping, each round hands the waiting sequences to
the decode processes.

Which process: the one holding the fewest hypotheses (each sequence reserves ``beam_size``), oldest sequence
first (strict FIFO, as the in-process loop admits). A process takes sequences while it holds fewer than
:data:`HELD_LOOPS` x ``max_active_hypotheses`` (its own loop admits ``max_active_hypotheses`` of them and
keeps the rest waiting, so that a freed place is refilled without waiting for a pipe round trip); the
others wait here, where they count against ``max_queue_size`` and are refused with the pushback hint as
before. Each process runs its own :class:`.decode_loop.DecodeLoop` with the model's keys
(``max_active_hypotheses`` is per process).

What comes back (on the event loop, from the processes' reader threads): a streaming sequence's best
hypothesis after each step (its ``on_update`` hears it as from the in-process loop), a finished sequence's
n-best list, a sequence's error, and the loops' metrics. A lost process (died, stopped, hung: see
:mod:`.decode_workers`) fails the sequences it held with UNAVAILABLE naming why; a cancelled or abandoned
request's sequences are cancelled in their process, whose loop drops their hypotheses.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Sequence

from ..backends.base import SeqUpdate
from ..errors import Unavailable
from .base import fail
from .decode_loop import DecodeQueue, DecodeSeq, LoopObserver
from .decode_workers import HELD_LOOPS, DecodeWorkers

log = logging.getLogger(__name__)


class DecodePool(DecodeQueue):
    """The sequences of one translation model spread over its decode processes (see the module docstring).
    Same surface as :class:`.decode_loop.DecodeLoop` for :mod:`relserve.service.tasks.translate`: ``reserve``,
    ``submit``, ``wait``, ``discard``, ``run``.

    Args:
        name: model name.
        workers: the model's :class:`.decode_workers.DecodeWorkers` (loaded; started serving by :meth:`start`).
        max_active_hypotheses: each process's hypothesis budget (a process holds up to :data:`HELD_LOOPS` x it).
        max_batch_size: sequences per encoder batch (reported by ListModels).
        max_queue_size: sequences allowed to wait here; beyond it submissions raise ResourceExhausted.
        observer: metrics hooks (the processes' loops report through it).
    """

    # the decode processes record no spans, so a request here starts no trace
    _traced = False

    worker_kind = "decode-dispatch"
    worker_error = "decode dispatch error"
    purge_stage = "before decoding started"
    waiting_noun = "texts"
    request_verb = "has"
    log = log

    def __init__(self, name: str, workers: DecodeWorkers, *, max_active_hypotheses: int = 256,
                 max_batch_size: int = 32, max_queue_size: int = 1024, observer: LoopObserver | None = None) -> None:
        self.observer = observer or LoopObserver()
        # the model's queue depth: waiting here plus waiting in the processes' loops (as they last reported)
        self._child_depth = [0] * len(workers.instances)
        super().__init__(name, max_queue_size=max_queue_size, max_queue_delay=0.0,
                         on_depth=lambda n: self.observer.queue_depth(n + sum(self._child_depth)), compute=None)
        self.workers = workers
        self.max_batch_size = max_batch_size
        self.capacity = HELD_LOOPS * max_active_hypotheses
        self._ids = itertools.count()
        self._held: dict[int, tuple[int, DecodeSeq]] = {}  # seq id -> (instance, sequence) handed to a process
        self._load = [0] * len(workers.instances)  # hypotheses reserved per process
        self._active_hypotheses = [0] * len(workers.instances)  # as the processes' loops last reported
        self.dispatched = 0  # sequences handed to a process (tests, logs)
        self.dropped = 0  # handed sequences a process dropped on a cancellation (tests, logs)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start dispatching on the running loop and let every decode process serve."""
        if self._worker is not None:
            return
        super().start()
        loop = asyncio.get_running_loop()

        def on_message(index: int, message: tuple) -> None:
            try:
                loop.call_soon_threadsafe(self._message, index, message)
            except RuntimeError:  # the event loop closed: nobody waits any more
                pass

        def on_lost(index: int, reason: str) -> None:
            try:
                loop.call_soon_threadsafe(self._lost, index, reason)
            except RuntimeError:
                pass

        self.workers.attach(on_message, on_lost)
        self.workers.start_serving()

    def _running(self) -> list[DecodeSeq]:
        return [s for _, s in self._held.values()]

    def _closing(self) -> None:
        self._held.clear()
        self._load = [0] * len(self._load)
        for inst in self.workers.instances:
            inst.held = 0
        self.observer.active(0)

    @property
    def held_sequences(self) -> int:
        """Sequences handed to a process and not finished yet."""
        return len(self._held)

    # ------------------------------------------------------------------ submission

    def _where_late(self, seqs: Sequence[DecodeSeq]) -> str:
        return "while decoding" if any(s.seq_id in self._held for s in seqs) else "while waiting in the queue"

    def discard(self, units: Sequence[DecodeSeq]) -> None:
        """Cancel the units; waiting ones leave the queue, handed ones are cancelled in their process (which
        drops their hypotheses and says so; their places free then)."""
        super().discard(units)
        by_instance: dict[int, list[int]] = {}
        for s in units:
            held = self._held.get(s.seq_id)
            if held is not None:
                by_instance.setdefault(held[0], []).append(s.seq_id)
        for index, sids in by_instance.items():
            if not self.workers.send(index, ("cancel", sids)):
                for sid in sids:  # the process is gone: nothing of these is left anywhere
                    self._forget(sid)

    # ------------------------------------------------------------------ dispatch

    def _full(self) -> bool:
        return True

    def _pick(self, beam: int) -> int | None:
        """The serving process with the fewest reserved hypotheses, if it has room for ``beam`` more (an empty
        one always has)."""
        serving = self.workers.serving()
        if not serving:
            return None
        index = min(serving, key=lambda i: self._load[i])
        if self._load[index] and self._load[index] + beam > self.capacity:
            return None
        return index

    def _has_work(self) -> bool:
        return bool(self._queue) and self._pick(self._queue[0].options.beam_size) is not None

    async def _round(self) -> None:
        self._purge()
        now = time.monotonic()
        handed: dict[tuple[int, float | None, bool], list[DecodeSeq]] = {}
        taken = 0
        for s in self._queue:
            index = self._pick(s.options.beam_size)
            if index is None:
                break
            taken += 1
            s.queue_s = now - s.enqueued_at
            self._load[index] += s.options.beam_size
            self.workers.instances[index].held += 1
            self._held[s.seq_id] = (index, s)
            handed.setdefault((index, s.deadline, s.on_update is not None), []).append(s)
        if not taken:
            return
        self._queue = self._queue[taken:]
        self._on_depth(len(self._queue))
        self.dispatched += taken
        for (index, deadline, stream), seqs in handed.items():
            items = [(s.seq_id, s.source_ids, s.options, stream) for s in seqs]
            if not self.workers.send(index, ("submit", items, deadline)):
                reason = self.workers.instances[index].lost or "its decode worker process is not running"
                for s in seqs:
                    self._forget(s.seq_id)
                    fail(s, Unavailable(f"model {self.name!r} is not ready: {reason}; retry later"))

    def _forget(self, sid: int) -> DecodeSeq | None:
        held = self._held.pop(sid, None)
        if held is None:
            return None
        index, s = held
        self._load[index] -= s.options.beam_size
        inst = self.workers.instances[index]
        inst.held = max(0, inst.held - 1)
        if self._wake is not None:
            self._wake.set()
        return s

    # ------------------------------------------------------------------ what comes back (event loop)

    def _message(self, index: int, message: tuple) -> None:
        op = message[0]
        if op == "tick":
            self._observe(index, message[2])
            return
        if op == "ok":
            return
        sid = message[1]
        if op == "update":
            held = self._held.get(sid)
            if held is None:
                return
            s = held[1]
            s.steps = message[2]
            if s.on_update is not None and not s.future.done():
                try:
                    s.on_update(SeqUpdate(live=1, best_tokens=message[3], best_score=0.0), message[2])
                except Exception:
                    log.exception("model %r: stream update failed", self.name)
            return
        s = self._forget(sid)
        if s is None:
            return
        if op == "done":
            s.steps = max(s.steps, message[3])
            if not s.future.done():
                s.future.set_result(message[2])
        elif op == "fail":
            fail(s, message[2])
        elif op == "gone":
            self.dropped += 1

    def _observe(self, index: int, observations: list[tuple]) -> None:
        try:
            for kind, *values in observations:
                if kind == "encoded":
                    self.observer.encoded(*values)
                elif kind == "stepped":
                    self.observer.stepped(*values)
                elif kind == "queue_depth":
                    self._child_depth[index] = values[0]
                    self._on_depth(len(self._queue))
                elif kind == "active":
                    self._active_hypotheses[index] = values[0]
                    self.observer.active(sum(self._active_hypotheses))
        except Exception:
            log.exception("model %r: observer failed", self.name)

    def _lost(self, index: int, reason: str) -> None:
        """Process ``index`` serves no more: every sequence it held fails UNAVAILABLE naming ``reason``."""
        lost = [sid for sid, (i, _) in self._held.items() if i == index]
        for sid in lost:
            s = self._forget(sid)
            if s is not None:
                fail(s, Unavailable(f"model {self.name!r} is not ready: {reason}; the texts its decode worker "
                                    f"process held were lost, retry later"))
        self._active_hypotheses[index] = 0
        self._child_depth[index] = 0
        if lost:
            log.warning("model %r: %d texts failed with their decode worker process: %s", self.name, len(lost),
                        reason)
