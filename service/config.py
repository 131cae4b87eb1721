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
    # Connection management (seconds). Clients reconnect, and re-resolve DNS, when a connection reaches its
    # age, so long-lived clients of a headless Service reach replicas the autoscaler added.
    max_connection_age: 300               # GOAWAY after this (+-10 % jitter); 0 or null: connections live forever
    max_connection_age_grace: 30          # then in-flight calls get this long before the connection is closed
    keepalive_time: 60                    # server pings each connection this often (0: never) ...
    keepalive_timeout: 20                 # ... and drops it when a ping is unanswered this long
    keepalive_min_ping_interval: 10       # clients may ping this often (a client keepalive_time below it gets
                                          #   GOAWAY too_many_pings)
    keepalive_permit_without_calls: true  # clients may ping connections with no call open
    compute_scheduling: partition         # how the models share the cores (service/compute.py): partition:
                                          #   concurrently, each call with max(1, cores // active models)
                                          #   intra-op threads (unless *_intra_op_threads is set), so a
                                          #   saturated model cannot slow a light one; fair: one model's
                                          #   backend call at a time, models in turn; shared: no coordination
    gil_switch_interval_us: null          # sys.setswitchinterval while serving, microseconds; null: Python's
                                          #   5000. 10 helps encoder-only servers (a torch thread takes the
                                          #   GIL back after each op) but slows translation's decode loop
                                          #   (service/server.py has the measurements)
    # Transport security and auth: all off by default. File paths are relative to this file.
    tls_cert: null                        # PEM certificate chain; with tls_key: TLS on the gRPC port
    tls_key: null                         # PEM private key, unencrypted
    tls_client_ca: null                   # PEM CA bundle: clients must present a certificate it signed (mTLS)
    auth_token_file: null                 # bearer tokens, one per line ('#' comments); others: UNAUTHENTICATED
    auth_health: false                    # true: grpc.health.v1 on the gRPC port needs a token too
    reflection: true                      # false: no grpc.reflection service (--no-reflection)
    metrics_host: null                    # address of the /metrics server (null: host); other paths are 404
    health_port: null                     # plaintext listener serving only grpc.health.v1 (kubelet probes
                                          #   cannot speak TLS or send tokens); null: none
    health_host: null                     # its address (null: host); the kubelet probes the pod IP, so in
                                          #   Kubernetes it must not be 127.0.0.1
    http_port: null                       # HTTP/JSON API (service/http_api.py: KServe v2 REST, /v1/classify,
                                          #   /v1/answer, /v1/translate, /metrics) on this port, same TLS and
                                          #   tokens as gRPC; 0 picks a free port; null: off
    http_host: null                       # its address (null: host)
    models:
      - name: sentiment
        path: defaults/sentiment          # relative paths are relative to the config file
        device: auto                      # auto | cpu | cuda | cuda:N
        dtype: auto                       # auto | float32 | bfloat16 | float16 | int8. auto (default): bfloat16
                                          #   where the device runs it natively (CUDA with bf16 support; a CPU
                                          #   with AVX512-BF16 or AMX-BF16, see service/cpu_features.py and its
                                          #   RELSERVE_CPU_BF16 override) and the agreement gate below passes,
                                          #   else float32; the choice and its reason are logged and shown in
                                          #   ListModels (dtype, dtype_reason). backend onnx: float32.
                                          #   bfloat16: only on such devices; float16: CUDA only.
                                          #   int8 (explicit only; backend onnx, CPU, classification / QA):
                                          #   the exported graph's MatMul/Gemm weights dynamically quantized
                                          #   (onnxruntime.quantization, cached beside the float32 graph with
                                          #   its own sha256), served only if it passes the gate below against
                                          #   the float32 torch model at load, else the float32 graph serves
        dtype_gate_agreement: 0.99        # auto's gate, run after warm-up on real text (the checkpoint's
                                          #   calibration.jsonl, else loadtest/data for the task; int8's: at
                                          #   load, warmup or not): bfloat16 (int8) is kept when this
                                          #   fraction of items has the same argmax label / best QA span /
                                          #   greedy translation tokens as float32 ...
        dtype_gate_max_prob_diff: 0.05    # ... and no probability differs by more than this (classification:
                                          #   label probabilities; QA: the best span's score; translation: the
                                          #   mean token probability exp(log_prob / tokens))
        dtype_gate_items: 256             # items the gate runs (the first ones of the text; at least 200 are
                                          #   needed, fewer usable items keep float32)
        max_batch_size: 32
        max_batch_tokens: 8192            # padded tokens: batch size x longest sequence
        max_queue_delay: 0.005            # seconds
        max_queue_size: 1024              # units (sequences / QA windows) waiting
        max_request_texts: 256            # texts per Classify / Translate request (more: INVALID_ARGUMENT)
        max_request_chars: 1000000        # characters per request, all texts (QA: question + context) together
        length_bucketing: true            # false: batches in arrival order (more padding)
        cost_batching: true               # run a formed batch as the sub-batches of least predicted time
                                          #   (cost model fitted at warm-up and from every call: per call,
                                          #   per real / padded token, per n x L^2); false: as formed
        max_request_batch_share: 0.5      # one request's units per batch <= ceil(share x max_batch_size) while
                                          #   other requests wait (1.0: no cap); a long QA context cannot
                                          #   starve the short requests behind it
        max_batch_time_ms: 20             # how long one backend call should hold the cores while another
                                          #   model is active: batches run in pieces expected to take <= this;
                                          #   with compute_scheduling fair, torch backends also yield between
                                          #   encoder layers after it; 0: no cap (encoder models)
        backend: torch                    # torch | onnx (ONNX Runtime) | auto (onnx when onnxruntime is installed)
        onnx_cache_dir: null              # exported graphs, keyed by checkpoint hash (default: $XDG_CACHE_HOME/
                                          #   relserve/onnx, ~/.cache/relserve/onnx without it); created 0700;
                                          #   refused if another uid owns it or group/others can write it
        onnx_intra_op_threads: 0          # ONNX Runtime intra-op threads (0: the share under partition, else
                                          #   ONNX Runtime's default, one per core)
        torch_intra_op_threads: 0         # torch intra-op threads of this model's backend thread (0: under
                                          #   partition max(1, cores // active models) per call, else torch's
                                          #   default, one per core)
        torch_unpadded: true              # torch backend, DeBERTa: batches with padding run the dense layers
                                          #   on the real tokens only (attention core padded); false: padded
        worker_process: true              # compute in a child process of the server (own GIL: the event
                                          #   loop's refusals no longer slow the batches; service/backends/
                                          #   worker.py), restarted if it dies; unset: true for encoder
                                          #   models, false (in-process, the only choice) for translation
        instances: 1                      # worker processes of this encoder model; each backend call is split
                                          #   between them (by tokens; at most one part per intra-op thread the
                                          #   call gets), one thread each (backends/worker_pool.py); 2 on a
                                          #   2-core CPU: 1.1-1.35x short-sentence throughput, one more copy of
                                          #   the weights; torch/onnx_intra_op_threads are then shared out
        onnx_graph_optimization: all      # disable | basic | extended | all
        onnx_parity_tolerance: 0.001      # graph vs torch on the warm-up batch at load: passes where
        onnx_parity_rtol: 0.0001          #   |diff| <= onnx_parity_tolerance + onnx_parity_rtol * |torch|;
                                          #   worse refuses to serve (rtol: float32 differences grow with
                                          #   the output, e.g. logits near 40; 0: absolute only)
        spm_normalization: spm            # spm.model-only tokenizers (no tokenizer.json): spm applies the
                                          #   model's own normaliser (nmt_nfkc), as sentencepiece and
                                          #   transformers 4 do; transformers5 drops it as transformers 5 does
      - name: qa
        path: defaults/qa
        max_seq_len: 384
        doc_stride: 128                   # default overlap between windows (tokens); at most (max_seq_len - 4) // 2.
                                          #   Unset: 128, or that limit when smaller (a short-window model).
                                          #   For a question too long for it, the default is lowered to half
                                          #   the window's context room; a client's larger doc_stride is refused
        max_answer_len: 30
        max_qa_windows: 64                # windows per Answer request; a longer context is INVALID_ARGUMENT
        align_to_words: true              # answers widened to whole words, as transformers' QA pipeline (a
                                          #   request's align_to_words overrides); false: token-exact spans
                                          #   (better for scripts without spaces: Chinese, Japanese)
      - name: translate-de-en           # an RNNsearch directory (config.json model_type "rnnsearch")
        path: defaults/translate-de-en
        scheduling: iteration             # iteration (join/leave between decoder steps) | request
        max_active_hypotheses: 256        # beam hypotheses decoded together per step
        encode_batch_delay_ms: 2          # iteration: newcomers wait at most this long (from the oldest's
                                          #   arrival) while others decode, so several share one encoder
                                          #   call; the loop keeps stepping meanwhile; 0: encode at the next step
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
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from .auth import check_tls_files, read_tokens
from .cpu_features import CPU_BF16_ENV, bf16_support, cpu_bf16_mode
from .errors import ConfigError

