"""Encoder batches as model inputs, shared by every encoder backend: right-padding a batch of encodings into
the model's input arrays, and the synthetic encodings of warm-up and the load-time self-checks."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def pad_batch(batch: Sequence[Any], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-pad ``batch`` (items with ``input_ids`` and optional ``token_type_ids``) to its longest item.

    Returns:
        ``(input_ids, attention_mask, token_type_ids)``, each Int64[B, T] with T = longest item; padding has
        id ``pad_id``, mask 0 and type 0. Items without (or with mismatched) type ids get type 0.
    """
    lengths = [len(item.input_ids) for item in batch]
    longest = max(lengths)
    ids = np.full((len(batch), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), longest), dtype=np.int64)
    types = np.zeros((len(batch), longest), dtype=np.int64)
    for i, item in enumerate(batch):
        n = lengths[i]
        ids[i, :n] = item.input_ids
        mask[i, :n] = 1
        tt = getattr(item, "token_type_ids", None)
        if tt is not None and len(tt) == n:
            types[i, :n] = tt
    return ids, mask, types


class WarmupEncoding:
    """A synthetic single-segment encoding (``token_type_ids`` all 0) for warm-up batches."""

    def __init__(self, ids: list[int]) -> None:
        self.input_ids = ids
        self.token_type_ids = [0] * len(ids)


def probe_encodings(tokenizer: Any, lengths: Sequence[int]) -> list[WarmupEncoding]:
    """Synthetic encodings of exactly ``lengths`` tokens each (``[CLS] 5 5 ... [SEP]``, the tokenizer's own
    special ids), the probe batches that fit a backend's batch cost model at warm-up
    (``relserve.service.scheduling.cost_model.calibrate``)."""
    cls_id = int(getattr(tokenizer, "cls_token_id", 1) or 1)
    sep_id = int(getattr(tokenizer, "sep_token_id", 2) or 2)
    return [WarmupEncoding(([cls_id] + [5] * (n - 2) + [sep_id]) if n >= 2 else [cls_id]) for n in lengths]
