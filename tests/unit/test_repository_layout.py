"""service/repository/layout.py on real temporary directories: what a repository scan serves, and each refusal
with its reason (the rest of the repository still scans)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from relserve.service.config import ModelConfig
from relserve.service.errors import ConfigError, InvalidArgument
from relserve.service.repository import layout


def checkpoint(path: Path, weights: bytes = b"") -> Path:
    """A directory that looks like a checkpoint to the scan (config.json, weights, tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "deberta-v2"}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [10, 4], "data_offsets": [0, 160]}}).encode()
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + (weights or bytes(160)))
    (path / "tokenizer.json").write_text("{}")
    return path


def test_a_checkpoint_directory_is_version_1_and_numbered_directories_are_versions(tmp_path):
    checkpoint(tmp_path / "plain")
    for v in ("1", "2", "10"):
        checkpoint(tmp_path / "versioned" / v)
    (tmp_path / "versioned" / "README").write_text("ignored: a file beside the versions")
    (tmp_path / "notes.txt").write_text("ignored: a file in the repository")
    (tmp_path / ".git").mkdir()
    (tmp_path / "lost+found").mkdir()

    found = layout.scan([tmp_path])

    assert sorted(found) == ["plain", "versioned"]
    assert list(found["plain"].versions) == ["1"] and found["plain"].versions["1"].path == tmp_path / "plain"
    assert list(found["versioned"].versions) == ["1", "2", "10"]
    assert found["versioned"].selected() == ["10"]  # the default policy: the highest
    assert not found["plain"].problem and not found["versioned"].problem


def test_relserve_yaml_policy_and_model_keys(tmp_path):
    for v in ("1", "2", "3"):
        checkpoint(tmp_path / "m" / v)
    (tmp_path / "m" / "relserve.yaml").write_text("version_policy: {specific: [1, 3]}\nmax_batch_size: 4\n"
                                                  "dtype: float32\n")
    model = layout.scan([tmp_path])["m"]
    assert model.selected() == ["1", "3"]
    cfg = model.config("3")
    assert (cfg.name, cfg.path, cfg.max_batch_size, cfg.dtype) == ("m", tmp_path / "m" / "3", 4, "float32")
    assert model.config("3", {"max_batch_size": 2}).max_batch_size == 2  # the load API's config wins

    (tmp_path / "m" / "relserve.yaml").write_text("version_policy: all\n")
    assert layout.scan([tmp_path])["m"].selected() == ["1", "2", "3"]
    (tmp_path / "m" / "relserve.yaml").write_text("version_policy: {latest: 2}\n")
    assert layout.scan([tmp_path])["m"].selected() == ["2", "3"]


@pytest.mark.parametrize("text, why", [
    ("max_batch_sise: 4\n", "unknown key(s) ['max_batch_sise']"),
    ("version_policy: {latest: 0}\n", "version_policy must be all"),
    ("max_batch_size: 0\n", "max_batch_size must be >= 1"),
    ("[1, 2]\n", "top level must be a mapping"),
    ("a: [\n", "is not valid YAML"),
])
def test_a_bad_relserve_yaml_refuses_that_model_only(tmp_path, text, why):
    checkpoint(tmp_path / "bad" / "1")
    checkpoint(tmp_path / "good")
    (tmp_path / "bad" / "relserve.yaml").write_text(text)
    found = layout.scan([tmp_path])
    assert why in found["bad"].problem and "relserve.yaml" in found["bad"].problem
    assert not found["good"].problem


def test_refusals_name_the_path_and_why(tmp_path):
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    checkpoint(outside / "ckpt")
    checkpoint(repo / "ok" / "1")
    checkpoint(repo / "latest" / "2")
    (repo / "latest" / "latest").mkdir()                     # a non-number version directory
    os.symlink(outside / "ckpt", repo / "linked")             # a model directory linked out of the repository
    checkpoint(repo / "filelink" / "1")
    (repo / "filelink" / "1" / "tokenizer.json").unlink()
    os.symlink(outside / "ckpt" / "tokenizer.json", repo / "filelink" / "1" / "tokenizer.json")
    checkpoint(repo / "bad name")                             # not a model name
    inside = checkpoint(repo / "in" / "1")
    os.symlink(inside, repo / "alias")                        # a link that stays inside is fine

    found = layout.scan([repo])

    assert not found["ok"].problem and not found["alias"].problem
    assert "'latest'" not in found["latest"].versions and "must be a positive integer" in found["latest"].problem
    assert str(repo / "latest" / "latest") in found["latest"].problem
    assert "symbolic link out of the repository" in found["linked"].problem
    assert "symbolic link out of the repository" in found["filelink"].problem
    assert "tokenizer.json" in found["filelink"].problem
    assert "is not a model name" in found["bad name"].problem


