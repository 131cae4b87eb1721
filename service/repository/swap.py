"""One version of a repository model loaded beside what serves, swapped in, and retired (drained, then closed).

The order is what makes a swap invisible to callers: the new runner is built, loaded, warmed and gated (its
load raises on unreadable weights, wrong shapes or a failed parity gate) and started while the old version keeps
serving; the registry's entry changes in one assignment on the event loop (a call looks its runner up once);
the old runner then drains (:meth:`relserve.service.runner.Runner.drain`: its queued and running work finishes,
bounded by ``drain_timeout``) and closes. A failure anywhere before the swap closes the new runner and leaves
the registry as it was.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .. import metrics
from ..config import MIB, ModelConfig
from ..errors import Unavailable
from ..registry import ModelRegistry, build_runner, check_models
from ..runner import Runner
from .layout import Fingerprint, estimate_weight_bytes

log = logging.getLogger(__name__)

# a version's state in the repository index: Triton's strings
READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"


@dataclass(frozen=True)
class Slot:
    """What is known of one version of a repository model."""

    state: str                          # READY | LOADING | UNLOADING | UNAVAILABLE
    reason: str = ""
    runner: Runner | None = None        # loaded (READY, UNLOADING)
    fingerprint: Fingerprint | None = None  # the files it was loaded (or failed) from
    config: ModelConfig | None = None
    failed: bool = False                # UNAVAILABLE because its load failed (a poll does not retry the same files)
    # READY, but a reload of these (files, config) failed: the loaded files keep serving, a poll does not retry
    failed_fingerprint: tuple[Any, ...] | None = None


class VersionLoader:
    """Loads, swaps in and retires versions (see the module docstring) for a
    :class:`relserve.service.repository.manager.RepositoryManager`; every method runs on the event loop.

    Args:
        registry: the server's registry.
        publish: ``publish(name)`` updates model ``name``'s health from the registry.
        compute: the server's compute scheduler (given to each runner).
        build: config -> runner (default :func:`relserve.service.registry.build_runner`).
        memory_limit: bytes of weights that may be loaded at once (0: no limit).
        drain_timeout: seconds a retired version's work gets to finish.
    """

    def __init__(self, registry: ModelRegistry, publish: Callable[[str], None], *, compute: Any = None,
                 build: Callable[[ModelConfig], Runner] | None = None, memory_limit: int = 0,
                 drain_timeout: float = 30.0) -> None:
        self.registry = registry
        self._publish = publish
        self._compute = compute
        self._build = build or build_runner
        self.memory_limit = memory_limit
        self.drain_timeout = drain_timeout
        self.fixed_bytes = 0  # estimated weights of the --model / models: entries
        self._bytes: dict[Runner, int] = {}  # estimated weights of each loaded repository runner
        self._tasks: set[asyncio.Task] = set()  # drains running in the background
        self._draining: set[Runner] = set()

    @property
    def loaded_bytes(self) -> int:
        return self.fixed_bytes + sum(self._bytes.values())

    async def load(self, slots: dict[str, Slot], version: str, config: ModelConfig, fingerprint: Fingerprint, *,
                   strict: bool = False) -> str:
        """Load ``version`` (``config``) beside what serves and swap it in; returns "" or why it failed (the
        slot then says so, and what served keeps serving).

        Raises:
            Exception: with ``strict``, the load's own error instead of returning it.
        """
        name = config.name
        old = slots.get(version)
        replacing = old if old is not None and old.state == READY and old.runner is not None else None
        if replacing is None:
            slots[version] = Slot(LOADING, "", None, fingerprint, config)
            self._publish(name)
        runner: Runner | None = None
        t0 = time.monotonic()
        try:
            estimate = await asyncio.to_thread(estimate_weight_bytes, config)
            if self.memory_limit and self.loaded_bytes + estimate > self.memory_limit:
                raise Unavailable(
                    f"over memory_limit_mb: its weights take an estimated {estimate / MIB:.1f} MiB as {config.dtype} "
                    f"and {self.loaded_bytes / MIB:.1f} MiB are loaded, limit {self.memory_limit / MIB:.0f} MiB")
            await asyncio.to_thread(check_models, [config])
            runner = await asyncio.to_thread(self._build, config)
            runner.version = version
            runner.compute = self._compute
            await asyncio.to_thread(runner.load)
            await runner.start()
        except Exception as exc:
            reason = f"load failed: {exc}"
            metrics.count_model_load(name, False)
            if runner is not None:
                await _close_quietly(runner)
            serving = self.registry.runners.get(name)
            log.warning("model %r version %s: %s; %s", name, version, reason,
                        f"version {serving.version} keeps serving" if serving is not None else "no version serves")
            if replacing is not None:
                slots[version] = dataclasses.replace(replacing, failed_fingerprint=(fingerprint, config))
            else:
                slots[version] = Slot(UNAVAILABLE, reason, None, fingerprint, config, failed=True)
                self._publish(name)
            if strict:
                raise
            return reason
        slots[version] = Slot(READY, "", runner, fingerprint, config)
        self._bytes[runner] = estimate
        self.registry.add_version(runner)  # new calls go to it from here on (if it is the highest version)
        runner.readiness_listeners.append(lambda _ready: self._publish(name))
        self._publish(name)
        metrics.count_model_load(name, True)
        info = runner.info()
        log.info("model %r version %s: ready in %.2f s (%s, %s on %s)%s", name, version, time.monotonic() - t0,
                 info.task, info.dtype, info.device,
                 f"; version {version}'s previous files drain" if replacing is not None else "")
        if replacing is not None and replacing.runner is not None:
            self._background(self._drain(replacing.runner))
        return ""

    async def retire(self, slots: dict[str, Slot], version: str, reason: str, *, wait: bool) -> None:
        """Take ``version`` out of the registry at once (calls after it do not reach it), then drain and close it
        (``wait``: before returning; else in the background); its slot ends UNAVAILABLE with ``reason``."""
        slot = slots[version]
        runner = slot.runner
        if runner is None:
            return
        unloading = dataclasses.replace(slot, state=UNLOADING, reason=reason)
        slots[version] = unloading
        if self.registry.loaded(runner.name).get(version) is runner:
            self.registry.remove_version(runner.name, version)
        self._publish(runner.name)

        async def finish() -> None:
            await self._drain(runner)
            if slots.get(version) is unloading:
                slots[version] = Slot(UNAVAILABLE, reason, None, slot.fingerprint, slot.config)

        if wait:
            await finish()
        else:
            self._background(finish())

    async def _drain(self, runner: Runner) -> None:
        self._draining.add(runner)
        try:
            await runner.drain(self.drain_timeout)
        finally:
            self._draining.discard(runner)
            self._bytes.pop(runner, None)
            log.info("model %r version %s: unloaded", runner.name, runner.version)

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self, runners: Iterable[Runner]) -> None:
        """Server stop: drains under way end now, and ``runners`` (loaded, not serving) close."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for runner in {*runners, *self._draining}:
            await _close_quietly(runner)


async def _close_quietly(runner: Runner) -> None:
    try:
        if runner.state != "closed":
            await runner.close()
    except Exception:
        log.exception("model %r version %s: close failed", runner.name, runner.version)
