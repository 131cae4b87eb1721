"""Server configuration (service/config/: schema, validation, loader): the YAML file, CLI overrides and
``--model`` specs, defaults, the ONNX Runtime and translation keys, and the errors a user gets (message names the
key and the limit). No model is loaded: model directories here are empty folders."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

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
    assert b.max_batch_size == 8 and b.warmup is False and b.max_batch_tokens == 8192 and b.doc_stride is None
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
    # the user's own cache (XDG Base Directory spec), never a world-writable /tmp path; relative XDG values ignored
    assert default_onnx_cache_dir({"HOME": "/h"}).as_posix() == "/h/.cache/relserve/onnx"
    assert default_onnx_cache_dir({"XDG_CACHE_HOME": "rel", "HOME": "/h"}).as_posix() == "/h/.cache/relserve/onnx"
    assert default_onnx_cache_dir({}) == Path.home() / ".cache" / "relserve" / "onnx"


def test_onnx_parity_rtol_key(tmp_path):
    m = load_config(model_specs=[f"a={tmp_path}"]).model("a")
    assert (m.onnx_parity_tolerance, m.onnx_parity_rtol) == (1e-3, 1e-4)
    m = load_config(model_specs=[f"a={tmp_path},onnx_parity_tolerance=1e-5,onnx_parity_rtol=0"]).model("a")
    assert (m.onnx_parity_tolerance, m.onnx_parity_rtol) == (1e-5, 0.0)
    for bad in ("-1e-4", "1", "nan"):
        with pytest.raises(ConfigError, match=r"onnx_parity_rtol must be >= 0 and < 1 .* got"):
            load_config(model_specs=[f"a={tmp_path},onnx_parity_rtol={bad}"])


def test_max_request_batch_share(tmp_path):
    assert load_config(model_specs=[f"a={tmp_path}"]).model("a").max_request_batch_share == 0.5
    m = load_config(model_specs=[f"a={tmp_path},max_request_batch_share=1"]).model("a")
    assert m.max_request_batch_share == 1.0


def test_doc_stride_unset_is_128_or_the_limit_explicit_is_checked(tmp_path):
    # unset: 128, lowered to (max_seq_len - 4) // 2 for a short window instead of refusing to load
    m = load_config(model_specs=[f"a={tmp_path},max_seq_len=128"]).model("a")
    assert m.doc_stride is None
    assert (m.resolved_doc_stride(128), m.resolved_doc_stride(260), m.resolved_doc_stride(512)) == (62, 128, 128)
    # explicit: kept when it fits, refused naming the limit when it does not
    m = load_config(model_specs=[f"a={tmp_path},doc_stride=100"]).model("a")
    assert m.resolved_doc_stride(512) == 100
    with pytest.raises(ConfigError, match=r"model 'a': doc_stride 100 is over the limit of 62 tokens for max_seq_len "
                                          r"128"):
        m.resolved_doc_stride(128)
    with pytest.raises(ConfigError, match="doc_stride 128 is over the limit of 62"):
        load_config(model_specs=[f"a={tmp_path},max_seq_len=128,doc_stride=128"])
    with pytest.raises(ConfigError, match="doc_stride must be >= 1"):
        load_config(model_specs=[f"a={tmp_path},doc_stride=0"])


def test_request_limit_keys(tmp_path):
    m = load_config(model_specs=[f"a={tmp_path}"]).model("a")
    assert (m.max_request_texts, m.max_request_chars, m.max_qa_windows) == (256, 1_000_000, 64)
    m = load_config(model_specs=[f"a={tmp_path},max_request_texts=8,max_request_chars=5000,max_qa_windows=4,"
                                 f"max_seq_len=128,doc_stride=62"]).model("a")
    assert (m.max_request_texts, m.max_request_chars, m.max_qa_windows, m.doc_stride) == (8, 5000, 4, 62)


def test_align_to_words_key(tmp_path):
    assert load_config(model_specs=[f"a={tmp_path}"]).model("a").align_to_words is True  # the pipeline's default
    assert load_config(model_specs=[f"a={tmp_path},align_to_words=false"]).model("a").align_to_words is False
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"models:\n  - name: a\n    path: {tmp_path}\n    align_to_words: false\n")
    assert load_config(cfg).model("a").align_to_words is False


def test_spm_normalization_key(tmp_path):
    from relserve.models.tokenization import SPM_NORMALIZATIONS as TOKENIZER_CHOICES
    from relserve.service.config import SPM_NORMALIZATIONS

    assert SPM_NORMALIZATIONS == TOKENIZER_CHOICES  # config keeps its own copy (it must not import models/)
    assert load_config(model_specs=[f"a={tmp_path}"]).model("a").spm_normalization == "spm"
    m = load_config(model_specs=[f"a={tmp_path},spm_normalization=transformers5"]).model("a")
    assert m.spm_normalization == "transformers5"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"models:\n  - name: a\n    path: {tmp_path}\n    spm_normalization: transformers5\n")
    assert load_config(cfg).model("a").spm_normalization == "transformers5"


def test_translation_keys(tmp_path):
    m = load_config(model_specs=[f"de-en={tmp_path},scheduling=request,max_active_hypotheses=64"]).model("de-en")
    assert (m.scheduling, m.max_active_hypotheses, m.beam_size, m.max_source_tokens) == ("request", 64, 5, 256)
    assert m.encode_batch_delay_ms == 2.0
    held = load_config(model_specs=[f"de-en={tmp_path},encode_batch_delay_ms=0.5"]).model("de-en")
    assert held.encode_batch_delay_ms == 0.5


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
    ("a={d},dtype=int8", "dtype int8 needs backend onnx (int8 is ONNX Runtime's dynamic quantization"),
    ("a={d},backend=auto,dtype=int8", "dtype int8 needs backend onnx"),
    ("a={d},backend=onnx,dtype=int8,device=cuda", "dtype int8 runs on ONNX Runtime's CPU provider only"),
    ("a={d},backend=onnx,onnx_cache_dir=", "onnx_cache_dir is empty"),
    ("a={d},scheduling=sometimes", "scheduling 'sometimes'"),
    ("a={d},beam_size=17", "beam_size"),
    ("a={d},max_active_hypotheses=0", "max_active_hypotheses"),
    ("a={d},encode_batch_delay_ms=-1", "encode_batch_delay_ms must be between 0 and 1000 ms"),
    ("a={d},encode_batch_delay_ms=5000", "encode_batch_delay_ms must be between 0 and 1000 ms"),
    ("a={d},max_request_batch_share=0", "max_request_batch_share must be > 0 and <= 1"),
    ("a={d},max_request_batch_share=1.5", "max_request_batch_share must be > 0 and <= 1"),
    ("a={d},max_request_batch_share=half", "max_request_batch_share must be a number"),
    ("a={d},max_request_texts=0", "max_request_texts must be >= 1"),
    ("a={d},max_request_chars=0", "max_request_chars must be >= 1"),
    ("a={d},max_qa_windows=0", "max_qa_windows must be >= 1"),
    ("a={d},max_qa_windows=many", "max_qa_windows must be an integer"),
    ("a={d},align_to_words=maybe", "align_to_words must be true or false, got 'maybe'"),
    ("a={d},spm_normalization=nfkc", "spm_normalization 'nfkc' is not one of ['spm', 'transformers5']"),
    ("a={d},max_seq_len=128,doc_stride=63", "doc_stride 63 is over the limit of 62 tokens for max_seq_len 128"),
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


def test_int8_with_backend_torch_exits_2(tmp_path, capsys):
    """dtype int8 is the onnx backend's; with backend torch it is a configuration error (exit 2) naming the fix,
    and with backend onnx the same entry validates."""
    from relserve.service.main import main

    assert main(["serve", "--port", "0", "--model", f"a={tmp_path},dtype=int8,backend=torch"]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "dtype int8 needs backend onnx" in err and "got backend torch" in err
    assert load_config(model_specs=[f"a={tmp_path},dtype=int8,backend=onnx"]).model("a").dtype == "int8"


def test_bad_cpu_bf16_env_is_a_config_error_for_auto_and_bfloat16(tmp_path, monkeypatch):
    """A RELSERVE_CPU_BF16 typo with dtype auto on device auto used to pass validation and fail only at model
    load, after the gRPC port was bound (exit 1); it is a configuration error (exit 2) now. Where the variable is
    never read (float32, or an explicit CUDA device) it stays ignored."""
    monkeypatch.setenv("RELSERVE_CPU_BF16", "yes")
    for spec in (f"a={tmp_path}", f"a={tmp_path},device=cpu", f"a={tmp_path},dtype=bfloat16"):
        with pytest.raises(ConfigError, match=r"model 'a': RELSERVE_CPU_BF16='yes' is not one of"):
            load_config(model_specs=[spec])
    assert load_config(model_specs=[f"a={tmp_path},dtype=float32"]).model("a").dtype == "float32"
    assert load_config(model_specs=[f"a={tmp_path},device=cuda"]).model("a").device == "cuda"
    proc = subprocess.run([sys.executable, "-m", "relserve.service.main", "serve", "--port", "0", "--metrics-port",
                           "0", "--model", f"a={tmp_path}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "RELSERVE_CPU_BF16='yes' is not one of" in proc.stderr


# ---------------------------------------------------------------------- transport security and auth


@pytest.fixture
def pki(tmp_path):
    from fixtures.tls import make_pki

    return make_pki(tmp_path / "pki")


def test_security_keys_from_file_are_relative_to_it(tmp_path, pki, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "pki" / "tokens").write_text("# comment\n\n  tok-1  \ntok-2\n")
    cfg_file = tmp_path / "relserve.yaml"
    cfg_file.write_text(textwrap.dedent(f"""
        tls_cert: pki/{pki.server_cert.name}
        tls_key: pki/{pki.server_key.name}
        tls_client_ca: {pki.ca_cert}
        auth_token_file: pki/tokens
        auth_health: true
        reflection: false
        metrics_host: 127.0.0.1
        health_port: 8081
        health_host: 0.0.0.0
        models: [{{name: a, path: m}}]
    """))
    monkeypatch.chdir(tmp_path / "m")  # relative paths follow the file, not the working directory
    cfg = load_config(cfg_file)
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) == (pki.server_cert, pki.server_key, pki.ca_cert)
    assert cfg.auth_token_file == tmp_path / "pki" / "tokens" and cfg.auth_health is True
    assert cfg.reflection is False and cfg.metrics_host == "127.0.0.1"
    assert (cfg.health_port, cfg.health_host) == (8081, "0.0.0.0")
    # command-line paths are relative to the working directory
    monkeypatch.chdir(tmp_path / "pki")
    flags = load_config(cfg_file, overrides={"tls_cert": pki.server_cert.name, "reflection": True})
    assert flags.tls_cert == pki.server_cert and flags.reflection is True


def test_security_defaults(tmp_path):
    cfg = load_config(model_specs=[f"a={tmp_path}"])
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca, cfg.auth_token_file) == (None, None, None, None)
    assert cfg.reflection is True and cfg.auth_health is False
    assert (cfg.metrics_host, cfg.health_port, cfg.health_host) == (None, None, None)


def test_token_file_parsing(tmp_path):
    from relserve.service.auth import read_tokens

    path = tmp_path / "tokens"
    path.write_text("# ops team\n\nabc\n   # indented comment\n  def  \r\nabc\n")
    assert read_tokens(path) == (b"abc", b"def", b"abc")


@pytest.mark.parametrize("overrides, fragment", [
    ({"tls_cert": "{server_cert}"}, "tls_cert is set but tls_key is not"),
    ({"tls_key": "{server_key}"}, "tls_key is set but tls_cert is not"),
    ({"tls_client_ca": "{ca_cert}"}, "tls_client_ca (client certificates, mTLS) needs TLS"),
    ({"tls_cert": "{d}/missing.pem", "tls_key": "{server_key}"}, "tls_cert: cannot read"),
    ({"tls_cert": "{server_cert}", "tls_key": "{d}/missing.pem"}, "tls_key: cannot read"),
    ({"tls_cert": "{server_cert}", "tls_key": "{server_key}", "tls_client_ca": "{d}/missing.pem"},
     "tls_client_ca: cannot read"),
    ({"tls_cert": "{server_key}", "tls_key": "{server_key}"}, "holds no PEM certificate"),
    ({"tls_cert": "{server_cert}", "tls_key": "{server_cert}"}, "holds no PEM private key"),
    ({"tls_cert": "{server_cert}", "tls_key": "{other_key}"}, "the key is not the certificate's"),
    ({"tls_cert": "{server_cert}", "tls_key": "{server_key}", "tls_client_ca": "{server_key}"},
     "holds no PEM CA certificate"),
    ({"tls_cert": ""}, "tls_cert is empty"),
    ({"auth_token_file": "{d}/missing"}, "auth_token_file: cannot read"),
    ({"auth_token_file": "{d}/empty"}, "holds no token"),
    ({"auth_token_file": "{d}/comments"}, "holds no token"),
    ({"auth_token_file": "{d}/spaced"}, "line 2: a token must be printable ASCII without spaces"),
    ({"auth_health": True}, "auth_health: true needs auth_token_file"),
    ({"reflection": "maybe"}, "reflection must be true or false"),
    ({"health_port": 70000}, "health_port must be between 0 and 65535"),
    ({"health_port": 50051}, "health_port 50051 is already the gRPC or the metrics port"),
    ({"health_host": " "}, "health_host is empty"),
    ({"metrics_host": ""}, "metrics_host is empty"),
])
def test_security_config_errors_are_clear(tmp_path, pki, overrides, fragment):
    (tmp_path / "empty").write_text("")
    (tmp_path / "comments").write_text("# nothing but comments\n\n   \n")
    (tmp_path / "spaced").write_text("good-token\nsecret with spaces\n")
    paths = {"d": tmp_path, **{k: getattr(pki, k) for k in ("server_cert", "server_key", "ca_cert", "other_key")}}
    values = {k: v.format(**paths) if isinstance(v, str) else v for k, v in overrides.items()}
    with pytest.raises(ConfigError) as err:
        load_config(overrides=values, model_specs=[f"a={tmp_path}"])
    assert fragment in str(err.value)
    assert "secret with spaces" not in str(err.value)  # a token file's content is never quoted


def test_encrypted_tls_key_is_refused(tmp_path, pki):
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.server_key.read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"passphrase")))
    with pytest.raises(ConfigError, match="is encrypted; gRPC needs an unencrypted PEM key"):
        load_config(overrides={"tls_cert": str(pki.server_cert), "tls_key": str(encrypted)},
                    model_specs=[f"a={tmp_path}"])


# ---------------------------------------------------------------------- connection management

def test_connection_keys_defaults_file_and_grpc_options(tmp_path):
    from relserve.service.server import connection_options

    cfg = load_config(model_specs=[f"a={tmp_path}"])
    assert (cfg.max_connection_age, cfg.max_connection_age_grace) == (300.0, 30.0)
    assert (cfg.keepalive_time, cfg.keepalive_timeout, cfg.keepalive_min_ping_interval) == (60.0, 20.0, 10.0)
    assert cfg.keepalive_permit_without_calls is True
    assert dict(connection_options(cfg)) == {
        "grpc.max_connection_age_ms": 300_000, "grpc.max_connection_age_grace_ms": 30_000,
        "grpc.keepalive_time_ms": 60_000, "grpc.keepalive_timeout_ms": 20_000,
        "grpc.http2.min_ping_interval_without_data_ms": 10_000, "grpc.keepalive_permit_without_calls": 1,
    }
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(textwrap.dedent(f"""
        max_connection_age: null
        keepalive_time: 0
        keepalive_min_ping_interval: 2.5
        keepalive_permit_without_calls: false
        models: [{{name: a, path: {tmp_path}}}]
    """))
    off = load_config(cfg_file)
    opts = dict(connection_options(off))
    assert off.max_connection_age is None and "grpc.max_connection_age_ms" not in opts  # no GOAWAY by age
    assert opts["grpc.keepalive_time_ms"] == 2**31 - 1  # 0: the server never pings
    assert opts["grpc.http2.min_ping_interval_without_data_ms"] == 2500
    assert opts["grpc.keepalive_permit_without_calls"] == 0
    zero = load_config(cfg_file, overrides={"max_connection_age": 0})
    assert "grpc.max_connection_age_ms" not in dict(connection_options(zero))
    short = load_config(cfg_file, overrides={"max_connection_age": "1.5", "max_connection_age_grace": 0})
    assert dict(connection_options(short))["grpc.max_connection_age_ms"] == 1500


@pytest.mark.parametrize("overrides, fragment", [
    ({"max_connection_age": -1}, "max_connection_age must be between 0 and 2000000 seconds, got -1"),
    ({"max_connection_age": 0.01}, "max_connection_age must be 0 (off) or at least 0.1 seconds"),
    ({"max_connection_age": 3e6}, "max_connection_age must be between 0 and 2000000 seconds"),
    ({"max_connection_age_grace": -0.5}, "max_connection_age_grace must be between 0 and"),
    ({"keepalive_time": "nan"}, "keepalive_time must be between 0 and"),
    ({"keepalive_time": "soon"}, "keepalive_time must be a number"),
    ({"keepalive_timeout": 0}, "keepalive_timeout must be > 0 seconds when keepalive_time is on"),
    ({"keepalive_min_ping_interval": -1}, "keepalive_min_ping_interval must be between 0 and"),
    ({"keepalive_permit_without_calls": "sometimes"}, "keepalive_permit_without_calls must be true or false"),
])
def test_connection_config_errors_are_clear(tmp_path, overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides, model_specs=[f"a={tmp_path}"])
    assert fragment in str(err.value)


@pytest.mark.parametrize("value", [-1, "nan", "inf", 1e300])
def test_drain_timeout_must_be_finite_and_bounded(tmp_path, value):
    # NaN fired the exit deadline at once (exit 1 on every SIGTERM); inf / 1e300 killed the deadline
    # thread with OverflowError, so a hung drain had no backstop.
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"drain_timeout": value}, model_specs=[f"a={tmp_path}"])
    assert "drain_timeout must be between 0 and 86400 seconds" in str(err.value)
    assert load_config(overrides={"drain_timeout": 86400}, model_specs=[f"a={tmp_path}"]).drain_timeout == 86400


# ---------------------------------------------------------------------- compute scheduling (service/scheduling/cores.py)


def test_compute_keys_defaults_and_overrides(tmp_path):
    cfg = load_config(model_specs=[f"a={tmp_path}"])
    m = cfg.model("a")
    assert cfg.compute_scheduling == "partition"
    assert (m.max_batch_time_ms, m.torch_intra_op_threads) == (20.0, 0)
    cfg = load_config(overrides={"compute_scheduling": "fair"},
                      model_specs=[f"a={tmp_path},max_batch_time_ms=0,torch_intra_op_threads=3"])
    assert cfg.compute_scheduling == "fair"
    assert (cfg.model("a").max_batch_time_ms, cfg.model("a").torch_intra_op_threads) == (0.0, 3)
    (tmp_path / "c.yaml").write_text(f"compute_scheduling: shared\nmodels:\n  - name: a\n    path: {tmp_path}\n")
    assert load_config(tmp_path / "c.yaml").compute_scheduling == "shared"


@pytest.mark.parametrize("overrides, spec, fragment", [
    ({"compute_scheduling": "roundrobin"}, "a={d}",
     "compute_scheduling 'roundrobin' is not one of ['partition', 'fair', 'shared']"),
    ({}, "a={d},max_batch_time_ms=-1", "max_batch_time_ms must be between 0 (no cap) and 60000 milliseconds"),
    ({}, "a={d},max_batch_time_ms=nan", "max_batch_time_ms must be between 0 (no cap) and 60000"),
    ({}, "a={d},max_batch_time_ms=soon", "max_batch_time_ms must be a number"),
    ({}, "a={d},torch_intra_op_threads=-1", "torch_intra_op_threads must be between 0"),
    ({}, "a={d},torch_intra_op_threads=two", "torch_intra_op_threads must be an integer"),
])
def test_compute_config_errors_are_clear(tmp_path, overrides, spec, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides, model_specs=[spec.format(d=tmp_path)])
    assert fragment in str(err.value)


def test_compute_scheduling_flag(tmp_path):
    from relserve.service.main import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "--model", f"a={tmp_path}", "--compute-scheduling", "shared"])
    assert config_from_args(args).compute_scheduling == "shared"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--compute-scheduling", "sometimes"])


def test_gil_switch_interval_key_flag_and_limits(tmp_path):
    from relserve.service.main import build_parser, config_from_args

    assert load_config(model_specs=[f"a={tmp_path}"]).gil_switch_interval_us is None  # Python's own
    (tmp_path / "c.yaml").write_text(f"gil_switch_interval_us: 10\nmodels: [{{name: a, path: {tmp_path}}}]\n")
    assert load_config(tmp_path / "c.yaml").gil_switch_interval_us == 10.0
    args = build_parser().parse_args(["serve", "--model", f"a={tmp_path}", "--gil-switch-interval-us", "250"])
    assert config_from_args(args).gil_switch_interval_us == 250.0
    for bad in (0, 0.5, 2e6, float("nan")):
        with pytest.raises(ConfigError, match="gil_switch_interval_us must be between 1 and 1000000"):
            load_config(overrides={"gil_switch_interval_us": bad}, model_specs=[f"a={tmp_path}"])


@pytest.mark.parametrize("spec, fragment", [
    ("a={d},max_len_a=inf", "max_len_a must be between 0 and 100"),
    ("a={d},max_len_a=nan", "max_len_a must be between 0 and 100"),
    ("a={d},max_len_a=1.7e308", "max_len_a must be between 0 and 100"),
    ("a={d},max_len_b=" + "9" * 30, "max_len_b between 0 and 1000000"),
    ("a={d},torch_intra_op_threads=2147483648", "torch_intra_op_threads must be between 0"),
    ("a={d},onnx_intra_op_threads=100000", "onnx_intra_op_threads must be between 0"),
    ("a={d},max_queue_delay=nan", "max_queue_delay must be between 0 and 10"),
    ("a={d},onnx_parity_tolerance=inf", "onnx_parity_tolerance must be > 0 and finite"),
])
def test_model_numbers_out_of_range_are_refused_at_config_time(tmp_path, spec, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(model_specs=[spec.format(d=tmp_path)])


def test_message_limits_past_grpcs_int32_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="max_send_message_length must be between 1024 and 2147483647"):
        load_config(overrides={"max_send_message_length": 2**31}, model_specs=[f"a={tmp_path}"])
    assert load_config(overrides={"max_receive_message_length": 2**31 - 1},
                       model_specs=[f"a={tmp_path}"]).max_receive_message_length == 2**31 - 1


def test_numbers_past_float_or_int_range_are_config_errors_not_tracebacks(tmp_path):
    huge = "1" * 400  # YAML reads it as an int that float() cannot hold
    (tmp_path / "f.yaml").write_text(f"drain_timeout: {huge}\nmodels: [{{name: a, path: {tmp_path}}}]\n")
    with pytest.raises(ConfigError, match="drain_timeout must be a number"):
        load_config(tmp_path / "f.yaml")
    (tmp_path / "i.yaml").write_text(f"models: [{{name: a, path: {tmp_path}, max_queue_size: .inf}}]\n")
    with pytest.raises(ConfigError, match="max_queue_size must be an integer"):
        load_config(tmp_path / "i.yaml")


def test_http_api_keys(tmp_path):
    cfg_file = tmp_path / "relserve.yaml"
    cfg_file.write_text(f"http_port: 8080\nhttp_host: 127.0.0.1\nmodels: [{{name: a, path: {tmp_path}}}]\n")
    cfg = load_config(cfg_file)
    assert (cfg.http_port, cfg.http_host) == (8080, "127.0.0.1")
    assert load_config(cfg_file, overrides={"http_port": 9090}).http_port == 9090  # --http-port wins
    plain = load_config(model_specs=[f"a={tmp_path}"])
    assert (plain.http_port, plain.http_host) == (None, None)  # off by default
    assert load_config(overrides={"http_port": 8080, "http_host": "::1", "port": 8080},
                       model_specs=[f"a={tmp_path}"]).http_port == 8080  # another address: no clash


@pytest.mark.parametrize("overrides, fragment", [
    ({"http_port": 70000}, "http_port must be between 0 and 65535"),
    ({"http_port": -1}, "http_port must be between 0 and 65535"),
    ({"http_port": 50051}, "http_port 50051 is already the gRPC, the metrics or the health port"),
    ({"http_port": 8002}, "http_port 8002 is already the gRPC, the metrics or the health port"),
    ({"http_port": 8081, "health_port": 8081}, "http_port 8081 is already"),
    ({"http_port": "eighty"}, "http_port"),
    ({"http_host": " "}, "http_host is empty"),
])
def test_http_api_config_errors_are_clear(tmp_path, overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides, model_specs=[f"a={tmp_path}"])
    assert fragment in str(err.value)


@pytest.mark.parametrize("key, value", [
    ("max_queue_delay", "true"), ("onnx_parity_tolerance", "true"), ("max_request_batch_share", "false"),
])
def test_yaml_booleans_are_refused_for_float_model_keys(tmp_path, key, value):
    # bool is an int subclass, so float(True) == 1.0: `max_queue_delay: true` silently meant one second.
    (tmp_path / "m").mkdir()
    cfg_file = tmp_path / "relserve.yaml"
    cfg_file.write_text(f"models:\n  - name: a\n    path: m\n    {key}: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg_file)
    assert f"{key} must be a number, got {value}" in str(err.value)


def test_yaml_boolean_is_refused_for_float_server_key(tmp_path):
    (tmp_path / "m").mkdir()
    cfg_file = tmp_path / "relserve.yaml"
    cfg_file.write_text("keepalive_time: true\nmodels:\n  - name: a\n    path: m\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg_file)
    assert "keepalive_time must be a number, got true" in str(err.value)


def test_worker_process_key_is_unset_true_or_false(tmp_path):
    def models(extra: str):
        return load_config(model_specs=[f"m={tmp_path}{extra}"], defaults_dir=tmp_path / "none").models

    assert models("")[0].worker_process is None  # unset: encoder models in a worker, translation in-process
    assert models(",worker_process=true")[0].worker_process is True
    assert models(",worker_process=false")[0].worker_process is False
    with pytest.raises(ConfigError, match="worker_process must be true or false"):
        models(",worker_process=sometimes")
    (tmp_path / "c.yaml").write_text(f"models: [{{name: a, path: {tmp_path}, worker_process: null}},"
                                     f" {{name: b, path: {tmp_path}, worker_process: false}}]\n")
    assert [m.worker_process for m in load_config(tmp_path / "c.yaml").models] == [None, False]
