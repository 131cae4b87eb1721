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
    """The runners of one server, looked up by name; knows whether the server is draining."""

    def __init__(self, runners: Sequence[Runner]) -> None:
        self.runners: dict[str, Runner] = {}
        for r in runners:
            if r.name in self.runners:
                raise ValueError(f"model name {r.name!r} appears twice")
            self.runners[r.name] = r
        self.draining = False

    def names(self) -> list[str]:
        return sorted(self.runners)

    def get(self, name: str, task: str) -> Runner:
        """The runner for ``name`` that can do ``task``.

        Raises:
            Unavailable: draining, or the model is not loaded and warmed up yet.
            InvalidArgument: empty model name.
            NotFound: unknown model (lists the loaded ones).
            FailedPrecondition: the model does another task (names it).
        """
        if self.draining:
            raise Unavailable("server is shutting down and no longer accepts requests; retry on another replica")
        if not name:
            raise InvalidArgument(f"model is empty; set it to one of {self.names()}")
        runner = self.runners.get(name)
        if runner is None:
            raise NotFound(f"model {shown(name)} is not loaded; loaded models: {self.names()}")
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
        return bool(self.runners) and all(r.ready for r in self.runners.values())


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
