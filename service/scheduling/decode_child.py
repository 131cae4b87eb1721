"""What runs in a decode worker process (``worker_process: true`` for a translation model; the parent side is
:mod:`.decode_workers`): the model's in-process step backend behind a whole :class:`.decode_loop.DecodeLoop`,
so that the loop's scheduling, the beam bookkeeping and the decoder steps run on this process's GIL and one
message crosses the pipe per sequence (plus one per step only for a streaming one), not one per step.

Two phases on one pipe:

1. set-up, request and reply (the parent waits for each answer): ``("load",)`` -> ``(meta, backend name)``,
   ``("warmup",)`` -> the warmed meta (or None), then ``("serve",)``, after which this process starts its
   decode loop on an asyncio event loop of its own (its ``("ok", None, stats)`` is read with the serving
   messages);
2. serving, both ways without replies. In: ``("submit", [(sid, source_ids, options, stream)], deadline)``
   (one request's sequences, all or none, as ``DecodeLoop.submit``), ``("cancel", [sid, ...])``,
   ``("trim",)``, ``("close",)``. Out: ``("update", sid, step, best_tokens)`` after each step of a
   streaming sequence, ``("done", sid, hypotheses, steps)``, ``("fail", sid, exception)``, ``("gone", sid)``
   (cancelled here at the parent's request) and ``("tick", stats, observations)`` at most every
   :data:`TICK_S` while the loop works (the parent's watchdog reads it as progress; ``observations`` are
   the loop's metrics since the last tick).

``deadline`` is a ``time.monotonic()`` value: CLOCK_MONOTONIC is one clock for every process of the machine,
so the parent's deadline holds here as it is. Replies carry :func:`.worker_child`-style stats
(``{"rss": bytes, "cpu": seconds}``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Any

from ..backends.heap import trim_heap
from ..backends.worker_child import _die_with_parent, _picklable, _without_tokenizer, resident_bytes
from ..config import ModelConfig
from .decode_loop import DecodeLoop, LoopObserver

log = logging.getLogger(__name__)

TICK_S = 0.2  # progress (and metrics) at most this often while the loop works


def _stats() -> dict[str, Any]:
    times = os.times()
    try:
        rss = resident_bytes()
    except (OSError, ValueError, IndexError):
        rss = 0
    return {"rss": rss, "cpu": times.user + times.system}


class _Forwarding(LoopObserver):
    """The loop's metrics hooks, kept until the next tick (``observations``) instead of recorded here."""

    def __init__(self) -> None:
        self.pending: list[tuple] = []

    def queue_depth(self, n: int) -> None:
        self.pending.append(("queue_depth", n))

    def encoded(self, size, real_tokens, padded_tokens, seconds, queue_s) -> None:
        self.pending.append(("encoded", size, real_tokens, padded_tokens, seconds, list(queue_s)))

    def stepped(self, hypotheses, seconds) -> None:
        self.pending.append(("stepped", hypotheses, seconds))

    def active(self, hypotheses) -> None:
        self.pending.append(("active", hypotheses))


