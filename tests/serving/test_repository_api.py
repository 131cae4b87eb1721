"""Triton's model repository extension and ``model_version``, end to end on a real server: a repository of tiny
real DeBERTa checkpoints in explicit mode (``cls`` with versions 1 and 2 under ``version_policy: all``, ``other``
one checkpoint, not loaded at start; a checkpoint ``outside`` beside the repository), inference tokens and an
admin token.

* tritonclient[http] and tritonclient[grpc] 2.73.0, unchanged, in their venv (tests/fixtures/client_venvs.py;
  sessions ``repository`` of tests/fixtures/tritonclient_http_script.py and tritonclient_script.py): the index,
  load, unload, readiness and inference per version; the admin token's refusals (none: 401 / UNAUTHENTICATED;
  the inference token: 403 / PERMISSION_DENIED); names that are paths refused (400 / INVALID_ARGUMENT) with
  nothing loaded; every version's probabilities against transformers on that version's checkpoint.
* relserve.v1 (gRPC and /v1 JSON): ``model_version`` and ListModels' rows per version.
* A poll-mode server with an empty repository: live and ready, and load / unload refused naming the mode.
* The admin token file reloaded: a rotated token is in force without a restart.
"""

from __future__ import annotations

import http.client
import json
import time

import grpc
import numpy as np
import pytest
import transformers

from fixtures import client_venvs
from fixtures.client_venvs import TRITONCLIENT
from fixtures.deberta import make_deberta_checkpoint
from fixtures.fake_serving import server_config
from fixtures.server import Running
from relserve.client import Client
from relserve.client.cli import main as call_main
from relserve.service._proto import grpc_predict_v2_pb2 as v2
from relserve.service._proto import grpc_predict_v2_pb2_grpc as v2_grpc
from relserve.service._proto import inference_pb2 as pb

ADMIN, USER = "admin-token-7f3a", "user-token-91c2"
LABELS = ("a", "b", "c")
TEXTS = ["the film was a quiet delight", "a dull and tiring evening"]
# served as transformers computes them: float32, in the server process; no warm-up (loads in a fraction of a second)
MODEL_KEYS = ("device: cpu\ndtype: float32\nmax_seq_len: 64\nmax_queue_delay: 0.002\nworker_process: false\n"
              "warmup: false\n")
SPEC = {"admin": ADMIN, "inference": USER, "cls": "cls", "other": "other", "outside": "outside", "texts": TEXTS}


def _probabilities(model, path) -> list[list[float]]:
    """transformers' softmax over the labels of ``model`` (the checkpoint at ``path``) for :data:`TEXTS`."""
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        logits = model(**tok(TEXTS, return_tensors="pt", padding=True)).logits
    return torch.softmax(logits, -1).tolist()


@pytest.fixture(scope="module")
def venvs():
    return client_venvs.start(TRITONCLIENT)


