"""The model repository at run time: which versions of which repository models are loaded, and the changes
(control modes none / poll / explicit, as Triton's; docs/operations.md "Model repository").

Every change runs on the server's event loop under one lock, so a scan, a load and an unload never interleave.
A version loads beside whatever serves (:mod:`.swap`: built, loaded and warmed in a thread, started, its gates
passed); only then does the registry's serving entry move to it, and the version it replaces drains (its queued
and running work finishes) before it closes. A version that fails leaves the serving one in place and is listed
in :meth:`RepositoryManager.index` with its reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .. import metrics
from ..config import MIB, MODEL_KEYS, ModelConfig, ServerConfig
from ..errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound, Unavailable, shown
from ..registry import ModelRegistry
from ..runner import Runner
from . import layout
from .swap import LOADING, READY, UNAVAILABLE, Slot, VersionLoader

log = logging.getLogger(__name__)

LOAD_PARAMETERS = ("config",)
UNLOAD_PARAMETERS = ("unload_dependents",)


@dataclass(frozen=True)
class IndexEntry:
    """One row of the repository index (Triton's ``RepositoryIndexResponse.ModelIndex``)."""

    name: str
    version: str  # "" for a model of the repository with no loaded, loading or failed version
    state: str    # READY | LOADING | UNLOADING | UNAVAILABLE
    reason: str   # "" when READY


class RepositoryManager:
    """The repository models of one server (see the module docstring).

    Args:
        config: the server config (``model_repositories``, ``model_control_mode``, ``repository_poll_secs``,
            ``load_models``, ``memory_limit_mb``, ``drain_timeout``).
        registry: the server's registry; loaded versions are added to it, unloaded ones taken out.
        health: ``health(name, ready)`` sets model ``name``'s own health service: True SERVING, False
            NOT_SERVING, None removed (an unknown service to grpc.health.v1: Check NOT_FOUND, Watch
            SERVICE_UNKNOWN).
        fixed: names served from ``--model`` / ``models:`` (not part of the repository, never unloaded here).
        compute: the server's compute scheduler, given to every runner.
        build: config -> runner (tests may pass their own).
    """

    def __init__(self, config: ServerConfig, registry: ModelRegistry | None = None,
                 health: Callable[[str, bool | None], None] | None = None, *, fixed: Iterable[str] = (),
                 compute: Any = None, build: Callable[[ModelConfig], Runner] | None = None) -> None:
        self.mode = config.model_control_mode
        self.repositories = [Path(p) for p in config.model_repositories]
        self.poll_secs = config.repository_poll_secs
        self.load_models = tuple(config.load_models)
        self.registry = registry if registry is not None else ModelRegistry([])
        self._health = health or (lambda _name, _ready: None)
        self._fixed = set(fixed)
        self._loader = VersionLoader(self.registry, self._publish_health, compute=compute, build=build,
                                     memory_limit=config.memory_limit_mb * MIB, drain_timeout=config.drain_timeout)
        self._fixed_models = [m for m in config.models if m.name in self._fixed]
        self._known: dict[str, layout.RepoModel] = {}
        self._slots: dict[str, dict[str, Slot]] = {}  # name -> version -> what is known of it
        self._reasons: dict[str, str] = {}  # name -> why it has no version row ("unloaded", a scan refusal)
        self._overrides: dict[str, dict[str, Any]] = {}  # name -> the load API's config, kept for reloads
        self._lock = asyncio.Lock()
        self._poller: asyncio.Task | None = None
        self._changes: set[asyncio.Task] = set()  # API loads / unloads whose caller was cancelled
        self._closed = False

    # ------------------------------------------------------------------ start and stop

    def attach(self, registry: ModelRegistry, health: Callable[[str, bool | None], None], compute: Any) -> None:
        """The server's registry, model-health setter and compute scheduler, once it has built them."""
        self.registry = registry
        self._health = health
        self._loader.registry = registry
        self._loader._compute = compute

    def check_start(self) -> None:
        """Before any port is bound: scan the repositories. Mode none: every model must be acceptable and its
        files sound (as a bad ``--model``); explicit: every ``load_models`` name must be in a repository.

        Raises:
            ConfigError: naming the model, the path and why.
        """
        if not self.repositories:
            return
        from ..registry import check_models

        self._known = layout.scan(self.repositories)
        self._loader.fixed_bytes = sum(_estimate(m) for m in self._fixed_models)
        if self.mode == "explicit":
            missing = [n for n in self.load_models if n != "*" and n not in self._known]
            if missing:
                raise ConfigError(f"load_models {missing}: not in the model repositories "
                                  f"{[str(r) for r in self.repositories]}; models there: {sorted(self._known)}")
        if self.mode != "none":
            return
        for model in self._known.values():
            problem = model.problem or self._refusal(model)
            if problem:
                raise ConfigError(f"repository model {model.name!r}: {problem}")
            check_models([model.config(v) for v in model.selected()])

    async def start(self) -> None:
        """The first loads (mode none and poll: every model; explicit: ``load_models``), then the poll loop.

        Raises:
            Exception: mode none only: the first version that fails to load (the server does not start).
        """
        if not self.repositories:
            return
        async with self._lock:
            known = await self._scan()
            if self.mode == "explicit":
                names = list(known) if "*" in self.load_models else [n for n in self.load_models if n in known]
            else:
                names = list(known)
            for name in names:
                await self._apply(known[name], strict=self.mode == "none")
        if self.mode == "poll":
            self._poller = asyncio.get_running_loop().create_task(self._poll_loop(), name="relserve-repository-poll")

    async def close(self) -> None:
        """Stop polling and close every repository runner that is not the serving one of its name (the server
        closes those with its other models)."""
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except (asyncio.CancelledError, Exception):
                pass
            self._poller = None
        for task in list(self._changes):  # a load whose caller went away: the server stops instead
            task.cancel()
        await asyncio.gather(*self._changes, return_exceptions=True)
        await self._loader.close(
            [s.runner for slots in self._slots.values() for s in slots.values()
             if s.runner is not None and self.registry.runners.get(s.runner.name) is not s.runner])

    # ------------------------------------------------------------------ poll mode

    async def _poll_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.poll_secs)
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one bad round (a repository unmounted) must not stop the polling
                log.warning("model repository poll failed: %s: %s", type(exc).__name__, exc)

    async def poll(self) -> None:
        """One scan: new models and versions load, changed files reload, removed models unload (poll mode's
        round; also callable in tests)."""
        async with self._lock:
            if self.registry.draining:
                return
            known = await self._scan()
            for model in known.values():
                await self._apply(model)
            for name in [n for n in self._slots if n not in known]:
                log.info("model %r: removed from the repository; unloading", name)
                await self._unload_all(name, "unloaded (removed from the repository)", wait=False)
                self._slots.pop(name, None)
                self._reasons.pop(name, None)
            self._known = known

    # ------------------------------------------------------------------ the API (explicit mode)

    async def load(self, name: str, parameters: Mapping[str, object] | None = None) -> None:
        """Load or reload model ``name`` (its versions per policy; a loaded version with unchanged files and
        config is kept, new or changed ones load beside and swap in). Returns when they serve.

        Raises:
            FailedPrecondition: the mode is not explicit, or ``name`` is served from --model / models:.
            InvalidArgument: a bad name or parameter (an unknown key, a ``config`` that is not a JSON object of
                model keys or holds a bad value).
            NotFound: no such model in the repositories (lists those there).
            Unavailable: a version failed to load (the reason; what served before still serves).
        """
        self._check_mode("load")
        layout.check_name(name)
        overrides = _load_parameters(parameters)
        if name in self._fixed:
            raise FailedPrecondition(f"model {shown(name)} is served from --model / models:, not from the repository; "
                                     f"it cannot be loaded or unloaded through the repository API")
        if self.registry.draining:
            raise Unavailable("server is shutting down and loads no model; retry on another replica")
        problem = await self._to_the_end(self._load_locked(name, overrides))
        if problem:
            raise Unavailable(f"model {shown(name)}: {problem}")

    async def unload(self, name: str, parameters: Mapping[str, object] | None = None) -> None:
        """Take model ``name`` out of the registry (calls after get NOT_FOUND), let its queued and running work
        finish, then unload every version.

        Raises:
            FailedPrecondition: the mode is not explicit, or ``name`` is served from --model / models:.
            InvalidArgument: a bad name or parameter.
            NotFound: no such model, loaded or in the repositories.
        """
        self._check_mode("unload")
        layout.check_name(name)
        _check_parameters(parameters, UNLOAD_PARAMETERS)
        if parameters and "unload_dependents" in parameters and not isinstance(parameters["unload_dependents"], bool):
            raise InvalidArgument("parameter unload_dependents must be a bool")
        if name in self._fixed:
            raise FailedPrecondition(f"model {shown(name)} is served from --model / models:, not from the repository; "
                                     f"it cannot be unloaded")
        await self._to_the_end(self._unload_locked(name))

    async def _to_the_end(self, change: Any) -> Any:
        """Run ``change`` (a load or an unload under the lock) to its end even when the call is cancelled (the
        client's deadline passed, or it went away): cut short, a version would stay LOADING or UNLOADING with
        its worker running. The cancelled caller still gets CancelledError; the change finishes in the
        background and its outcome is in the index and the log."""
        task = asyncio.ensure_future(change)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._changes.add(task)
            task.add_done_callback(self._changes.discard)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # the load logs its failure
            raise

    async def _load_locked(self, name: str, overrides: dict[str, Any]) -> str:
        async with self._lock:
            known = await self._scan()
            model = known.get(name)
            if model is None:
                raise NotFound(f"model {shown(name)} is not in the model repositories "
                               f"{[str(r) for r in self.repositories]}; models there: {sorted(known)}")
            policy = overrides.pop("version_policy", None)
            if policy is not None:
                try:
                    model = dataclasses.replace(model, policy=layout.parse_policy(policy, "config"))
                except ConfigError as exc:
                    raise InvalidArgument(str(exc)) from None
            if not model.problem and model.versions:
                try:
                    model.config(model.selected()[-1] if model.selected() else next(iter(model.versions)), overrides)
                except ConfigError as exc:
                    raise InvalidArgument(f"parameter config: {exc}") from None
            self._overrides[name] = overrides
            problem = await self._apply(model, retry=True)
            self._known = known
        return problem

    async def _unload_locked(self, name: str) -> None:
        async with self._lock:
            known = await self._scan()
            self._known = known
            if name not in known and name not in self._slots:
                raise NotFound(f"model {shown(name)} is neither loaded nor in the model repositories; models there: "
                               f"{sorted(known)}")
            await self._unload_all(name, "unloaded", wait=True)
            self._overrides.pop(name, None)

    def _check_mode(self, what: str) -> None:
        if self.mode != "explicit":
            raise FailedPrecondition(f"model control mode is {self.mode}: {what} through the repository API needs "
                                     f"--model-control-mode explicit")

    # ------------------------------------------------------------------ the index

    def index(self, repository_name: str = "", ready: bool = False) -> list[IndexEntry]:
        """Every model of the repositories and every version loading, loaded, unloading or failed, sorted by name
        then version number. ``repository_name``: "" all, else a repository's directory as configured or its
        basename. ``ready``: READY rows only.

        Raises:
            NotFound: no repository of that name (lists them).
        """
        repos = set(self.repositories)
        if repository_name:
            repos = {r for r in self.repositories if repository_name in (str(r), r.name)}
            if not repos:
                raise NotFound(f"repository {repository_name[:200]!r} is not one of "
                               f"{[str(r) for r in self.repositories]}")
        rows = []
        for name in sorted(set(self._known) | set(self._slots)):
            model = self._known.get(name)
            if model is not None and model.repository not in repos:
                continue
            slots = self._slots.get(name, {})
            if not slots:
                reason = self._reasons.get(name) or (model.problem if model else "") or "not loaded"
                rows.append(IndexEntry(name, "", UNAVAILABLE, reason))
                continue
            # a loaded model whose repository entry is now refused keeps serving what it loaded (a broken edit
            # takes nothing down); its READY rows say so, since only they show the operator the refusal
            refused = self._reasons.get(name, "")
            for version in sorted(slots, key=int):
                slot = slots[version]
                if slot.state != READY:
                    reason = slot.reason
                elif refused:
                    reason = f"serving the files loaded earlier; the repository entry is refused: {refused}"
                else:
                    reason = ""
                rows.append(IndexEntry(name, version, slot.state, reason))
        return [r for r in rows if r.state == READY] if ready else rows

    # ------------------------------------------------------------------ changes (under the lock)

    async def _scan(self) -> dict[str, layout.RepoModel]:
        return await asyncio.to_thread(layout.scan, self.repositories)

    def _refusal(self, model: layout.RepoModel) -> str:
        if model.name in self._fixed:
            return (f"the name {model.name!r} is already served from --model / models:; rename the repository "
                    f"directory {str(model.path)!r}")
        if model.versions and not model.selected():
            return (f"no version to serve: version_policy {model.policy.describe()} selects none of "
                    f"{list(model.versions)}")
        if not model.versions:
            return f"{str(model.path)!r} holds neither {layout.CHECKPOINT_MARKER} nor a version directory"
        return ""

    async def _apply(self, model: layout.RepoModel, *, strict: bool = False, retry: bool = False) -> str:
        """Bring ``model``'s loaded versions to what its directory and policy say; returns "" or why a version
        (or the model) cannot serve. ``strict``: raise the first failure instead. ``retry``: load again a version
        that failed with the same files (the API); a poll does not."""
        name = model.name
        problem = model.problem or self._refusal(model)
        slots = self._slots.setdefault(name, {})
        if problem:
            if self._reasons.get(name) != problem:
                log.warning("repository model %r refused: %s", name, problem)
            self._reasons[name] = problem
            if strict:
                raise ConfigError(f"repository model {name!r}: {problem}")
            if not slots:
                self._slots.pop(name, None)
            return problem
        self._reasons.pop(name, None)
        wanted = model.selected()
        errors = []
        for version in wanted:
            found = model.versions[version]
            try:
                cfg = model.config(version, self._overrides.get(name))
            except ConfigError as exc:
                errors.append(str(exc))
                continue
            slot = slots.get(version)
            if slot is not None and slot.fingerprint == found.fingerprint and slot.config == cfg:
                if slot.state == READY or (slot.state == UNAVAILABLE and slot.failed and not retry):
                    if slot.failed:
                        errors.append(slot.reason)
                    continue
            if slot is not None and slot.state == READY and slot.failed_fingerprint == (found.fingerprint, cfg) \
                    and not retry:
                continue  # a reload of these files failed already: the loaded files keep serving
            error = await self._loader.load(slots, version, cfg, found.fingerprint, strict=strict)
            if error:
                errors.append(f"version {version}: {error}")
        if any(slots.get(v) is not None and slots[v].state == READY for v in wanted):
            for version, slot in list(slots.items()):
                if version not in wanted and slot.state == READY:
                    await self._loader.retire(slots, version, "unloaded (not in the version policy)", wait=False)
        for version in [v for v, s in slots.items() if v not in model.versions and s.runner is None]:
            del slots[version]  # a failed or unloaded version whose directory is gone
        if not slots:
            self._slots.pop(name, None)
        return "; ".join(errors)

    async def _unload_all(self, name: str, reason: str, *, wait: bool) -> None:
        slots = self._slots.get(name, {})
        loaded = [v for v, s in slots.items() if s.runner is not None and s.state in (READY, LOADING)]
        for version in [v for v, s in slots.items() if s.runner is None]:
            slots[version] = dataclasses.replace(slots[version], state=UNAVAILABLE, reason=reason, failed=False)
        await asyncio.gather(*(self._loader.retire(slots, v, reason, wait=wait) for v in loaded))
        self._health(name, None)
        metrics.remove_model_info(name)
        if not loaded and not slots:
            self._reasons[name] = reason
        elif not slots:
            self._slots.pop(name, None)

    def _publish_health(self, name: str) -> None:
        """Model ``name``'s health service: SERVING while its serving version is ready, else NOT_SERVING."""
        runner = self.registry.runners.get(name)
        self._health(name, runner is not None and runner.ready)


