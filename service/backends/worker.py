"""An encoder backend in a process of its own (``worker_process: true``): the server keeps the gRPC side
(decode, validation, tokenization, batching, refusals) and a child process runs the model.

Why: in one process the model's compute and the gRPC event loop share one GIL. A torch eager forward takes
the GIL back after every op (a DeBERTa-base forward is a few thousand ops), so under overload the loop
refusing a thousand calls a second slows every batch, and the process cannot use more than about one
core: 64 clients retrying after a fixed 50 ms kept the default sentiment model at 0.32-0.60 of its capacity
on the 2-core machine (``loadtest/bench/hostile.py --only overload``) with the server at 0.98 cores and a
third of the machine idle. With the model in its own process each side has its own GIL; Triton's Python
backend runs each model instance in a stub process for the same reason.

What crosses the pipe (``multiprocessing`` spawn context, pickled): the batch as plain token ids
(:class:`WireItem`), the intra-op thread count the compute scheduler gives this call (the ``threads`` of the
call's :class:`.base.CallBudget` in the parent, a :meth:`.base.CallBudget.fixed` budget of the child's backend
call), and back the per-item results (numpy arrays or Exceptions) with the child's resident
memory and accelerator memory stats. Per batch this costs well under a millisecond (token ids and a few
logits).

Lifecycle: :meth:`WorkerBackend.load` starts the child, which builds the backend the config names
(``create_backend`` with ``worker_process`` off) and loads it; ``warmup`` runs in the child (the bf16
agreement gate included). The child ignores SIGINT and SIGTERM (a terminal's Ctrl-C and a service manager's
stop reach the whole process group: the parent drains, then ends the child) and dies with the parent (``PR_SET_PDEATHSIG`` on Linux; a pipe EOF
elsewhere). If the child dies during a batch (killed by the OOM killer, a crash in native code), that
batch's items fail with INTERNAL naming the exit status: one crash fails only the batch it happened in.

Supervision (:meth:`WorkerBackend.watch`, started by the model's runner once it serves): a watchdog thread
looks at the child every :data:`WATCH_INTERVAL_S`. A child that died, that has been stopped (SIGSTOP, state
``T``) for :data:`STOPPED_GRACE_S`, or whose batch has run past its timeout (``worker_batch_timeout``; by
default :data:`BATCH_TIMEOUT_FACTOR` x the cost model's prediction for that batch, which arrives as the
call's ``CallBudget.expected_s``, at least :data:`MIN_BATCH_TIMEOUT_S`) is reported to the runner first (the
model turns NOT_SERVING and its queued calls fail UNAVAILABLE naming the reason), then killed (the batch it
held fails UNAVAILABLE with the same reason) and replaced: a new child loads (``dtype: auto`` as the first
child decided it: the agreement gate does not run again) and warms up, and the model is ready again.
Without a watchdog (a backend used on its own) the next ``run`` starts the new child.

Recycling (``recycle_rss_mb``, 0: off; once the model serves, i.e. watched): after a batch, a child whose
resident memory is over the threshold is replaced between batches (closed cleanly, a new one loaded and
warmed) while the calls that arrive queue; no call fails and the model stays ready.

Limits: ``compute_scheduling: fair`` cannot hand the cores over in the middle of such a call (yield points
run in the child, which has no compute slot); the call is still split into pieces of ``max_batch_time_ms``.
Translation models (the step contract, one call per decoder step) are not offered this mode.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from ..config import ModelConfig
from ..errors import Internal, Unavailable
from .base import UNBUDGETED, CallBudget, EncoderBackendDefaults, ModelMeta
from .worker_child import WireItem, child_main, resident_bytes, to_wire

__all__ = ["WireItem", "WorkerBackend", "batch_timeout", "to_wire"]

log = logging.getLogger(__name__)

T = TypeVar("T")

START_TIMEOUT_S = 600.0  # load + warm-up of a large checkpoint (the bf16 gate included) in the child
STOP_TIMEOUT_S = 2.0  # a close request's answer, then SIGKILL, when the child is ended
WATCH_INTERVAL_S = 0.25  # how often the watchdog looks at the child
# A child stopped this long (SIGSTOP; state T, not a debugger's t) is hung: it cannot answer until a SIGCONT
# nobody may send.
STOPPED_GRACE_S = 3.0
BATCH_TIMEOUT_FACTOR = 10.0  # worker_batch_timeout 0: this many times the cost model's prediction ...
MIN_BATCH_TIMEOUT_S = 30.0  # ... and at least this (a prediction can be off: other models, a busy machine)
UNPREDICTED_TIMEOUT_S = 300.0  # ... or this before any prediction (the first call without warm-up probes)
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # between failed replacement attempts
MIB = 1024 * 1024


def batch_timeout(config: ModelConfig, expected_s: float | None) -> float:
    """Seconds a worker process may take for one batch before it is declared hung: ``worker_batch_timeout``
    when set (> 0), else ``max(MIN_BATCH_TIMEOUT_S, BATCH_TIMEOUT_FACTOR x expected_s)``, or
    :data:`UNPREDICTED_TIMEOUT_S` when the cost model has no prediction (``expected_s`` None or <= 0)."""
    if config.worker_batch_timeout > 0:
        return float(config.worker_batch_timeout)
    if expected_s is None or not expected_s > 0:
        return UNPREDICTED_TIMEOUT_S
    return max(MIN_BATCH_TIMEOUT_S, BATCH_TIMEOUT_FACTOR * expected_s)


def _alive(process: Any) -> bool:
    """Whether ``process`` (a started ``multiprocessing`` Process) still runs, from its sentinel: unlike
    ``is_alive()``, safe from several threads (two concurrent ``waitpid`` calls leave one of them with ECHILD,
    which ``is_alive`` reads as alive)."""
    return process.exitcode is None and not multiprocessing.connection.wait([process.sentinel], 0)


def exit_description(process: Any) -> str:
    """How a worker ``process`` (a ``multiprocessing`` process) ended, for a message: "exited with status 1",
    "was killed by SIGKILL", or "stopped answering" while it still runs (after a 0.5 s join)."""
    process.join(0.5)
    code = process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def on_all(threads: concurrent.futures.Executor, fn: Callable[[T], Any], items: Sequence[T]) -> list[Any]:
    """``fn(item)`` for every item at once in ``threads``, each result in ``items``' order; every call is
    waited for, then the first failure (by that order) is raised."""
    futures = [threads.submit(fn, item) for item in items]
    results, error = [], None
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as exc:  # noqa: BLE001 - every process is waited for before raising
            error = error or exc
            results.append(None)
    if error is not None:
        raise error
    return results


def _process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (stat(5) field 3: R, S, D, T, t, Z, ...); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return None


class WorkerBackend(EncoderBackendDefaults):
    """The encoder :class:`relserve.service.backends.base.Backend` contract, computed in a child process (see
    the module docstring). Every call except ``memory_stats``, ``watch`` and ``close`` comes from the model's
    executor thread, one at a time, as for any backend.

    Args:
        config: the model's entry; the child builds ``cls`` of ``module`` (what ``create_backend`` would build
            in-process for it) with ``worker_process`` false.
        module, cls: that backend class by name (``backends.ENCODER_BACKENDS``).

    Raises (from ``load``): whatever the child's backend raised loading (ConfigError, OSError, ...), or
    :class:`Internal` if the child exited before answering.
    """

    is_padded = True
    max_batch_size: int | None = None
    worker_processes = True

    def __init__(self, config: ModelConfig, module: str, cls: str) -> None:
        self.config = config
        self._target = (module, cls)  # the in-process backend the child builds (backends.ENCODER_BACKENDS)
        self._child_config = config  # what a child loads (after warm-up: dtype auto's decision)
        self.name = module.rsplit(".", 1)[-1].split("_")[0]  # "torch" | "onnx" until load() reads the child's own
        self._tokenizer: Any = None  # loaded here once (the child's stays there)
        self.meta: ModelMeta | None = None
        self.resident_bytes = 0  # the child's RSS after its last answer
        self.cpu_seconds = 0.0  # the child's CPU seconds (user + system) after its last answer
        self._memory: dict[str, tuple[int, int, int]] = {}
        self._has_probe = False
        self._process: Any = None
        self._conn: Any = None
        self._warmed = False
        self._closed = False
        self._lock = threading.Lock()  # one request on the pipe at a time; held while a child is replaced
        # supervision (watch): what the watchdog reads of the call in progress, and what it decided
        self._listener: Callable[[str | None], None] | None = None
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set: the watchdog looks now (a recycle is due, or close)
        self._recycle_due: tuple[int, int] | None = None  # (rss, recycle_rss_mb) of a child to replace
        self._call_since: float | None = None  # monotonic start of the "run" on the pipe now
        self._call_limit = 0.0  # its timeout (batch_timeout)
        self._call_items = 0
        self._stopped_since: float | None = None  # first time the watchdog saw the child stopped (state T)
        self._kill_reason: str | None = None  # set before the watchdog kills: the running call fails with it
        self._last_exit: str | None = None  # how the last child ended during a call (the watchdog reports it)
        self._unhealthy: str | None = None  # what the listener was last told
        self._replacing = False  # a recycle swaps the child: the watchdog looks away
        self.replacements = 0  # children replaced (watchdog and recycling), for logs and tests

    # -------------------------------------------------------------- the child

    @property
    def pid(self) -> int | None:
        """The worker process's pid (None before load and after close)."""
        return self._process.pid if self._process is not None else None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs grpc's threads
        parent_conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=child_main, name=f"relserve-worker-{self.config.name}", daemon=True,
                              args=(child_conn, self._child_config, *self._target,
                                    logging.getLogger().getEffectiveLevel(), os.getpid()))
        process.start()
        child_conn.close()  # ours closed, so the child's exit is an EOF here
        self._process, self._conn = process, parent_conn
        self._stopped_since = None
        log.info("model %r: worker process %d started", self.config.name, process.pid)

    def _exit_description(self, process: Any = None) -> str:
        process = process or self._process
        return "is not running" if process is None else exit_description(process)

    def _call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        """Send one request and wait for its reply; raises the child's exception, or :class:`Internal` when
        the child is gone (it is then restarted by the watchdog or the next :meth:`run`)."""
        with self._lock:
            return self._exchange(op, *args, timeout=timeout)

    def _exchange(self, op: str, *args: Any, timeout: float | None = None, limit: float | None = None,
                  items: int = 0) -> Any:
        """:meth:`_call` with the lock held. ``limit``: the batch timeout the watchdog applies to this call
        (``items`` items); a call the watchdog killed raises :class:`Unavailable` naming why."""
        if self._conn is None:
            raise Internal(f"model {self.config.name!r}: worker process is not running")
        if limit is not None:
            self._call_limit, self._call_items = limit, items
            self._call_since = time.monotonic()  # before the send: a stopped child can block it too
        try:
            self._conn.send((op, *args))
            if timeout is not None and not self._conn.poll(timeout):
                raise Internal(f"model {self.config.name!r}: worker process did not answer {op} within "
                               f"{timeout:.0f} s")
            status, value, stats = self._conn.recv()
        except (EOFError, OSError) as exc:
            what = self._exit_description()
            self._forget()
            reason = self._kill_reason
            if reason is not None:
                raise Unavailable(f"model {self.config.name!r} is not ready: {reason}; its worker process was "
                                  f"killed and is being replaced, retry later") from exc
            self._last_exit = f"worker process {what} during {op}"
            raise Internal(f"model {self.config.name!r}: worker process {what} during {op}") from exc
        finally:
            self._call_since = None
        self.resident_bytes = int(stats.get("rss", 0))
        self.cpu_seconds = float(stats.get("cpu", 0.0))
        self._memory = dict(stats.get("memory") or {})
        if status == "error":
            raise value
        return value

    def _forget(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None
        self._process = None

    def _load_in_child(self) -> ModelMeta:
        """A new child, loaded (the lock held)."""
        self._start()
        meta, is_padded, max_batch_size, has_probe = self._exchange("load", timeout=START_TIMEOUT_S)
        self.is_padded, self.max_batch_size, self._has_probe = is_padded, max_batch_size, has_probe
        self.name = meta.backend
        return self._with_tokenizer(meta)

    def _restart(self) -> None:
        """A new child, loaded and warmed as the first was (the lock held; the old one gone)."""
        self._load_in_child()
        if self._warmed:
            self._exchange("warmup", timeout=START_TIMEOUT_S)
        self.replacements += 1

    def _with_tokenizer(self, meta: ModelMeta) -> ModelMeta:
        """``meta`` with the tokenizer loaded in this process from the checkpoint directory, as the child's
        backend loaded its own (``tokenization.load_tokenizer``, the same ``spm_normalization``)."""
        if self._tokenizer is None:
            from relserve.models.tokenization import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.path, spm_normalization=self.config.spm_normalization,
                                             log_choice=False)  # the child logged it
        return dataclasses.replace(meta, tokenizer=self._tokenizer)

    # -------------------------------------------------------------- contract

    def load(self) -> ModelMeta:
        with self._lock:
            self.meta = self._load_in_child()
        return self.meta

    def warmup(self) -> ModelMeta | None:
        warmed = self._call("warmup", timeout=START_TIMEOUT_S)
        self._warmed = True
        if isinstance(warmed, ModelMeta):
            self.meta = warmed = self._with_tokenizer(warmed)
            if self.config.dtype == "auto":  # replacements load the dtype decided now: no second agreement gate
                self._child_config = dataclasses.replace(self.config, dtype=warmed.dtype)
        return warmed

    @property
    def can_probe(self) -> bool:  # type: ignore[override]
        """Whether the child's backend makes probe batches (known once loaded)."""
        return self._has_probe

    def probe_batch(self, lengths: Sequence[int]) -> list[Any]:
        """The child backend's ``probe_batch(lengths)`` (``Backend.probe_batch``), forwarded.

        Raises:
            NotImplementedError: the child's backend makes none (``can_probe`` is false).
        """
        if not self._has_probe:
            return super().probe_batch(lengths)
        return self._call("probe_batch", list(lengths))

    def run(self, batch: Sequence[Any], budget: CallBudget = UNBUDGETED) -> list[Any]:
        """Compute ``batch`` in the child (restarted first if it died), with the intra-op threads ``budget``
        grants when the call starts (the child cannot hand the cores over: no layer hook crosses the pipe).
        Under :meth:`watch`, a call running past :func:`batch_timeout` (from ``budget.expected_s``) is killed.

        Raises:
            Unavailable: the watchdog killed the child during this call (names why).
            Internal: the child died during this call (names how), or the model is closed.
        """
        if self._closed:
            raise Internal(f"model {self.config.name!r}: closed")
        items = to_wire(batch)
        with self._lock:
            if self._listener is not None and (self._conn is None or not _alive(self._process)):
                # watched: the watchdog replaces it (and says so); this batch fails fast instead of waiting
                gone = self._last_exit or f"worker process {self._exit_description()}"
                raise Unavailable(f"model {self.config.name!r} is not ready: {gone}; a new worker process is "
                                  f"starting, retry later")
            if self._conn is not None and not _alive(self._process):  # died while idle: no batch lost
                log.warning("model %r: worker process %s", self.config.name, self._exit_description())
                self._forget()
            if self._conn is None:  # the last one died: a new child, loaded and warmed as the first was
                log.warning("model %r: restarting its worker process", self.config.name)
                self._restart()
            value = self._exchange("run", budget.threads(), items, limit=batch_timeout(self.config, budget.expected_s),
                                   items=len(items))
        self._recycle_if_large()
        return value

    @property
    def can_compute(self) -> bool:
        """Whether a call now would reach a live child that the watchdog has no complaint about (always true
        while unwatched: ``run`` then restarts a dead child itself)."""
        process = self._process
        return self._listener is None or (self._unhealthy is None and process is not None and _alive(process))

    def process_stats(self) -> tuple[float, int] | None:
        """``(cpu seconds, resident bytes)`` of the running worker process, read from /proc now (the
        ``relserve_worker_*`` metrics); where there is no /proc, as of its last answer. None without one."""
        process = self._process
        if process is None or process.pid is None:
            return None
        try:
            with open(f"/proc/{process.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "(comm)": state is field 3 of stat(5)
            if fields[0] == b"Z":  # exited, not yet reaped (the next batch restarts it): no worker now
                return None
            rss = resident_bytes(str(process.pid))
        except (OSError, ValueError, IndexError):
            return self.cpu_seconds, self.resident_bytes
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), rss

    def trim_heap(self) -> bool:
        """:func:`.heap.trim_heap` in the worker process (the server calls it once its models are loaded)."""
        return bool(self._call("trim", timeout=START_TIMEOUT_S))

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        """The child's accelerator memory as of its last answer (the event loop asks; the pipe is not used)."""
        return dict(self._memory)

    # -------------------------------------------------------------- supervision and recycling

    def watch(self, listener: Callable[[str | None], None]) -> None:
        """Start the watchdog (see the module docstring): ``listener(reason)`` from its thread when the child
        died, is stopped or overran a batch (before it is killed), ``listener(None)`` once a new child has
        warmed. Call once, after load."""
        self._listener = listener
        if self._watchdog is None and not self._closed:
            self._watchdog = threading.Thread(target=self._watch_loop, daemon=True,
                                              name=f"relserve-watchdog-{self.config.name}")
            self._watchdog.start()

    def _tell(self, reason: str | None) -> None:
        if reason == self._unhealthy:
            return
        self._unhealthy = reason
        if self._listener is not None:
            try:
                self._listener(reason)
            except Exception:  # a listener's bug must not stop the watchdog
                log.exception("model %r: health listener failed", self.config.name)

    def _watch_loop(self) -> None:
        # Children are started from this thread (replacements, recycling): PR_SET_PDEATHSIG ends a child when
        # the thread that started it ends, so no short-lived thread may start one.
        while True:
            self._wake.wait(WATCH_INTERVAL_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                due, self._recycle_due = self._recycle_due, None
                if due is not None:
                    self._recycle(*due)
                    continue
                reason = self._diagnose()
                if reason is not None:
                    self._replace(reason)
            except Exception:
                log.exception("model %r: worker watchdog error; continuing", self.config.name)

    def _diagnose(self) -> str | None:
        """Why the child cannot compute (None: it can): gone, stopped for :data:`STOPPED_GRACE_S`, or its
        batch past its timeout."""
        if self._closed or self._replacing:
            return None
        process = self._process
        if process is None:  # died during a call (the caller forgot it) or a replacement failed
            if self._lock.locked():  # a run() may be restarting it right now
                return None
            return self._last_exit or "worker process is not running"
        if not _alive(process):
            return f"worker process {process.pid} {self._exit_description(process)}"
        now = time.monotonic()
        if _process_state(process.pid) == "T":
            if self._stopped_since is None:
                self._stopped_since = now
            elif now - self._stopped_since >= STOPPED_GRACE_S:
                return f"worker process {process.pid} has been stopped (SIGSTOP) for {now - self._stopped_since:.1f} s"
        else:
            self._stopped_since = None
        since = self._call_since
        if since is not None and now - since > self._call_limit:
            return (f"worker process {process.pid} has not finished a batch of {self._call_items} items in "
                    f"{now - since:.1f} s (worker_batch_timeout: {self._call_limit:.1f} s)")
        return None

    def _replace(self, reason: str) -> None:
        """Report ``reason``, kill the child, start a new one (retrying with back-off) and report ready."""
        log.warning("model %r: %s; NOT_SERVING until a new worker process has warmed", self.config.name, reason)
        self._tell(reason)
        process = self._process
        self._kill_reason = reason
        if process is not None and _alive(process):
            process.kill()  # a call blocked on the pipe gets its EOF and fails with the reason
        attempt = 0
        while not (self._closed or self._stop.is_set()):
            with self._lock:  # once the killed call has failed
                try:
                    if self._closed:
                        return
                    if self._process is not None and self._process is not process and _alive(self._process):
                        break  # a run() already started a new child
                    if self._process is not None:
                        self._process.kill()
                        self._process.join(STOP_TIMEOUT_S)
                        self._forget()
                    self._kill_reason = None
                    self._restart()
                    break
                except Exception as exc:
                    if not self._closed:  # a close kills the child being started: no failure then
                        log.error("model %r: starting a new worker process failed (%s: %s)", self.config.name,
                                  type(exc).__name__, exc)
                    if self._process is not None and _alive(self._process):
                        self._process.kill()
                    self._forget()
                finally:
                    self._kill_reason = None
            self._stop.wait(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            attempt += 1
        if self._closed:
            return
        self._last_exit = None
        log.info("model %r: worker process %s replaced the one that failed; serving again", self.config.name,
                 self.pid)
        self._tell(None)

    def _recycle_if_large(self) -> None:
        """After a batch: a child whose RSS is over ``recycle_rss_mb`` is replaced by a new one, in the
        watchdog's thread, between batches (the next call waits for the new child; none fails)."""
        limit = self.config.recycle_rss_mb
        if (limit <= 0 or self.resident_bytes <= limit * MIB or self._listener is None  # not serving yet (probes)
                or self._closed or self._replacing):
            return
        self._replacing = True  # the watchdog looks away until the new child serves
        self._recycle_due = (self.resident_bytes, limit)
        self._wake.set()

    def _recycle(self, rss: int, limit: int) -> None:
        try:
            with self._lock:
                process = self._process
                if self._closed or process is None:
                    return
                log.info("model %r: worker process %d holds %d MB after its batch, over recycle_rss_mb %d; "
                         "replacing it", self.config.name, process.pid, rss // MIB, limit)
                try:
                    self._end_child(process)
                    self._forget()
                    self._restart()
                    log.info("model %r: worker process %d replaced %d", self.config.name, self.pid, process.pid)
                except Exception as exc:  # the watchdog (or the next run) starts another
                    if not self._closed:
                        log.error("model %r: replacing worker process %d failed (%s: %s)", self.config.name,
                                  process.pid, type(exc).__name__, exc)
                    if self._process is not None and _alive(self._process):
                        self._process.kill()
                    self._forget()
        finally:
            self._replacing = False

    def _end_child(self, process: Any) -> None:
        """Ask ``process`` (the current child, the lock held) to close within :data:`STOP_TIMEOUT_S`, else
        SIGKILL it."""
        if self._conn is not None and _alive(process):
            try:
                self._conn.send(("close",))
                if self._conn.poll(STOP_TIMEOUT_S):
                    self._conn.recv()
            except (EOFError, OSError):
                pass
            process.join(STOP_TIMEOUT_S)
        if _alive(process):
            process.kill()
            process.join(STOP_TIMEOUT_S)

    def close(self) -> None:
        """End the child: asked to close when no batch is running (it answers within :data:`STOP_TIMEOUT_S`),
        else, or if it does not, SIGKILL (it ignores SIGTERM; it holds nothing that outlives it). A batch still
        running in it fails (its requests were already answered UNAVAILABLE by the scheduler's close). No new
        child is started after this; the watchdog stops."""
        self._closed = True
        self._stop.set()
        self._wake.set()
        process = self._process
        if process is None:
            return
        if self._lock.acquire(blocking=False):  # idle: a clean close
            try:
                self._end_child(process)
            finally:
                self._lock.release()
        if _alive(process):
            process.kill()
            process.join(STOP_TIMEOUT_S)
        current = self._process  # a replacement started meanwhile must not outlive the close either
        if current is not None and current is not process and _alive(current):
            current.kill()
            current.join(STOP_TIMEOUT_S)
        log.info("model %r: worker process %d ended (%s)", self.config.name, process.pid,
                 self._exit_description(process))
        if self._lock.acquire(blocking=False):
            try:
                self._forget()
            finally:
                self._lock.release()