MIB = 1024 * 1024
# <repo>/defaults in a checkout; relserve/defaults (package data, same relative path) in an installed wheel.
DEFAULTS_DIR = Path(__file__).resolve().parents[1] / "defaults"
DEFAULT_MODELS: tuple[tuple[str, str], ...] = (("sentiment", "sentiment"), ("qa", "qa"))
# Served by default only when their directory exists (translation models are produced separately).
OPTIONAL_DEFAULT_MODELS: tuple[tuple[str, str], ...] = (
    ("translate-de-en", "translate-de-en"), ("translate-de-en-deberta", "translate-de-en-deberta"),
)
SCHEDULING = ("iteration", "request")
# The GIL switch interval while serving (server key gil_switch_interval_us), microseconds; None keeps
# Python's own 5000. A backend thread that releases the GIL around each torch op waits up to this long to
# take it back from the event loop, once per op; but Python-heavy threads (the translation decode loop)
# lose to frequent switches: service/server.py apply_switch_interval has the measurements of both.
MAX_SWITCH_INTERVAL_US = 1_000_000.0
MAX_THREADS = 1024          # *_intra_op_threads (torch and ORT take a C int; beyond any machine's cores)
MAX_LEN_A = 100.0           # max_len_a: output tokens per source token, far past any language pair
MAX_LEN_B = 1_000_000       # max_len_b: tokens (max_output_tokens caps max_length anyway)
MAX_MESSAGE_BYTES = 2**31 - 1  # grpc's max_*_message_length channel arguments are C ints
COMPUTE_SCHEDULING = ("partition", "fair", "shared")  # server key compute_scheduling (service/compute.py)
MAX_BATCH_TIME_MS = 60_000.0
MAX_BEAM_SIZE = 16

