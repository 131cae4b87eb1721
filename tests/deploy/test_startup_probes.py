"""The Deployment's startup and readiness probes follow the measured start (docs/performance.md#cold_start, the
figures of ``python -m relserve.loadtest.bench.cold_start``): the startup probe asks often enough to find a warm
pod within a couple of seconds and waits long enough for the slowest start measured (the gate running for every
model) with room for a slower node; the readiness probe asks the same service."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _container() -> dict:
    doc = yaml.safe_load((REPO / "deploy/k8s/base/deployment.yaml").read_text())
    return doc["spec"]["template"]["spec"]["containers"][0]


def _measured_serving_seconds() -> list[float]:
    """The seconds of the SERVING rows of the cold-start tables in docs/performance.md (not their ratio columns)."""
    text = (REPO / "docs/performance.md").read_text()
    section = text.split("## cold_start", 1)[1].split("\n## ", 1)[0]
    tables = re.findall(r"^seconds from process start\s+(.*)\n(?:.*\n)*?^SERVING\s+([\d. ]+)$", section, flags=re.M)
    assert tables, "docs/performance.md#cold_start has no table of the benchmark with a SERVING row"
    out = []
    for heads, row in tables:
        modes = [h for h in heads.split() if "/" not in h]
        out += [float(x) for x in row.split()[:len(modes)]]
    return out


def test_startup_probe_follows_the_measured_start():
    c = _container()
    startup, readiness = c["startupProbe"], c["readinessProbe"]
    slowest = max(_measured_serving_seconds())
    assert startup["periodSeconds"] <= 2  # a warm pod is found serving within 2 s
    ceiling = startup["periodSeconds"] * startup["failureThreshold"] + startup.get("initialDelaySeconds", 0)
    assert ceiling >= 1.5 * slowest, (ceiling, slowest)  # room for a node half as fast again as the slowest run
    assert startup.get("initialDelaySeconds", 0) < min(_measured_serving_seconds())  # no wait past a fast start
    assert startup["timeoutSeconds"] <= startup["periodSeconds"]
    assert readiness["grpc"] == startup["grpc"]
