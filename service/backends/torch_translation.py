"""PyTorch step backend for RNNsearch translation checkpoints (``backend: torch``).

Follows :class:`relserve.service.backends.base.StepBackend`: the model is
:class:`relserve.models.rnnsearch.RNNSearch` loaded eagerly on the model's device and dtype; the beams over
it are kept by a :class:`.translation_steps.BeamStepper`.

``loader`` is a seam for tests: ``(path, device=, dtype=) -> (model, config, tokenizer)``; default
``relserve.models.checkpoint.load_translation_checkpoint``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from relserve.models.checkpoint import load_translation_checkpoint
from relserve.models.deberta import set_unpadded

from ..config import ModelConfig, check_dtype_for_device
from .base import TASK_TRANSLATION, ModelMeta
from .torch_device import DTYPES, resolve_device
from .translation_steps import BeamStepper, SteppedBackend

log = logging.getLogger(__name__)

Loader = Callable[..., tuple[Any, Any, Any]]


class TorchTranslationBackend(SteppedBackend):
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
        # a DeBERTa encoder runs its dense layers on the real source tokens only (torch_unpadded), as the
        # torch encoder backend does; a BiGRU encoder has no such switch (0 modules set)
        if set_unpadded(self.model, self.config.torch_unpadded):
            log.info("model %r: DeBERTa encoder unpadded execution %s (torch_unpadded)", self.config.name,
                     "on" if self.config.torch_unpadded else "off")
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