BACKENDS = ("torch", "onnx", "auto")
ONNX_GRAPH_OPTIMIZATIONS = ("disable", "basic", "extended", "all")
# an spm.model-only tokenizer's normalisation (models.tokenization.SPM_NORMALIZATIONS; config must not import it)
SPM_NORMALIZATIONS = ("spm", "transformers5")
DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
# dtype: auto's agreement gate needs at least this many usable items of text (the ">= 200 items")
DTYPE_GATE_MIN_ITEMS = 200
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
    dtype: str = "auto"  # DTYPES; auto: bfloat16 where native and the gate passes (service/backends/precision.py);
    # int8: backend onnx only, served when it passes the same gate (service/backends/onnx_encoder.py)
    dtype_gate_agreement: float = 0.99  # auto: fraction of gate items whose label / span / tokens must agree
    dtype_gate_max_prob_diff: float = 0.05  # auto: largest probability difference bf16 vs fp32 accepted
    dtype_gate_items: int = 256  # auto: items of calibration text the gate runs (>= DTYPE_GATE_MIN_ITEMS)
    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_queue_delay: float = 0.005
    max_queue_size: int = 1024
    max_seq_len: int | None = None
    doc_stride: int | None = None  # None: DEFAULT_DOC_STRIDE, lowered to the model's limit (resolved_doc_stride)
    max_answer_len: int = 30
    align_to_words: bool = True  # QA spans widened to whole words (the transformers pipeline's default)
    # per-request limits, checked before any tokenizing (service/tasks/*.validate_*; QA windows by the tokenizer)
    max_request_texts: int = 256
    max_request_chars: int = 1_000_000
    max_qa_windows: int = 64
    instances: int = 1  # worker processes (backends/worker_pool.py); > 1 needs worker_process
    warmup: bool = True
    length_bucketing: bool = True  # batch similar lengths together (false: plain arrival order)
    cost_batching: bool = True  # formed batches run as the sub-batches of least predicted time (batcher step 5)
    max_request_batch_share: float = 0.5  # fairness cap per request per batch (encoder models)
    max_batch_time_ms: float = 20.0  # cap on one backend call's hold on the cores while another model waits
    # ONNX Runtime backend (backend: onnx | auto)
    onnx_cache_dir: Path | None = None  # None: default_onnx_cache_dir()
    onnx_intra_op_threads: int = 0
    onnx_graph_optimization: str = "all"
    onnx_parity_tolerance: float = 1e-3  # atol of the load-time self-check
    # rtol of the self-check: ONNX Runtime sums in another order than torch, so correct float32 graphs differ
    # in proportion to the output (1.5e-5 relative on a v3 classifier with logits near 40); 1e-4 leaves ~6x
    # headroom and stays far below what a wrong op gives (1e-2 relative and more). Same rtol as the export.
    onnx_parity_rtol: float = 1e-4
    torch_intra_op_threads: int = 0  # torch backends: intra-op threads of the model's thread (0: torch's default)
    torch_unpadded: bool = True  # torch backends, DeBERTa encoders: dense layers on real tokens (models/deberta.py)
    # the backend computes in a child process (backends/worker.py); None: encoder models yes, translation no
    worker_process: bool | None = None
    spm_normalization: str = "spm"  # SPM_NORMALIZATIONS: spm.model-only tokenizers (models/tokenization.py)
    # translation (RNNsearch) models only
    scheduling: str = "iteration"
    max_active_hypotheses: int = 256
    encode_batch_delay_ms: float = 2.0  # newcomers held (while others decode) for a shared encoder call
    max_source_tokens: int = 256
    beam_size: int = 5
    max_len_a: float = 2.0
    max_len_b: int = 10
    max_output_tokens: int = 256
    length_penalty: float = 1.0

    def resolved_doc_stride(self, max_seq_len: int) -> int:
        """The QA default overlap for ``max_seq_len``: the configured ``doc_stride``, else
        ``min(DEFAULT_DOC_STRIDE, (max_seq_len - 4) // 2)`` (so a checkpoint with a short position table loads
        without the user setting it; transformers' pipeline likewise lowers its default stride).

        Raises:
            ConfigError: a configured ``doc_stride`` over the limit (:func:`check_doc_stride`).
        """
        if self.doc_stride is None:
            return min(DEFAULT_DOC_STRIDE, doc_stride_limit(max_seq_len))
        check_doc_stride(f"model {self.name!r}", self.doc_stride, max_seq_len)
        return self.doc_stride

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
    """``$XDG_CACHE_HOME/relserve/onnx``, or ``$HOME/.cache/relserve/onnx`` when XDG_CACHE_HOME is unset or not
    an absolute path (the XDG Base Directory spec ignores relative values): the user's own cache, never a
    world-writable place such as /tmp, where another user could plant graphs.

    Raises:
        ConfigError: neither XDG_CACHE_HOME nor a home directory is known (set one, or onnx_cache_dir).
    """
    import os

    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or ""
    if os.path.isabs(base):
        return Path(base) / "relserve" / "onnx"
    try:
        home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    except (RuntimeError, KeyError) as exc:  # no HOME and no passwd entry (an arbitrary container uid)
        raise ConfigError("no onnx_cache_dir is set and neither XDG_CACHE_HOME nor a home directory is known; "
                          "set onnx_cache_dir or XDG_CACHE_HOME") from exc
    return home / ".cache" / "relserve" / "onnx"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int | None = 8002  # 0 picks a free port; None (or negative) disables /metrics
    max_receive_message_length: int = 4 * MIB
    max_send_message_length: int = 4 * MIB
    drain_timeout: float = 30.0
    log_level: str = "INFO"
    compute_scheduling: str = "partition"  # COMPUTE_SCHEDULING: how models share the cores (service/compute.py)
    # sys.setswitchinterval while serving (service/server.py apply_switch_interval); None: Python's 5000 us
    gil_switch_interval_us: float | None = None
    # Connection management, seconds (grpc channel arguments: service/server.py connection_options)
    max_connection_age: float | None = 300.0  # GOAWAY after this age (None or 0: off) so clients rebalance
    max_connection_age_grace: float = 30.0    # in-flight calls' time after that GOAWAY before the close
    keepalive_time: float = 60.0              # server keepalive ping interval (0: no pings)
    keepalive_timeout: float = 20.0           # unanswered ping -> connection dropped
    keepalive_min_ping_interval: float = 10.0  # shortest client ping interval accepted (else too_many_pings)
    keepalive_permit_without_calls: bool = True  # clients may ping idle connections
    # Transport security and auth (service/auth.py). Paths in a config file are relative to that file.
    tls_cert: Path | None = None        # PEM certificate chain; with tls_key: TLS on the gRPC port
    tls_key: Path | None = None         # PEM private key (unencrypted)
    tls_client_ca: Path | None = None   # PEM CA bundle: clients must present a certificate it signed (mTLS)
    auth_token_file: Path | None = None  # bearer tokens, one per line: calls without one are UNAUTHENTICATED
    auth_health: bool = False           # true: grpc.health.v1 on the gRPC port needs a token too
    reflection: bool = True             # grpc.reflection.v1 + v1alpha (needs a token when auth is on)
    metrics_host: str | None = None     # address of the /metrics HTTP server (None: host)
    health_port: int | None = None      # plaintext grpc.health.v1-only listener for probes (None: off)
    health_host: str | None = None      # its address (None: host)
    http_port: int | None = None        # HTTP/JSON API port (service/http_api.py; None: off, 0: a free port)
    http_host: str | None = None        # its address (None: host)
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
    "dtype_gate_agreement": float, "dtype_gate_max_prob_diff": float, "dtype_gate_items": int,
    "max_batch_size": int, "max_batch_tokens": int, "max_queue_delay": float, "max_queue_size": int,
    "max_seq_len": int, "doc_stride": int, "max_answer_len": int, "instances": int, "warmup": bool,
    "max_request_texts": int, "max_request_chars": int, "max_qa_windows": int, "align_to_words": bool,
    "length_bucketing": bool, "cost_batching": bool, "max_request_batch_share": float, "max_batch_time_ms": float,
    "onnx_cache_dir": str, "onnx_intra_op_threads": int, "onnx_graph_optimization": str,
    "onnx_parity_tolerance": float, "onnx_parity_rtol": float, "torch_intra_op_threads": int,
    "torch_unpadded": bool, "worker_process": bool, "spm_normalization": str,
    "scheduling": str, "max_active_hypotheses": int, "encode_batch_delay_ms": float,
    "max_source_tokens": int, "beam_size": int,
    "max_len_a": float, "max_len_b": int, "max_output_tokens": int, "length_penalty": float,
}
_SERVER_TYPES: dict[str, type] = {
    "host": str, "port": int, "metrics_port": int, "max_receive_message_length": int,
    "max_send_message_length": int, "drain_timeout": float, "log_level": str, "compute_scheduling": str,
    "gil_switch_interval_us": float,
    "tls_cert": str, "tls_key": str, "tls_client_ca": str, "auth_token_file": str, "auth_health": bool,
    "reflection": bool, "metrics_host": str, "health_port": int, "health_host": str,
    "max_connection_age": float, "max_connection_age_grace": float, "keepalive_time": float,
    "keepalive_timeout": float, "keepalive_min_ping_interval": float, "keepalive_permit_without_calls": bool,
    "http_port": int, "http_host": str,
}
# Server keys naming files: relative paths are relative to the config file (flags: to the cwd).
_SERVER_PATH_KEYS = ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file")
_NULLABLE_SERVER_KEYS = (*_SERVER_PATH_KEYS, "metrics_host", "health_port", "health_host", "max_connection_age",
                         "http_port", "http_host", "gil_switch_interval_us")


