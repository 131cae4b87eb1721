"""Replay of the recorded wire transcript (tests/fixtures/transcript.py): every RPC and route of every surface,
good and bad inputs, recorded on the code before a regroup, must give the same codes, replies, error messages,
behaviour headers / trailers and request-counter changes on the code as it is now.

A case that differs is reported with the paths of its differences (``.reply.results[0].labels[0].label:
expected 'positive', got 'negative'``). A change that means to change behaviour re-records the file on its
base commit (the transcript module's docstring says how).
"""

from __future__ import annotations

import re

import pytest

from fixtures import transcript

RECORDED = transcript.load()
BY_NAME = {c["name"]: c for c in RECORDED["cases"]}

# the routes of the HTTP listener, each as a pattern over the recorded paths
HTTP_ROUTES = {
    "GET /v2": r"/v2",
    "GET /v2/health/live": r"/v2/health/live",
    "GET /v2/health/ready": r"/v2/health/ready",
    "GET /v2/models/{name}": r"/v2/models/[^/]+",
    "GET /v2/models/{name}/versions/{v}": r"/v2/models/[^/]+/versions/[^/]+",
    "GET /v2/models/{name}/ready": r"/v2/models/[^/]+/ready",
    "GET /v2/models/{name}/versions/{v}/ready": r"/v2/models/[^/]+/versions/[^/]+/ready",
    "POST /v2/models/{name}/infer": r"/v2/models/[^/]+/infer",
    "POST /v2/models/{name}/versions/{v}/infer": r"/v2/models/[^/]+/versions/[^/]+/infer",
    "GET /v1/models": r"/v1/models",
    "POST /v1/classify": r"/v1/classify",
    "POST /v1/answer": r"/v1/answer",
    "POST /v1/translate": r"/v1/translate",
    "POST /v1/zero-shot-classify": r"/v1/zero-shot-classify",
    "POST /v1/classify-tokens": r"/v1/classify-tokens",
    "POST /v1/rerank": r"/v1/rerank",
    "POST /v2/repository/index": r"/v2/repository/index",
    "POST /v2/repository/models/{name}/load": r"/v2/repository/models/[^/]+/load",
    "POST /v2/repository/models/{name}/unload": r"/v2/repository/models/[^/]+/unload",
    "GET /metrics": r"/metrics",
}


def _describe(case: dict) -> str:
    if case["surface"] == "grpc":
        return f"gRPC /{case['service']}/{case['method']}"
    return f"HTTP {case['method']} {case['path']}"


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """One server on the current code, every recorded case sent in the recorded order."""
    cases = [{k: v for k, v in c.items() if k != "result"} for c in RECORDED["cases"]]
    info, results = transcript.run_cases(cases, tmp_path_factory.mktemp("transcript"))
    return info, {c["name"]: r for c, r in zip(cases, results)}


@pytest.mark.parametrize("name", list(BY_NAME))
def test_case_replays_as_recorded(replayed, name):
    case = BY_NAME[name]
    differences = transcript.diff(case["result"], replayed[1][name])
    assert not differences, (f"case {name!r} ({_describe(case)}) differs from the recording "
                             f"({len(differences)}):\n  " + "\n  ".join(differences[:40]))


def test_the_server_logged_no_traceback(replayed):
    assert replayed[0]["tracebacks"] == 0


def test_the_recording_is_of_the_current_case_list():
    """A case added or changed in transcript.py without re-recording would never be compared."""
    recorded = [{k: v for k, v in c.items() if k != "result"} for c in RECORDED["cases"]]
    assert recorded == transcript.CASES, "tests/fixtures/transcript.py's CASES changed: re-record (see its docstring)"


def test_every_rpc_and_route_is_covered():
    stubs = transcript.Stubs()
    grpc_cases = {(c["service"], c["method"]) for c in RECORDED["cases"] if c["surface"] == "grpc"}
    for service in (transcript.V1, transcript.V2, transcript.REFLECTION):
        for method in stubs.pool.FindServiceByName(service).methods:
            assert (service, method.name) in grpc_cases, f"no case for /{service}/{method.name}"
    assert {(transcript.HEALTH, "Check"), (transcript.HEALTH, "Watch")} <= grpc_cases
    http_cases = [(c["method"], c["path"]) for c in RECORDED["cases"] if c["surface"] == "http"]
    for route, pattern in HTTP_ROUTES.items():
        method = route.split()[0]
        assert any(m == method and re.fullmatch(pattern, p) for m, p in http_cases), f"no case for {route}"


def test_the_comparison_sees_a_change():
    case = next(c for c in RECORDED["cases"] if c["name"] == "v1.Classify.one")
    result = case["result"]
    changed = {**result, "reply": {"results": [{**result["reply"]["results"][0], "labels": []}]}}
    assert transcript.diff(result, changed)
    noisy = transcript._round({**result, "metrics": {k: v + 1e-9 for k, v in result["metrics"].items()}})
    assert not transcript.diff(result, noisy)
