"""ONNX graph cache integrity (issue 10, item 6): a graph planted or changed by someone else is never served.

Real checkpoints, real exports, real loads of the ONNX Runtime backend. The repro of the issue: a valid graph
whose metadata carries the right checkpoint hash but with a trigger (negate the logits when the input has 9
tokens) passes the load-time parity check, so only the recorded sha256 and the owner/mode checks stop it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from relserve.models.checkpoint import checkpoint_hash  # noqa: E402
from relserve.models.onnx.runtime import EXPORT_VERSION, GRAPH_NAME, REPORT_DIGESTS, REPORT_NAME  # noqa: E402
from relserve.service.backends import file_trust  # noqa: E402
from relserve.service.backends.graph_cache import GraphMismatch  # noqa: E402
from relserve.service.backends.onnx_encoder import OnnxBackend  # noqa: E402
from relserve.service.backends.padding import WarmupEncoding  # noqa: E402
from relserve.service.config import ConfigError, ModelConfig, default_onnx_cache_dir  # noqa: E402

NINE = WarmupEncoding([1, 11, 12, 13, 14, 15, 16, 17, 2])  # the trigger length
SIX = WarmupEncoding([1, 11, 12, 13, 14, 2])


def _mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _cfg(ckpt, cache=None) -> ModelConfig:
    return ModelConfig(name="m", path=ckpt, device="cpu", backend="onnx", max_seq_len=64, onnx_cache_dir=cache)


def _plant_trigger(graph) -> None:
    """Rewrite ``graph`` in place: logits negated when the sequence has 9 tokens; metadata (the checkpoint
    hash) kept, so provenance checks pass and the warm-up parity check (5 and 64 tokens) does not see it."""
    from onnx import TensorProto, helper

    proto = onnx.load(graph)
    g = proto.graph
    for node in g.node:
        node.output[:] = ["logits_raw" if o == "logits" else o for o in node.output]
    g.initializer.extend([helper.make_tensor("one", TensorProto.INT64, [], [1]),
                          helper.make_tensor("nine", TensorProto.INT64, [], [9])])
    g.node.extend([
        helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
        helper.make_node("Gather", ["ids_shape", "one"], ["seq_len"], axis=0),
        helper.make_node("Equal", ["seq_len", "nine"], ["is_nine"]),
        helper.make_node("Neg", ["logits_raw"], ["negated"]),
        helper.make_node("Where", ["is_nine", "negated", "logits_raw"], ["logits"]),
    ])
    onnx.save(proto, graph)


@pytest.fixture(scope="module")
def ckpt(unigram_tokenizer_dir, tmp_path_factory):
    return make_deberta_checkpoint(tmp_path_factory.mktemp("cache-ckpt") / "cls", task="classification",
                                   tokenizer_dir=unigram_tokenizer_dir, labels=("a", "b", "c"), init="spread",
                                   seed=5).path


@pytest.fixture(scope="module")
def first_load(ckpt, tmp_path_factory):
    """The default cache directory with XDG_CACHE_HOME on a 0777 volume (a Kubernetes emptyDir): the server's
    first load exports into it. Returns (the volume, the default root, the clean backend)."""
    volume = tmp_path_factory.mktemp("emptydir")
    os.chmod(volume, 0o777)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(volume))
        root = default_onnx_cache_dir()
        be = OnnxBackend(_cfg(ckpt))
        be.load()
    return volume, root, be


def _copy_cache(first_load, dest):
    shutil.copytree(first_load[1], dest)  # copytree keeps the 0700 / 0755 / 0644 modes
    return dest / checkpoint_hash(first_load[2].config.path, EXPORT_VERSION)


def test_default_cache_is_the_users_own_and_created_0700(first_load, ckpt):
    volume, root, be = first_load
    assert root == volume / "relserve" / "onnx"
    assert _mode(volume) == 0o777  # the shared volume is left as it is ...
    assert _mode(volume / "relserve") == 0o700 and _mode(root) == 0o700  # ... the server's directories are 0700
    entry = root / checkpoint_hash(ckpt, EXPORT_VERSION)
    assert be.graph == entry / GRAPH_NAME and be.parity_diff < 1e-4
    report = json.loads((entry / REPORT_NAME).read_text())
    assert report[REPORT_DIGESTS] == {GRAPH_NAME: _sha(entry / GRAPH_NAME)}
    assert _mode(entry / GRAPH_NAME) & 0o022 == 0


def test_a_tampered_cache_graph_is_not_served_but_exported_again(first_load, ckpt, tmp_path, caplog):
    clean = first_load[2]
    want_nine = clean.run([NINE])[0]
    entry = _copy_cache(first_load, tmp_path / "cache")
    _plant_trigger(entry / GRAPH_NAME)
    planted = _sha(entry / GRAPH_NAME)
    recorded = json.loads((entry / REPORT_NAME).read_text())[REPORT_DIGESTS][GRAPH_NAME]

    # The planted graph is a working attack: beside the checkpoint with no report (a hand-placed graph, guarded
    # only by provenance metadata and parity), it loads and flips the 9-token answers.
    beside = tmp_path / "ckpt"
    shutil.copytree(ckpt, beside)
    (beside / "onnx").mkdir()
    shutil.copyfile(entry / GRAPH_NAME, beside / "onnx" / GRAPH_NAME)
    attacked = OnnxBackend(_cfg(beside, tmp_path / "unused"))
    with caplog.at_level("WARNING"):
        attacked.load()
    assert "records no sha256 of its graph files" in caplog.text
    np.testing.assert_allclose(attacked.run([NINE])[0], -want_nine, atol=1e-4)
    np.testing.assert_allclose(attacked.run([SIX])[0], clean.run([SIX])[0], atol=1e-4)
    # with the report its export wrote, the same file beside the checkpoint is refused (never rewritten there)
    shutil.copyfile(entry / REPORT_NAME, beside / "onnx" / REPORT_NAME)
    with pytest.raises(GraphMismatch, match=f"has sha256 {planted}, but its export recorded {recorded}.*relserve export"):
        OnnxBackend(_cfg(beside, tmp_path / "unused")).load()

    # in the cache: refused, logged with both digests, exported again into a fresh entry
    caplog.clear()
    be = OnnxBackend(_cfg(ckpt, tmp_path / "cache"))
    with caplog.at_level("WARNING"):
        be.load()
    warning = next(r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "unusable" in r.getMessage())
    assert str(entry / GRAPH_NAME) in warning and planted in warning and recorded in warning
    assert _sha(entry / GRAPH_NAME) == json.loads((entry / REPORT_NAME).read_text())[REPORT_DIGESTS][GRAPH_NAME]
    np.testing.assert_allclose(be.run([NINE])[0], want_nine, atol=1e-4)


def test_a_world_writable_cache_dir_is_refused_naming_the_mode(ckpt, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match=rf"onnx_cache_dir '{shared}' is writable by group and others "
                                          r"\(owner uid \d+, mode 0777\).*chmod go-w.*relserve"):
        OnnxBackend(_cfg(ckpt, shared)).load()
    os.chmod(shared, 0o770)
    with pytest.raises(ConfigError, match=r"writable by group \(owner uid \d+, mode 0770\)"):
        OnnxBackend(_cfg(ckpt, shared)).load()
    assert not any(shared.iterdir())  # nothing was exported into it


def test_a_cache_dir_of_another_uid_is_refused(ckpt, tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(theirs, 4242, 4242)
        owner = 4242
    else:  # cannot chown: the server believes it runs as another uid; the real directory is still checked
        owner = os.geteuid()
        monkeypatch.setattr(file_trust, "server_uid", lambda: owner + 1)
    with pytest.raises(ConfigError, match=rf"'{theirs}' is owned by uid {owner}, not by the server's uid "
                                          rf"\d+ \(or root\) \(owner uid {owner}, mode 0700\).*own user"):
        OnnxBackend(_cfg(ckpt, theirs)).load()


def test_group_writable_or_linked_graph_files_are_refused(first_load, ckpt, tmp_path, caplog):
    entry = _copy_cache(first_load, tmp_path / "cache")
    beside = tmp_path / "ckpt"
    shutil.copytree(ckpt, beside)
    shutil.copytree(entry, beside / "onnx")
    graph = beside / "onnx" / GRAPH_NAME
    os.chmod(graph, 0o664)
    with pytest.raises(GraphMismatch, match=rf"{graph} is writable by group \(owner uid \d+, mode 0664\).*chmod go-w"):
        OnnxBackend(_cfg(beside, tmp_path / "unused")).load()
    os.chmod(graph, 0o644)
    os.chmod(beside / "onnx" / REPORT_NAME, 0o646)  # the report carries the digests: checked the same way
    with pytest.raises(GraphMismatch, match=r"export_report.json is writable by others .*mode 0646"):
        OnnxBackend(_cfg(beside, tmp_path / "unused")).load()
    os.chmod(beside / "onnx" / REPORT_NAME, 0o644)
    graph.rename(tmp_path / "real.onnx")
    graph.symlink_to(tmp_path / "real.onnx")  # not followed, even to a good graph
    with pytest.raises(GraphMismatch, match=rf"{graph} is a symbolic link"):
        OnnxBackend(_cfg(beside, tmp_path / "unused")).load()
    # in the cache, a group-writable graph is not used: exported again, owner-writable only
    os.chmod(entry / GRAPH_NAME, 0o664)
    be = OnnxBackend(_cfg(ckpt, tmp_path / "cache"))
    with caplog.at_level("WARNING"):
        be.load()
    assert f"{entry / GRAPH_NAME} is writable by group (owner uid {os.geteuid()}, mode 0664)" in caplog.text
    assert _mode(entry / GRAPH_NAME) == 0o644 and be.parity_diff < 1e-4


def test_a_fresh_export_failing_parity_is_not_exported_again(first_load, ckpt, tmp_path, monkeypatch, caplog):
    # Was: the fresh graph was taken for a stale cache entry, exported a second time, and the error said
    # "delete <dir> to export again", which cannot help.
    from relserve.service.backends import onnx_encoder

    exports = []
    real_export = onnx_encoder.export_checkpoint
    monkeypatch.setattr(onnx_encoder, "export_checkpoint", lambda *a, **kw: exports.append(a) or real_export(*a, **kw))
    strict = {"onnx_parity_tolerance": 1e-9, "onnx_parity_rtol": 0.0}
    fresh = ModelConfig(**{**_cfg(ckpt, tmp_path / "empty").__dict__, **strict})
    with pytest.raises(GraphMismatch) as err:
        OnnxBackend(fresh).load()
    message = str(err.value)
    assert len(exports) == 1
    assert "max |diff| " in message and "(atol 1e-09, rtol 0)" in message
    assert "exported from this checkpoint just now" in message and "onnx_parity_tolerance" in message
    assert "onnx_parity_rtol" in message and "delete" not in message

    # a graph cached by an earlier run still gets today's treatment: deleted and exported again, once
    exports.clear()
    entry = _copy_cache(first_load, tmp_path / "cache")
    with caplog.at_level("WARNING"):
        with pytest.raises(GraphMismatch) as err:
            OnnxBackend(ModelConfig(**{**_cfg(ckpt, tmp_path / "cache").__dict__, **strict})).load()
    assert len(exports) == 1
    assert any("unusable" in r.getMessage() and f"deleting {entry}" in r.getMessage() for r in caplog.records)
    assert "exported from this checkpoint just now" in str(err.value) and "delete" not in str(err.value)
