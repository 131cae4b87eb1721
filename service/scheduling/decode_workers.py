"""A translation model's decode loops in worker processes (``worker_process: true``): the processes, their
pipes and their supervision. The runner holds this object where an in-process model holds its step backend;
:class:`.decode_pool.DecodePool` spreads the sequences over the processes.

Why whole loops and not single steps: the in-process decode loop is one Python thread, so at saturation the
server uses about one core whatever the machine has (the beam bookkeeping between two ONNX Runtime or torch
calls holds the GIL). A decoder step costs a few milliseconds; a round trip over a pipe per step would eat
what a second process gains, so each process runs a whole :class:`.decode_loop.DecodeLoop`
(:mod:`.decode_child`) and one message crosses per sequence (per step only for a streaming one).
``decode_instances`` loops (0: one per core the server may use), each with its share of the intra-op threads.

Supervision, as :mod:`relserve.service.backends.worker` does for encoder workers: one watchdog thread looks at
every process each :data:`WATCH_INTERVAL_S`. A process that died (its pipe's EOF), that has been stopped
(SIGSTOP) for :data:`STOPPED_GRACE_S`, or that holds sequences but has sent nothing (no step finished) for
``worker_batch_timeout`` seconds (0: :data:`STEP_TIMEOUT_S`) is lost: the sequences it held fail UNAVAILABLE
naming the reason at once, it is killed and a new one is loaded, warmed and started from the watchdog thread.
While no process can serve, the listener hears the reason (the runner turns the model NOT_SERVING and its
queued calls fail UNAVAILABLE); ``listener(None)`` once one serves again. With several processes the others
keep serving meanwhile (the calls go to them), as the encoder worker pool does.

Limits: the server's compute scheduler (``compute_scheduling``) does not reach into these processes;
``recycle_rss_mb`` is not applied to them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from typing import Any, Callable

from ..backends.base import ModelMeta
from ..backends.worker import (STOPPED_GRACE_S, STOP_TIMEOUT_S, WATCH_INTERVAL_S, _alive, _process_state,
                               exit_description, on_all)
from ..backends.worker_child import resident_bytes
from ..config import ModelConfig
from ..cpu_features import available_cores
from ..errors import Internal
from .decode_child import decode_child_main

log = logging.getLogger(__name__)

# a process holds at most this many times max_active_hypotheses (admitted in its loop + waiting in it), so that a
# freed place is refilled from its own queue, not after a pipe round trip
HELD_LOOPS = 2
START_TIMEOUT_S = 600.0  # load + warm-up (an ONNX export on the first load included)
STEP_TIMEOUT_S = 30.0  # worker_batch_timeout 0: a process holding sequences silent this long is hung
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)

# what a lost process's sequences hear: (instance, reason)
OnLost = Callable[[int, str], None]
# a serving process's message: (instance, message)
OnMessage = Callable[[int, tuple], None]


def decode_instances(config: ModelConfig) -> int:
    """How many decode loops a ``worker_process`` translation model runs: ``decode_instances``, or one per
    core the server may use (:func:`relserve.service.cpu_features.available_cores`) when it is 0."""
    return config.decode_instances or max(1, available_cores())


class _Instance:
    """One decode process: its pipe, its reader thread, and what the watchdog reads of it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Any = None
        self.conn: Any = None
        self.serving = False  # set once it answered "serve"; cleared when lost
        self.held = 0  # sequences it holds (the pool keeps this up to date)
        self.last_heard = time.monotonic()
        self.stopped_since: float | None = None
        self.lost: str | None = None  # why it stopped serving (its reader or the watchdog says)
        self.replacing = False  # a replacement runs (the watchdog leaves it alone)
        self.send_lock = threading.Lock()
        self.rss = 0
        self.cpu = 0.0