def _estimate(config: ModelConfig) -> int:
    try:
        return layout.estimate_weight_bytes(config)
    except OSError:
        return 0


def _check_parameters(parameters: Mapping[str, object] | None, allowed: tuple[str, ...]) -> None:
    for key in parameters or {}:
        if key not in allowed:
            raise InvalidArgument(f"unknown parameter {str(key)[:64]!r}; relserve accepts {list(allowed)}")


def _load_parameters(parameters: Mapping[str, object] | None) -> dict[str, Any]:
    """The load API's parameters: only ``config``, JSON text of model keys (and version_policy) overriding
    relserve.yaml (Triton's ``config`` parameter carries the model's configuration the same way).

    Raises:
        InvalidArgument: another key, or config not a JSON object of known keys.
    """
    _check_parameters(parameters, LOAD_PARAMETERS)
    text = (parameters or {}).get("config")
    if text is None:
        return {}
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not isinstance(text, str):
        raise InvalidArgument("parameter config must be a string: JSON text of model keys")
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise InvalidArgument(f"parameter config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument("parameter config must be a JSON object of model keys")
    allowed = set(MODEL_KEYS) - {"name", "path"}
    unknown = sorted(k for k in value if k not in allowed and k != "version_policy")
    if unknown:
        raise InvalidArgument(f"parameter config: unknown key(s) {unknown}; allowed: version_policy and "
                              f"{sorted(allowed)}")
    return value