class _Server:
    """The serving phase: the decode loop, the parent's sequences by their id, and the pipe's sender."""

    def __init__(self, conn: Any, config: ModelConfig, backend: Any) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()
        self.observer = _Forwarding()
        c = config
        self.loop = DecodeLoop(
            c.name, backend, scheduling=c.scheduling, max_active_hypotheses=c.max_active_hypotheses,
            max_batch_size=c.max_batch_size, max_batch_tokens=c.max_batch_tokens, max_queue_delay=c.max_queue_delay,
            encode_batch_delay=c.encode_batch_delay_ms / 1000, max_queue_size=c.max_queue_size,
            observer=self.observer)
        self.seqs: dict[int, Any] = {}  # parent sid -> DecodeSeq
        self.closed: asyncio.Event | None = None
        self.last_tick = 0.0

    def send(self, message: tuple) -> None:
        with self.send_lock:
            try:
                self.conn.send(message)
            except (BrokenPipeError, OSError):
                pass  # the parent is gone: this process ends with it
            except Exception as exc:  # a value that does not pickle fails its own sequence only
                if message[0] in ("done", "update"):
                    self.conn.send(("fail", message[1], _picklable(exc)))
                else:
                    raise

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_tick >= TICK_S:
            self.last_tick = now
            pending, self.observer.pending = self.observer.pending, []
            self.send(("tick", _stats(), pending))

    def submit(self, items: list[tuple], deadline: float | None) -> None:
        def on_update(sid: int):
            return lambda update, step: self.send(("update", sid, step, list(update.best_tokens)))

        try:
            if len(items) == 1 or not any(stream for *_, stream in items):
                seqs = self.loop.submit([(src, options) for _, src, options, _ in items], deadline,
                                        on_update=on_update(items[0][0]) if items[0][3] else None)
            else:  # streaming sequences each need their own hook
                seqs = [self.loop.submit([(src, options)], deadline, on_update=on_update(sid) if stream else None)[0]
                        for sid, src, options, stream in items]
        except Exception as exc:  # refused as a whole (queue full, deadline passed, ...)
            for sid, *_ in items:
                self.send(("fail", sid, _picklable(exc)))
            return
        for (sid, *_), seq in zip(items, seqs):
            self.seqs[sid] = seq
            seq.future.add_done_callback(lambda f, sid=sid, seq=seq: self.finished(sid, seq, f))

    def finished(self, sid: int, seq: Any, future: asyncio.Future) -> None:
        self.seqs.pop(sid, None)
        if future.cancelled():
            self.send(("gone", sid))
        elif future.exception() is not None:
            self.send(("fail", sid, _picklable(future.exception())))
        else:
            self.send(("done", sid, future.result(), seq.steps))
        self.tick()

    def cancel(self, sids: list[int]) -> None:
        seqs = [self.seqs[s] for s in sids if s in self.seqs]
        if seqs:
            self.loop.discard(seqs)

    def handle(self, message: tuple) -> None:
        op = message[0]
        if op == "submit":
            self.submit(message[1], message[2])
        elif op == "cancel":
            self.cancel(message[1])
        elif op == "trim":
            trim_heap()
        elif op == "close":
            assert self.closed is not None
            self.closed.set()
        else:
            log.error("decode worker: unknown request %r", op)

    async def run(self) -> None:
        self.closed = asyncio.Event()
        loop = asyncio.get_running_loop()
        self.loop.start()

        def reader() -> None:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    loop.call_soon_threadsafe(self.closed.set)
                    return
                loop.call_soon_threadsafe(self.handle, message)
                if message[0] == "close":
                    return

        threading.Thread(target=reader, daemon=True, name="relserve-decode-reader").start()
        self.send(("ok", None, _stats()))  # the answer to "serve": from here on the parent reads in a thread

        async def ticker() -> None:
            while True:
                await asyncio.sleep(TICK_S)
                if self.loop.active_sequences or self.loop.queue_depth or self.observer.pending:
                    self.tick()

        ticking = loop.create_task(ticker())
        await self.closed.wait()
        ticking.cancel()
        await self.loop.close()


def decode_child_main(conn: Any, config: ModelConfig, log_level: int, parent_pid: int) -> None:
    """The decode worker process (see the module docstring): build and load the in-process translation
    backend ``config`` names, warm it up when asked, then serve a decode loop until the pipe closes or
    ``close`` arrives. Replies to set-up requests are ``("ok", value, stats)`` or ``("error", exception,
    stats)``. The process then exits at once (``os._exit``): it holds nothing an interpreter shutdown would
    save, and tearing down torch and its thread pools took 1.3 s of every close and replacement."""
    code = 1
    try:
        _serve_process(conn, config, log_level, parent_pid)
        code = 0
    except BaseException:
        log.exception("decode worker failed")
    finally:
        logging.shutdown()
        os._exit(code)


def _serve_process(conn: Any, config: ModelConfig, log_level: int, parent_pid: int) -> None:
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        return
    # a terminal's Ctrl-C and a service manager's stop reach the whole process group: the server drains,
    # finishing the sequences decoding here, then ends this process itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [decode worker]: %(message)s")
    from ..backends import create_translation_backend

    backend: Any = None
    while True:
        try:
            op, *_args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op == "load":
                backend = create_translation_backend(dataclasses.replace(config, worker_process=False))
                value: Any = (_without_tokenizer(backend.load()), backend.name)
            elif op == "warmup":
                value = _without_tokenizer(backend.warmup())
                trim_heap()  # what warm-up freed goes back before serving
            elif op == "serve":
                break
            elif op == "close":
                conn.send(("ok", None, _stats()))
                return
            else:
                raise ValueError(f"unknown decode worker request {op!r}")
            reply = ("ok", value, _stats())
        except Exception as exc:
            reply = ("error", _picklable(exc), _stats())
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
    try:
        asyncio.run(_Server(conn, config, backend).run())
    finally:
        try:
            backend.close()
        except Exception:
            log.exception("decode worker: closing the backend failed")
