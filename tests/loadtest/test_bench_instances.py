"""loadtest/bench/instances.py on a tiny random checkpoint: both variants (one 2-thread process, two 1-thread
processes, with the busy neighbour) run every call in spawned model processes and report a real throughput. No
timing is asserted (the script prints what it measured)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from relserve.loadtest.bench import instances as bi  # noqa: E402


def test_both_variants_run_the_calls_and_report_throughput(unigram_tokenizer_dir, tmp_path):
    path = make_deberta_checkpoint(tmp_path / "cls", tokenizer_dir=unigram_tokenizer_dir, labels=("a", "b"),
                                   seed=1).path
    batches = [[[5, 6, 7, 8]] * 3, [[9, 10]] * 2, [[11, 12, 13]], [[14] * 9] * 2]
    one = bi.run_variant(path, "float32", 1, 2, batches, rounds=1, busy_ms=0.0)
    many = bi.run_variant(path, "float32", 2, 1, batches, rounds=1, busy_ms=1.0)
    assert math.isfinite(one) and one > 0 and math.isfinite(many) and many > 0
