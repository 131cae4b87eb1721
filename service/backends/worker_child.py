"""What runs in a worker process (``worker_process: true``; the parent side is :mod:`.worker`): the items as
they cross the pipe (:class:`WireItem`), and :func:`child_main`, which builds the model's in-process backend
and answers the parent's requests until the pipe closes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
from typing import Any, Sequence

from ..config import ModelConfig
from ..errors import Internal
from .base import CallBudget, ModelMeta
from .heap import trim_heap


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


def resident_bytes(pid: str = "self") -> int:
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


def child_main(conn: Any, config: ModelConfig, module: str, cls: str, log_level: int, parent_pid: int) -> None:
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
            rss = resident_bytes()
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
                backend.own_process = True  # its heap holds this model's batches only (torch_encoder.load reads it)
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