class DecodeWorkers:
    """The runner's backend for a ``worker_process`` translation model (see the module docstring): ``load`` and
    ``warmup`` start the processes and bring each to serving; :meth:`attach` (by the pool, on the event loop)
    says where their messages go; :meth:`send` reaches one.

    Args:
        config: the model's entry (each process builds its in-process step backend from it, with its share of
            the intra-op threads).
        backend_name: the in-process backend's name (``onnx`` / ``torch``) until a process says.
    """

    worker_processes = True
    decode_workers = True  # the runner serves this with a DecodePool, not an in-process DecodeLoop

    def __init__(self, config: ModelConfig, backend_name: str = "") -> None:
        self.config = config
        self.name = backend_name
        n = decode_instances(config)
        share = max(1, available_cores() // n)
        # each loop gets its share of the cores unless the config fixes a thread count (then per process)
        self._child_config = dataclasses.replace(
            config, worker_process=False,
            # what the pool hands a process always fits its loop's queue (HELD_LOOPS x the hypothesis budget)
            max_queue_size=max(config.max_queue_size, HELD_LOOPS * config.max_active_hypotheses),
            torch_intra_op_threads=config.torch_intra_op_threads or share,
            onnx_intra_op_threads=config.onnx_intra_op_threads or share)
        self.instances = [_Instance(i) for i in range(n)]
        self.meta: ModelMeta | None = None
        self._tokenizer: Any = None
        self._warmed = False
        self._closed = False
        self._on_message: OnMessage | None = None
        self._on_lost: OnLost | None = None
        self._listener: Callable[[str | None], None] | None = None
        self._told: str | None = None
        self._health_lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        self.replacements = 0
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=n,
                                                              thread_name_prefix=f"relserve-decode-{config.name}")

    # ------------------------------------------------------------------ processes

    @property
    def pids(self) -> list[int | None]:
        """The processes' pids, one per instance (None where one is not running)."""
        return [i.process.pid if i.process is not None else None for i in self.instances]

    def _request(self, inst: _Instance, op: str, timeout: float = START_TIMEOUT_S) -> Any:
        """One set-up request to a process that is not serving yet; its answer's value.

        Raises:
            whatever the process raised; Internal when it died or did not answer within ``timeout``.
        """
        try:
            inst.conn.send((op,))
            if not inst.conn.poll(timeout):
                raise Internal(f"model {self.config.name!r}: decode worker did not answer {op} within {timeout:.0f} s")
            status, value, stats = inst.conn.recv()
        except (EOFError, OSError) as exc:
            raise Internal(f"model {self.config.name!r}: decode worker process {exit_description(inst.process)} "
                           f"during {op}") from exc
        inst.rss, inst.cpu = int(stats.get("rss", 0)), float(stats.get("cpu", 0.0))
        if status == "error":
            raise value
        return value

    def _launch(self, inst: _Instance) -> ModelMeta:
        """Start and load a process for ``inst`` (not serving yet)."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs grpc's threads
        parent_conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=decode_child_main, name=f"relserve-decode-{self.config.name}-{inst.index}",
                              daemon=True, args=(child_conn, self._child_config,
                                                 logging.getLogger().getEffectiveLevel(), os.getpid()))
        process.start()
        child_conn.close()  # ours closed, so the child's exit is an EOF here
        inst.process, inst.conn, inst.lost, inst.stopped_since, inst.held = process, parent_conn, None, None, 0
        meta, name = self._request(inst, "load")
        self.name = name
        return meta

    def _serve(self, inst: _Instance) -> None:
        """Tell a loaded (and warmed) process to serve and start reading its messages."""
        inst.conn.send(("serve",))  # its answer is read with the serving messages: the event loop never waits
        inst.last_heard = time.monotonic()
        inst.serving = True
        threading.Thread(target=self._read, args=(inst, inst.conn), daemon=True,
                         name=f"relserve-decode-read-{self.config.name}-{inst.index}").start()

    def _read(self, inst: _Instance, conn: Any) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if inst.conn is not conn:  # replaced meanwhile
                return
            inst.last_heard = time.monotonic()
            if message[0] == "tick":
                stats = message[1]
                inst.rss, inst.cpu = int(stats.get("rss", 0)), float(stats.get("cpu", 0.0))
            if self._on_message is not None:
                self._on_message(inst.index, message)
        if inst.conn is conn and not self._closed:
            reason = inst.lost or f"decode worker process {inst.process.pid} {exit_description(inst.process)}"
            self._lose(inst, reason)

    def _lose(self, inst: _Instance, reason: str) -> None:
        """``inst`` serves no more: its sequences fail with ``reason`` (once)."""
        if not inst.serving:
            return
        inst.serving = False
        inst.lost = reason
        if self._on_lost is not None:
            self._on_lost(inst.index, reason)
        self._health()

    def send(self, index: int, message: tuple) -> bool:
        """Send ``message`` to serving instance ``index``; False when it is not serving (or the pipe broke)."""
        inst = self.instances[index]
        if not inst.serving or inst.conn is None:
            return False
        try:
            with inst.send_lock:
                inst.conn.send(message)
            return True
        except (BrokenPipeError, OSError):
            return False

    def serving(self) -> list[int]:
        """The instances that take sequences now."""
        return [i.index for i in self.instances if i.serving]

    def attach(self, on_message: OnMessage, on_lost: OnLost) -> None:
        """Where serving processes' messages and losses go (called from reader and watchdog threads)."""
        self._on_message, self._on_lost = on_message, on_lost

    # ------------------------------------------------------------------ the runner's backend contract

    def _on_all(self, fn: Callable[[_Instance], Any]) -> list[Any]:
        """``fn(instance)`` for every instance at once, in this object's own threads (they live as long as it:
        PR_SET_PDEATHSIG ends a child when the thread that started it ends); the first failure is raised."""
        return on_all(self._threads, fn, self.instances)

    def _with_tokenizer(self, meta: ModelMeta) -> ModelMeta:
        """``meta`` with the tokenizer loaded here from the checkpoint directory, as the processes' backends
        loaded theirs (a SentencePiece tokenizer does not cross the pipe)."""
        if self._tokenizer is None:
            import json

            from relserve.models.tokenization import SOURCE_SPM, TARGET_SPM, TranslationTokenizer

            root = os.fspath(self.config.path)
            raw = json.loads(open(os.path.join(root, "config.json"), encoding="utf-8").read())
            self._tokenizer = TranslationTokenizer(os.path.join(root, raw.get("source_tokenizer", SOURCE_SPM)),
                                                   os.path.join(root, raw.get("target_tokenizer", TARGET_SPM)))
        return dataclasses.replace(meta, tokenizer=self._tokenizer)

    def load(self) -> ModelMeta:
        """Start every process and load the model in each (at once).

        Raises:
            whatever a process's backend raised loading (the others are ended), or Internal.
        """
        # processes are started here (the model's load thread), so none outlives it through PR_SET_PDEATHSIG
        # before the watchdog takes over replacements
        try:
            metas = self._on_all(self._launch)
        except BaseException:
            self.close()
            raise
        self.meta = self._with_tokenizer(metas[0])
        log.info("model %r: %d decode worker processes (%s)", self.config.name, len(self.instances),
                 ", ".join(str(p) for p in self.pids))
        return self.meta

    def warmup(self) -> ModelMeta | None:
        warmed = self._on_all(lambda inst: self._request(inst, "warmup"))[0]
        self._warmed = True
        if isinstance(warmed, ModelMeta):
            self.meta = self._with_tokenizer(warmed)
            if self.config.dtype == "auto":  # replacements load what the first processes decided
                self._child_config = dataclasses.replace(self._child_config, dtype=warmed.dtype)
            return self.meta
        return None

    def start_serving(self) -> None:
        """Every loaded process starts its decode loop (the pool calls this once attached)."""
        self._on_all(self._serve)

    def watch(self, listener: Callable[[str | None], None]) -> None:
        """Start the watchdog (see the module docstring); ``listener(reason)`` while no process serves,
        ``listener(None)`` once one does again."""
        self._listener = listener
        if self._watchdog is None and not self._closed:
            self._watchdog = threading.Thread(target=self._watch_loop, daemon=True,
                                              name=f"relserve-decode-watchdog-{self.config.name}")
            self._watchdog.start()

    def _health(self) -> None:
        with self._health_lock:  # reader, watchdog and replacement threads: one verdict at a time, in order
            self._tell_health()

    def _tell_health(self) -> None:
        down = [i for i in self.instances if not i.serving]
        told = None
        if len(down) == len(self.instances) and not self._closed:
            told = f"instance {down[0].index}: {down[0].lost or 'decode worker process is not running'}"
        if told != self._told:
            self._told = told
            if self._listener is not None:
                try:
                    self._listener(told)
                except Exception:
                    log.exception("model %r: health listener failed", self.config.name)

    def _watch_loop(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            for inst in self.instances:
                try:
                    reason = None if inst.replacing else self._diagnose(inst)
                    if reason is not None:
                        # in this object's long-lived threads (PR_SET_PDEATHSIG ends a child when the thread that
                        # started it ends), each instance on its own, so that one slow start delays no other's loss
                        inst.replacing = True
                        self._threads.submit(self._replace, inst, reason)
                except Exception:
                    log.exception("model %r: decode watchdog error; continuing", self.config.name)

    def _diagnose(self, inst: _Instance) -> str | None:
        if self._closed:
            return None
        process = inst.process
        if process is None:
            return inst.lost or "decode worker process is not running"
        if not inst.serving:
            return inst.lost or f"decode worker process {process.pid} is not serving"
        if not _alive(process):
            return None  # its reader sees the EOF and reports it (with the exit status)
        now = time.monotonic()
        if _process_state(process.pid) == "T":
            if inst.stopped_since is None:
                inst.stopped_since = now
            elif now - inst.stopped_since >= STOPPED_GRACE_S:
                return (f"decode worker process {process.pid} has been stopped (SIGSTOP) for "
                        f"{now - inst.stopped_since:.1f} s")
        else:
            inst.stopped_since = None
        limit = self.config.worker_batch_timeout or STEP_TIMEOUT_S
        silent = now - inst.last_heard
        if inst.held and silent > limit:
            return (f"decode worker process {process.pid} holds {inst.held} texts and finished no decoder step in "
                    f"{silent:.1f} s (worker_batch_timeout: {limit:.1f} s)")
        return None

    def _replace(self, inst: _Instance, reason: str) -> None:
        """``inst`` lost (``reason``): its sequences fail, it is killed, and a new process is loaded, warmed
        and serving (retried with back-off)."""
        try:
            self._replace_now(inst, reason)
        except Exception:
            log.exception("model %r: replacing a decode worker process failed", self.config.name)
        finally:
            inst.replacing = False

    def _replace_now(self, inst: _Instance, reason: str) -> None:
        log.warning("model %r: %s; replacing it", self.config.name, reason)
        inst.lost = inst.lost or reason
        self._lose(inst, inst.lost)
        old = inst.process
        if old is not None and _alive(old):
            old.kill()
        if old is not None:
            old.join(STOP_TIMEOUT_S)
        if inst.conn is not None:
            inst.conn.close()
        inst.process, inst.conn = None, None
        attempt = 0
        while not (self._closed or self._stop.is_set()):
            try:
                self._launch(inst)
                if self._warmed:
                    self._request(inst, "warmup")
                if self._closed:
                    break
                self._serve(inst)
                self.replacements += 1
                log.info("model %r: decode worker process %d replaced the one that failed", self.config.name,
                         inst.process.pid)
                self._health()
                return
            except Exception as exc:
                if not self._closed:
                    log.error("model %r: starting a decode worker process failed (%s: %s)", self.config.name,
                              type(exc).__name__, exc)
                if inst.process is not None and _alive(inst.process):
                    inst.process.kill()
                inst.serving = False
            self._stop.wait(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            attempt += 1

    # ------------------------------------------------------------------ stats and close

    def process_stats(self) -> tuple[float, int] | None:
        """``(cpu seconds, resident bytes)`` summed over the running processes, from /proc now (the
        ``relserve_worker_*`` metrics); None when none runs."""
        total_cpu, total_rss, any_ = 0.0, 0, False
        for inst in self.instances:
            process = inst.process
            if process is None or process.pid is None:
                continue
            try:
                with open(f"/proc/{process.pid}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                if fields[0] == b"Z":
                    continue
                cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                rss = resident_bytes(str(process.pid))
            except (OSError, ValueError, IndexError):
                cpu, rss = inst.cpu, inst.rss
            total_cpu, total_rss, any_ = total_cpu + cpu, total_rss + rss, True
        return (total_cpu, total_rss) if any_ else None

    def trim_heap(self) -> bool:
        """Ask every serving process to return its free heap to the OS (no answer is awaited)."""
        return any([self.send(i, ("trim",)) for i in range(len(self.instances))])

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        return {}

    def close(self) -> None:
        """End every process: a serving one is asked to close (its loop fails what it still holds), then
        SIGKILL after :data:`STOP_TIMEOUT_S`. No process starts after this."""
        self._closed = True
        self._stop.set()
        for inst in self.instances:
            inst.serving = False
            if inst.conn is not None:
                try:
                    with inst.send_lock:
                        inst.conn.send(("close",))
                except (BrokenPipeError, OSError):
                    pass
        for inst in self.instances:
            process = inst.process
            if process is None:
                continue
            process.join(STOP_TIMEOUT_S)
            if _alive(process):
                process.kill()
                process.join(STOP_TIMEOUT_S)
            if inst.conn is not None:
                inst.conn.close()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(STOP_TIMEOUT_S)
        self._threads.shutdown(wait=False, cancel_futures=True)