MAX_INSTANCES = 64  # worker processes per model (each holds a copy of the weights)
DEFAULT_DOC_STRIDE = 128  # tokens: the QA overlap when doc_stride is unset (transformers' pipeline default)


def doc_stride_limit(max_seq_len: int) -> int:
    """The largest ``doc_stride`` a model with ``max_seq_len`` accepts: ``(max_seq_len - 4) // 2``."""
    return (max_seq_len - 4) // 2


def check_doc_stride(where: str, doc_stride: int, max_seq_len: int) -> None:
    """The default QA overlap must fit the shortest question: at most half the context room of a window with a
    one-token question, ``(max_seq_len - 4) // 2`` (longer questions lower it at request time, see
    ``Tokenizer.qa_windows(clamp_stride=True)``). Called here for an explicit ``max_seq_len`` and by the
    runner once the model's is known.

    Raises:
        ConfigError: naming the model, doc_stride, the limit and how it is computed.
    """
    limit = doc_stride_limit(max_seq_len)
    if doc_stride > limit:
        raise ConfigError(
            f"{where}: doc_stride {doc_stride} is over the limit of {limit} tokens for max_seq_len {max_seq_len}: "
            f"the overlap between QA windows may be at most half a window's context room ((max_seq_len - 3 "
            f"special tokens - 1 question token) // 2)"
        )