@pytest.fixture(scope="module")
def world(venvs, unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("repository_api")
    repo = root / "models"

    def checkpoint(path, seed):
        return make_deberta_checkpoint(path, oracle=True, tokenizer_dir=unigram_tokenizer_dir, labels=LABELS,
                                       init="matrices", seed=seed)

    made = {"1": checkpoint(repo / "cls" / "1", 11), "2": checkpoint(repo / "cls" / "2", 12),
            "other": checkpoint(repo / "other", 13)}
    # a model directory beside the repository: "../outside" must not reach it
    (root / "outside").mkdir()
    (root / "outside" / "config.json").write_text((made["other"].path / "config.json").read_text())
    (repo / "cls" / "relserve.yaml").write_text("version_policy: all\n" + MODEL_KEYS)
    (repo / "other" / "relserve.yaml").write_text(MODEL_KEYS)
    expected = {key: _probabilities(c.model, c.path) for key, c in made.items()}
    (root / "admin").write_text(ADMIN + "\n")
    (root / "users").write_text(USER + "\n")
    srv = Running(server_config(http_port=0, metrics_port=None, model_repositories=(repo,),
                                model_control_mode="explicit", load_models=("cls",),
                                auth_token_file=root / "users", admin_token_file=root / "admin"), None)
    srv.wait_serving(timeout=120)
    srv.root, srv.expected = root, expected
    srv.http_target = f"127.0.0.1:{srv.server.http_port}"
    srv.v2 = v2_grpc.GRPCInferenceServiceStub(srv.channel)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def http_out(venvs, world):
    return client_venvs.run_script(venvs, TRITONCLIENT, "tritonclient_http_script.py", world.http_target,
                                   json.dumps(SPEC))


@pytest.fixture(scope="module")
def grpc_out(venvs, world, http_out):  # after the HTTP session: both load and unload "other"
    return client_venvs.run_script(venvs, TRITONCLIENT, "tritonclient_script.py", f"127.0.0.1:{world.port}",
                                   json.dumps(SPEC))


def _http_index(rows) -> list[tuple]:
    return [(r["name"], r.get("version", ""), r.get("state", ""), r.get("reason", "")) for r in rows]


def _probs(out) -> list[list[float]]:
    return out["outputs"]["probabilities"]["data"]


def _status(out) -> str:
    return out["error"]["status"]


def test_tritonclient_http_drives_the_repository(world, http_out):
    out, expected = http_out, world.expected
    assert "model_repository" in out["extensions"] and "binary_tensor_data" in out["extensions"]
    # the index before: cls's two versions READY, other known but not loaded (Triton: no version for it)
    assert _http_index(out["index"]) == [("cls", "1", "READY", ""), ("cls", "2", "READY", ""),
                                         ("other", "", "UNAVAILABLE", "not loaded")]
    assert _status(out["index/no_token"]) == "401" and "admin token" in out["index/no_token"]["error"]["message"]
    assert _status(out["index/inference_token"]) == "403"
    assert _status(out["load/inference_token"]) == "403"
    assert out["ready/other/before"] is False
    assert out["load"] is None and out["ready/other"] is True
    np.testing.assert_allclose(_probs(out["infer/other"]), expected["other"], atol=1e-5)
    assert {v: out[f"ready/cls/{v}"] for v in "123"} == {"1": True, "2": True, "3": False}
    for version in ("1", "2"):
        got = out[f"infer/cls/{version}"]
        assert got["model_version"] == version
        np.testing.assert_allclose(_probs(got), expected[version], atol=1e-5)
    assert not np.allclose(expected["1"], expected["2"], atol=1e-3)  # the versions are told apart
    # no version: the highest ready one serves
    assert out["infer/cls/"]["model_version"] == "2"
    np.testing.assert_allclose(_probs(out["infer/cls/"]), expected["2"], atol=1e-5)
    assert _status(out["infer/cls/3"]) == "404" and "'3'" in out["infer/cls/3"]["error"]["message"]
    assert out["versions/cls"] == ["1", "2"]
    assert ("other", "1", "READY", "") in _http_index(out["index/loaded"])
    assert _status(out["unload/no_token"]) == "401"
    assert out["unload"] is None and out["ready/other/after"] is False
    assert _status(out["infer/other/after"]) == "404"
    assert out["unload/again"] is None  # as Triton: unloading a model that is not loaded succeeds
    for name in ("../outside", "a/b", "%2e%2e"):
        assert _status(out[f"load/{name}"]) == "400", (name, out[f"load/{name}"])
    assert _status(out["load/no-such-model"]) == "404"
    # as Triton: the unloaded version stays listed, UNAVAILABLE; the refused names left no row
    assert _http_index(out["index/after"]) == [("cls", "1", "READY", ""), ("cls", "2", "READY", ""),
                                               ("other", "1", "UNAVAILABLE", "unloaded")]


def test_tritonclient_grpc_drives_the_repository(world, grpc_out):
    out, expected = grpc_out, world.expected
    assert "model_repository" in out["extensions"]
    # after the HTTP session: other's version 1 was loaded and unloaded there
    assert [(r["name"], r.get("version", ""), r["state"]) for r in out["index"]] == [
        ("cls", "1", "READY"), ("cls", "2", "READY"), ("other", "1", "UNAVAILABLE")]
    assert _status(out["index/no_token"]) == "StatusCode.UNAUTHENTICATED"
    assert _status(out["index/inference_token"]) == "StatusCode.PERMISSION_DENIED"
    assert _status(out["load/inference_token"]) == "StatusCode.PERMISSION_DENIED"
    assert out["ready/other/before"] is False and out["load"] is None and out["ready/other"] is True
    np.testing.assert_allclose(_probs(out["infer/other"]), expected["other"], atol=1e-5)
    assert {v: out[f"ready/cls/{v}"] for v in "123"} == {"1": True, "2": True, "3": False}
    for version in ("1", "2"):
        assert out[f"infer/cls/{version}"]["model_version"] == version
        np.testing.assert_allclose(_probs(out[f"infer/cls/{version}"]), expected[version], atol=1e-5)
    assert out["infer/cls/"]["model_version"] == "2"
    assert _status(out["infer/cls/3"]) == "StatusCode.NOT_FOUND"
    assert out["versions/cls"] == ["1", "2"]
    assert _status(out["unload/no_token"]) == "StatusCode.UNAUTHENTICATED"
    assert out["unload"] is None and out["ready/other/after"] is False
    assert _status(out["infer/other/after"]) == "StatusCode.NOT_FOUND" and out["unload/again"] is None
    for name in ("../outside", "a/b", "%2e%2e"):
        assert _status(out[f"load/{name}"]) == "StatusCode.INVALID_ARGUMENT", (name, out[f"load/{name}"])
    assert _status(out["load/no-such-model"]) == "StatusCode.NOT_FOUND"
    assert [(r["name"], r["version"], r["state"]) for r in out["index/after"]] == [
        ("cls", "1", "READY"), ("cls", "2", "READY"), ("other", "1", "UNAVAILABLE")]


def _raw_post(world, path: str, token: str = ADMIN, body: bytes = b"") -> tuple[int, dict | list | None]:
    """POST ``path`` as sent (no client-side normalisation of dot segments or escapes)."""
    conn = http.client.HTTPConnection("127.0.0.1", world.server.http_port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {token}"})
        reply = conn.getresponse()
        body = reply.read()
        return reply.status, json.loads(body) if body else None
    finally:
        conn.close()


@pytest.mark.parametrize("path", ["/v2/repository/models/%2e%2e/load", "/v2/repository/models/..%2Foutside/load",
                                  "/v2/repository/models/../outside/load", "/v2/repository/models/a%5Cb/unload"])
def test_names_that_are_paths_are_refused_and_change_nothing(world, http_out, path):
    before = _raw_post(world, "/v2/repository/index")
    status, body = _raw_post(world, path)
    assert status == 400 and body["code"] == "INVALID_ARGUMENT", (status, body)
    assert _raw_post(world, "/v2/repository/index") == before
    assert "outside" not in world.server.registry.runners


def test_the_index_filters_ready_rows_and_repositories(world, grpc_out):
    status, rows = _raw_post(world, "/v2/repository/index", body=b'{"ready": true}')
    assert status == 200 and rows == [{"name": "cls", "version": "1", "state": "READY"},
                                      {"name": "cls", "version": "2", "state": "READY"}]
    assert _raw_post(world, "/v2/repository/index", body=b'{"ready": 1}')[0] == 400
    admin = (("authorization", f"Bearer {ADMIN}"),)
    named = world.v2.RepositoryIndex(v2.RepositoryIndexRequest(repository_name="models"), metadata=admin, timeout=5)
    assert [m.name for m in named.models] == ["cls", "cls", "other"]
    with pytest.raises(grpc.RpcError) as err:
        world.v2.RepositoryIndex(v2.RepositoryIndexRequest(repository_name="elsewhere"), metadata=admin, timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_relserve_v1_addresses_versions_and_lists_them(world, http_out, capsys):
    user = (("authorization", f"Bearer {USER}"),)
    for version in ("1", "2"):
        reply = world.stub.Classify(pb.ClassifyRequest(model="cls", texts=TEXTS, top_k=0, model_version=version),
                                    metadata=user, timeout=60)
        got = [[{ls.label: ls.score for ls in r.labels}[label] for label in LABELS] for r in reply.results]
        np.testing.assert_allclose(got, world.expected[version], atol=1e-5)
    with pytest.raises(grpc.RpcError) as err:
        world.stub.Classify(pb.ClassifyRequest(model="cls", texts=TEXTS, model_version="3"), metadata=user, timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'3'" in err.value.details()
    rows = world.stub.ListModels(pb.ListModelsRequest(), metadata=user, timeout=10).models
    assert [(m.name, m.version, m.state) for m in rows] == [("cls", "1", "READY"), ("cls", "2", "READY")]
    # /v1 JSON: the same field
    conn = http.client.HTTPConnection("127.0.0.1", world.server.http_port, timeout=60)
    conn.request("POST", "/v1/classify", body=json.dumps({"model": "cls", "texts": TEXTS[:1], "modelVersion": "1"}),
                 headers={"Authorization": f"Bearer {USER}", "Content-Type": "application/json"})
    reply = json.loads(conn.getresponse().read())
    conn.close()
    scores = {ls["label"]: ls["score"] for ls in reply["results"][0]["labels"]}
    np.testing.assert_allclose([scores[label] for label in LABELS], world.expected["1"][0], atol=1e-5)
    # the Python client and relserve call
    with Client(f"127.0.0.1:{world.port}", token=USER) as client:
        reply = client.classify("cls", TEXTS[:1], top_k=0, model_version="1")
    scores = {ls.label: ls.score for ls in reply.results[0].labels}
    np.testing.assert_allclose([scores[label] for label in LABELS], world.expected["1"][0], atol=1e-5)
    capsys.readouterr()
    assert call_main(["classify", "--address", f"127.0.0.1:{world.port}", "--token", USER, "--model", "cls",
                      "--text", TEXTS[0], "--top-k", "0", "--model-version", "2"]) == 0
    scores = {ls["label"]: ls["score"] for ls in json.loads(capsys.readouterr().out)["results"][0]["labels"]}
    np.testing.assert_allclose([scores[label] for label in LABELS], world.expected["2"][0], atol=1e-5)
    assert call_main(["models", "--address", f"127.0.0.1:{world.port}", "--token", USER]) == 0
    listed = json.loads(capsys.readouterr().out)["models"]
    assert [(m["name"], m["version"], m["state"]) for m in listed] == [("cls", "1", "READY"), ("cls", "2", "READY")]


def test_relserve_call_drives_the_repository(world, grpc_out, capsys):
    """``relserve call repository index|load|unload`` (relserve.client over KServe v2) with the admin token."""
    common = ["--address", f"127.0.0.1:{world.port}", "--token", ADMIN]
    capsys.readouterr()
    assert call_main(["repository", "index", "--ready", *common]) == 0
    rows = json.loads(capsys.readouterr().out)["models"]
    assert [(r["name"], r["version"], r["state"]) for r in rows] == [("cls", "1", "READY"), ("cls", "2", "READY")]
    assert call_main(["repository", "load", "--model", "other", *common]) == 0
    assert "other" in world.server.registry.runners
    assert call_main(["repository", "unload", "--model", "other", *common]) == 0
    assert "other" not in world.server.registry.runners
    capsys.readouterr()
    user = ["--address", f"127.0.0.1:{world.port}", "--token", USER]
    assert call_main(["repository", "load", "--model", "other", *user]) == 1
    assert json.loads(capsys.readouterr().err)["code"] == "PERMISSION_DENIED"
    assert "other" not in world.server.registry.runners


def test_a_rotated_admin_token_is_in_force_without_a_restart(world, grpc_out):
    """Last: the admin file is rewritten; the old token is refused and the new one accepted once the watch has
    read it (polled every 0.25 s; waited for, not timed)."""
    (world.root / "admin").write_text("admin-token-rotated\n")
    index = v2.RepositoryIndexRequest()
    end = time.monotonic() + 10
    while True:
        try:
            world.v2.RepositoryIndex(index, metadata=(("authorization", "Bearer admin-token-rotated"),), timeout=5)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
            assert time.monotonic() < end, "the rotated admin token was never accepted"
            time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as err:
        world.v2.RepositoryIndex(index, metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


# ------------------------------------------------------------------------------------------------- poll mode


def test_poll_mode_serves_an_empty_repository_and_refuses_load_and_unload(tmp_path):
    (tmp_path / "repo").mkdir()
    srv = Running(server_config(http_port=0, metrics_port=None, model_repositories=(tmp_path / "repo",),
                                model_control_mode="poll", repository_poll_secs=60.0), None)
    try:
        srv.wait_serving(timeout=30)
        stub = v2_grpc.GRPCInferenceServiceStub(srv.channel)
        assert stub.ServerReady(v2.ServerReadyRequest(), timeout=5).ready
        assert list(stub.RepositoryIndex(v2.RepositoryIndexRequest(), timeout=5).models) == []
        for call, request in ((stub.RepositoryModelLoad, v2.RepositoryModelLoadRequest(model_name="x")),
                              (stub.RepositoryModelUnload, v2.RepositoryModelUnloadRequest(model_name="x"))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "poll" in err.value.details()
        conn = http.client.HTTPConnection("127.0.0.1", srv.server.http_port, timeout=10)
        conn.request("POST", "/v2/repository/models/x/load", body=b"")
        reply = conn.getresponse()
        body = json.loads(reply.read())
        conn.close()
        assert reply.status == 400 and "poll" in body["error"] and "explicit" in body["error"]
    finally:
        srv.close()


def _refusal(call, request, metadata=()) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(request, metadata=metadata, timeout=5)
    return err.value.code(), err.value.details()


@pytest.mark.parametrize("files", ["inference tokens only", "admin tokens only"])
def test_who_may_call_without_one_of_the_token_files(tmp_path, files):
    """Inference tokens without admin_token_file: the repository API is refused to everyone (403 naming the
    key). Admin tokens without auth_token_file: inference is open, the repository API needs the admin token."""
    (tmp_path / "repo").mkdir()
    (tmp_path / "tokens").write_text((USER if files == "inference tokens only" else ADMIN) + "\n")
    key = "auth_token_file" if files == "inference tokens only" else "admin_token_file"
    srv = Running(server_config(http_port=0, metrics_port=None, model_repositories=(tmp_path / "repo",),
                                model_control_mode="explicit", **{key: tmp_path / "tokens"}), None)
    try:
        srv.wait_serving(timeout=30)
        stub, index = v2_grpc.GRPCInferenceServiceStub(srv.channel), v2.RepositoryIndexRequest()
        conn = http.client.HTTPConnection("127.0.0.1", srv.server.http_port, timeout=10)
        if files == "inference tokens only":
            code, details = _refusal(stub.RepositoryIndex, index, (("authorization", f"Bearer {USER}"),))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "admin_token_file" in details
            conn.request("POST", "/v2/repository/index", headers={"Authorization": f"Bearer {USER}"})
            assert conn.getresponse().status == 403
        else:
            assert list(srv.stub.ListModels(pb.ListModelsRequest(), timeout=5).models) == []  # no token needed
            assert _refusal(stub.RepositoryIndex, index)[0] == grpc.StatusCode.UNAUTHENTICATED
            reply = stub.RepositoryIndex(index, metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=5)
            assert list(reply.models) == []
            conn.request("POST", "/v2/repository/index", headers={"Authorization": f"Bearer {USER}"})
            assert conn.getresponse().status == 403
        conn.close()
    finally:
        srv.close()
