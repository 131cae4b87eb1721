"""loadtest/bench/: the shared harness (rotating side-by-side rounds, ratios, the side-by-side table, JSON
output), every benchmark's command line, and the rule that the load-test product never imports the benchmarks."""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relserve.loadtest.bench import harness

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
BENCHMARKS = ("cpu", "decode_step", "encoder", "hostile", "instances", "isolation", "onnx_encoder", "onnx_ops",
              "onnx_translation", "relpos", "serving", "train_autocast", "translation", "unpadded",
              "worker_faults", "http_flood", "shape_soak")
NEEDS_ONNX = {"onnx_encoder", "onnx_ops"}


def test_interleaved_runs_every_path_once_per_round_in_rotating_order():
    calls = []
    times = harness.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"),
                                 "c": lambda: calls.append("c")}, repeats=3, warmup=1)
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in times.values() for t in v)
    assert harness.medians({"x": [3.0, 1.0, 2.0]}) == {"x": 2.0}
    assert harness.median_seconds(lambda: None, repeats=3) >= 0


def test_ratio_and_side_by_side_table():
    assert harness.ratio(3.0, 2.0) == 1.5 and harness.ratio(1.0, 0.0) is None and harness.ratio(None, 1.0) is None
    assert harness.fmt_ratio(1.5) == "1.50x" and harness.fmt_ratio(None) == "-"
    lines = harness.side_by_side_table("median", {"a": {"req/s": 10.0, "ms": 4.0}, "b": {"req/s": 15.0}})
    assert lines[0].split() == ["median", "a", "b", "b/a"]
    assert lines[1].split() == ["req/s", "10.00", "15.00", "1.50"]
    assert lines[2].split() == ["ms", "4.00", "-", "-"]


def test_common_args_keep_each_benchmarks_defaults_and_json_forms(tmp_path, capsys):
    ap = argparse.ArgumentParser()
    harness.add_common_args(ap, threads=2, repeats=None, json="file")
    args = ap.parse_args(["--json", str(tmp_path / "s.json")])
    assert (args.threads, args.repeats) == (2, None) and not hasattr(args, "warmup")
    harness.emit_json(args, [{"x": 1}], {"results": [{"x": 1}], "threads": 2})
    assert json.loads((tmp_path / "s.json").read_text()) == {"results": [{"x": 1}], "threads": 2}

    ap = argparse.ArgumentParser()
    harness.add_common_args(ap, warmup=1, json="print")
    harness.emit_json(ap.parse_args(["--json"]), [{"x": 1}, {"x": 2}])
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [{"x": 1}, {"x": 2}]
    harness.emit_json(ap.parse_args([]), [{"x": 1}])
    assert capsys.readouterr().out == ""


def test_fill_defaults_takes_the_quick_or_full_value_only_where_the_command_line_gave_none():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None)
    quick, full = {"repeats": 1, "seconds": 5.0}, {"repeats": 3, "seconds": 20.0}
    fill = harness.fill_defaults
    assert vars(fill(ap.parse_args([]), quick=quick, full=full)) == {"quick": False, "repeats": 3, "seconds": 20.0}
    assert vars(fill(ap.parse_args(["--quick"]), quick=quick, full=full)) == {
        "quick": True, "repeats": 1, "seconds": 5.0}
    assert vars(fill(ap.parse_args(["--quick", "--repeats", "7"]), quick=quick, full=full)) == {
        "quick": True, "repeats": 7, "seconds": 5.0}


def test_child_pids_lists_a_started_child_and_none_for_a_gone_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in harness.child_pids(os.getpid())
        assert harness.child_pids(child.pid) == []
    finally:
        child.kill()
        child.wait()
    assert harness.child_pids(child.pid) == []


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_answers_help(name, capsys):
    if name in NEEDS_ONNX:
        pytest.importorskip("onnxruntime")
    module = importlib.import_module(f"relserve.loadtest.bench.{name}")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    assert f"python -m relserve.loadtest.bench.{name}" in capsys.readouterr().out


def test_the_load_test_product_never_imports_the_benchmarks():
    for path in sorted(LOADTEST.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module or ''}.{a.name}" for a in node.names]
                if node.level:
                    names = [n.lstrip(".") for n in names]
                assert not any(n.split(".")[0] == "bench" or ".loadtest.bench" in f".{n}" for n in names), path
            elif isinstance(node, ast.Import):
                assert not any("loadtest.bench" in a.name for a in node.names), path
