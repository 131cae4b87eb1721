"""Checks of a built ServerConfig / ModelConfig: each key's bounds and choices as the schema declares them, and
the rules between keys. Every refusal is a ConfigError naming the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any

from relserve.models.architectures import DEFAULT_MODEL_TYPE, model_type_problem, served_architecture

from ..auth import check_tls_files, read_tokens
from ..cpu_features import CPU_BF16_ENV, bf16_support, cpu_bf16_mode
from ..errors import ConfigError
from .schema import (
    DEVICE_RE, LOG_LEVELS, MIB, MODEL_KEYS, NAME_RE, SERVER_KEYS, KeySpec, ModelConfig, ServerConfig, check_doc_stride,
)


def _check(specs: dict[str, KeySpec], cfg: Any, prefix: str, *names: str) -> None:
    """Each named key's declared bounds or choices; None passes (the loader has refused null where it is not
    allowed, and an unset doc_stride is resolved at load)."""
    for name in names:
        spec, value = specs[name], getattr(cfg, name)
        if value is None:
            continue
        if spec.bounds is not None and not spec.bounds.contains(value):
            b = spec.bounds
            raise ConfigError(f"{prefix}{name} must be {b.phrase()}{b.unit}{b.note}, got {value}")
        if spec.choices is not None and value not in spec.choices:
            raise ConfigError(f"{prefix}{name} {value!r} is not one of {list(spec.choices)}{spec.choices_note}")


def check_dtype_for_device(model: str, dtype: str, device: str) -> None:
    """float16 runs on CUDA only, bfloat16 on CUDA or on a CPU that runs it natively
    (:func:`relserve.service.cpu_features.bf16_support`: AVX512-BF16 / AMX-BF16, or ``RELSERVE_CPU_BF16=assume``);
    say so clearly instead of serving an emulated, slower-than-float32 model. ``auto`` and float32 run anywhere.
    The backend calls it once ``device: auto`` is resolved.

    Raises:
        ConfigError: float16 off CUDA; bfloat16 on a CPU without native support (naming the missing feature).
    """
    if dtype in ("auto", "float32", "int8") or device.startswith("cuda"):
        return  # int8: the onnx backend's, on its CPU provider (validate_model refuses the rest)
    if dtype == "bfloat16":
        supported, why = bf16_support()
        if not supported:
            raise ConfigError(
                f"model {model!r}: dtype bfloat16 on CPU needs a CPU with AVX512-BF16 or AMX-BF16, but {why}; "
                f"use dtype auto or float32 (or set {CPU_BF16_ENV}=assume to run it emulated anyway)"
            )
        return
    raise ConfigError(
        f"model {model!r}: dtype {dtype} needs a CUDA device, but the device is {device!r}; "
        f"use dtype auto or float32 on CPU (bfloat16 where the CPU has AVX512-BF16 or AMX-BF16)"
    )


def validate_model(m: ModelConfig) -> ModelConfig:
    """Check one model entry; returns it unchanged.

    Raises:
        ConfigError: naming the model, the key, the value and the allowed range.
    """
    where = f"model {m.name!r}"
    prefix = f"{where}: "

    def check(*names: str) -> None:
        _check(MODEL_KEYS, m, prefix, *names)

    if not NAME_RE.match(m.name):
        raise ConfigError(f"{where}: name must match {NAME_RE.pattern}")
    if not m.path.is_dir():
        raise ConfigError(f"{where}: path {str(m.path)!r} is not a directory")
    check("backend")
    if not DEVICE_RE.match(m.device):
        raise ConfigError(f"{where}: device {m.device!r} must be auto, cpu, cuda or cuda:N")
    check("dtype")
    if m.dtype in ("auto", "bfloat16") and not m.device.startswith("cuda"):
        # read at load (device auto may resolve to the CPU), where a bad RELSERVE_CPU_BF16 would only fail after
        # the port is bound (exit 1); refuse it here with the other configuration errors (exit 2)
        try:
            cpu_bf16_mode()
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if m.device == "cpu":
        check_dtype_for_device(m.name, m.dtype, m.device)
    if m.dtype == "int8" and m.backend != "onnx":
        raise ConfigError(f"{where}: dtype int8 needs backend onnx (int8 is ONNX Runtime's dynamic quantization of "
                          f"the exported graph; the torch backend has no int8 path), got backend {m.backend}")
    if m.dtype == "int8" and m.device.startswith("cuda"):
        raise ConfigError(f"{where}: dtype int8 runs on ONNX Runtime's CPU provider only (dynamically quantized "
                          f"MatMulInteger graphs), got device {m.device!r}; use device cpu or auto")
    if m.onnx_path is not None and m.backend == "torch":
        raise ConfigError(f"{where}: onnx_path {str(m.onnx_path)!r} is served by backend onnx, but the backend is "
                          f"torch; set backend: onnx, or leave onnx_path out")
    if m.backend == "onnx" and m.dtype not in ("auto", "float32", "int8"):
        raise ConfigError(f"{where}: the onnx backend runs float32 graphs only (and int8 ones, dtype: int8), got "
                          f"dtype {m.dtype}; use backend torch for half precision")
    check("dtype_gate_agreement", "dtype_gate_max_prob_diff", "dtype_gate_items",
          "max_batch_size", "max_batch_tokens", "max_queue_size", "doc_stride", "max_answer_len",
          "max_request_texts", "max_request_chars", "max_qa_windows", "max_candidate_labels", "max_rerank_texts",
          "max_request_batch_share", "max_batch_time_ms", "max_queue_delay", "max_seq_len")
    if m.max_seq_len is not None:
        if m.doc_stride is not None:
            check_doc_stride(where, m.doc_stride, m.max_seq_len)
        if m.max_batch_tokens < m.max_seq_len:
            raise ConfigError(
                f"{where}: max_batch_tokens {m.max_batch_tokens} must be >= max_seq_len {m.max_seq_len} "
                f"so that one full-length sequence fits in a batch"
            )
    check("onnx_graph_optimization", "onnx_intra_op_threads", "torch_intra_op_threads", "spm_normalization",
          "onnx_parity_tolerance", "onnx_parity_rtol", "scheduling", "encode_batch_delay_ms",
          "max_active_hypotheses", "max_source_tokens", "max_output_tokens", "beam_size")
    len_a, len_b = MODEL_KEYS["max_len_a"].bounds, MODEL_KEYS["max_len_b"].bounds
    if not (len_a.contains(m.max_len_a) and len_b.contains(m.max_len_b)):
        raise ConfigError(f"{where}: max_len_a must be {len_a.phrase()} and max_len_b {len_b.phrase()}, got "
                          f"{m.max_len_a} and {m.max_len_b}")
    check("length_penalty", "instances", "decode_instances")
    if m.decode_instances and not m.worker_process:
        raise ConfigError(f"{where}: decode_instances {m.decode_instances} needs worker_process: true (the decode "
                          f"loops of a translation model run in worker processes only with it)")
    if m.instances > 1 and m.worker_process is False:
        raise ConfigError(f"{where}: instances {m.instances} needs worker_process (each instance is a worker "
                          f"process of its own; in one process the instances would share one GIL and one torch "
                          f"thread pool); set worker_process: true or instances: 1")
    return m


# the files a checkpoint directory is served from (names as models/checkpoint.py and models/tokenization read them)
_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
_TOKENIZERS = (("tokenizer.json",), ("spm.model",), ("vocab.json", "merges.txt"))
_SAFETENSORS_HEADER_MAX = 100 * MIB  # safetensors' own limit on the JSON header


def _unreadable(path: Path) -> str | None:
    """Why ``path`` is not a readable regular file (its first byte is read), or None."""
    try:
        with open(path, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return "is not a regular file"
            fh.read(1)
    except FileNotFoundError:
        return "is missing"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a safetensors file (its 8-byte header length and JSON header), or None."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > min(size - 8, _SAFETENSORS_HEADER_MAX):
                return f"is not a safetensors file (header length {n} in a file of {size} bytes)"
            header = json.loads(fh.read(n).decode("utf-8"))
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    except ValueError:
        return "is not a safetensors file (its header is not JSON)"
    return None if isinstance(header, dict) else "is not a safetensors file (its header is not a JSON object)"


def check_model_files(m: ModelConfig) -> None:
    """The files ``m`` is served from, checked before the server binds a port: the directory readable,
    ``config.json`` a readable JSON object, the weights (``model.safetensors``: its header too; or
    ``pytorch_model.bin``) and the tokenizer files readable (translation: the SentencePiece files its config
    names; encoders: ``tokenizer.json``, ``spm.model`` or ``vocab.json`` + ``merges.txt``), and an encoder's
    ``model_type`` and ``architectures`` among those served (:mod:`relserve.models.architectures`). Whether the
    weights fit the architecture is the backend's check at load. No torch.

    Raises:
        ConfigError: naming the model, the path and the problem.
    """
    where = f"model {m.name!r}"
    root = Path(m.path)
    if not root.is_dir():
        raise ConfigError(f"{where}: path {str(root)!r} is not a directory")
    try:
        names = set(os.listdir(root))
    except OSError as exc:
        raise ConfigError(f"{where}: checkpoint directory {str(root)!r} cannot be listed ({exc.strerror or exc})")
    cfg_path = root / "config.json"
    why = _unreadable(cfg_path)
    if why:
        raise ConfigError(f"{where}: {str(cfg_path)!r} {why}; a checkpoint directory needs its config.json (as "
                          f"save_pretrained writes it)")
    try:
        raw = json.loads(cfg_path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: {str(cfg_path)!r} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {str(cfg_path)!r} is not a JSON object")
    if not isinstance(raw.get("model_type", ""), str):
        raise ConfigError(f"{where}: {str(cfg_path)!r}: model_type must be a string, got {raw['model_type']!r}")
    translation = raw.get("model_type") == "rnnsearch"
    if not translation:  # the served families and heads, known by name: refused here, not after the ports are bound
        model_type = raw.get("model_type") or DEFAULT_MODEL_TYPE
        architectures = raw.get("architectures")
        problem = model_type_problem(model_type) or served_architecture(
            architectures if isinstance(architectures, list) else None, model_type)[1]
        if problem:
            raise ConfigError(f"{where}: {str(cfg_path)!r}: {problem}")
    weights = [root / n for n in (_WEIGHTS[:1] if translation else _WEIGHTS) if n in names]
    if not weights:
        raise ConfigError(f"{where}: no weights in {str(root)!r} (expected "
                          f"{' or '.join(_WEIGHTS[:1] if translation else _WEIGHTS)})")
    why = _unreadable(weights[0]) or (_safetensors_problem(weights[0]) if weights[0].suffix == ".safetensors"
                                      else None)
    if why:
        raise ConfigError(f"{where}: weights {str(weights[0])!r} {why}")
    if translation:
        files = [root / str(raw.get(k) or d) for k, d in (("source_tokenizer", "source.spm"),
                                                            ("target_tokenizer", "target.spm"))]
    else:
        files = next(([root / n for n in group] for group in _TOKENIZERS if all(n in names for n in group)), [])
        if not files:
            raise ConfigError(f"{where}: no tokenizer in {str(root)!r} (expected tokenizer.json, spm.model, or "
                              f"vocab.json + merges.txt)")
    for f in files:
        why = _unreadable(f)
        if why:
            raise ConfigError(f"{where}: tokenizer file {str(f)!r} {why}")


def validate_security(cfg: ServerConfig) -> None:
    """TLS, mTLS, token and listener keys: consistent, and every named file readable and well-formed.

    Raises:
        ConfigError: only one of tls_cert / tls_key; tls_client_ca without TLS; auth_health without
        auth_token_file; a bad port or empty address; a file that is unreadable or wrong (see
        :func:`relserve.service.auth.check_tls_files` and :func:`relserve.service.auth.read_tokens`).
    """
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        given, missing = ("tls_cert", "tls_key") if cfg.tls_cert is not None else ("tls_key", "tls_cert")
        raise ConfigError(f"{given} is set but {missing} is not: TLS needs both (--tls-cert FILE --tls-key FILE)")
    if cfg.tls_client_ca is not None and cfg.tls_cert is None:
        raise ConfigError("tls_client_ca (client certificates, mTLS) needs TLS: set tls_cert and tls_key too")
    if cfg.auth_health and cfg.auth_token_file is None:
        raise ConfigError("auth_health: true needs auth_token_file (without tokens there is nothing to require)")
    for key in ("metrics_host", "health_host", "http_host"):
        if getattr(cfg, key) is not None and not getattr(cfg, key).strip():
            raise ConfigError(f"{key} is empty; give an address, or leave the key out to use host")
    if cfg.health_port is not None:
        _check(SERVER_KEYS, cfg, "", "health_port")
        if cfg.health_port != 0 and (cfg.health_host or cfg.host) == cfg.host and cfg.health_port in (
                cfg.port, cfg.metrics_port):
            raise ConfigError(f"health_port {cfg.health_port} is already the gRPC or the metrics port")
    if cfg.http_port is not None:
        _check(SERVER_KEYS, cfg, "", "http_port")
        if cfg.http_port != 0 and (cfg.http_host or cfg.host) == cfg.host and cfg.http_port in (
                cfg.port, cfg.metrics_port, cfg.health_port):
            raise ConfigError(f"http_port {cfg.http_port} is already the gRPC, the metrics or the health port")
    if cfg.tls_cert is not None and cfg.tls_key is not None:
        check_tls_files(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
    if cfg.auth_token_file is not None:
        read_tokens(cfg.auth_token_file)


def validate_server(cfg: ServerConfig) -> ServerConfig:
    """Raises ConfigError for out-of-range server keys; returns cfg (metrics_port < 0 becomes None)."""
    _check(SERVER_KEYS, cfg, "", "port")
    if cfg.metrics_port is not None and cfg.metrics_port < 0:
        cfg = dataclasses.replace(cfg, metrics_port=None)
    _check(SERVER_KEYS, cfg, "", "metrics_port", "max_receive_message_length", "max_send_message_length",
           "drain_timeout")
    if cfg.log_level.upper() not in LOG_LEVELS:
        raise ConfigError(f"log_level {cfg.log_level!r} is not a logging level name")
    _check(SERVER_KEYS, cfg, "", "compute_scheduling", "gil_switch_interval_us")
    validate_security(cfg)
    validate_connections(cfg)
    names = [m.name for m in cfg.models]
    if len(set(names)) != len(names):
        raise ConfigError(f"model names must be unique, got {names}")
    validate_repository(cfg)
    return cfg


def validate_repository(cfg: ServerConfig) -> None:
    """The model repository keys: each repository an existing directory (checked before any port is bound), the
    mode's companions consistent, the admin token file readable.

    Raises:
        ConfigError: naming the key and the value.
    """
    _check(SERVER_KEYS, cfg, "", "model_control_mode", "repository_poll_secs", "memory_limit_mb")
    for repo in cfg.model_repositories:
        if not repo.is_dir():
            raise ConfigError(f"model_repositories: {str(repo)!r} is not a directory")
    if len(set(cfg.model_repositories)) != len(cfg.model_repositories):
        raise ConfigError(f"model_repositories lists a directory twice: {[str(r) for r in cfg.model_repositories]}")
    if cfg.model_control_mode != "none" and not cfg.model_repositories:
        raise ConfigError(f"model_control_mode {cfg.model_control_mode} needs a model repository "
                          f"(--model-repository DIR)")
    if cfg.load_models and cfg.model_control_mode != "explicit":
        raise ConfigError(f"load_models (--load-model) is for model_control_mode explicit; in mode "
                          f"{cfg.model_control_mode} every repository model loads")
    for name in cfg.load_models:
        if name != "*" and not NAME_RE.match(name):
            raise ConfigError(f"load_models: {name!r} is not a model name (it must match {NAME_RE.pattern}, or be *)")
    if cfg.admin_token_file is not None:
        read_tokens(cfg.admin_token_file, "admin_token_file")


def validate_connections(cfg: ServerConfig) -> None:
    """Check the connection-management keys (seconds).

    Raises:
        ConfigError: a negative or non-finite value, one over MAX_CONNECTION_SECONDS, a max_connection_age
            under 0.1 s (other than 0 / null: off), or keepalive_time on with keepalive_timeout 0.
    """
    _check(SERVER_KEYS, cfg, "", "max_connection_age", "max_connection_age_grace", "keepalive_time",
           "keepalive_timeout", "keepalive_min_ping_interval")
    if cfg.max_connection_age and cfg.max_connection_age < 0.1:
        raise ConfigError(f"max_connection_age must be 0 (off) or at least 0.1 seconds, got {cfg.max_connection_age}")
    if cfg.keepalive_time > 0 and cfg.keepalive_timeout <= 0:
        raise ConfigError(f"keepalive_timeout must be > 0 seconds when keepalive_time is on, got "
                          f"{cfg.keepalive_timeout}")