def check_dtype_for_device(model: str, dtype: str, device: str) -> None:
    """float16 runs on CUDA only, bfloat16 on CUDA or on a CPU that runs it natively
    (:func:`relserve.service.cpu_features.bf16_support`: AVX512-BF16 / AMX-BF16, or ``RELSERVE_CPU_BF16=assume``);
    say so clearly instead of serving an emulated, slower-than-float32 model. ``auto`` and float32 run anywhere.

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


def _coerce(where: str, key: str, value: Any, typ: type) -> Any:
    if value is None and key in ("max_seq_len", "metrics_port", "onnx_cache_dir", "worker_process", *_NULLABLE_SERVER_KEYS):
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
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(.inf)
            raise ConfigError(f"{where}: {key} must be an integer, got {value!r}") from None
    if typ is float:
        # bool is an int subclass: float(True) == 1.0 would turn `max_queue_delay: true` into one second
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be a number, got {str(value).lower()}")
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an integer past float's range
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
    if m.backend == "onnx" and m.dtype not in ("auto", "float32", "int8"):
        raise ConfigError(f"{where}: the onnx backend runs float32 graphs only (and int8 ones, dtype: int8), got "
                          f"dtype {m.dtype}; use backend torch for half precision")
    if not 0 < m.dtype_gate_agreement <= 1:  # also refuses NaN
        raise ConfigError(f"{where}: dtype_gate_agreement must be > 0 and <= 1 (the fraction of gate items that must "
                          f"agree), got {m.dtype_gate_agreement}")
    if not 0 <= m.dtype_gate_max_prob_diff <= 1:
        raise ConfigError(f"{where}: dtype_gate_max_prob_diff must be between 0 and 1 (a probability), got "
                          f"{m.dtype_gate_max_prob_diff}")
    if m.dtype_gate_items < DTYPE_GATE_MIN_ITEMS:
        raise ConfigError(f"{where}: dtype_gate_items must be >= {DTYPE_GATE_MIN_ITEMS} (the agreement gate runs on "
                          f"at least that many items), got {m.dtype_gate_items}")
    positive = ("max_batch_size", "max_batch_tokens", "max_queue_size", "doc_stride", "max_answer_len",
                "max_request_texts", "max_request_chars", "max_qa_windows")
    for key in positive:
        if key == "doc_stride" and m.doc_stride is None:  # unset: resolved at load (resolved_doc_stride)
            continue
        if getattr(m, key) < 1:
            raise ConfigError(f"{where}: {key} must be >= 1, got {getattr(m, key)}")
    if not 0 < m.max_request_batch_share <= 1:
        raise ConfigError(f"{where}: max_request_batch_share must be > 0 and <= 1 (1: no cap), got "
                          f"{m.max_request_batch_share}")
    if not 0 <= m.max_batch_time_ms <= MAX_BATCH_TIME_MS:
        raise ConfigError(f"{where}: max_batch_time_ms must be between 0 (no cap) and {MAX_BATCH_TIME_MS:.0f} "
                          f"milliseconds, got {m.max_batch_time_ms}")
    if not 0 <= m.max_queue_delay <= 10:  # also refuses NaN
        raise ConfigError(f"{where}: max_queue_delay must be between 0 and 10 seconds, got {m.max_queue_delay}")
    if m.max_seq_len is not None:
        if m.max_seq_len < 8:
            raise ConfigError(f"{where}: max_seq_len must be >= 8, got {m.max_seq_len}")
        if m.doc_stride is not None:
            check_doc_stride(where, m.doc_stride, m.max_seq_len)
        if m.max_batch_tokens < m.max_seq_len:
            raise ConfigError(
                f"{where}: max_batch_tokens {m.max_batch_tokens} must be >= max_seq_len {m.max_seq_len} "
                f"so that one full-length sequence fits in a batch"
            )
    if m.onnx_graph_optimization not in ONNX_GRAPH_OPTIMIZATIONS:
        raise ConfigError(f"{where}: onnx_graph_optimization {m.onnx_graph_optimization!r} is not one of "
                          f"{list(ONNX_GRAPH_OPTIMIZATIONS)}")
    if not 0 <= m.onnx_intra_op_threads <= MAX_THREADS:
        raise ConfigError(f"{where}: onnx_intra_op_threads must be between 0 (ONNX Runtime's default) and "
                          f"{MAX_THREADS}, got {m.onnx_intra_op_threads}")
    if not 0 <= m.torch_intra_op_threads <= MAX_THREADS:
        raise ConfigError(f"{where}: torch_intra_op_threads must be between 0 (torch's default, one per core) and "
                          f"{MAX_THREADS}, got {m.torch_intra_op_threads}")
    if m.spm_normalization not in SPM_NORMALIZATIONS:
        raise ConfigError(f"{where}: spm_normalization {m.spm_normalization!r} is not one of "
                          f"{list(SPM_NORMALIZATIONS)} (spm: the spm.model's own normaliser, as sentencepiece and "
                          f"transformers 4; transformers5: without it, as transformers 5)")
    if not 0 < m.onnx_parity_tolerance < math.inf:  # inf would switch the parity gate off
        raise ConfigError(f"{where}: onnx_parity_tolerance must be > 0 and finite, got {m.onnx_parity_tolerance}")
    if not 0 <= m.onnx_parity_rtol < 1:  # also refuses NaN; rtol >= 1 would accept a graph that outputs 0
        raise ConfigError(f"{where}: onnx_parity_rtol must be >= 0 and < 1 (0: absolute tolerance only), got "
                          f"{m.onnx_parity_rtol}")
    if m.scheduling not in SCHEDULING:
        raise ConfigError(f"{where}: scheduling {m.scheduling!r} is not one of {list(SCHEDULING)}")
    if not 0 <= m.encode_batch_delay_ms <= 1000:  # also refuses NaN
        raise ConfigError(f"{where}: encode_batch_delay_ms must be between 0 and 1000 ms (0: no hold), got "
                          f"{m.encode_batch_delay_ms}")
    for key in ("max_active_hypotheses", "max_source_tokens", "max_output_tokens"):
        if getattr(m, key) < 1:
            raise ConfigError(f"{where}: {key} must be >= 1, got {getattr(m, key)}")
    if not 1 <= m.beam_size <= MAX_BEAM_SIZE:
        raise ConfigError(f"{where}: beam_size must be between 1 and {MAX_BEAM_SIZE}, got {m.beam_size}")
    if not (0 <= m.max_len_a <= MAX_LEN_A and 0 <= m.max_len_b <= MAX_LEN_B):  # also refuses NaN and inf
        raise ConfigError(f"{where}: max_len_a must be between 0 and {MAX_LEN_A:g} and max_len_b between 0 and "
                          f"{MAX_LEN_B}, got {m.max_len_a} and {m.max_len_b}")
    if not 0 <= m.length_penalty <= 10:
        raise ConfigError(f"{where}: length_penalty must be between 0 and 10, got {m.length_penalty}")
    if not 1 <= m.instances <= MAX_INSTANCES:
        raise ConfigError(f"{where}: instances must be between 1 and {MAX_INSTANCES}, got {m.instances}")
    if m.instances > 1 and m.worker_process is False:
        raise ConfigError(f"{where}: instances {m.instances} needs worker_process (each instance is a worker "
                          f"process of its own; in one process the instances would share one GIL and one torch "
                          f"thread pool); set worker_process: true or instances: 1")
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
    # checked here, not only in _model_from_mapping: name and path are refused as options, so the list of
    # allowed option keys must leave them out (as --model-options does)
    unknown = set(raw) - _MODEL_KEYS
    if unknown:
        raise ConfigError(f"--model {spec!r}: unknown key(s) {sorted(unknown)}; "
                          f"allowed: {sorted(_MODEL_KEYS - {'name', 'path'})}")
    return raw


def load_config(
    config_file: str | Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    model_specs: Sequence[str] = (),
    dir_models: Sequence[tuple[str, Mapping[str, Any]]] = (),
    defaults_dir: Path = DEFAULTS_DIR,
) -> ServerConfig:
    """Build the one :class:`ServerConfig` of a process.

    Args:
        config_file: YAML file (optional).
        overrides: server-level keys from the command line; None values are ignored.
        model_specs: ``--model NAME=DIR[,key=value...]`` strings; relative DIRs are relative to the cwd.
        dir_models: ``(where, raw model mapping)`` entries of ``--model-dir`` (service/model_dir.py
            ``dir_models``); like ``--model`` entries they replace file entries of the same name.
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
    for key in _SERVER_PATH_KEYS:  # a config file's paths are relative to the file
        if isinstance(raw.get(key), str):
            raw[key] = _server_path(key, raw[key], base_dir)
    for key, value in (overrides or {}).items():
        if value is not None:
            if key not in _SERVER_TYPES:
                raise ConfigError(f"unknown server option {key!r}")
            raw[key] = _server_path(key, value, Path.cwd()) if key in _SERVER_PATH_KEYS else value
    server_values = {k: _coerce("config", k, v, _SERVER_TYPES[k]) for k, v in raw.items()}
    for key in _SERVER_PATH_KEYS:
        if server_values.get(key) is not None:
            server_values[key] = Path(server_values[key])

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
    for where, entry in dir_models:
        m = _model_from_mapping(entry, Path.cwd(), where)
        if m.name in from_cli:
            raise ConfigError(f"{where}: model name {m.name!r} is also given by --model")
        from_cli.add(m.name)
        models[m.name] = m
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


