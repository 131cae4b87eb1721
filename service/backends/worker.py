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
batch's items fail with INTERNAL naming the exit status, and the next batch starts a new child (load and
warm-up again) first: one crash fails only the batch it happened in.

Limits: ``compute_scheduling: fair`` cannot hand the cores over in the middle of such a call (yield points
run in the child, which has no compute slot); the call is still split into pieces of ``max_batch_time_ms``.
Translation models (the step contract, one call per decoder step) are not offered this mode.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from typing import Any, Sequence

from ..config import ModelConfig
from ..errors import Internal
from .base import UNBUDGETED, CallBudget, EncoderBackendDefaults, ModelMeta
from .heap import trim_heap

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # load + warm-up of a large checkpoint (the bf16 gate included) in the child
STOP_TIMEOUT_S = 2.0  # a close request's answer, then SIGKILL, when the child is ended


class WireItem:
    """One encoder item as it crosses to the worker: ``input_ids`` and ``token_type_ids`` (lists of ints, the
    same length), all :func:`.padding.pad_batch` reads."""

    __slots__ = ("input_ids", "token_type_ids")

    def __init__(self, input_ids: list[int], token_type_ids: list[int] | None) -> None:
        self.input_ids = input_ids
        self.token_type_ids = token_type_ids


def to_wire(batch: Sequence[Any]) -> list[WireItem]:
    """``batch`` (Encodings, QA windows, anything with ``input_ids`` and optional ``token_type_ids``) as
    :class:`WireItem` s."""
    out = []
    for item in batch:
        types = getattr(item, "token_type_ids", None)
        out.append(WireItem(list(item.input_ids), None if types is None else list(types)))
    return out


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else an :class:`Internal` carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return Internal(f"{type(exc).__name__}: {exc}")


def _resident_bytes(pid: str = "self") -> int:
    """Resident set size in bytes of process ``pid`` (Linux /proc statm).

    Raises:
        OSError, ValueError, IndexError: no such process, or no /proc.
    """
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _without_tokenizer(meta: Any) -> Any:
    """``meta`` without its tokenizer, which the parent loads itself (a SentencePiece tokenizer holds protobuf
    objects of a module generated at run time, which pickle cannot import on the other side)."""
    return dataclasses.replace(meta, tokenizer=None) if isinstance(meta, ModelMeta) else meta


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG); a no-op elsewhere."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child_main(conn: Any, config: ModelConfig, module: str, cls: str, log_level: int, parent_pid: int) -> None:
    """The worker process: build and load the backend, then answer requests until the pipe closes.

    Requests are ``(op, *args)``; replies ``("ok", value, stats)`` or ``("error", exception, stats)``, where
    ``stats`` is ``{"rss": bytes, "cpu": seconds, "memory": backend.memory_stats()}``.
    """
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        return
    # Ctrl-C in a terminal and `kill -TERM -<pgid>` (systemd's control-group stop) signal the whole process
    # group: the server drains, finishing the batches running here, then ends this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [worker]: %(message)s")
    import importlib

    backend: Any = None

    def stats() -> dict[str, Any]:
        memory = {}
        if backend is not None:
            try:
                memory = backend.memory_stats()
            except Exception:  # a stats failure must not fail the batch it rides on
                memory = {}
        times = os.times()
        try:
            rss = _resident_bytes()
        except (OSError, ValueError, IndexError):
            rss = 0
        return {"rss": rss, "cpu": times.user + times.system, "memory": memory}

    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            break  # the parent closed the pipe or died
        op, args = request[0], request[1:]
        try:
            if op == "load":
                backend = getattr(importlib.import_module(module), cls)(dataclasses.replace(config, worker_process=False))
                meta = _without_tokenizer(backend.load())
                value: Any = (meta, bool(backend.is_padded), backend.max_batch_size, bool(backend.can_probe))
            elif op == "warmup":
                value = _without_tokenizer(backend.warmup())
            elif op == "run":
                threads, items = args
                value = [r if not isinstance(r, BaseException) else _picklable(r)
                         for r in backend.run(items, CallBudget.fixed(threads))]
            elif op == "trim":
                value = trim_heap()
            elif op == "probe_batch":
                value = to_wire(backend.probe_batch(args[0]))
            elif op == "close":
                if backend is not None:
                    backend.close()
                conn.send(("ok", None, stats()))
                break
            else:
                raise ValueError(f"unknown worker request {op!r}")
            reply = ("ok", value, stats())
        except Exception as exc:
            reply = ("error", _picklable(exc), stats())
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            break
        except Exception as exc:  # the value itself did not pickle
            conn.send(("error", Internal(f"worker reply could not be sent: {type(exc).__name__}: {exc}"), stats()))


