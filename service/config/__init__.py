"""Server configuration, read in this one place and passed down: ``schema`` declares every key once (type,
default, bounds, doc, flag), ``validation`` checks a built config, ``loader`` reads the YAML file, the
``relserve serve`` flags and a KServe model directory (``model_dir``). docs/configuration.md is generated from
the schema (``python -m relserve.service.config.docs``).
"""

from ..errors import ConfigError
from .loader import add_config_flags, config_from_args, load_config, parse_model_spec
from .schema import (
    BACKENDS, COMPUTE_SCHEDULING, DEFAULT_DOC_STRIDE, DEFAULT_MAX_SEQ_LEN_CAP, DEFAULT_MODELS, DEFAULTS_DIR,
    DTYPE_GATE_MIN_ITEMS, DTYPES, MAX_BATCH_TIME_MS, MAX_BEAM_SIZE, MAX_CONNECTION_SECONDS, MAX_DRAIN_SECONDS,
    MAX_INSTANCES, MAX_LEN_A, MAX_LEN_B, MAX_MESSAGE_BYTES, MAX_SWITCH_INTERVAL_US, MAX_THREADS, MIB, MODEL_KEYS,
    ONNX_GRAPH_OPTIMIZATIONS, OPTIONAL_DEFAULT_MODELS, SCHEDULING, SERVER_KEYS, SPM_NORMALIZATIONS, ModelConfig,
    ServerConfig, check_doc_stride, default_onnx_cache_dir, doc_stride_limit,
)
from .validation import (
    check_dtype_for_device, validate_connections, validate_model, validate_security, validate_server,
)

__all__ = [
    "BACKENDS", "COMPUTE_SCHEDULING", "DEFAULT_DOC_STRIDE", "DEFAULT_MAX_SEQ_LEN_CAP", "DEFAULT_MODELS",
    "DEFAULTS_DIR", "DTYPE_GATE_MIN_ITEMS", "DTYPES", "MAX_BATCH_TIME_MS", "MAX_BEAM_SIZE", "MAX_CONNECTION_SECONDS",
    "MAX_DRAIN_SECONDS", "MAX_INSTANCES", "MAX_LEN_A", "MAX_LEN_B", "MAX_MESSAGE_BYTES", "MAX_SWITCH_INTERVAL_US",
    "MAX_THREADS", "MIB", "MODEL_KEYS", "ONNX_GRAPH_OPTIMIZATIONS", "OPTIONAL_DEFAULT_MODELS", "SCHEDULING",
    "SERVER_KEYS", "SPM_NORMALIZATIONS", "ConfigError", "ModelConfig", "ServerConfig", "add_config_flags",
    "check_doc_stride", "check_dtype_for_device", "config_from_args", "default_onnx_cache_dir", "doc_stride_limit",
    "load_config", "parse_model_spec", "validate_connections", "validate_model", "validate_security",
    "validate_server",
]
