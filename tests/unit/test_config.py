"""Server configuration (service/config.py): the YAML file, CLI overrides and ``--model`` specs, defaults, the
ONNX Runtime and translation keys, and the errors a user gets (message names the key and the limit). No model
is loaded: model directories here are empty folders."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from relserve.service.config import MIB, ConfigError, default_onnx_cache_dir, load_config

# ---------------------------------------------------------------------- file, flags, specs, defaults


def test_config_file_cli_and_model_specs(tmp_path):
    (tmp_path / "m1").mkdir()
    (tmp_path / "m2").mkdir()
    cfg_file = tmp_path / "relserve.yaml"
    cfg_file.write_text(textwrap.dedent("""
        port: 6000
        metrics_port: 9000
        max_receive_message_length: 8388608
        models:
          - name: a
            path: m1
            max_batch_size: 4
            max_queue_delay: 0
    """))
    cfg = load_config(cfg_file, overrides={"port": 7000, "host": None},
                      model_specs=[f"b={tmp_path / 'm2'},max_batch_size=8,dtype=float32,warmup=false"])
    assert cfg.port == 7000 and cfg.metrics_port == 9000 and cfg.host == "0.0.0.0"
    assert cfg.max_receive_message_length == 8 * MIB and cfg.max_send_message_length == 4 * MIB
    a, b = cfg.model("a"), cfg.model("b")
    assert a.path == tmp_path / "m1" and a.max_batch_size == 4 and a.max_queue_delay == 0.0
    assert b.max_batch_size == 8 and b.warmup is False and b.max_batch_tokens == 8192 and b.doc_stride == 128
    assert a.resolved_max_seq_len(None) == 512 and a.resolved_max_seq_len(128) == 128


def test_config_defaults_to_builtin_models(tmp_path):
    for sub in ("sentiment", "qa"):
        (tmp_path / sub).mkdir()
    cfg = load_config(defaults_dir=tmp_path)
    assert [m.name for m in cfg.models] == ["sentiment", "qa"]
    assert cfg.port == 50051 and cfg.metrics_port == 8002 and cfg.drain_timeout == 30.0
    with pytest.raises(ConfigError, match="--model NAME=DIR"):
        load_config(defaults_dir=tmp_path / "missing")


def test_default_translation_models_only_when_built(tmp_path):
    for sub in ("sentiment", "qa", "translate-de-en"):
        (tmp_path / sub).mkdir()
    (tmp_path / "translate-de-en" / "config.json").write_text(json.dumps({"model_type": "rnnsearch"}))
    (tmp_path / "translate-de-en-deberta").mkdir()  # no config.json yet (still being produced): skipped
    assert [m.name for m in load_config(defaults_dir=tmp_path).models] == ["sentiment", "qa", "translate-de-en"]


# ---------------------------------------------------------------------- backend and model-family keys


def test_onnx_keys_and_cache_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(model_specs=[f"m={tmp_path},backend=onnx,onnx_cache_dir=c,onnx_intra_op_threads=2,"
                                   f"onnx_graph_optimization=basic"])
    m = cfg.models[0]
    assert m.backend == "onnx" and m.onnx_intra_op_threads == 2 and m.onnx_graph_optimization == "basic"
    assert m.resolved_onnx_cache_dir() == tmp_path / "c"  # relative to the working directory, made absolute
    assert default_onnx_cache_dir({"XDG_CACHE_HOME": "/x"}).as_posix() == "/x/relserve/onnx"
    assert default_onnx_cache_dir({}).as_posix() == "/tmp/relserve-cache/onnx"


def test_translation_keys(tmp_path):
    m = load_config(model_specs=[f"de-en={tmp_path},scheduling=request,max_active_hypotheses=64"]).model("de-en")
    assert (m.scheduling, m.max_active_hypotheses, m.beam_size, m.max_source_tokens) == ("request", 64, 5, 256)


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize("spec, fragment", [
    ("a={d},dtype=float16,device=cpu", "needs a CUDA device"),
    ("a={d},max_batch_size=0", "max_batch_size must be >= 1"),
    ("a={d},bogus=1", "unknown key"),
    ("a={d},backend=tensorflow", "backend 'tensorflow'"),
    ("a={d}/nope", "is not a directory"),
    ("a={d},max_seq_len=128,doc_stride=200", "doc_stride 200"),
    ("a={d},max_batch_size=lots", "must be an integer"),
    ("justaname", "NAME=DIR"),
    ("a={d},onnx_graph_optimization=max", "onnx_graph_optimization"),
    ("a={d},backend=onnx,dtype=float16", "float32 graphs only"),
    ("a={d},backend=onnx,onnx_cache_dir=", "onnx_cache_dir is empty"),
    ("a={d},scheduling=sometimes", "scheduling 'sometimes'"),
    ("a={d},beam_size=17", "beam_size"),
    ("a={d},max_active_hypotheses=0", "max_active_hypotheses"),
])
def test_config_errors_are_clear(tmp_path, spec, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(model_specs=[spec.format(d=tmp_path)])
    assert fragment in str(err.value)


def test_duplicate_model_names_on_the_command_line(tmp_path):
    with pytest.raises(ConfigError, match="given twice"):
        load_config(model_specs=[f"a={tmp_path}", f"a={tmp_path}"])


def test_cli_config_error_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "relserve.service.main", "serve", "--model", f"a={tmp_path}/missing"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is not a directory" in proc.stderr