class WorkerBackend(EncoderBackendDefaults):
    """The encoder :class:`relserve.service.backends.base.Backend` contract, computed in a child process (see
    the module docstring). Every call except ``memory_stats`` and ``close`` comes from the model's executor
    thread, one at a time, as for any backend.

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
        self._lock = threading.Lock()  # one request on the pipe at a time

    # -------------------------------------------------------------- the child

    @property
    def pid(self) -> int | None:
        """The worker process's pid (None before load and after close)."""
        return self._process.pid if self._process is not None else None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs grpc's threads
        parent_conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=_child_main, name=f"relserve-worker-{self.config.name}", daemon=True,
                              args=(child_conn, self.config, *self._target, logging.getLogger().getEffectiveLevel(),
                                    os.getpid()))
        process.start()
        child_conn.close()  # ours closed, so the child's exit is an EOF here
        self._process, self._conn = process, parent_conn
        log.info("model %r: worker process %d started", self.config.name, process.pid)

    def _exit_description(self, process: Any = None) -> str:
        process = process or self._process
        if process is None:
            return "is not running"
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

    def _call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        """Send one request and wait for its reply; raises the child's exception, or :class:`Internal` when
        the child is gone (it is then restarted by the next :meth:`run`)."""
        with self._lock:
            if self._conn is None:
                raise Internal(f"model {self.config.name!r}: worker process is not running")
            try:
                self._conn.send((op, *args))
                if timeout is not None and not self._conn.poll(timeout):
                    raise Internal(f"model {self.config.name!r}: worker process did not answer {op} within "
                                   f"{timeout:.0f} s")
                status, value, stats = self._conn.recv()
            except (EOFError, OSError) as exc:
                what = self._exit_description()
                self._forget()
                raise Internal(f"model {self.config.name!r}: worker process {what} during {op}") from exc
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
        self._start()
        meta, is_padded, max_batch_size, has_probe = self._call("load", timeout=START_TIMEOUT_S)
        self.is_padded, self.max_batch_size, self._has_probe = is_padded, max_batch_size, has_probe
        self.name = meta.backend
        return self._with_tokenizer(meta)

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
        self.meta = self._load_in_child()
        return self.meta

    def warmup(self) -> ModelMeta | None:
        warmed = self._call("warmup", timeout=START_TIMEOUT_S)
        self._warmed = True
        if isinstance(warmed, ModelMeta):
            self.meta = warmed = self._with_tokenizer(warmed)
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
        grants when the call starts (the child cannot hand the cores over: no layer hook crosses the pipe)."""
        if self._closed:
            raise Internal(f"model {self.config.name!r}: closed")
        if self._conn is not None and not self._process.is_alive():  # died while idle: no batch lost
            log.warning("model %r: worker process %s", self.config.name, self._exit_description())
            self._forget()
        if self._conn is None:  # the last one died: a new child, loaded and warmed as the first was
            log.warning("model %r: restarting its worker process", self.config.name)
            self._load_in_child()
            if self._warmed:
                self._call("warmup", timeout=START_TIMEOUT_S)
        return self._call("run", budget.threads(), to_wire(batch))

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
            rss = _resident_bytes(str(process.pid))
        except (OSError, ValueError, IndexError):
            return self.cpu_seconds, self.resident_bytes
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), rss

    def trim_heap(self) -> bool:
        """:func:`.heap.trim_heap` in the worker process (the server calls it once its models are loaded)."""
        return bool(self._call("trim", timeout=START_TIMEOUT_S))

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        """The child's accelerator memory as of its last answer (the event loop asks; the pipe is not used)."""
        return dict(self._memory)

    def close(self) -> None:
        """End the child: asked to close when no batch is running (it answers within :data:`STOP_TIMEOUT_S`),
        else, or if it does not, SIGKILL (it ignores SIGTERM; it holds nothing that outlives it). A batch still
        running in it fails (its requests were already answered UNAVAILABLE by the scheduler's close). No new
        child is started after this."""
        self._closed = True
        process = self._process
        if process is None:
            return
        if self._lock.acquire(blocking=False):  # idle: a clean close
            try:
                if self._conn is not None and process.is_alive():
                    try:
                        self._conn.send(("close",))
                        if self._conn.poll(STOP_TIMEOUT_S):
                            self._conn.recv()
                    except (EOFError, OSError):
                        pass
                    process.join(STOP_TIMEOUT_S)
            finally:
                self._lock.release()
        if process.is_alive():
            process.kill()
            process.join(STOP_TIMEOUT_S)
        log.info("model %r: worker process %d ended (%s)", self.config.name, process.pid,
                 self._exit_description(process))
        if self._lock.acquire(blocking=False):
            try:
                self._forget()
            finally:
                self._lock.release()
