"""loadtest/bench/decode_step.py on a tiny random RNNsearch: every figure is a real positive time, and the line
fit is exact on collinear points. No timing is asserted (the script prints what it measured)."""

from __future__ import annotations

import math

import pytest
import torch

from relserve.loadtest.bench import decode_step as bds
from relserve.models.rnnsearch import RNNSearch, RNNSearchConfig


def test_fit_line_recovers_intercept_and_slope():
    a, b = bds.fit_line([10.0, 50.0, 255.0], [4.0 + 0.13 * x for x in (10.0, 50.0, 255.0)])
    assert a == pytest.approx(4.0) and b == pytest.approx(0.13)
    with pytest.raises(ValueError):
        bds.fit_line([5.0, 5.0], [1.0, 2.0])


def test_step_costs_of_a_tiny_model():
    torch.manual_seed(0)
    cfg = RNNSearchConfig(src_vocab_size=40, tgt_vocab_size=30, embedding_size=8, hidden_size=6, alignment_size=5,
                          maxout_size=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    r = bds.step_costs(RNNSearch(cfg).eval(), source_len=4, repeats=2)
    assert set(r["encode_ms"]) == set(bds.ENCODE_BATCHES) and set(r["decode_step_ms"]) == set(bds.STEP_HYPOTHESES)
    for ms in [*r["encode_ms"].values(), *r["decode_step_ms"].values(), r["apply_ms_per_beam"]]:
        assert math.isfinite(ms) and ms > 0
    assert math.isfinite(r["decode_step_fixed_ms"]) and math.isfinite(r["decode_step_ms_per_hypothesis"])
