"""PyTorch step backend for RNNsearch translation checkpoints (``backend: torch``).

Follows :class:`relserve.service.backends.base.StepBackend`: the model is
:class:`relserve.models.rnnsearch.RNNSearch` loaded eagerly on the model's device and dtype; the beams over
it are kept by a :class:`.translation_steps.BeamStepper`. ``dtype: auto`` loads float32 and lets the agreement gate
of :mod:`.precision` (greedy tokens, bf16 vs fp32) switch to bfloat16 after warm-up.

``loader`` is a seam for tests: ``(path, device=, dtype=) -> (model, config, tokenizer)``; default
``relserve.models.checkpoint.load_translation_checkpoint``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from relserve.models.checkpoint import load_translation_checkpoint
from relserve.models.deberta import set_unpadded

from ..config import ModelConfig, check_dtype_for_device
from . import precision
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
        self.dtype: Any = None  # load(): the plan's torch dtype; warmup(): the gate may switch it to bfloat16
        self.plan: precision.Plan | None = None
        self._float32_model: Any = None  # the float32 model while the gate runs its bfloat16 copy
        self.model: Any = None
        self.model_config: Any = None
        self.tokenizer: Any = None
        self.meta: ModelMeta | None = None
        self.stepper: BeamStepper | None = None

    # -------------------------------------------------------------- lifecycle

    def load(self) -> ModelMeta:
        self.device = resolve_device(self.config.name, self.config.device)
        check_dtype_for_device(self.config.name, self.config.dtype, self.device)
        self.plan = precision.plan(self.config, self.device)
        self.dtype = DTYPES[self.plan.dtype]
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
            dtype=self.plan.dtype, tokenizer=self.tokenizer, max_positions=None,
            dtype_reason=self.plan.reason + ("; the bfloat16 agreement gate runs at warm-up" if self.plan.gate else ""),
            extra={"eos_token_id": int(self.model_config.eos_token_id)},
        )
        log.info("model %r: loaded translation model %s (%s encoder) on %s as %s", self.config.name,
                 self.config.path, kind, self.device, self.plan.dtype)
        return self.meta

    def warmup(self) -> ModelMeta:
        """The shared warm-up (two short sources, beam 2), then for ``dtype: auto`` where bfloat16 is native the
        agreement gate (:func:`.precision.decide`). Returns the meta with the dtype that serves and why."""
        super().warmup()
        assert self.plan is not None and self.meta is not None
        precision.gate_torch_backend(self, TASK_TRANSLATION)
        return self.meta

    def _gate_outcomes(self, items: list[dict[str, str]]) -> list[precision.Outcome]:
        return precision.translation_outcomes(items, tokenizer=self.tokenizer, stepper=self._stepper(),
                                              config=self.config)

    def _use_bfloat16(self) -> None:
        self._float32_model = self.model
        self._swap(precision.to_bfloat16(self.model))
        self.dtype = DTYPES["bfloat16"]

    def _use_float32(self) -> None:
        if self._float32_model is not None:
            self._swap(self._float32_model)
        self._float32_model = None
        self.dtype = DTYPES["float32"]

    def _swap(self, model: Any) -> None:
        stepper = self._stepper()
        stepper.clear()  # no beam (nor cached encoder stack) of the other dtype may survive the swap
        self.model = stepper.model = model
