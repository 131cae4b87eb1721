"""The CPU table against OpenVINO (loadtest/bench/cpu_openvino.py) and the memory benchmark (bench/memory.py):
one quick run of the command on a tiny model prints every row it measured with real numbers (OpenVINO's column
when its package installs here; transformers is the fp32 oracle of both engines), a real server's memory is read
from /proc, and the verdicts follow the ratios. No timing is asserted (the command prints ratios)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers")

from relserve.loadtest.bench import cpu_openvino, memory, openvino_peer  # noqa: E402

TINY = ["--layers", "1", "--hidden", "64", "--heads", "2", "--intermediate", "128", "--buckets", "16"]
ROW = re.compile(r"^(?P<figure>\S.*?)\s+(?P<ours>\d+\.\d+)\s+(?P<peer>\d+\.\d+|-)\s+(?P<unit>\S+)\s+"
                 r"(?P<ratio>\d+\.\d+|-)\s+(?P<need>[<>]=\d+\.\d+)\s+(?P<verdict>PASS|MISS|-)$")


@pytest.fixture(scope="module")
def openvino_available():
    try:
        return openvino_peer.openvino_path() or "this interpreter"
    except openvino_peer.PeerUnavailable as exc:
        return exc


def test_quick_run_prints_every_measured_row(openvino_available, tmp_path, capsys):
    argv = ["--quick", "--parts", "offline,memory", "--committed-text", *TINY, "--threads", "1",
            "--sentences", "24", "--batch", "8", "--long", "2x48", "--memory-load-s", "2",
            "--memory-server-args", "--model sentiment={checkpoint}",
            "--json", str(tmp_path / "out.json")]
    if isinstance(openvino_available, Exception):
        argv.append("--no-openvino")
    results = cpu_openvino.main(argv)
    printed = capsys.readouterr().out
    with_ov = not isinstance(openvino_available, Exception)

    machine = printed.splitlines()[0]
    assert cpu_openvino.harness.cpu_name() in machine and "flags" in machine and "load average" in machine
    rows = [m.groupdict() for m in map(ROW.match, printed.splitlines()) if m]
    figures = [r["figure"] for r in rows]
    assert figures[:4] == ["offline, sorted batches of short sentences, fp32",
                           "offline, sorted batches of short sentences, bf16",
                           "offline, long sequences, fp32", "offline, long sequences, bf16"]
    assert figures[4:] == ["memory of the server after warm-up (server + workers, PSS, GB)",
                           "memory after 2 s of mixed load (server + workers, PSS, GB)"]
    for r in rows:  # every printed figure is a measured positive number with its verdict from the ratio
        assert float(r["ours"]) > 0
        if r["ratio"] != "-":
            need = float(r["need"][2:])
            ok = float(r["ratio"]) >= need if r["need"].startswith(">=") else float(r["ratio"]) <= need
            assert r["verdict"] == ("PASS" if ok else "MISS")
    for r in rows[:4]:
        assert (r["peer"] != "-") == with_ov and (r["verdict"] in ("PASS", "MISS")) == with_ov

    off = {r["workload"]: r for r in results["offline"]}
    assert off["short"]["units"] == 24 and off["long"]["units"] == 2
    for w in off.values():  # the fp32 paths are transformers' numbers; bf16 keeps its argmax on this tiny model
        assert w["max_abs_diff_vs_transformers"]["relserve_fp32"] < 1e-4
        assert w["max_abs_diff_vs_transformers"]["relserve_bf16"] < 0.1
        if with_ov:
            assert w["max_abs_diff_vs_transformers"]["openvino_f32"] < 1e-4
            assert w["max_abs_diff_vs_transformers"]["openvino_bf16"] < 0.1
            assert set(w["per_s"]) == {*cpu_openvino.OURS_PATHS, *cpu_openvino.OV_PATHS}
    if with_ov:
        assert results["openvino"]["version"].startswith(openvino_peer.OPENVINO_VERSION)

    mem = results["memory"]
    roles = [p["role"] for p in mem["warm"]["processes"]]
    assert roles[0] == "server" and len(roles) >= 2  # the sentiment model computes in a worker process
    worker = max(mem["warm"]["processes"][1:], key=lambda p: p["pss"])
    assert worker["pss"] > 100e6 and worker["peak_rss"] >= worker["rss"]  # torch and the model live there
    for snap in (mem["warm"], mem["loaded"]):
        assert snap["total_pss"] == sum(p["pss"] for p in snap["processes"]) > 0
        assert snap["total_pss"] <= snap["total_rss"]
    assert mem["load"]["successes"] > 0 and mem["load"]["errors"] == 0
    assert (tmp_path / "out.json").is_file()
    if isinstance(openvino_available, Exception):
        pytest.skip(f"the OpenVINO column was not measured: {openvino_available}")


def test_memory_snapshot_sums_a_process_tree_from_proc(tmp_path):
    """A child holding 64 MB it wrote and a grandchild: both are in the tree, the child's PSS holds its 64 MB."""
    script = textwrap.dedent("""
        import subprocess, sys, time
        block = bytearray(64 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(grandchild.pid, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(proc.stdout.readline())
        snap = memory.snapshot(proc.pid)
        pids = [p["pid"] for p in snap["processes"]]
        assert pids[0] == proc.pid and grandchild in pids
        child = snap["processes"][0]
        assert child["pss_anon"] >= 64e6 and child["uss"] >= 64e6
        assert snap["total_pss"] == sum(p["pss"] for p in snap["processes"])
    finally:
        proc.kill()
        proc.wait()
    assert memory.process_memory(proc.pid) is None


def test_table_verdicts_follow_the_targets():
    results = {
        "offline": [{"workload": "short", "per_s": {"relserve_fp32": 50.0, "relserve_bf16": 110.0,
                                                    "openvino_f32": 55.0, "openvino_bf16": 100.0}},
                    {"workload": "long", "per_s": {"relserve_fp32": 3.0, "relserve_bf16": 6.0}}],
        "served": {"concurrency": 32, "dtype": "bfloat16", "throughput_rps": 115.0},
        "translation": {"modes": {"in-process": {"sentences_per_s": 100.0, "p99_s": 0.4, "errors": {}},
                                  "workers xcores": {"sentences_per_s": 160.0, "p99_s": 0.5, "errors": {}}},
                        "ratios": {"workers xcores": 1.6}},
        "memory": {"warm": {"total_pss": 1.1e9}, "loaded": {"total_pss": 1.6e9}, "load_s": 60},
    }
    rows = cpu_openvino.table(results)
    got = [(r["figure"].split(",")[0].split(" (")[0], r["verdict"]) for r in rows]
    assert got == [("offline", "MISS"), ("offline", "PASS"), ("offline", "-"), ("offline", "-"),
                   ("served at 32 clients", "PASS"),
                   ("translation at saturation: workers xcores / in-process loop", "MISS"),  # p99 worse
                   ("memory of the server after warm-up", "PASS"), ("memory after 60 s of mixed load", "MISS")]
    assert math.isclose(rows[0]["ratio"], 50 / 55) and math.isclose(rows[4]["ratio"], 1.15)
    assert rows[2]["peer"] is None and rows[2]["ratio"] is None  # no peer column: no verdict