def test_the_same_name_in_two_repositories_is_refused(tmp_path):
    checkpoint(tmp_path / "a" / "m")
    checkpoint(tmp_path / "b" / "m")
    checkpoint(tmp_path / "b" / "other")
    found = layout.scan([tmp_path / "a", tmp_path / "b"])
    assert "in two repositories" in found["m"].problem
    assert str(tmp_path / "a" / "m") in found["m"].problem and str(tmp_path / "b" / "m") in found["m"].problem
    assert not found["other"].problem


def test_a_missing_repository_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        layout.scan([tmp_path / "nope"])


def test_the_fingerprint_sees_a_changed_file(tmp_path):
    checkpoint(tmp_path / "m" / "1")
    before = layout.scan([tmp_path])["m"].versions["1"].fingerprint
    assert layout.scan([tmp_path])["m"].versions["1"].fingerprint == before
    weights = tmp_path / "m" / "1" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + b"\x01")  # same size: only mtime_ns tells
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    assert layout.scan([tmp_path])["m"].versions["1"].fingerprint != before


def test_links_back_up_the_tree_are_walked_once(tmp_path):
    # a link to the version's own directory was walked again at every level until ELOOP (40 copies of each file;
    # two such links: 2**40 directories, and the poll never returned)
    version = checkpoint(tmp_path / "m" / "1")
    os.symlink(".", version / "a")
    model = layout.scan([tmp_path])["m"]
    assert model.problem == ""
    assert [row[0] for row in model.versions["1"].fingerprint] == ["config.json", "model.safetensors",
                                                                     "tokenizer.json"]


@pytest.mark.parametrize("name, why", [
    ("", "empty"), ("a/b", "is a path"), ("..", "is a path"), ("a..b", "is a path"), ("x\\y", "is a path"),
    ("-x", "must match"),
])
def test_check_name_refuses_paths(name, why):
    with pytest.raises(InvalidArgument, match=why):
        layout.check_name(name)


def test_weight_estimate_follows_the_dtype(tmp_path):
    ckpt = checkpoint(tmp_path / "m")
    f32 = layout.estimate_weight_bytes(ModelConfig(name="m", path=ckpt, dtype="float32"))
    bf16 = layout.estimate_weight_bytes(ModelConfig(name="m", path=ckpt, dtype="bfloat16"))
    two = layout.estimate_weight_bytes(ModelConfig(name="m", path=ckpt, dtype="float32", instances=2,
                                                   worker_process=True))
    assert (f32, bf16, two) == (160, 80, 320)


def test_repository_keys_from_flags_and_file(tmp_path, monkeypatch):
    from relserve.service.config import config_from_args, load_config
    from relserve.service.main import build_parser

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["serve", "--model-repository", "a", "--model-repository", str(tmp_path / "b"),
                                      "--model-control-mode", "explicit", "--load-model", "x", "--load-model", "*",
                                      "--repository-poll-secs", "0.5", "--memory-limit-mb", "512"])
    cfg = config_from_args(args, {})
    assert cfg.model_repositories == (tmp_path / "a", tmp_path / "b")
    assert (cfg.model_control_mode, cfg.load_models, cfg.repository_poll_secs, cfg.memory_limit_mb) == (
        "explicit", ("x", "*"), 0.5, 512)
    assert cfg.models == ()  # with a repository the built-in default models are not added

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "repo").mkdir()
    (conf / "server.yaml").write_text("model_repositories: [repo]\nmodel_control_mode: poll\n")
    cfg = load_config(conf / "server.yaml")
    assert cfg.model_repositories == (conf / "repo",)  # relative to the config file

    for text, why in (("model_repositories: [nope]\n", "'.*nope' is not a directory"),
                      ("model_control_mode: poll\n", "needs a model repository"),
                      ("model_repositories: [repo]\nload_models: [x]\n", "is for model_control_mode explicit"),
                      ("model_repositories: [repo]\nmodel_control_mode: sometimes\n", "is not one of"),
                      ("model_repositories: [repo]\nrepository_poll_secs: 0\n", "repository_poll_secs must be > 0")):
        (conf / "server.yaml").write_text(text)
        with pytest.raises(ConfigError, match=why):
            load_config(conf / "server.yaml")


def test_the_manager_quotes_a_long_name_cut(tmp_path):
    # a 20,000-character name echoed whole overflowed the client's metadata limit: RESOURCE_EXHAUSTED, not NOT_FOUND
    import asyncio

    from relserve.service.config import config_from_args
    from relserve.service.errors import NotFound
    from relserve.service.main import build_parser
    from relserve.service.repository.manager import RepositoryManager

    args = build_parser().parse_args(["serve", "--model-repository", str(tmp_path), "--model-control-mode",
                                      "explicit"])
    manager = RepositoryManager(config_from_args(args, {}))
    for call in (manager.load, manager.unload):
        with pytest.raises(NotFound) as err:
            asyncio.run(call("a" * 20000))
        assert "(20000 characters)" in str(err.value) and len(str(err.value)) < 300