def _server_path(key: str, value: Any, base_dir: Path) -> Any:
    """A file key's value made absolute against ``base_dir`` (non-strings are left for _coerce to refuse)."""
    if not isinstance(value, str):
        return value
    if not value.strip():
        raise ConfigError(f"{key} is empty; give a file, or leave the key out")
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else base_dir / path)


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
        if not 0 <= cfg.health_port <= 65535:
            raise ConfigError(f"health_port must be between 0 and 65535 (leave it out for no health-only "
                              f"listener), got {cfg.health_port}")
        if cfg.health_port != 0 and (cfg.health_host or cfg.host) == cfg.host and cfg.health_port in (
                cfg.port, cfg.metrics_port):
            raise ConfigError(f"health_port {cfg.health_port} is already the gRPC or the metrics port")
    if cfg.http_port is not None:
        if not 0 <= cfg.http_port <= 65535:
            raise ConfigError(f"http_port must be between 0 and 65535 (leave it out for no HTTP/JSON API), "
                              f"got {cfg.http_port}")
        if cfg.http_port != 0 and (cfg.http_host or cfg.host) == cfg.host and cfg.http_port in (
                cfg.port, cfg.metrics_port, cfg.health_port):
            raise ConfigError(f"http_port {cfg.http_port} is already the gRPC, the metrics or the health port")
    if cfg.tls_cert is not None and cfg.tls_key is not None:
        check_tls_files(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
    if cfg.auth_token_file is not None:
        read_tokens(cfg.auth_token_file)


MAX_DRAIN_SECONDS = 86_400  # a day: far past any terminationGracePeriodSeconds, finite for the exit deadline


def validate_server(cfg: ServerConfig) -> ServerConfig:
    """Raises ConfigError for out-of-range server keys; returns cfg (metrics_port < 0 becomes None)."""
    if not 0 <= cfg.port <= 65535:
        raise ConfigError(f"port must be between 0 and 65535, got {cfg.port}")
    if cfg.metrics_port is not None and cfg.metrics_port < 0:
        cfg = dataclasses.replace(cfg, metrics_port=None)
    if cfg.metrics_port is not None and cfg.metrics_port > 65535:
        raise ConfigError(f"metrics_port must be between 0 and 65535, got {cfg.metrics_port}")
    for key in ("max_receive_message_length", "max_send_message_length"):
        if not 1024 <= getattr(cfg, key) <= MAX_MESSAGE_BYTES:
            raise ConfigError(f"{key} must be between 1024 and {MAX_MESSAGE_BYTES} bytes (grpc's int32 channel "
                              f"argument), got {getattr(cfg, key)}")
    # NaN would fire the exit deadline at once, and a value past threading.TIMEOUT_MAX kills that thread
    # (OverflowError), leaving a hung drain without its backstop (service/drain.py ExitDeadline).
    if not 0 <= cfg.drain_timeout <= MAX_DRAIN_SECONDS:  # also refuses NaN
        raise ConfigError(f"drain_timeout must be between 0 and {MAX_DRAIN_SECONDS} seconds, got {cfg.drain_timeout}")
    if cfg.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"log_level {cfg.log_level!r} is not a logging level name")
    if cfg.compute_scheduling not in COMPUTE_SCHEDULING:
        raise ConfigError(f"compute_scheduling {cfg.compute_scheduling!r} is not one of {list(COMPUTE_SCHEDULING)}")
    interval = cfg.gil_switch_interval_us
    if interval is not None and not 1.0 <= interval <= MAX_SWITCH_INTERVAL_US:  # also refuses NaN
        raise ConfigError(f"gil_switch_interval_us must be between 1 and {MAX_SWITCH_INTERVAL_US:.0f} "
                          f"microseconds (or null: Python's 5000), got {interval}")
    validate_security(cfg)
    validate_connections(cfg)
    names = [m.name for m in cfg.models]
    if len(set(names)) != len(names):
        raise ConfigError(f"model names must be unique, got {names}")
    return cfg


