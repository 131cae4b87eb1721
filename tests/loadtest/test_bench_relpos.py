"""loadtest/bench/relpos.py on small shapes: every kernel it times agrees with the reference (the script checks
bit equality before timing and exits non-zero otherwise), by_shift is left out past the exact bucket range, and
each row names every kernel. No timing is asserted."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")

from relserve.loadtest.bench import relpos as bench_relpos  # noqa: E402


def test_rows_for_each_shape_and_dtype(capsys):
    assert bench_relpos.main(["--shapes", "2x16,1x200", "--repeats", "1", "--threads", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(rows) == 4  # two shapes x float32, bfloat16
    for row in rows:
        assert "reference" in row and "by_rows" in row and "by_shift" in row
    short, long_ = [r for r in rows if "2x16" in r], [r for r in rows if "1x200" in r]
    skipped = re.compile(r"by_shift\s+-\s")
    assert short and not any(skipped.search(r) for r in short)  # 16 tokens: every distance exact, a strided view
    assert long_ and all(skipped.search(r) for r in long_)  # 200 tokens: log buckets bend the index
