"""Yield points inside a torch model's forward: where a long backend call runs its :class:`.base.CallBudget`'s
layer hook (the scheduler decides whether to hand the cores to another model; this only marks the places)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import CallBudget
from .torch_device import use_threads


def add_yield_points(model: torch.nn.Module, budget: Callable[[], CallBudget], threads: int = 0,
                     depth: int = 2) -> int:
    """Register a forward pre-hook on every item of every ``nn.ModuleList`` of ``model`` (the encoder
    layers) and on their sub-modules down to ``depth`` levels (a DeBERTa layer: attention, its
    self-attention and output, the feed-forward halves). The hook reads ``budget()`` (the running call's
    :class:`.base.CallBudget`), runs its ``layer_hook`` (``fair``: hand the cores to a waiting model) and,
    unless ``threads`` (the model's ``torch_intra_op_threads``) fixes the count, follows its ``threads``
    (``partition``: a call that began alone shrinks to its share as soon as another model computes). Both
    are a few attribute reads when nothing changes. Returns the number of hooks."""
    hooked: set[int] = set()

    def pre_hook(_module: torch.nn.Module, _args: Any) -> None:
        current = budget()
        current.layer_hook()
        if not threads:
            use_threads(current.threads())

    def hook(module: torch.nn.Module, level: int) -> None:
        if id(module) not in hooked:
            module.register_forward_pre_hook(pre_hook)
            hooked.add(id(module))
        if level < depth:
            for child in module.children():
                hook(child, level + 1)

    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList):
            for item in m:
                hook(item, 0)
    return len(hooked)
