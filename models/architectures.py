"""Which checkpoints relserve serves, by name only (no torch): config.json's ``model_type`` -> the
``architectures`` served for it and the task each one is. :mod:`relserve.models.checkpoint` maps each task to
its model classes; the server's start-up checks read the same table before any port is bound, without importing
torch. A missing ``model_type`` means ``deberta-v2`` (as transformers' DeBERTa-v2/v3 checkpoints are read).
"""

from __future__ import annotations

from typing import Sequence

DEFAULT_MODEL_TYPE = "deberta-v2"

# model_type -> {architecture: task}
ARCHITECTURES: dict[str, dict[str, str]] = {
    "deberta-v2": {
        "DebertaV2ForSequenceClassification": "classification",
        "DebertaV2ForQuestionAnswering": "question-answering",
        "DebertaV2ForTokenClassification": "token-classification",
    },
    "deberta": {
        "DebertaForSequenceClassification": "classification",
        "DebertaForQuestionAnswering": "question-answering",
        "DebertaForTokenClassification": "token-classification",
    },
}


def supported_summary() -> str:
    """Every model_type with the architectures served for it, as refusal messages name them."""
    return "; ".join(f"model_type {mt!r}: {', '.join(archs)}" for mt, archs in ARCHITECTURES.items())


def model_type_problem(model_type: str) -> str | None:
    """Why ``model_type`` is not served (the message lists what is), None when it is."""
    if model_type not in ARCHITECTURES:
        return f"model_type {model_type!r} is not supported; supported: {supported_summary()}"
    return None


def served_architecture(architectures: Sequence[str] | None, model_type: str) -> tuple[str | None, str | None]:
    """``(the first of architectures served for model_type, None)``, or ``(None, why not)``: no
    ``architectures`` entry, or none of them served (the message lists exactly what is). ``model_type`` must be
    served (:func:`model_type_problem`)."""
    archs = ARCHITECTURES[model_type]
    if not architectures:
        return None, (f"no 'architectures' entry; cannot tell the task (supported for model_type {model_type!r}: "
                      f"{', '.join(archs)})")
    for arch in architectures:
        if arch in archs:
            return arch, None
    return None, (f"unsupported architectures {list(architectures)} for model_type {model_type!r}; supported: "
                  f"{supported_summary()}")
