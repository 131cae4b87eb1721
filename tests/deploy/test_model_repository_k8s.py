"""deploy/k8s/components/model-repository: models updated without a rollout (a repository volume in poll mode, the
admin token as its own Secret), checked offline and against a real server.

* The component laid over the cpu and gpu overlays, alone and with tls-auth: rendered like ``kubectl kustomize``
  (where installed) and valid for Kubernetes 1.27 and the newest schema (strict), with the renderer and helpers
  of test_deploy.py.
* Its config loads with the real loader: poll mode on the mounted repository, no built-in models, the base's
  server keys unchanged, ``admin_token_file`` inside the admin Secret's own read-only mount (beside the inference
  tokens' when tls-auth is on, and the tls-auth args still in place); the repository volume is read-only in the
  server pod and is the claim the publish Job writes.
* publish-job.yaml's script, run here with ``/models`` moved into tmp_path and a stand-in ``rclone`` that copies
  a local directory: it publishes into a server started in poll mode on that repository with an admin token
  file, which swaps to the new version (its replies change) while health stays SERVING; the repository index
  shows it with the admin token (none: UNAUTHENTICATED; load in poll mode: FAILED_PRECONDITION); the script
  refuses an existing version, a source without config.json and a bad version name, leaving the repository as
  it was.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

import test_deploy as td  # noqa: E402  (tests/deploy is on sys.path: pytest's rootdir-relative import)

COMPONENT = td.K8S / "components" / "model-repository"
PUBLISH_JOB = COMPONENT / "publish-job.yaml"
REPO_KEYS = {"model_repositories", "model_control_mode", "repository_poll_secs", "admin_token_file"}


@pytest.fixture(scope="module", params=[("cpu",), ("gpu",), ("cpu", "tls-auth")], ids="+".join)
def with_repository(request, tmp_path_factory) -> tuple[str, Path, list[dict]]:
    overlay, *more = request.param
    comps = [COMPONENT] + [td.K8S / "components" / c for c in more]
    root = td._with_components(tmp_path_factory.mktemp("repo-" + "-".join(request.param)), overlay, *comps)
    return "+".join(request.param), root, td.render(root)


def test_component_renders_like_kubectl_and_validates(with_repository):
    name, root, docs = with_repository
    td._assert_like_kubectl_and_valid(f"{name}+model-repository", root, docs)
    assert td._one(docs, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]


def _mount_of(docs: list[dict], path: str) -> tuple[dict, dict]:
    """(volumeMount, pod volume) that holds ``path`` in the relserve container (the longest matching mount)."""
    mounts = [m for m in td._container(docs)["volumeMounts"]
              if Path(path) == Path(m["mountPath"]) or Path(m["mountPath"]) in Path(path).parents]
    assert mounts, f"{path} is on no volume of the container"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    pod = td._one(docs, "Deployment")["spec"]["template"]["spec"]
    return mount, next(v for v in pod["volumes"] if v["name"] == mount["name"])


def test_config_is_poll_mode_on_the_mounted_volume_with_its_own_admin_secret(with_repository, tmp_path):
    from relserve.service import main as cli

    name, _root, docs = with_repository
    raw = td._config_yaml(docs)
    base = td._config_yaml(td.render(td.TARGETS["cpu"]))
    # the base's server keys, unchanged; no built-in models; only the repository keys added
    assert "models" not in raw
    assert {k: v for k, v in raw.items() if k not in REPO_KEYS} == {k: v for k, v in base.items() if k != "models"}
    assert set(raw) - set(base) == REPO_KEYS
    # the repository is on the claim, mounted read-only, at the path the publish Job writes into
    (repo_dir,) = raw["model_repositories"]
    mount, volume = _mount_of(docs, repo_dir)
    assert mount["readOnly"] is True and volume["persistentVolumeClaim"]["readOnly"] is True
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert claim == td._one(docs, "PersistentVolumeClaim")["metadata"]["name"]
    job = td._load_docs(PUBLISH_JOB)[0]["spec"]["template"]["spec"]
    job_vol = next(v for v in job["volumes"] if "persistentVolumeClaim" in v)
    assert job_vol["persistentVolumeClaim"]["claimName"] == claim
    job_mount = next(m for m in job["containers"][0]["volumeMounts"] if m["name"] == job_vol["name"])
    assert job_mount["mountPath"] == mount["mountPath"] and not job_mount.get("readOnly")
    # the admin tokens: their own Secret at their own path, not world-readable, apart from the inference tokens
    assert td._secret_file(docs, raw["admin_token_file"]) == ("relserve-admin", "tokens")
    c = td._container(docs)
    args = cli.build_parser().parse_args(c["command"][1:] + c.get("args", []))
    if "tls-auth" in name:
        assert args.tls_cert and args.auth_token_file, "tls-auth's args must survive the component"
        assert Path(args.auth_token_file).parent != Path(raw["admin_token_file"]).parent
        assert td._secret_file(docs, args.auth_token_file)[0] != "relserve-admin"
    # the real loader takes it: local stand-ins for the mounted files
    repo = tmp_path / "repository"
    repo.mkdir()
    admin = tmp_path / "admin-tokens"
    admin.write_text("an-admin-token\n")
    cfg = td._load_with_real_loader({**raw, "model_repositories": [str(repo)], "admin_token_file": str(admin)},
                                    tmp_path)
    assert cfg.model_control_mode == "poll" and cfg.models == ()
    assert [Path(p) for p in cfg.model_repositories] == [repo]
    assert cfg.repository_poll_secs == raw["repository_poll_secs"] and Path(cfg.admin_token_file) == admin
    # only /tmp is writable in the server pod
    assert [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")] == ["/tmp"]


# ------------------------------------------------------------------------------------ the publish script

def _publish_script(volume: Path, rclone_dir: Path) -> tuple[list[str], dict[str, str]]:
    """publish-job.yaml's command, its /models moved to ``volume``, and its environment with a stand-in rclone
    (``rclone copy --checksum SRC DST`` copies the local directory SRC into DST) first on PATH."""
    job = td._load_docs(PUBLISH_JOB)[0]["spec"]["template"]["spec"]
    (c,) = job["containers"]
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "model-repository")
    script = c["args"][0].replace(mount + "/", f"{volume}/")
    assert str(volume) in script and mount + "/" not in script
    rclone = rclone_dir / "rclone"
    rclone.write_text('#!/bin/sh\n[ "$1" = copy ] && [ "$2" = --checksum ] || exit 64\ncp -R "$3"/. "$4"\n')
    rclone.chmod(rclone.stat().st_mode | stat.S_IXUSR)
    env = {e["name"]: e["value"] for e in c["env"]}
    env.update(PATH=f"{rclone_dir}{os.pathsep}{os.environ['PATH']}", HOME=str(rclone_dir))
    return c["command"] + [script], env


def _publish(volume: Path, tmp_path: Path, model: str, version: str, source: Path) -> subprocess.CompletedProcess:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    cmd, env = _publish_script(volume, bindir)
    env.update(MODEL=model, VERSION=version, SOURCE=str(source))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, unigram_tokenizer_dir) -> tuple[Path, Path]:
    """Two tiny classifiers (labels a, b) with different weights, so their replies tell them apart."""
    from fixtures.deberta import make_deberta_checkpoint

    root = tmp_path_factory.mktemp("publish-src")
    return tuple(make_deberta_checkpoint(root / f"v{seed}", tokenizer_dir=unigram_tokenizer_dir, labels=("a", "b"),
                                         seed=seed).path for seed in (1, 2))


def _scores(stub, pb, model: str) -> list[float]:
    reply = stub.Classify(pb.ClassifyRequest(model=model, texts=["hello world", "a test"]), timeout=30)
    return [round(ls.score, 5) for r in reply.results for ls in r.labels]


def test_publish_script_swaps_a_polling_server_and_refuses_bad_publications(two_checkpoints, tmp_path):
    grpc = pytest.importorskip("grpc")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from relserve.loadtest.serverproc import ServerProcess
    from relserve.service._proto import grpc_predict_v2_pb2 as v2_pb
    from relserve.service._proto import grpc_predict_v2_pb2_grpc as v2_grpc
    from relserve.service._proto import inference_pb2 as pb
    from relserve.service._proto import inference_pb2_grpc as pb_grpc

    v1, v2 = two_checkpoints
    volume = tmp_path / "volume"
    repo = volume / "repository"
    (repo / "m").mkdir(parents=True)
    (repo / "m" / "relserve.yaml").write_text("dtype: float32\nworker_process: false\nwarmup: false\n")
    first = _publish(volume, tmp_path, "m", "1", v1)
    assert first.returncode == 0, first.stderr
    assert (repo / "m" / "1" / "config.json").is_file() and not any((volume / ".staging").iterdir())
    admin = tmp_path / "admin-tokens"  # the component's relserve-admin Secret, without tls-auth's inference tokens
    admin.write_text("an-admin-token\n")
    args = ["--model-repository", str(repo), "--model-control-mode", "poll", "--repository-poll-secs", "0.2",
            "--admin-token-file", str(admin)]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1"}, start_timeout=120) as srv:
        channel = grpc.insecure_channel(srv.target)
        stub, health = pb_grpc.InferenceStub(channel), health_pb2_grpc.HealthStub(channel)
        repo_api = v2_grpc.GRPCInferenceServiceStub(channel)
        before = _scores(stub, pb, "m")  # inference needs no token: only the repository API is the admin's
        second = _publish(volume, tmp_path, "m", "2", v2)
        assert second.returncode == 0, second.stderr
        statuses, after = set(), before
        end = time.monotonic() + 60
        while after == before and time.monotonic() < end:
            statuses.add(health.Check(health_pb2.HealthCheckRequest(service="relserve.v1.Inference"),
                                      timeout=5).status)
            after = _scores(stub, pb, "m")  # a failed call raises: the swap must not fail any
        assert after != before, "the published version 2 never answered"
        assert statuses == {health_pb2.HealthCheckResponse.SERVING}
        # the repository API: the admin token sees version 2 serve; no token is UNAUTHENTICATED; poll mode refuses load
        rows = repo_api.RepositoryIndex(v2_pb.RepositoryIndexRequest(ready=True), timeout=10,
                                  metadata=[("authorization", "Bearer an-admin-token")]).models
        assert [(r.name, r.version, r.state) for r in rows] == [("m", "2", "READY")]
        with pytest.raises(grpc.RpcError) as err:
            repo_api.RepositoryIndex(v2_pb.RepositoryIndexRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            repo_api.RepositoryModelLoad(v2_pb.RepositoryModelLoadRequest(model_name="m"), timeout=10,
                                   metadata=[("authorization", "Bearer an-admin-token")])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "poll" in err.value.details()
        # refused: the same version again, a source without config.json; the repository is left as it was
        tree = _tree(repo)
        again = _publish(volume, tmp_path, "m", "2", v1)
        assert again.returncode != 0 and "exists" in again.stderr
        empty = tmp_path / "empty"
        empty.mkdir()
        (empty / "README").write_text("not a checkpoint\n")
        bad = _publish(volume, tmp_path, "m", "3", empty)
        assert bad.returncode != 0 and "config.json" in bad.stderr
        for version in ("0", "x1", "../1"):
            assert _publish(volume, tmp_path, "m", version, v1).returncode == 2
        assert _tree(repo) == tree
        assert _scores(stub, pb, "m") == after
        channel.close()
