"""Whether a forward is being captured into a graph or recorded by autograd: the two checks every fast inference
path of models/ makes before leaving the plain torch ops (the oneDNN linears, the packed encoder, the diagonal
relative-bias kernel).

One module so the three agree on what "capture" means and so models/onednn.py and models/relative_position.py
can share the checks without importing each other (relative_position already imports onednn).
"""

from __future__ import annotations

import torch


def graph_capture() -> bool:
    """True while torch.export, TorchDynamo (torch.compile) or ``torch.jit.trace`` records the forward.

    The ONNX exporters run one of these, and a captured graph must hold only ops the exporter knows with static
    shape arithmetic. No ``torch.onnx`` check: touching ``torch.onnx`` imports it into every serving process.
    """
    return bool(torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting())


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """True when autograd records an op on ``tensors`` (None entries are skipped): grad mode is on, no export is
    running, and any tensor requires grad (a frozen weight with a trainable bias, as in bias-only tuning,
    included). The fast paths' ops have no backward, so then the differentiable torch ops run instead.
    """
    if not torch.is_grad_enabled() or torch.compiler.is_exporting():
        return False
    return any(t is not None and t.requires_grad for t in tensors)
