"""PyTorch step backend for RNNsearch translation checkpoints (``backend: torch``).

Follows :class:`relserve.service.backends.base.StepBackend`: the model is
:class:`relserve.models.rnnsearch.RNNSearch` loaded eagerly on the model's device and dtype; the beams over
it are kept by a :class:`.translation_steps.BeamStepper`.

``loader`` is a seam for tests: ``(path, device=, dtype=) -> (model, config, tokenizer)``; default
``relserve.models.checkpoint.load_translation_checkpoint``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from relserve.models.checkpoint import load_translation_checkpoint

from ..config import ModelConfig, check_dtype_for_device
from .base import TASK_TRANSLATION, ModelMeta, SeqUpdate, StartItem, StepPlan
from .torch_device import DTYPES, cuda_memory_stats, release_cuda_cache, resolve_device
from .translation_steps import BeamStepper

log = logging.getLogger(__name__)

Loader = Callable[..., tuple[Any, Any, Any]]


class TorchTranslationBackend:
    """Translation backend over an eager RNNsearch checkpoint (any encoder: BiGRU or DeBERTa-style)."""

    name = "torch"

    def __init__(self, config: ModelConfig, loader: Loader | None = None) -> None:
        self.config = config
        self._loader = loader or load_translation_checkpoint
        self.device = "cpu"
        self.dtype = DTYPES[config.dtype]
        self.model: Any = None
        self.model_config: Any = None
        self.tokenizer: Any = None
        self.meta: ModelMeta | None = None
        self.stepper: BeamStepper | None = None

    # -------------------------------------------------------------- lifecycle

    def load(self) -> ModelMeta:
        self.device = resolve_device(self.config.name, self.config.device)
        check_dtype_for_device(self.config.name, self.config.dtype, self.device)
        self.model, self.model_config, self.tokenizer = self._loader(self.config.path, device=self.device,
                                                                     dtype=self.dtype)
        self.model.eval()
        self.stepper = BeamStepper(self.config.name, self.model, self.device)
        kind = "bigru" if getattr(self.model_config, "encoder_type", "bigru") == "bigru" else "deberta"
        self.meta = ModelMeta(
            task=TASK_TRANSLATION, family=f"rnnsearch-{kind}", backend=self.name, device=self.device,
            dtype=self.config.dtype, tokenizer=self.tokenizer, max_positions=None,
            extra={"eos_token_id": int(self.model_config.eos_token_id)},
        )
        log.info("model %r: loaded translation model %s (%s encoder) on %s as %s", self.config.name,
                 self.config.path, kind, self.device, self.config.dtype)
        return self.meta

    def warmup(self) -> None:
        """Encode two short sources and decode them a few steps with a beam of 2."""
        self._stepper().warmup()

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        return cuda_memory_stats(self.device)

    def close(self) -> None:
        if self.stepper is not None:
            self.stepper.clear()
        self.stepper = None
        self.model = None
        release_cuda_cache(self.device)

    # -------------------------------------------------------------- step contract

    def _stepper(self) -> BeamStepper:
        if self.stepper is None:
            raise RuntimeError(f"model {self.config.name!r}: translation backend used before load()")
        return self.stepper

    def start(self, items: Sequence[StartItem]) -> list[int | Exception]:
        return self._stepper().start(items)

    def step(self, plan: StepPlan) -> list[SeqUpdate | Exception]:
        return self._stepper().step(plan)

    def release(self, seq_ids: Sequence[int]) -> None:
        if self.stepper is not None:
            self.stepper.release(seq_ids)
