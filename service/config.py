"""Server configuration: read in this one place (YAML file + CLI overrides), validated, then passed down.

Precedence: built-in defaults < ``--config FILE`` < command-line flags. Models come from the file's
``models:`` section and from ``--model NAME=DIR[,key=value...]`` (a CLI entry with the same name as a
file entry replaces it). With no model anywhere, the default models shipped in ``<repo>/defaults/`` are
served (``sentiment`` and ``qa``, plus ``translate-de-en`` and ``translate-de-en-deberta`` when their
directories exist).

Example file::

    host: 0.0.0.0
    port: 50051
    metrics_port: 8002
    max_receive_message_length: 4194304   # bytes
    max_send_message_length: 4194304
    drain_timeout: 30                     # seconds
    models:
      - name: sentiment
        path: defaults/sentiment          # relative paths are relative to the config file
        device: auto                      # auto | cpu | cuda | cuda:N
        dtype: float32                    # float16 / bfloat16 only on CUDA
        max_batch_size: 32
        max_batch_tokens: 8192            # padded tokens: batch size x longest sequence
        max_queue_delay: 0.005            # seconds
        max_queue_size: 1024              # units (sequences / QA windows) waiting
        length_bucketing: true            # false: batches in arrival order (more padding)
        backend: torch                    # torch | onnx (ONNX Runtime) | auto (onnx when onnxruntime is installed)
        onnx_cache_dir: null              # exported graphs, keyed by checkpoint hash (default: $XDG_CACHE_HOME/
                                          #   relserve/onnx, or /tmp/relserve-cache without XDG_CACHE_HOME)
        onnx_intra_op_threads: 0          # ONNX Runtime intra-op threads (0: its default, one per core)
        onnx_graph_optimization: all      # disable | basic | extended | all
        onnx_parity_tolerance: 0.001      # graph vs torch on the warm-up batch at load; worse refuses to serve
      - name: qa
        path: defaults/qa
        max_seq_len: 384
        doc_stride: 128
        max_answer_len: 30
      - name: translate-de-en           # an RNNsearch directory (config.json model_type "rnnsearch")
        path: defaults/translate-de-en
        scheduling: iteration             # iteration (join/leave between decoder steps) | request
        max_active_hypotheses: 256        # beam hypotheses decoded together per step
        max_source_tokens: 256            # longer sources are INVALID_ARGUMENT
        beam_size: 5                      # default when a request sends 0
        max_len_a: 2.0                    # default max_length = min(int(a * source_tokens + b), max_output_tokens)
        max_len_b: 10
        max_output_tokens: 256            # the largest max_length a request may ask for
        length_penalty: 1.0               # ranking: log_prob / num_tokens ** length_penalty

This module does not import torch: whether CUDA exists is decided by the backend at load time, which
calls :func:`check_dtype_for_device` once ``device: auto`` is resolved.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import ConfigError

MIB = 1024 * 1024
DEFAULTS_DIR = Path(__file__).resolve().parents[1] / "defaults"
DEFAULT_MODELS: tuple[tuple[str, str], ...] = (("sentiment", "sentiment"), ("qa", "qa"))
# Served by default only when their directory exists (translation models are produced separately).
OPTIONAL_DEFAULT_MODELS: tuple[tuple[str, str], ...] = (
    ("translate-de-en", "translate-de-en"), ("translate-de-en-deberta", "translate-de-en-deberta"),
)
SCHEDULING = ("iteration", "request")
MAX_BEAM_SIZE = 16

BACKENDS = ("torch", "onnx", "auto")
ONNX_GRAPH_OPTIMIZATIONS = ("disable", "basic", "extended", "all")
DTYPES = ("float32", "float16", "bfloat16")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
DEFAULT_MAX_SEQ_LEN_CAP = 512


@dataclass(frozen=True)
class ModelConfig:
    """One served model. ``max_seq_len`` None means min(model's max positions, 512), resolved at load."""

    name: str
    path: Path
    backend: str = "torch"
    device: str = "auto"
    dtype: str = "float32"
    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_queue_delay: float = 0.005
    max_queue_size: int = 1024
    max_seq_len: int | None = None
    doc_stride: int = 128
    max_answer_len: int = 30
    instances: int = 1
    warmup: bool = True
    length_bucketing: bool = True  # batch similar lengths together (false: plain arrival order)
    # ONNX Runtime backend (backend: onnx | auto)
    onnx_cache_dir: Path | None = None  # None: default_onnx_cache_dir()
    onnx_intra_op_threads: int = 0
    onnx_graph_optimization: str = "all"
    onnx_parity_tolerance: float = 1e-3
    # translation (RNNsearch) models only
    scheduling: str = "iteration"
    max_active_hypotheses: int = 256
    max_source_tokens: int = 256
    beam_size: int = 5
    max_len_a: float = 2.0
    max_len_b: int = 10
    max_output_tokens: int = 256
    length_penalty: float = 1.0

    def resolved_max_seq_len(self, model_max: int | None) -> int:
        """The sequence length fed to the model: the configured one, else min(model max, 512).

        Raises:
            ConfigError: the configured value exceeds what the model's position table allows.
        """
        if self.max_seq_len is None:
            return min(model_max, DEFAULT_MAX_SEQ_LEN_CAP) if model_max else DEFAULT_MAX_SEQ_LEN_CAP
        if model_max and self.max_seq_len > model_max:
            raise ConfigError(
                f"model {self.name!r}: max_seq_len {self.max_seq_len} exceeds the model's maximum of "
                f"{model_max} positions"
            )
        return self.max_seq_len

    def resolved_onnx_cache_dir(self) -> Path:
        return self.onnx_cache_dir if self.onnx_cache_dir is not None else default_onnx_cache_dir()


def default_onnx_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/relserve/onnx``, or ``/tmp/relserve-cache/onnx`` when XDG_CACHE_HOME is unset."""
    import os

    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME")
    return Path(base) / "relserve" / "onnx" if base else Path("/tmp/relserve-cache") / "onnx"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int | None = 8002  # 0 picks a free port; None (or negative) disables /metrics
    max_receive_message_length: int = 4 * MIB
    max_send_message_length: int = 4 * MIB
    drain_timeout: float = 30.0
    log_level: str = "INFO"
    models: tuple[ModelConfig, ...] = field(default_factory=tuple)

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


_SERVER_KEYS = {f.name for f in dataclasses.fields(ServerConfig)}
_MODEL_KEYS = {f.name for f in dataclasses.fields(ModelConfig)}
_MODEL_TYPES: dict[str, type] = {
    "name": str, "path": str, "backend": str, "device": str, "dtype": str,
    "max_batch_size": int, "max_batch_tokens": int, "max_queue_delay": float, "max_queue_size": int,
    "max_seq_len": int, "doc_stride": int, "max_answer_len": int, "instances": int, "warmup": bool,
    "length_bucketing": bool,
    "onnx_cache_dir": str, "onnx_intra_op_threads": int, "onnx_graph_optimization": str,
    "onnx_parity_tolerance": float,
    "scheduling": str, "max_active_hypotheses": int, "max_source_tokens": int, "beam_size": int,
    "max_len_a": float, "max_len_b": int, "max_output_tokens": int, "length_penalty": float,
}
_SERVER_TYPES: dict[str, type] = {
    "host": str, "port": int, "metrics_port": int, "max_receive_message_length": int,
    "max_send_message_length": int, "drain_timeout": float, "log_level": str,
}


def check_dtype_for_device(model: str, dtype: str, device: str) -> None:
    """float16/bfloat16 only run on CUDA here; say so clearly instead of failing inside a matmul.

    Raises:
        ConfigError: a half-precision dtype with a non-CUDA device.
    """
    if dtype != "float32" and not device.startswith("cuda"):
        raise ConfigError(
            f"model {model!r}: dtype {dtype} needs a CUDA device, but the device is {device!r}; "
            f"use dtype float32 on CPU"
        )


def _coerce(where: str, key: str, value: Any, typ: type) -> Any:
    if value is None and key in ("max_seq_len", "metrics_port", "onnx_cache_dir"):
        return None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {key} must be an integer, got {value!r}") from None
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {key} must be a number, got {value!r}") from None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key} must be a string, got {value!r}")
    return value


def _model_from_mapping(raw: Mapping[str, Any], base_dir: Path, where: str) -> ModelConfig:
    unknown = set(raw) - _MODEL_KEYS
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_MODEL_KEYS)}"
        )
    for key in ("name", "path"):
        if key not in raw or raw[key] in (None, ""):
            raise ConfigError(f"{where}: {key!r} is required")
    values = {k: _coerce(where, k, v, _MODEL_TYPES[k]) for k, v in raw.items()}
    path = Path(values["path"]).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    values["path"] = path
    if values.get("onnx_cache_dir") is not None:
        if not str(values["onnx_cache_dir"]).strip():
            raise ConfigError(f"{where}: onnx_cache_dir is empty; give a directory, or leave the key out for the "
                              f"default cache")
        cache = Path(values["onnx_cache_dir"]).expanduser()
        values["onnx_cache_dir"] = cache if cache.is_absolute() else base_dir / cache
    return validate_model(ModelConfig(**values))


def validate_model(m: ModelConfig) -> ModelConfig:
    """Check one model entry; returns it unchanged.

    Raises:
        ConfigError: naming the model, the key, the value and the allowed range.
    """
    where = f"model {m.name!r}"
    if not _NAME_RE.match(m.name):
        raise ConfigError(f"{where}: name must match {_NAME_RE.pattern}")
    if not m.path.is_dir():
        raise ConfigError(f"{where}: path {str(m.path)!r} is not a directory")
    if m.backend not in BACKENDS:
        raise ConfigError(f"{where}: backend {m.backend!r} is not one of {list(BACKENDS)}")
    if not _DEVICE_RE.match(m.device):
        raise ConfigError(f"{where}: device {m.device!r} must be auto, cpu, cuda or cuda:N")
    if m.dtype not in DTYPES:
        raise ConfigError(f"{where}: dtype {m.dtype!r} is not one of {list(DTYPES)}")
    if m.device == "cpu":
        check_dtype_for_device(m.name, m.dtype, m.device)
    if m.backend == "onnx" and m.dtype != "float32":
        raise ConfigError(f"{where}: the onnx backend runs float32 graphs only, got dtype {m.dtype}; use backend "
                          f"torch for half precision")
    positive = ("max_batch_size", "max_batch_tokens", "max_queue_size", "doc_stride", "max_answer_len")
    for key in positive:
        if getattr(m, key) < 1:
            raise ConfigError(f"{where}: {key} must be >= 1, got {getattr(m, key)}")
    if m.max_queue_delay < 0 or m.max_queue_delay > 10:
        raise ConfigError(f"{where}: max_queue_delay must be between 0 and 10 seconds, got {m.max_queue_delay}")
    if m.max_seq_len is not None:
        if m.max_seq_len < 8:
            raise ConfigError(f"{where}: max_seq_len must be >= 8, got {m.max_seq_len}")
        if m.doc_stride >= m.max_seq_len:
            raise ConfigError(
                f"{where}: doc_stride {m.doc_stride} must be smaller than max_seq_len {m.max_seq_len}"
            )
        if m.max_batch_tokens < m.max_seq_len:
            raise ConfigError(
                f"{where}: max_batch_tokens {m.max_batch_tokens} must be >= max_seq_len {m.max_seq_len} "
                f"so that one full-length sequence fits in a batch"
            )
    if m.onnx_graph_optimization not in ONNX_GRAPH_OPTIMIZATIONS:
        raise ConfigError(f"{where}: onnx_graph_optimization {m.onnx_graph_optimization!r} is not one of "
                          f"{list(ONNX_GRAPH_OPTIMIZATIONS)}")
    if m.onnx_intra_op_threads < 0:
        raise ConfigError(f"{where}: onnx_intra_op_threads must be >= 0 (0: ONNX Runtime's default), got "
                          f"{m.onnx_intra_op_threads}")
    if not m.onnx_parity_tolerance > 0:
        raise ConfigError(f"{where}: onnx_parity_tolerance must be > 0, got {m.onnx_parity_tolerance}")
    if m.scheduling not in SCHEDULING:
        raise ConfigError(f"{where}: scheduling {m.scheduling!r} is not one of {list(SCHEDULING)}")
    for key in ("max_active_hypotheses", "max_source_tokens", "max_output_tokens"):
        if getattr(m, key) < 1:
            raise ConfigError(f"{where}: {key} must be >= 1, got {getattr(m, key)}")
    if not 1 <= m.beam_size <= MAX_BEAM_SIZE:
        raise ConfigError(f"{where}: beam_size must be between 1 and {MAX_BEAM_SIZE}, got {m.beam_size}")
    if m.max_len_a < 0 or m.max_len_b < 0:
        raise ConfigError(f"{where}: max_len_a and max_len_b must be >= 0, got {m.max_len_a} and {m.max_len_b}")
    if not 0 <= m.length_penalty <= 10:
        raise ConfigError(f"{where}: length_penalty must be between 0 and 10, got {m.length_penalty}")
    if m.instances != 1:
        raise ConfigError(f"{where}: instances must be 1 (several instances per model are not supported yet)")
    return m


def parse_model_spec(spec: str, base_dir: Path | None = None) -> dict[str, Any]:
    """``NAME=DIR[,key=value...]`` (the ``--model`` flag) -> a raw model mapping.

    Raises:
        ConfigError: the spec is malformed.
    """
    head, *rest = spec.split(",")
    if "=" not in head:
        raise ConfigError(f"--model {spec!r}: expected NAME=DIR[,key=value...]")
    name, path = (s.strip() for s in head.split("=", 1))
    raw: dict[str, Any] = {"name": name, "path": path}
    for item in rest:
        if "=" not in item:
            raise ConfigError(f"--model {spec!r}: option {item!r} is not key=value")
        key, value = (s.strip() for s in item.split("=", 1))
        if key in ("name", "path"):
            raise ConfigError(f"--model {spec!r}: {key} is given by NAME=DIR, not as an option")
        raw[key] = value
    return raw


def load_config(
    config_file: str | Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    model_specs: Sequence[str] = (),
    defaults_dir: Path = DEFAULTS_DIR,
) -> ServerConfig:
    """Build the one :class:`ServerConfig` of a process.

    Args:
        config_file: YAML file (optional).
        overrides: server-level keys from the command line; None values are ignored.
        model_specs: ``--model NAME=DIR[,key=value...]`` strings; relative DIRs are relative to the cwd.
        defaults_dir: where the built-in default models live (``<repo>/defaults``).

    Raises:
        ConfigError: anything invalid, with a message naming the key and the allowed values.
    """
    raw: dict[str, Any] = {}
    base_dir = Path.cwd()
    if config_file is not None:
        path = Path(config_file)
        try:
            import yaml

            loaded = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r}: top level must be a mapping")
        raw = dict(loaded)
        base_dir = path.resolve().parent

    models_raw = raw.pop("models", None) or []
    if isinstance(models_raw, dict):  # also accept {name: {path: ..., ...}}
        models_raw = [{"name": k, **(v or {})} for k, v in models_raw.items()]
    if not isinstance(models_raw, list):
        raise ConfigError("models must be a list of model entries")

    unknown = set(raw) - (_SERVER_KEYS - {"models"})
    if unknown:
        raise ConfigError(f"config: unknown key(s) {sorted(unknown)}; allowed: {sorted(_SERVER_KEYS)}")
    for key, value in (overrides or {}).items():
        if value is not None:
            if key not in _SERVER_TYPES:
                raise ConfigError(f"unknown server option {key!r}")
            raw[key] = value
    server_values = {k: _coerce("config", k, v, _SERVER_TYPES[k]) for k, v in raw.items()}

    models: dict[str, ModelConfig] = {}
    for i, entry in enumerate(models_raw):
        if not isinstance(entry, dict):
            raise ConfigError(f"models[{i}] must be a mapping with at least name and path")
        m = _model_from_mapping(entry, base_dir, f"models[{i}] ({entry.get('name', '?')})")
        if m.name in models:
            raise ConfigError(f"model name {m.name!r} appears twice in models")
        models[m.name] = m
    from_cli: set[str] = set()
    for spec in model_specs:
        m = _model_from_mapping(parse_model_spec(spec), Path.cwd(), f"--model {spec!r}")
        if m.name in from_cli:
            raise ConfigError(f"--model names must be unique: {m.name!r} is given twice")
        from_cli.add(m.name)
        models[m.name] = m  # the command line replaces a file entry of the same name
    if not models:
        for name, sub in DEFAULT_MODELS:
            path = defaults_dir / sub
            if not path.is_dir():
                raise ConfigError(
                    f"no model configured and the default model directory {str(path)!r} is missing; "
                    f"pass --model NAME=DIR or a config file with models"
                )
            models[name] = validate_model(ModelConfig(name=name, path=path))
        for name, sub in OPTIONAL_DEFAULT_MODELS:
            path = defaults_dir / sub
            if (path / "config.json").is_file():
                models[name] = validate_model(ModelConfig(name=name, path=path))

    cfg = ServerConfig(**server_values, models=tuple(models.values()))
    return validate_server(cfg)


def validate_server(cfg: ServerConfig) -> ServerConfig:
    """Raises ConfigError for out-of-range server keys; returns cfg (metrics_port < 0 becomes None)."""
    if not 0 <= cfg.port <= 65535:
        raise ConfigError(f"port must be between 0 and 65535, got {cfg.port}")
    if cfg.metrics_port is not None and cfg.metrics_port < 0:
        cfg = dataclasses.replace(cfg, metrics_port=None)
    if cfg.metrics_port is not None and cfg.metrics_port > 65535:
        raise ConfigError(f"metrics_port must be between 0 and 65535, got {cfg.metrics_port}")
    for key in ("max_receive_message_length", "max_send_message_length"):
        if getattr(cfg, key) < 1024:
            raise ConfigError(f"{key} must be at least 1024 bytes, got {getattr(cfg, key)}")
    if cfg.drain_timeout < 0:
        raise ConfigError(f"drain_timeout must be >= 0 seconds, got {cfg.drain_timeout}")
    if cfg.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"log_level {cfg.log_level!r} is not a logging level name")
    names = [m.name for m in cfg.models]
    if len(set(names)) != len(names):
        raise ConfigError(f"model names must be unique, got {names}")
    return cfg
