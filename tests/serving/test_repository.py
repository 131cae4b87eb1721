"""The model repository through real servers on tiny checkpoints (transformers as the oracle of each version's
probabilities): poll mode serves a new model directory, swaps in a new version while concurrent calls all
succeed, keeps the serving version when a broken one is dropped in (the index names why), reloads a changed file,
and unloads a removed directory (NOT_FOUND after); explicit mode loads and unloads only through the manager, and
a server with no model is live and ready."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.fake_serving import server_config  # noqa: E402
from fixtures.server import Running  # noqa: E402
from grpc_health.v1 import health_pb2  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from relserve.service._proto import grpc_predict_v2_pb2 as v2  # noqa: E402
from relserve.service._proto import grpc_predict_v2_pb2_grpc as v2_grpc  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service.config import ModelConfig  # noqa: E402
from relserve.service.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable  # noqa: E402
from relserve.service.repository.manager import IndexEntry  # noqa: E402

TEXTS = ["a short text", "another text about Berlin and Paris", "x"]
LABELS = ("neg", "neu", "pos")
# float32 in this process (parity with transformers); no probe batches: the loads stay short
OPTIONS = "device: cpu\ndtype: float32\nworker_process: false\nmax_seq_len: 64\ncost_batching: false\n" \
          "max_queue_delay: 0.002\n"
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def versions(unigram_tokenizer_dir, tmp_path_factory):
    """Two checkpoints with different weights, and each one's probabilities by transformers' pipeline."""
    root = tmp_path_factory.mktemp("repo-src")
    out = {}
    for v, seed in (("1", 1), ("2", 2)):
        path = make_deberta_checkpoint(root / v, oracle=True, tokenizer_dir=unigram_tokenizer_dir, labels=LABELS,
                                       init="matrices", seed=seed).path
        model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        clf = transformers.pipeline("text-classification", model=model, tokenizer=tok, device="cpu")
        probs = [[{r["label"]: r["score"] for r in row}[name] for name in LABELS]
                 for row in clf(TEXTS, top_k=None)]
        out[v] = (path, np.array(probs))
    assert not np.allclose(out["1"][1], out["2"][1], atol=1e-3)  # the versions answer differently
    return out


def put(src: Path, dest: Path) -> None:
    """Copy ``src`` to ``dest`` as a repository update should be made: under a hidden name, then renamed (the
    scan skips hidden entries, so it never sees half a copy)."""
    tmp = dest.parent / f".tmp-{dest.name}"
    shutil.copytree(src, tmp)
    os.replace(tmp, dest)


def remove(path: Path) -> None:
    hidden = path.parent / f".gone-{path.name}"
    os.replace(path, hidden)
    shutil.rmtree(hidden)


def index(srv) -> list[IndexEntry]:
    async def read():
        return srv.server.repository.index()
    return srv.call(read())


def wait_for(srv, predicate, what: str, timeout: float = 60) -> list[IndexEntry]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rows = index(srv)
        if predicate(rows):
            return rows
        time.sleep(0.05)
    raise AssertionError(f"never {what}; index: {index(srv)}")


def probabilities(srv, model: str) -> np.ndarray:
    reply = srv.stub.Classify(pb.ClassifyRequest(model=model, texts=TEXTS, top_k=0), timeout=30)
    return np.array([[{s.label: s.score for s in r.labels}[name] for name in LABELS] for r in reply.results])


def loads(model: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("relserve_model_loads_total", {"model": model, "outcome": outcome}) or 0.0


def test_poll_mode_adds_swaps_keeps_reloads_and_removes(versions, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    srv = Running(server_config(model_repositories=(repo,), model_control_mode="poll", repository_poll_secs=0.05,
                                metrics_port=None), None)
    try:
        # no model: live and ready, as Triton's
        srv.wait_serving(timeout=30)
        assert srv.server.repository.index() == []
        assert v2_grpc.GRPCInferenceServiceStub(srv.channel).ServerReady(v2.ServerReadyRequest(), timeout=5).ready
        with pytest.raises(FailedPrecondition, match="model control mode is poll.*--model-control-mode explicit"):
            srv.call(srv.server.repository.load("polled"))

        # a new model directory (versioned; its options in relserve.yaml) loads and serves version 1
        staged = tmp_path / "polled"
        staged.mkdir()
        (staged / "relserve.yaml").write_text(OPTIONS)
        shutil.copytree(versions["1"][0], staged / "1")
        os.replace(staged, repo / "polled")
        wait_for(srv, lambda rows: rows == [IndexEntry("polled", "1", "READY", "")], "loaded version 1")
        np.testing.assert_allclose(probabilities(srv, "polled"), versions["1"][1], atol=1e-5)
        assert srv.health_status("polled") == SERVING

        # version 2 swaps in while 4 clients call without pause: every call succeeds, each reply is one
        # version's, and once the swap is done only version 2 answers
        stop, results, errors = threading.Event(), [], []

        def client():
            while not stop.is_set():
                try:
                    results.append(probabilities(srv, "polled"))
                except grpc.RpcError as exc:
                    errors.append(f"{exc.code()}: {exc.details()}")

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        while len(results) < 8 and not errors:
            time.sleep(0.01)
        put(versions["2"][0], repo / "polled" / "2")
        wait_for(srv, lambda rows: rows == [IndexEntry("polled", "1", "UNAVAILABLE", "unloaded (not in the version "
                                                       "policy)"), IndexEntry("polled", "2", "READY", "")],
                 "swapped to version 2")
        during = len(results)
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join()
        assert errors == []
        which = [("1" if np.allclose(r, versions["1"][1], atol=1e-5) else
                  "2" if np.allclose(r, versions["2"][1], atol=1e-5) else "?") for r in results]
        assert "?" not in which and "1" in which[:during] and "2" in which
        assert set(which[during:]) == {"2"}
        np.testing.assert_allclose(probabilities(srv, "polled"), versions["2"][1], atol=1e-5)
        assert srv.server.registry.versions("polled") == ["2"] and srv.server.registry.runners["polled"].version == "2"

        # a broken version 3 (weights cut short): version 2 keeps serving, the index says why
        failed_before = loads("polled", "failed")
        broken = tmp_path / "broken"
        shutil.copytree(versions["2"][0], broken)
        weights = broken / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        os.replace(broken, repo / "polled" / "3")
        rows = wait_for(srv, lambda rows: any(r.version == "3" and r.state == "UNAVAILABLE" for r in rows),
                        "failed version 3")
        (row3,) = [r for r in rows if r.version == "3"]
        assert row3.reason.startswith("load failed:") and "model.safetensors" in row3.reason, row3
        assert [r for r in rows if r.state == "READY"] == [IndexEntry("polled", "2", "READY", "")]
        np.testing.assert_allclose(probabilities(srv, "polled"), versions["2"][1], atol=1e-5)
        assert loads("polled", "failed") == failed_before + 1  # tried once: the next polls see the same files
        time.sleep(0.3)
        assert loads("polled", "failed") == failed_before + 1
        remove(repo / "polled" / "3")
        wait_for(srv, lambda rows: not any(r.version == "3" for r in rows), "forgot version 3")

        # a changed file in the served version reloads it: the labels renamed in config.json
        cfg_path = repo / "polled" / "2" / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["id2label"] = {str(i): name.upper() for i, name in enumerate(LABELS)}
        cfg["label2id"] = {name.upper(): i for i, name in enumerate(LABELS)}
        (repo / "polled" / "2" / ".config.json").write_text(json.dumps(cfg))
        os.replace(repo / "polled" / "2" / ".config.json", cfg_path)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            reply = srv.stub.Classify(pb.ClassifyRequest(model="polled", texts=TEXTS, top_k=0), timeout=30)
            if {s.label for s in reply.results[0].labels} == {"NEG", "NEU", "POS"}:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the changed config.json was never served")
        got = np.array([[{s.label: s.score for s in r.labels}[n.upper()] for n in LABELS] for r in reply.results])
        np.testing.assert_allclose(got, versions["2"][1], atol=1e-5)

        # a broken relserve.yaml: the loaded version keeps serving, and its READY row says the entry is refused
        yaml_path = repo / "polled" / "relserve.yaml"
        (repo / "polled" / ".relserve.yaml").write_text(OPTIONS + "no_such_key: 1\n")
        os.replace(repo / "polled" / ".relserve.yaml", yaml_path)
        rows = wait_for(srv, lambda rows: any(r.state == "READY" and "refused" in r.reason for r in rows),
                        "said the entry is refused")
        ((row,),) = [[r for r in rows if r.state == "READY"]]
        assert row.version == "2" and "no_such_key" in row.reason, row
        reply = srv.stub.Classify(pb.ClassifyRequest(model="polled", texts=TEXTS, top_k=0), timeout=30)
        still = np.array([[{s.label: s.score for s in r.labels}[n.upper()] for n in LABELS] for r in reply.results])
        np.testing.assert_allclose(still, versions["2"][1], atol=1e-5)
        (repo / "polled" / ".relserve.yaml").write_text(OPTIONS)
        os.replace(repo / "polled" / ".relserve.yaml", yaml_path)
        wait_for(srv, lambda rows: [r for r in rows if r.state == "READY"] == [IndexEntry("polled", "2", "READY", "")],
                 "cleared the refusal")

        # the directory removed: unloaded, NOT_FOUND after, its health service unknown again
        remove(repo / "polled")
        wait_for(srv, lambda rows: rows == [], "unloaded the removed model")
        with pytest.raises(grpc.RpcError) as err:
            probabilities(srv, "polled")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            srv.health_status("polled")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert srv.health_status() == SERVING
    finally:
        srv.close()


def test_explicit_mode_loads_and_unloads_through_the_manager(versions, tmp_path):
    repo = tmp_path / "repo"
    for name in ("first", "second"):
        (repo / name).mkdir(parents=True)
        (repo / name / "relserve.yaml").write_text(OPTIONS)
        shutil.copytree(versions["1"][0], repo / name / "1")
    fixed = ModelConfig(name="fixed", path=versions["2"][0], device="cpu", dtype="float32", worker_process=False,
                        max_seq_len=64, cost_batching=False)
    srv = Running(server_config(model_repositories=(repo,), model_control_mode="explicit", load_models=("first",),
                                models=(fixed,), metrics_port=None), None)
    manager = srv.server.repository
    try:
        srv.wait_serving(timeout=60)
        assert index(srv) == [IndexEntry("first", "1", "READY", ""),
                              IndexEntry("second", "", "UNAVAILABLE", "not loaded")]
        assert manager.index(ready=True) == [IndexEntry("first", "1", "READY", "")]
        with pytest.raises(NotFound, match="repository 'elsewhere' is not one of"):
            manager.index("elsewhere")
        assert manager.index(repo.name) == manager.index(str(repo)) == index(srv)
        with pytest.raises(grpc.RpcError) as err:
            probabilities(srv, "second")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        # refusals change nothing
        for name, params, error, match in (
                ("../first", None, InvalidArgument, "is a path"),
                ("nope", None, NotFound, r"not in the model repositories .* models there: \['first', 'second'\]"),
                ("second", {"file:1/model.safetensors": b""}, InvalidArgument, "unknown parameter"),
                ("second", {"config": "{\"max_batch_sise\": 2}"}, InvalidArgument, "max_batch_sise"),
                ("fixed", None, FailedPrecondition, "served from --model")):
            with pytest.raises(error, match=match):
                srv.call(manager.load(name, params))
        with pytest.raises(FailedPrecondition, match="served from --model"):
            srv.call(manager.unload("fixed"))
        assert index(srv)[1] == IndexEntry("second", "", "UNAVAILABLE", "not loaded")

        srv.call(manager.load("second"), timeout=60)
        np.testing.assert_allclose(probabilities(srv, "second"), versions["1"][1], atol=1e-5)
        np.testing.assert_allclose(probabilities(srv, "fixed"), versions["2"][1], atol=1e-5)
        assert srv.health_status("second") == SERVING

        # unload while calls run: they finish (none UNAVAILABLE), calls after get NOT_FOUND
        outcomes = []

        def call():
            try:
                outcomes.append(probabilities(srv, "second"))
            except grpc.RpcError as exc:
                outcomes.append(exc.code())

        threads = [threading.Thread(target=call) for _ in range(6)]
        for t in threads:
            t.start()
        srv.call(manager.unload("second", {"unload_dependents": False}), timeout=30)
        for t in threads:
            t.join()
        for outcome in outcomes:
            if isinstance(outcome, grpc.StatusCode):
                assert outcome == grpc.StatusCode.NOT_FOUND
            else:
                np.testing.assert_allclose(outcome, versions["1"][1], atol=1e-5)
        with pytest.raises(grpc.RpcError) as err:
            probabilities(srv, "second")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert index(srv) == [IndexEntry("first", "1", "READY", ""),
                              IndexEntry("second", "1", "UNAVAILABLE", "unloaded")]
        with pytest.raises(grpc.RpcError) as err:
            srv.health_status("second")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        np.testing.assert_allclose(probabilities(srv, "first"), versions["1"][1], atol=1e-5)
    finally:
        srv.close()


def test_memory_limit_refuses_a_version_before_loading_it(tmp_path):
    repo = tmp_path / "repo"
    (repo / "big").mkdir(parents=True)
    (repo / "big" / "relserve.yaml").write_text(OPTIONS)
    # 20000 x 32 float32 embeddings: about 2.4 MiB of weights; never loaded, so no tokenizer is needed
    make_deberta_checkpoint(repo / "big" / "1", vocab_size=20000)
    weights_mib = (repo / "big" / "1" / "model.safetensors").stat().st_size / 2**20
    assert weights_mib > 2
    srv = Running(server_config(model_repositories=(repo,), model_control_mode="explicit", memory_limit_mb=1,
                                metrics_port=None), None)
    try:
        srv.wait_serving(timeout=30)
        with pytest.raises(Unavailable, match="over memory_limit_mb"):
            srv.call(srv.server.repository.load("big"))
        (row,) = index(srv)
        assert (row.name, row.version, row.state) == ("big", "1", "UNAVAILABLE")
        assert "limit 1 MiB" in row.reason and "MiB as float32" in row.reason, row.reason
        assert srv.server.registry.names() == []
    finally:
        srv.close()


def test_mode_none_loads_the_repository_at_start_beside_nothing_else(versions, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(versions["2"][0], repo / "plain")  # a checkpoint directory is version 1
    (repo / "plain" / "relserve.yaml").write_text(OPTIONS)
    for v in ("1", "2"):  # version_policy all: both versions loaded, the highest serves unversioned calls
        shutil.copytree(versions[v][0], repo / "multi" / v)
    (repo / "multi" / "relserve.yaml").write_text(OPTIONS + "version_policy: all\n")
    srv = Running(server_config(model_repositories=(repo,), metrics_port=None), None)
    try:
        srv.wait_serving(timeout=60)
        assert index(srv) == [IndexEntry("multi", "1", "READY", ""), IndexEntry("multi", "2", "READY", ""),
                              IndexEntry("plain", "1", "READY", "")]
        assert srv.server.registry.names() == ["multi", "plain"]  # the built-in default models are not added
        np.testing.assert_allclose(probabilities(srv, "plain"), versions["2"][1], atol=1e-5)
        registry = srv.server.registry
        assert registry.versions("multi") == ["1", "2"] and registry.runners["multi"].version == "2"
        assert registry.lookup("multi", "1").version == "1" and registry.lookup("multi", "1").config.path == \
            repo / "multi" / "1"
        with pytest.raises(NotFound, match=r"version '3' of model 'multi' is not loaded; loaded versions: \['1', '2'\]"):
            registry.lookup("multi", "3")
        np.testing.assert_allclose(probabilities(srv, "multi"), versions["2"][1], atol=1e-5)
        with pytest.raises(FailedPrecondition, match="model control mode is none"):
            srv.call(srv.server.repository.unload("plain"))
    finally:
        srv.close()


@pytest.mark.parametrize("layout, why", [
    ("missing", "model_repositories: .* is not a directory"),
    ("non-number", "a version directory's name must be a positive integer"),
    ("no-weights", "no weights in"),
    ("unknown-load-model", r"load_models \['nope'\]: not in the model repositories"),
])
def test_a_bad_repository_fails_the_start_before_any_port_is_bound(tmp_path, capsys, layout, why):
    from relserve.service.main import main

    repo = tmp_path / "repo"
    if layout != "missing":
        model = repo / "m" / ("latest" if layout == "non-number" else "1")
        model.mkdir(parents=True)
        (model / "config.json").write_text(json.dumps({"model_type": "deberta-v2",
                                                       "architectures": ["DebertaV2ForSequenceClassification"]}))
        (model / "tokenizer.json").write_text("{}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    explicit = ["--model-control-mode", "explicit", "--load-model", "nope"] if layout == "unknown-load-model" else []
    assert main(["serve", "--model-repository", str(repo), "--port", str(port), "--host", "127.0.0.1",
                 "--metrics-port", "-1", *explicit]) == 2
    err = capsys.readouterr().err
    assert re.search(why, err), err
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # still free: refused before binding


def test_a_load_or_unload_whose_caller_goes_away_still_finishes(versions, tmp_path):
    # a client's deadline cancels the RPC handler: cut short with it, the version stayed LOADING for good
    import asyncio

    repo = tmp_path / "repo"
    (repo / "m").mkdir(parents=True)
    (repo / "m" / "relserve.yaml").write_text(OPTIONS)
    shutil.copytree(versions["1"][0], repo / "m" / "1")
    srv = Running(server_config(model_repositories=(repo,), model_control_mode="explicit", metrics_port=None), None)
    manager = srv.server.repository

    async def leave(change):
        task = asyncio.ensure_future(change)
        while not task.done() and all(r.state == "UNAVAILABLE" or r.state == "READY" for r in manager.index()):
            await asyncio.sleep(0)  # until the change shows in the index (LOADING / UNLOADING)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        srv.wait_serving(timeout=60)
        srv.call(leave(manager.load("m")))
        wait_for(srv, lambda rows: rows == [IndexEntry("m", "1", "READY", "")], "finished the load")
        assert probabilities(srv, "m").shape == (len(TEXTS), len(LABELS))
        srv.call(leave(manager.unload("m")))
        wait_for(srv, lambda rows: rows == [IndexEntry("m", "1", "UNAVAILABLE", "unloaded")], "finished the unload")
    finally:
        srv.close()
