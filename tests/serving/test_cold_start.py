"""A server's start, through real servers on tiny checkpoints: the dtype gate's decision and the batch cost
model's probe timings kept in the cache and used at the next start (ListModels' dtype_reason says so, a tampered
entry is ignored and rewritten), one progress line per load phase, every model's files checked before a port
is bound (exit 2, the ports stay free), and a ``relserve export`` directory served as it is through
``onnx_path`` (transformers as the oracle) or refused when it belongs to another checkpoint."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.fake_serving import server_config  # noqa: E402
from fixtures.server import Running  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service.backends import gate_cache  # noqa: E402
from relserve.service.config import ModelConfig  # noqa: E402
from relserve.service.main import main  # noqa: E402
from relserve.service.registry import build_runner  # noqa: E402

TEXTS = ["a short text", "another text about Berlin and Paris", "x"]
LABELS = ("a", "b", "c")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def ckpt(unigram_tokenizer_dir, tmp_path_factory):
    return make_deberta_checkpoint(tmp_path_factory.mktemp("cold") / "cls", task="classification", oracle=True,
                                   tokenizer_dir=unigram_tokenizer_dir, labels=LABELS, init="spread",
                                   seed=5)


def _start(config: ModelConfig):
    srv = Running(server_config(metrics_port=None), [build_runner(config)])
    srv.wait_serving(timeout=120)
    model = srv.stub.ListModels(pb.ListModelsRequest()).models[0]
    replies = srv.stub.Classify(pb.ClassifyRequest(model="m", texts=TEXTS), timeout=30).results
    scores = [[{s.label: s.score for s in r.labels}[name] for name in LABELS] for r in replies]
    srv.close()
    return model, scores


def test_gate_decision_and_probe_timings_are_kept_for_the_next_start(ckpt, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RELSERVE_CPU_BF16", "assume")  # the gate runs whatever this CPU has
    caplog.set_level(logging.INFO)
    # agreement 0.98 on this checkpoint: bfloat16 passes at 0.95, so the kept decision switches the model
    cfg = ModelConfig(name="m", path=ckpt.path, device="cpu", dtype="auto", worker_process=False, max_seq_len=64,
                      dtype_gate_agreement=0.95, onnx_cache_dir=tmp_path / "cache")
    first, scores = _start(cfg)
    assert first.dtype == "bfloat16"
    assert "agreement gate passed" in first.dtype_reason and "kept" not in first.dtype_reason
    entries = sorted(gate_cache.cache_dir(cfg).iterdir(), key=lambda p: p.name.endswith(".probes.json"))
    assert [p.name.endswith(".probes.json") for p in entries] == [False, True]
    decision = json.loads(entries[0].read_text())
    assert (decision["dtype"], decision["reason"]) == (first.dtype, first.dtype_reason)
    log = caplog.text
    for phase in ("weights and tokenizer loaded in", "warm-up in", "dtype agreement gate ran in",
                  "batch cost model from 8 warm-up probes in", "ready in"):
        assert f"model 'm': {phase}" in log, phase

    caplog.clear()
    second, again = _start(cfg)
    assert second.dtype == first.dtype
    assert second.dtype_reason == f"{first.dtype_reason} [decision kept in {entries[0]}; the gate did not run at " \
                                  f"this start]"
    assert "batch cost model from 8 kept probes" in caplog.text and "gate ran" not in caplog.text
    np.testing.assert_array_equal(again, scores)  # the same dtype serves the same numbers

    entry = json.loads(entries[0].read_text())  # an entry changed on disk is ignored and measured again
    entry["dtype"] = "float32" if entry["dtype"] == "bfloat16" else "bfloat16"
    entries[0].write_text(json.dumps(entry))
    caplog.clear()
    third, _ = _start(cfg)
    assert (third.dtype, third.dtype_reason) == (first.dtype, first.dtype_reason)
    assert "entry_sha256 does not match its content" in caplog.text
    assert json.loads(entries[0].read_text())["dtype"] == first.dtype


def test_shipped_decision_lets_a_fresh_cache_skip_the_gate(ckpt, tmp_path, monkeypatch, capsys):
    """``relserve dtype-decisions`` writes the decision beside the checkpoint; a server with an empty cache (a
    fresh clone on the same machine class) uses it; one with other gate keys does not."""
    monkeypatch.setenv("RELSERVE_CPU_BF16", "assume")
    path = tmp_path / "shipped"
    shutil.copytree(ckpt.path, path)
    for _ in range(2):  # the second run decides afresh too (not from the shipped file) and replaces its entry
        assert main(["dtype-decisions", "--model", f"m={path},max_seq_len=64,device=cpu"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("m: ") and "agreement gate" in out and "kept" not in out
    shipped = json.loads((path / gate_cache.SHIPPED_NAME).read_text())["entries"]
    assert len(shipped) == 1 and "loadtest/data/sentiment_dev.jsonl" in shipped[0]["reason"]
    cfg = ModelConfig(name="m", path=path, device="cpu", worker_process=False, max_seq_len=64, cost_batching=False,
                      onnx_cache_dir=tmp_path / "fresh")
    model, _ = _start(cfg)
    assert (model.dtype, model.dtype_reason) == (
        shipped[0]["dtype"], f"{shipped[0]['reason']} [decision kept in {path / gate_cache.SHIPPED_NAME}; the gate "
                             f"did not run at this start]")
    other, _ = _start(dataclasses.replace(cfg, dtype_gate_items=200, onnx_cache_dir=tmp_path / "other"))
    assert "kept" not in other.dtype_reason and "200 items" in other.dtype_reason


def test_missing_config_json_exits_2_before_any_port_is_bound(ckpt, tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes((ckpt.path / "model.safetensors").read_bytes())
    ports = [_free_port(), _free_port()]
    code = main(["serve", "--model", f"good={ckpt.path}", "--model", f"bad={broken}", "--host", "127.0.0.1",
                 "--port", str(ports[0]), "--metrics-port", str(ports[1])])
    err = capsys.readouterr().err
    assert code == 2
    assert f"model 'bad': '{broken / 'config.json'}' is missing" in err
    assert all(_bindable(p) for p in ports)
    assert "model 'good': config read and files checked in" in caplog.text and "bound" not in caplog.text


def test_export_dir_served_as_is_and_refused_for_another_checkpoint(ckpt, unigram_tokenizer_dir, tmp_path,
                                                                      capsys):
    pytest.importorskip("onnxruntime")
    from relserve.models.checkpoint import checkpoint_hash
    from relserve.models.onnx.cli import main as export_main
    from relserve.models.onnx.runtime import EXPORT_VERSION

    out = tmp_path / "export"
    assert export_main([str(ckpt.path), str(out), "--no-parity"]) == 0
    cache = tmp_path / "cache"
    cfg = ModelConfig(name="m", path=ckpt.path, device="cpu", backend="onnx", onnx_path=out, max_seq_len=64,
                      onnx_cache_dir=cache, worker_process=False, onnx_intra_op_threads=1)
    model, scores = _start(cfg)
    assert model.backend == "onnxruntime"
    # nothing exported again: the cache holds only the kept probe timings
    assert [p.name for p in cache.iterdir()] == [gate_cache.CACHE_SUBDIR]
    from relserve.models.tokenization import load_tokenizer

    tok = load_tokenizer(ckpt.path)
    for text, got in zip(TEXTS, scores):
        ids = tok.batch_encode([text], max_length=64)[0].input_ids
        with torch.no_grad():
            logits = ckpt.model(input_ids=torch.tensor([ids])).logits[0]
        np.testing.assert_allclose(got, torch.softmax(logits, -1).numpy(), atol=1e-5)

    other = make_deberta_checkpoint(tmp_path / "other", task="classification", tokenizer_dir=unigram_tokenizer_dir,
                                    labels=("a", "b", "c"), seed=6).path
    port = _free_port()
    code = main(["serve", "--model", f"m={other},backend=onnx,onnx_path={out}", "--host", "127.0.0.1", "--port",
                 str(port), "--metrics-port", "-1"])
    err = capsys.readouterr().err
    assert code == 2 and _bindable(port)
    for text in (f"model 'm': onnx_path '{out}' was exported from another checkpoint",
                 checkpoint_hash(ckpt.path, EXPORT_VERSION), checkpoint_hash(other, EXPORT_VERSION), f"'{other}'"):
        assert text in err


def test_an_architecture_not_served_exits_2_before_any_port_is_bound(ckpt, tmp_path, capsys):
    masked = tmp_path / "masked"
    shutil.copytree(ckpt.path, masked)
    config = json.loads((masked / "config.json").read_text())
    (masked / "config.json").write_text(json.dumps({**config, "architectures": ["DebertaV2ForMaskedLM"]}))
    ports = [_free_port(), _free_port()]
    code = main(["serve", "--model", f"mlm={masked}", "--host", "127.0.0.1", "--port", str(ports[0]),
                 "--metrics-port", str(ports[1])])
    err = capsys.readouterr().err
    assert code == 2
    assert "model 'mlm'" in err and "unsupported architectures ['DebertaV2ForMaskedLM']" in err
    assert "DebertaV2ForTokenClassification" in err  # the refusal lists what is served
    assert all(_bindable(p) for p in ports)
