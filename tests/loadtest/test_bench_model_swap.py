"""loadtest/bench/model_swap.py run tiny (a few seconds of load, a 32-wide 1-layer model) against the real server it
starts: the printed figures are real ones. The replies change version while the clients call (the versions are
told apart by their scores), no call fails, the broken version changes no answer and the index gives its reason,
and the printed counts are the JSON summary's. No latency is asserted (the script prints what it measured)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")

from relserve.loadtest.bench import model_swap as ms  # noqa: E402


def test_version_scores_name_their_version():
    for count in (2, 7, 60):
        scores = [ms.version_score(v, count) for v in range(1, count + 1)]
        assert all(0.01 < s < 0.99 for s in scores)
        assert [ms.version_of(s, count) for s in scores] == list(range(1, count + 1))
        assert min(b - a for a, b in zip(scores, scores[1:])) > 10 * ms.MATCH_TOL
    assert ms.version_of(0.5 + ms.version_score(1, 7), 7) is None


def test_tiny_run_prints_real_figures(tmp_path, capsys):
    out_json = tmp_path / "summary.json"
    rc = ms.main(["--clients", "4", "--duration", "5", "--swap-every", "2.5", "--broken-for", "1", "--warmup", "1",
                  "--hidden", "32", "--layers", "1", "--heads", "2", "--poll-secs", "0.2", "--settle", "0.5",
                  "--model-option", "worker_process=false", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    summary = json.loads(out_json.read_text())
    a, b = summary["swap"], summary["broken"]

    calls, failed = map(int, re.search(r"a\) .*\n   calls: (\d+), failed: (\d+)", out).groups())
    assert (calls, failed) == (a["calls"], a["failed"]) and calls > 0
    assert failed == 0, out
    order = json.loads(re.search(r"by first reply: (\[[^\]]*\])", out).group(1))
    assert order == a["versions_by_first_reply"] == [1, 2], out  # the replies changed to the new version
    assert a["unmatched_replies"] == 0 and a["versions_published"] == [1, 2]
    assert re.search(r"swap to version 2: first reply \d+\.\d+ s after the rename", out), out

    b_calls, b_failed = map(int, re.search(r"b\) .*\n   calls: (\d+), failed: (\d+)", out).groups())
    assert (b_calls, b_failed) == (b["calls"], 0) and b_calls > 0, out
    assert b["serving_version"] == 2 and b["answers_not_from_serving_version"] == 0, out
    assert b["answers_by_version"] == {"2": b_calls}
    row = b["index_row"]
    assert row is not None and row["version"] == "3" and row["state"] != "READY" and row["reason"], out
    assert f"reason: {row['reason']}" in out

    marks = re.findall(r"^   (PASS|MISS)  (.+)$", out, re.M)
    assert len(marks) == 6 and dict((n, m == "PASS") for m, n in marks) == summary["targets"]
    targets = summary["targets"]
    assert targets["failed calls during swaps = 0"] and targets["broken version: answers unchanged"]
