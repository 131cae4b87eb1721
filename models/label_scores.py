"""Scores of a sequence-classification head, as transformers' ``TextClassificationPipeline`` computes them.

The server's classify task and the bf16/int8 agreement gate both turn logits into scores here, so the
two cannot disagree on which function a model gets by default. numpy only.
"""

from __future__ import annotations

import numpy as np

FUNCTIONS = ("softmax", "sigmoid", "none")  # ClassifyRequest.function_to_apply, as the pipeline's


def default_function(problem_type: str | None, num_labels: int) -> str:
    """The function the transformers text-classification pipeline applies when none is asked for:
    ``"none"`` for regression, ``"sigmoid"`` for multi-label or one-label models, else ``"softmax"``
    (the pipeline's order of checks; a model with no labels at all gets ``"none"``, as its fallback)."""
    if problem_type == "regression":
        return "none"
    if problem_type == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    if problem_type == "single_label_classification" or num_labels > 1:
        return "softmax"
    return "none"


def apply_function(logits: np.ndarray, function: str) -> np.ndarray:
    """``function`` (one of :data:`FUNCTIONS`) of one item's logits ``Float[num_labels]``, in float64:
    an independent sigmoid per label, the identity, or a max-shifted softmax.

    Raises:
        ValueError: ``function`` is not one of :data:`FUNCTIONS`.
    """
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    if function == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    if function == "none":
        return x
    if function == "softmax":
        e = np.exp(x - x.max())
        return e / e.sum()
    raise ValueError(f"unknown function_to_apply {function!r}; expected one of {', '.join(FUNCTIONS)}")