MAX_CONNECTION_SECONDS = 2_000_000  # grpc takes these as int32 milliseconds (at most ~24.8 days)


def validate_connections(cfg: ServerConfig) -> None:
    """Check the connection-management keys (seconds).

    Raises:
        ConfigError: a negative or non-finite value, one over MAX_CONNECTION_SECONDS, a max_connection_age
            under 0.1 s (other than 0 / null: off), or keepalive_time on with keepalive_timeout 0.
    """
    keys = ("max_connection_age", "max_connection_age_grace", "keepalive_time", "keepalive_timeout",
            "keepalive_min_ping_interval")
    for key in keys:
        value = getattr(cfg, key)
        if value is None:
            continue
        if not 0 <= value <= MAX_CONNECTION_SECONDS:  # also refuses NaN
            raise ConfigError(f"{key} must be between 0 and {MAX_CONNECTION_SECONDS} seconds, got {value}")
    if cfg.max_connection_age and cfg.max_connection_age < 0.1:
        raise ConfigError(f"max_connection_age must be 0 (off) or at least 0.1 seconds, got {cfg.max_connection_age}")
    if cfg.keepalive_time > 0 and cfg.keepalive_timeout <= 0:
        raise ConfigError(f"keepalive_timeout must be > 0 seconds when keepalive_time is on, got "
                          f"{cfg.keepalive_timeout}")
