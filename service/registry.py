"""The runners of one server: built from the config (:func:`build_runner`) and looked up by name and task
(:class:`ModelRegistry`, which also answers for a draining server).
"""

from __future__ import annotations

import time
from typing import Sequence

from .backends import checkpoint_task, create_backend, create_translation_backend
from .backends.base import TASK_CLASSIFICATION, TASK_QA, TASK_TOKEN_CLASSIFICATION, TASK_TRANSLATION
from .backends.progress import log_phase
from .config import ModelConfig
from .config.validation import check_model_files
from .errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable, shown
from .runner import ModelRunner, Runner, TranslationRunner


class ModelRegistry:
    """The runners of one server, looked up by name (and version); knows whether the server is draining.

    ``runners`` maps each name to its *serving* runner (the highest ready version); every loaded version stays
    addressable through :meth:`lookup` / :meth:`get` with a version. A version swap replaces the entry in one
    assignment on the event loop: a call looks its runner up once, so it runs on either version, never on none.
    """

    def __init__(self, runners: Sequence[Runner]) -> None:
        self.runners: dict[str, Runner] = {}
        self._versions: dict[str, dict[str, Runner]] = {}  # name -> version -> loaded runner
        for r in runners:
            if r.name in self.runners:
                raise ValueError(f"model name {r.name!r} appears twice")
            self.runners[r.name] = r
            self._versions[r.name] = {r.version: r}
        self.draining = False
        # the server's first loads are still running (ServerReady false until they end, even with no model)
        self.starting = True

    def names(self) -> list[str]:
        return sorted(self.runners)

    def versions(self, name: str) -> list[str]:
        """The loaded and ready versions of ``name``, ascending ([] for an unknown name)."""
        return sorted((v for v, r in self._versions.get(name, {}).items() if r.ready), key=_version_key)

    def loaded(self, name: str) -> dict[str, Runner]:
        """Every loaded version's runner of ``name`` (ready or not), by version."""
        return dict(self._versions.get(name, {}))

    def add_version(self, runner: Runner) -> None:
        """Make a started ``runner`` addressable by its version, and the serving one of its name if its version
        is the highest ready one. A runner of the same name and version is replaced (the caller drains it)."""
        self._versions.setdefault(runner.name, {})[runner.version] = runner
        self._reserve(runner.name)

    def remove_version(self, name: str, version: str) -> Runner | None:
        """Take version ``version`` of ``name`` out (new calls no longer reach it); the serving entry moves to
        the highest ready version left, or the name goes when none is left. Returns the runner taken out."""
        runner = self._versions.get(name, {}).pop(version, None)
        self._reserve(name)
        return runner

    def _reserve(self, name: str) -> None:
        loaded = self._versions.get(name, {})
        ready = [v for v, r in loaded.items() if r.ready] or list(loaded)
        if not ready:
            self._versions.pop(name, None)
            self.runners.pop(name, None)
            return
        self.runners[name] = loaded[max(ready, key=_version_key)]

    def lookup(self, name: str, version: str = "") -> Runner:
        """The runner of ``name`` at ``version`` ("" = the serving one), ready or not.

        Raises:
            InvalidArgument: empty model name.
            NotFound: unknown model (lists the loaded ones), or a version that is not loaded (lists those that are).
        """
        if not name:
            raise InvalidArgument(f"model is empty; set it to one of {self.names()}")
        runner = self.runners.get(name)
        if runner is None:
            raise NotFound(f"model {shown(name)} is not loaded; loaded models: {self.names()}")
        if version:
            runner = self._versions.get(name, {}).get(version)
            if runner is None:
                raise NotFound(f"version {shown(version)} of model {shown(name)} is not loaded; loaded versions: "
                               f"{sorted(self._versions.get(name, {}), key=_version_key)}")
        return runner

    def get(self, name: str, task: str, version: str = "") -> Runner:
        """The runner for ``name`` (at ``version``, "" = the serving one) that can do ``task``.

        Raises:
            Unavailable: draining, or the model is not loaded and warmed up yet.
            InvalidArgument: empty model name.
            NotFound: unknown model (lists the loaded ones) or version (lists the loaded versions).
            FailedPrecondition: the model does another task (names it).
        """
        if self.draining:
            raise Unavailable("server is shutting down and no longer accepts requests; retry on another replica")
        runner = self.lookup(name, version)
        if not runner.ready:
            raise Unavailable(runner.not_ready_message())
        if runner.task != task:
            rpc = {TASK_CLASSIFICATION: "Classify", TASK_QA: "Answer",
                   TASK_TOKEN_CLASSIFICATION: "ClassifyTokens"}.get(runner.task or "", "Translate")
            raise FailedPrecondition(
                f"model {name!r} is a {runner.task} model and cannot serve {task}; use {rpc} instead"
            )
        return runner

    @property
    def all_ready(self) -> bool:
        """Every serving model ready once the first loads ended (true with no model: a repository server that
        serves nothing yet is ready, as Triton's)."""
        return not self.starting and all(r.ready for r in self.runners.values())


def _version_key(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)


def check_models(models: Sequence[ModelConfig]) -> None:
    """Every model's files before the server binds a port (:func:`relserve.service.config.validation.check_model_files`;
    an ``onnx_path`` export against its checkpoint: :func:`relserve.service.backends.graph_cache.check_export_dir`),
    each model's time logged as its first load phase.

    Raises:
        ConfigError: the first model whose files are missing, unreadable or invalid (naming it, the path and why).
    """
    for m in models:
        t0 = time.monotonic()
        check_model_files(m)
        if m.onnx_path is not None:
            from .backends.graph_cache import check_export_dir  # imports torch and onnx: only for such a model

            check_export_dir(m)
        log_phase(m.name, "config read and files checked", time.monotonic() - t0)


def build_runner(config: ModelConfig) -> Runner:
    """A runner with the backend named in the config (imports torch for the torch backends): a
    :class:`TranslationRunner` for RNNsearch directories (config.json model_type "rnnsearch"), else a
    :class:`ModelRunner`.

    Raises:
        ConfigError: the config names a backend that cannot serve the model.
    """
    if checkpoint_task(config.path) == TASK_TRANSLATION:
        backend = create_translation_backend(config)  # checks the config; loads nothing yet
        if config.worker_process:
            from .scheduling.decode_workers import DecodeWorkers

            return TranslationRunner(config, DecodeWorkers(config, backend.name))
        return TranslationRunner(config, backend)
    return ModelRunner(config, create_backend(config))
