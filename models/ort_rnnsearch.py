"""RNNsearch's step API over the exported graphs (:mod:`relserve.models.export_translation`) on ONNX Runtime.

:class:`OrtRNNSearch` has the methods search code uses on :class:`relserve.models.rnnsearch.RNNSearch`
(``config``, ``encode``, ``decode_step``, ``eval``), with torch tensors in and out, so
:mod:`relserve.models.decoding` and the server's decode loop run on it unchanged. Every call binds inputs and
outputs by pointer (:func:`relserve.models.ort_session.run_bound`): on the CUDA provider the encoder state
never leaves the device between steps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from .export_translation import DECODER_GRAPH, ENCODER_GRAPH
from .ort_session import run_bound
from .rnnsearch import EncoderState, RNNSearchConfig, check_source_mask


class OrtRNNSearch:
    """RNNsearch on ONNX Runtime: ``graph_dir`` holds ``encoder.onnx`` and ``decoder_step.onnx``.

    ``device`` is where tensors live (``"cpu"`` or ``"cuda:N"``, matching ``providers``); float32 only.

    Raises (constructor):
        FileNotFoundError: a graph is missing.
    """

    def __init__(self, graph_dir: str | os.PathLike, config: RNNSearchConfig, *,
                 providers: Sequence = ("CPUExecutionProvider",), intra_op_threads: int = 0,
                 graph_optimization: str = "all", native_library: str | None = None, device: str = "cpu") -> None:
        from .export import make_session

        self.config = config
        self.device = torch.device(device)
        d = Path(graph_dir)
        for name in (ENCODER_GRAPH, DECODER_GRAPH):
            if not (d / name).is_file():
                raise FileNotFoundError(f"{d / name}: missing (export the checkpoint with `relserve export`)")
        kwargs = dict(providers=providers, intra_op_threads=intra_op_threads, graph_optimization=graph_optimization,
                      native_library=native_library)
        self._mask_cache: tuple[Tensor, Tensor] | None = None
        self.encoder_session = make_session(d / ENCODER_GRAPH, **kwargs)
        self.decoder_session = make_session(d / DECODER_GRAPH, **kwargs)

    def _long_mask(self, mask: Tensor) -> Tensor:
        """The graph's Int64 mask; a decode loop passes the same stacked mask step after step, so it is
        converted once per stack, not once per step."""
        if self._mask_cache is None or self._mask_cache[0] is not mask:
            self._mask_cache = (mask, mask.to(self.device).long())
        return self._mask_cache[1]

    @property
    def providers(self) -> list[str]:
        return list(self.encoder_session.get_providers())

    def eval(self) -> "OrtRNNSearch":
        return self

    def encode(self, src_ids: Tensor, src_mask: Tensor) -> EncoderState:
        """``src_ids`` Long[B,S], ``src_mask`` [B,S] (right-padded) -> ``EncoderState`` (as ``RNNSearch.encode``).

        Raises:
            ValueError: an empty source or a mask that is not right padding.
        """
        mask = check_source_mask(src_mask.to(self.device))
        B, S = mask.shape
        cfg = self.config
        out = {
            "annotations": torch.empty(B, S, cfg.annotation_size, device=self.device),
            "projected_annotations": torch.empty(B, S, cfg.alignment_size, device=self.device),
            "init_state": torch.empty(B, cfg.hidden_size, device=self.device),
        }
        run_bound(self.encoder_session, {"src_ids": src_ids.to(self.device, torch.long),
                                         "src_mask": mask.long()}, out)
        return EncoderState(out["annotations"], out["projected_annotations"], mask, out["init_state"])

    def decode_step(self, state: EncoderState, source_index: Tensor | None, prev_tokens: Tensor,
                    prev_hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder step (as ``RNNSearch.decode_step``): -> (log_probs Float[N,K_y], new_hidden Float[N,n],
        alignment Float[N,S])."""
        N = prev_tokens.shape[0]
        if source_index is None:
            source_index = (torch.zeros(N, dtype=torch.long) if state.num_sources == 1
                            else torch.arange(N, dtype=torch.long))
        cfg = self.config
        dev = self.device
        out = {
            "log_probs": torch.empty(N, cfg.tgt_vocab_size, device=dev),
            "new_hidden": torch.empty(N, cfg.hidden_size, device=dev),
            "alignment": torch.empty(N, state.mask.shape[1], device=dev),
        }
        run_bound(self.decoder_session, {
            "annotations": state.annotations.to(dev, torch.float32),
            "projected_annotations": state.projected_annotations.to(dev, torch.float32),
            "src_mask": self._long_mask(state.mask),
            "source_index": source_index.to(dev, torch.long),
            "prev_tokens": prev_tokens.to(dev, torch.long),
            "prev_hidden": prev_hidden.to(dev, torch.float32),
        }, out)
        return out["log_probs"], out["new_hidden"], out["alignment"]
