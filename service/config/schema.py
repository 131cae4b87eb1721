"""Every configuration key, declared once: its type (the annotation), default, bounds or choices, one-line doc
and, for server keys that have one, its command-line flag.

``ServerConfig`` and ``ModelConfig`` are the declarations themselves: each field carries a :class:`Key` in its
metadata. The loader's type coercion, the validation's range and choice checks and their messages, the
``relserve serve`` flags and docs/configuration.md are all derived from these fields (:func:`keys`).

This module does not import torch: whether CUDA exists is decided by the backend at load time.
"""

# No `from __future__ import annotations` here: the field annotations are read as types (KeySpec.type).
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .derived import check_doc_stride, default_onnx_cache_dir, doc_stride_limit

MIB = 1024 * 1024
# <repo>/defaults in a checkout; relserve/defaults (package data, same relative path) in an installed wheel.
DEFAULTS_DIR = Path(__file__).resolve().parents[2] / "defaults"
DEFAULT_MODELS: tuple[tuple[str, str], ...] = (("sentiment", "sentiment"), ("qa", "qa"))
# Served by default only when their directory exists (translation models are produced separately).
OPTIONAL_DEFAULT_MODELS: tuple[tuple[str, str], ...] = (
    ("translate-de-en", "translate-de-en"), ("translate-de-en-deberta", "translate-de-en-deberta"),
)

SCHEDULING = ("iteration", "request")
# A backend thread that releases the GIL around each torch op waits up to the switch interval to take it back
# from the event loop, once per op; but Python-heavy threads (the translation decode loop) lose to frequent
# switches: service/server.py apply_switch_interval has the measurements of both.
MAX_SWITCH_INTERVAL_US = 1_000_000.0
MAX_THREADS = 1024          # *_intra_op_threads (torch and ORT take a C int; beyond any machine's cores)
MAX_LEN_A = 100.0           # max_len_a: output tokens per source token, far past any language pair
MAX_LEN_B = 1_000_000       # max_len_b: tokens (max_output_tokens caps max_length anyway)
MAX_MESSAGE_BYTES = 2**31 - 1  # grpc's max_*_message_length channel arguments are C ints
MODEL_CONTROL_MODES = ("none", "poll", "explicit")  # server key model_control_mode (service/repository/)
COMPUTE_SCHEDULING = ("partition", "fair", "shared")  # server key compute_scheduling (service/scheduling/cores.py)
MAX_BATCH_TIME_MS = 60_000.0
MAX_BEAM_SIZE = 16
MAX_INSTANCES = 64  # worker processes per model (each holds a copy of the weights)
MAX_DRAIN_SECONDS = 86_400  # a day: far past any terminationGracePeriodSeconds, finite for the exit deadline
MAX_CONNECTION_SECONDS = 2_000_000  # grpc takes these as int32 milliseconds (at most ~24.8 days)
MAX_PORT = 65535
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

BACKENDS = ("torch", "onnx", "auto")
ONNX_GRAPH_OPTIMIZATIONS = ("disable", "basic", "extended", "all")
# an spm.model-only tokenizer's normalisation (models.tokenization.SPM_NORMALIZATIONS; config must not import it)
SPM_NORMALIZATIONS = ("spm", "transformers5")
DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
# a classification model's predictions on KServe's v1 predict (frontends/kserve_v1.py): huggingfaceserver's shapes
KSERVE_V1_PREDICTIONS = ("label_id", "probabilities", "raw_logits")
# dtype: auto's agreement gate needs at least this many usable items of text
DTYPE_GATE_MIN_ITEMS = 200
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
DEFAULT_MAX_SEQ_LEN_CAP = 512
DEFAULT_DOC_STRIDE = 128  # tokens: the QA overlap when doc_stride is unset (transformers' pipeline default)


@dataclass(frozen=True)
class Bounds:
    """A numeric key's allowed range; ``None`` ends are open-ended. The refusal reads
    ``<key> must be <range><unit><note>, got <value>`` (see :meth:`phrase`), and NaN is always refused."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself refused
    hi_open: bool = False  # hi itself refused; hi = inf with hi_open reads "and finite"
    unit: str = ""         # " seconds", " ms", ...
    note: str = ""         # " (...)" after the range
    lo_note: str = ""      # " (...)" after lo, e.g. what 0 means

    def contains(self, value: float) -> bool:
        """Whether ``value`` is in range (False for NaN)."""
        lo_ok = self.lo is None or (self.lo < value if self.lo_open else self.lo <= value)
        hi_ok = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return bool(lo_ok and hi_ok)

    def phrase(self) -> str:
        """The range in words: ``between 0 and 10``, ``>= 1``, ``> 0 and <= 1``, ``>= 0 and < 1`` or
        ``> 0 and finite``."""
        lo, hi = number(self.lo), number(self.hi)
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {lo}{self.lo_note}"
        if self.lo_open and self.hi_open and self.hi == math.inf:
            return f"> {lo}{self.lo_note} and finite"
        if not self.lo_open and not self.hi_open:
            return f"between {lo}{self.lo_note} and {hi}"
        return f"{'>' if self.lo_open else '>='} {lo}{self.lo_note} and {'<' if self.hi_open else '<='} {hi}"


@dataclass(frozen=True)
class Flag:
    """The ``relserve serve`` flag that sets a server key (``None`` values in the parsed flags leave the key alone).

    ``action``: None (a value of the key's type), ``"store_false"`` (a ``--no-...`` switch that sets false) or
    ``"boolean"`` (``--x`` / ``--no-x``). ``also_sets``: further keys the same value sets. ``help`` may name
    ``{default}``, the key's default."""

    names: tuple[str, ...]
    help: str
    metavar: str | None = None
    dest: str | None = None  # default: the key's name
    action: str | None = None
    group: str | None = None  # FLAG_GROUPS key; None: the serve command's own options
    also_sets: tuple[str, ...] = ()


# Argument groups of ``relserve serve`` (their titles in --help).
FLAG_GROUPS = {
    "connection": "connection management (seconds; see the config keys of the same names)",
    "security": "transport security and auth",
}


@dataclass(frozen=True)
class Key:
    """What a config field declares beyond its annotation and default (``dataclasses.Field.metadata['key']``)."""

    doc: str
    bounds: Bounds | None = None
    choices: tuple[str, ...] | None = None
    choices_note: str = ""  # appended to the "is not one of" refusal
    nullable: bool | None = None  # None: as the annotation says (``X | None``)
    flag: Flag | None = None


def key(default: Any = dataclasses.MISSING, doc: str = "", **kwargs: Any) -> Any:
    """A dataclass field declaring one config key (see :class:`Key` for ``kwargs``); no default: required."""
    return field(default=default, metadata={"key": Key(doc=doc, **kwargs)})


@dataclass(frozen=True)
class KeySpec:
    """One key as the loader, the validation, the flags and the docs see it (derived by :func:`keys`)."""

    name: str
    type: type  # what YAML / flags must give: bool, int, float or str (paths are strings)
    is_path: bool
    nullable: bool  # null (YAML) / None accepted
    required: bool
    default: Any
    doc: str
    bounds: Bounds | None
    choices: tuple[str, ...] | None
    choices_note: str
    flag: Flag | None
    is_list: bool = False  # a list of values of ``type`` (declared ``tuple[T, ...]``; YAML list, repeatable flag)


def _spec(f: dataclasses.Field) -> KeySpec:
    declared: Key = f.metadata["key"]
    args = typing.get_args(f.type) if isinstance(f.type, types.UnionType) else (f.type,)
    base = next(a for a in args if a is not type(None))
    is_list = typing.get_origin(base) is tuple
    if is_list:
        base = typing.get_args(base)[0]
    nullable = type(None) in args if declared.nullable is None else declared.nullable
    return KeySpec(
        name=f.name, type=str if base is Path else base, is_path=base is Path, nullable=nullable,
        required=f.default is dataclasses.MISSING, default=None if f.default is dataclasses.MISSING else f.default,
        doc=declared.doc, bounds=declared.bounds, choices=declared.choices, choices_note=declared.choices_note,
        flag=declared.flag, is_list=is_list,
    )



def keys(cls: type) -> dict[str, KeySpec]:
    """The keys ``cls`` (ServerConfig or ModelConfig) declares, in declaration order."""
    return {f.name: _spec(f) for f in dataclasses.fields(cls) if "key" in f.metadata}


def number(value: Any) -> str:
    """A bound or default as written in messages and docs: ``60000.0`` -> ``60000``, ``0.005`` -> ``0.005``."""
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return str(int(value))
    return str(value)


_SECONDS = Bounds(0, MAX_CONNECTION_SECONDS, unit=" seconds")


@dataclass(frozen=True)
class ModelConfig:
    """One served model (an entry of ``models:``, a ``--model`` spec or a ``--model-dir`` checkpoint).
    ``max_seq_len`` None means min(model's max positions, 512), resolved at load."""

    name: str = key(doc="the model's name in requests (letters, digits, '.', '_', '-'; first a letter or digit)")
    path: Path = key(doc="the checkpoint directory (relative paths: relative to the config file; --model: to the "
                         "cwd)")
    backend: str = key("torch", "torch | onnx (ONNX Runtime) | auto (onnx when onnxruntime is installed)",
                       choices=BACKENDS)
    device: str = key("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = key(
        "auto",
        "auto (default): bfloat16 where the device runs it natively (CUDA with bf16 support; a CPU with "
        "AVX512-BF16 or AMX-BF16, see service/cpu_features.py and its RELSERVE_CPU_BF16 override) and the "
        "agreement gate (dtype_gate_*) passes, else float32; the choice and its reason are logged and shown in "
        "ListModels (dtype, dtype_reason). backend onnx: float32. bfloat16: only on such devices; float16: CUDA "
        "only. int8 (explicit only; backend onnx, CPU, classification / QA): the exported graph's MatMul/Gemm "
        "weights dynamically quantized (onnxruntime.quantization, cached beside the float32 graph with its own "
        "sha256), served only if it passes the gate against the float32 torch model at load, else the float32 "
        "graph serves",
        choices=DTYPES)
    dtype_gate_agreement: float = key(
        0.99,
        "auto's gate, run after warm-up on real text (the checkpoint's calibration.jsonl, else loadtest/data for "
        "the task; int8's: at load, warmup or not): bfloat16 (int8) is kept when this fraction of items has the "
        "same argmax label / best QA span / greedy translation tokens as float32 ...",
        bounds=Bounds(0, 1, lo_open=True, note=" (the fraction of gate items that must agree)"))
    dtype_gate_max_prob_diff: float = key(
        0.05,
        "... and no probability differs by more than this (classification: label probabilities; QA: the best "
        "span's score; translation: the mean token probability exp(log_prob / tokens))",
        bounds=Bounds(0, 1, note=" (a probability)"))
    dtype_gate_items: int = key(
        256,
        "items the gate runs (the first ones of the text; fewer usable items than the minimum keep float32)",
        bounds=Bounds(DTYPE_GATE_MIN_ITEMS, note=" (the agreement gate runs on at least that many items)"))
    load_cache: bool = key(
        True,
        "keep what a load measures, keyed by the checkpoint's files, the CPU/GPU and torch build, the relserve "
        "version and the keys it reads, in <onnx_cache_dir>/dtype-gate/ (auto's gate decision, also read from a "
        "dtype_decision.json shipped beside the checkpoint; the batch cost model's warm-up probe timings), and use "
        "it at the next start instead of measuring again; false: the gate and the probes run at every start")
    max_batch_size: int = key(32, "sequences (QA: windows) per backend batch", bounds=Bounds(1))
    max_batch_tokens: int = key(8192, "padded tokens per batch: batch size x longest sequence; at least "
                                      "max_seq_len", bounds=Bounds(1))
    max_queue_delay: float = key(0.005, "seconds the first waiting unit may wait for a batch to fill",
                                 bounds=Bounds(0, 10, unit=" seconds"))
    max_queue_size: int = key(1024, "units (sequences / QA windows) waiting; more: RESOURCE_EXHAUSTED",
                              bounds=Bounds(1))
    max_seq_len: int | None = key(None, "tokens fed to the model per sequence / QA window; null: min(the "
                                        "checkpoint's position table, 512)", bounds=Bounds(8))
    doc_stride: int | None = key(
        None,
        "default overlap between QA windows (tokens); at most (max_seq_len - 4) // 2. Unset: 128, or that limit "
        "when smaller (a short-window model). For a question too long for it, the default is lowered to half the "
        "window's context room; a client's larger doc_stride is refused",
        bounds=Bounds(1), nullable=False)  # leave it out for the default; `doc_stride: null` is refused
    max_answer_len: int = key(30, "longest QA answer span, tokens", bounds=Bounds(1))
    align_to_words: bool = key(
        True,
        "QA answers widened to whole words, as transformers' QA pipeline (a request's align_to_words overrides); "
        "false: token-exact spans (better for scripts without spaces: Chinese, Japanese)")
    kserve_v1_predictions: str = key(
        "label_id",
        "a classification model's predictions on KServe v1's :predict, as KServe's huggingfaceserver: label_id (the "
        "best label's index), probabilities (its --return_probabilities: softmax by label index, 4 decimals), "
        "raw_logits (its --return_raw_logits)", choices=KSERVE_V1_PREDICTIONS)
    # per-request limits, checked before any tokenizing (service/tasks/*.validate_*; QA windows by the tokenizer)
    max_request_texts: int = key(256, "texts per Classify / Translate request (more: INVALID_ARGUMENT)",
                                 bounds=Bounds(1))
    max_request_chars: int = key(1_000_000, "characters per request, all texts (QA: question + context) together",
                                 bounds=Bounds(1))
    max_qa_windows: int = key(64, "windows per Answer request; a longer context is INVALID_ARGUMENT",
                              bounds=Bounds(1))
    max_token_windows: int = key(64, "windows per text of a token-classification request (a text longer than "
                                 "max_seq_len runs as overlapping windows); more is INVALID_ARGUMENT",
                                 bounds=Bounds(1))
    token_stride: int | None = key(
        None, "default overlap between the windows of a long token-classification text (tokens); unset: 128; "
        "lowered to half a window's room (max_seq_len - 2) // 2 when over it", bounds=Bounds(0), nullable=False)
    max_candidate_labels: int = key(64, "candidate labels per zero-shot classification request (more: "
                                    "INVALID_ARGUMENT); its texts x labels pairs also count against "
                                    "max_request_texts", bounds=Bounds(1))
    max_rerank_texts: int = key(256, "texts per rerank request, each scored with the query as one pair (more: "
                                "INVALID_ARGUMENT)", bounds=Bounds(1))
    instances: int = key(
        1,
        "worker processes of this encoder model; each backend call is split between them (by tokens; at most one "
        "part per intra-op thread the call gets), one thread each (backends/worker_pool.py); 2 on a 2-core CPU: "
        "1.1-1.35x short-sentence throughput, one more copy of the weights; torch/onnx_intra_op_threads are then "
        "shared out. More than 1 needs worker_process",
        bounds=Bounds(1, MAX_INSTANCES))
    decode_instances: int = key(
        0,
        "translation with worker_process: decode loops, each in a worker process of its own with its share of the "
        "cores; texts go to the least loaded (scheduling/decode_workers.py); 0: one per core",
        bounds=Bounds(0, MAX_INSTANCES, lo_note=" (one per core)"))
    warmup: bool = key(True, "run warm-up batches at load, before the model reports SERVING")
    length_bucketing: bool = key(True, "batch similar lengths together; false: batches in arrival order (more "
                                       "padding)")
    cost_batching: bool = key(
        True,
        "run a formed batch as the sub-batches of least predicted time (cost model fitted at warm-up and from "
        "every call: per call, per real / padded token, per n x L^2); false: as formed")
    max_request_batch_share: float = key(
        0.5,
        "one request's units per batch <= ceil(share x max_batch_size) while other requests wait (1.0: no cap); "
        "a long QA context cannot starve the short requests behind it",
        bounds=Bounds(0, 1, lo_open=True, note=" (1: no cap)"))
    max_batch_time_ms: float = key(
        20.0,
        "how long one backend call should hold the cores while another model is active: batches run in pieces "
        "expected to take <= this; with compute_scheduling fair, torch backends also yield between encoder layers "
        "after it; 0: no cap (encoder models)",
        bounds=Bounds(0, MAX_BATCH_TIME_MS, unit=" milliseconds", lo_note=" (no cap)"))
    onnx_cache_dir: Path | None = key(
        None,
        "exported graphs, keyed by checkpoint hash (null: $XDG_CACHE_HOME/relserve/onnx, ~/.cache/relserve/onnx "
        "without it); created 0700; refused if another uid owns it or group/others can write it")
    onnx_path: Path | None = key(
        None,
        "backend onnx: a directory written by `relserve export` for this checkpoint (its graphs and "
        "export_report.json), served as is instead of the cache; refused at start when the checkpoint hash it "
        "records is not that of the checkpoint at path (relative paths: as path)")
    onnx_intra_op_threads: int = key(
        0, "ONNX Runtime intra-op threads (0: the share under partition, else ONNX Runtime's default, one per core)",
        bounds=Bounds(0, MAX_THREADS, lo_note=" (ONNX Runtime's default)"))
    onnx_graph_optimization: str = key("all", "ONNX Runtime graph optimization level",
                                       choices=ONNX_GRAPH_OPTIMIZATIONS)
    onnx_parity_tolerance: float = key(
        1e-3,
        "the load-time self-check, graph vs torch on the warm-up batch, passes where |diff| <= "
        "onnx_parity_tolerance + onnx_parity_rtol * |torch|; worse refuses to serve",
        bounds=Bounds(0, math.inf, lo_open=True, hi_open=True))  # inf would switch the parity gate off
    # ONNX Runtime sums in another order than torch, so correct float32 graphs differ in proportion to the output
    # (1.5e-5 relative on a v3 classifier with logits near 40); 1e-4 leaves ~6x headroom and stays far below what
    # a wrong op gives (1e-2 relative and more). Same rtol as the export. rtol >= 1 would accept a graph that
    # outputs 0.
    onnx_parity_rtol: float = key(
        1e-4,
        "the self-check's relative tolerance (float32 differences grow with the output, e.g. logits near 40; 0: "
        "absolute only)",
        bounds=Bounds(0, 1, hi_open=True, note=" (0: absolute tolerance only)"))
    torch_intra_op_threads: int = key(
        0,
        "torch intra-op threads of this model's backend thread (0: under partition max(1, cores // active models) "
        "per call, else torch's default, one per core)",
        bounds=Bounds(0, MAX_THREADS, lo_note=" (torch's default, one per core)"))
    torch_unpadded: bool = key(
        True,
        "torch backend, DeBERTa: batches with padding run the dense layers on the real tokens only (attention "
        "core padded; models/deberta.py); false: padded")
    torch_onednn: bool = key(
        True,
        "torch backend on CPU: dense layers (nn.Linear, the feed-forward's GELU fused) call oneDNN's inner product: "
        "float32 leaves MKL's sgemm, which takes a slow generic path on AMD processors, bfloat16 gains the fused "
        "GELU (models/onednn.py); false: torch's nn.Linear")
    heap_trim_mb: int = key(
        64,
        "torch backend: after a batch that leaves its process this many MiB above its resident size after the last "
        "trim, freed heap goes back to the OS (malloc_trim; each new input shape otherwise leaves hundreds of MB "
        "held); on CPU also caps torch's per-shape kernel caches at 64 entries (LRU_CACHE_CAPACITY, "
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY, where the environment does not set them: one forward's kernels); 0: neither",
        bounds=Bounds(0, lo_note=" (never)"))
    worker_process: bool | None = key(
        None,
        "compute in a child process of the server (own GIL: the event loop's refusals no longer slow the "
        "batches; service/backends/worker.py), restarted if it dies; translation: the decode loops in "
        "decode_instances processes (service/scheduling/decode_workers.py; 2 processes on 2 shared cores: 1.2-1.7x "
        "sentences/s, lower p99, ~280 MiB each); null: true for encoder models, false for translation")
    worker_batch_timeout: float = key(
        0.0,
        "worker_process: seconds one batch may take in the worker process before it is declared hung, killed and "
        "replaced (the model NOT_SERVING and its queued calls UNAVAILABLE until the new worker has warmed); 0: 10x "
        "the cost model's prediction for that batch, at least 30 s (300 s before any prediction)",
        bounds=Bounds(0, MAX_DRAIN_SECONDS, unit=" seconds", lo_note=" (10x the prediction, at least 30 s)"))
    recycle_rss_mb: int = key(
        0,
        "worker_process: a worker process whose resident memory is above this many MiB after a batch is replaced "
        "between batches (calls queue meanwhile, none fails; the model stays ready); 0: never",
        bounds=Bounds(0, lo_note=" (never)"))
    spm_normalization: str = key(
        "spm",
        "spm.model-only tokenizers (no tokenizer.json): spm applies the model's own normaliser (nmt_nfkc), as "
        "sentencepiece and transformers 4 do; transformers5 drops it as transformers 5 does",
        choices=SPM_NORMALIZATIONS,
        choices_note=" (spm: the spm.model's own normaliser, as sentencepiece and transformers 4; transformers5: "
                     "without it, as transformers 5)")
    # translation (RNNsearch) models only
    scheduling: str = key("iteration", "translation: iteration (join/leave between decoder steps) | request",
                          choices=SCHEDULING)
    max_active_hypotheses: int = key(256, "translation: beam hypotheses decoded together per step", bounds=Bounds(1))
    encode_batch_delay_ms: float = key(
        2.0,
        "translation, iteration: newcomers wait at most this long (from the oldest's arrival) while others "
        "decode, so several share one encoder call; the loop keeps stepping meanwhile; 0: encode at the next step",
        bounds=Bounds(0, 1000, unit=" ms", note=" (0: no hold)"))
    max_source_tokens: int = key(256, "translation: longer sources are INVALID_ARGUMENT", bounds=Bounds(1))
    beam_size: int = key(5, "translation: default when a request sends 0", bounds=Bounds(1, MAX_BEAM_SIZE))
    max_len_a: float = key(2.0, "translation: default max_length = min(int(a * source_tokens + b), "
                                "max_output_tokens)", bounds=Bounds(0, MAX_LEN_A))
    max_len_b: int = key(10, "translation: b of that default", bounds=Bounds(0, MAX_LEN_B))
    max_output_tokens: int = key(256, "translation: the largest max_length a request may ask for", bounds=Bounds(1))
    length_penalty: float = key(1.0, "translation: ranking by log_prob / num_tokens ** length_penalty",
                                bounds=Bounds(0, 10))

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
        """``onnx_cache_dir``, else :func:`default_onnx_cache_dir`."""
        return self.onnx_cache_dir if self.onnx_cache_dir is not None else default_onnx_cache_dir()


def _conn(default: float | None, doc: str, flag: str, help: str) -> Any:
    return key(default, doc, bounds=_SECONDS,
               flag=Flag((flag,), help, metavar="S", group="connection"))


def _security(default: Any, doc: str, flag: str | None, help: str = "", metavar: str | None = None,
              **kwargs: Any) -> Any:
    extra = {k: kwargs.pop(k) for k in ("dest", "action") if k in kwargs}
    spec = Flag((flag,), help, metavar=metavar, group="security", **extra) if flag else None
    return key(default, doc, flag=spec, **kwargs)


@dataclass(frozen=True)
class ServerConfig:
    """The process: listeners, limits, connection management, security, and the models it serves."""

    host: str = key("0.0.0.0", "address to bind",
                    flag=Flag(("--host",), "address to bind (default {default})"))
    port: int = key(50051, "gRPC port; 0 picks a free port", bounds=Bounds(0, MAX_PORT),
                    flag=Flag(("--port",), "gRPC port (default {default}; 0 picks a free port)"))
    metrics_port: int | None = key(
        8002, "Prometheus /metrics port; 0 picks a free port; null (or negative) disables /metrics",
        bounds=Bounds(0, MAX_PORT),
        flag=Flag(("--metrics-port",), "Prometheus /metrics port (default {default}; 0 picks a free port; "
                                       "-1 disables)"))
    max_receive_message_length: int = key(
        4 * MIB, "largest gRPC message the server accepts, bytes",
        bounds=Bounds(1024, MAX_MESSAGE_BYTES, unit=" bytes", note=" (grpc's int32 channel argument)"),
        flag=Flag(("--max-message-bytes",), "max gRPC message size both ways (default {default})",
                  dest="max_message_bytes", also_sets=("max_send_message_length",)))
    max_send_message_length: int = key(
        4 * MIB, "largest gRPC message the server sends, bytes",
        bounds=Bounds(1024, MAX_MESSAGE_BYTES, unit=" bytes", note=" (grpc's int32 channel argument)"))
    # NaN would fire the exit deadline at once, and a value past threading.TIMEOUT_MAX kills that thread
    # (OverflowError), leaving a hung drain without its backstop (service/drain.py ExitDeadline).
    drain_timeout: float = key(
        30.0, "seconds in-flight calls get to finish after SIGTERM / SIGINT",
        bounds=Bounds(0, MAX_DRAIN_SECONDS, unit=" seconds"),
        flag=Flag(("--drain-timeout",), "seconds to let in-flight requests finish on SIGTERM"))
    log_level: str = key("INFO", "DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)",
                         flag=Flag(("--log-level",), "DEBUG, INFO, WARNING, ... (default {default})"))
    otlp_endpoint: str | None = key(
        None, "OpenTelemetry collector to send traces to (OTLP; http/protobuf, or grpc when OTEL_EXPORTER_OTLP_PROTOCOL "
        "is grpc), e.g. http://collector:4318; null: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT "
        "if set, else no tracing. Needs the [otel] extra",
        flag=Flag(("--otlp-endpoint",), "send OpenTelemetry traces to this OTLP collector URL (needs the [otel] "
                                        "extra)", metavar="URL"))
    compute_scheduling: str = key(
        "partition",
        "how the models share the cores (service/scheduling/cores.py): partition: concurrently, each call with "
        "max(1, cores // active models) intra-op threads (unless *_intra_op_threads is set), so a saturated model "
        "cannot slow a light one; fair: one model's backend call at a time, models in turn; shared: no "
        "coordination",
        choices=COMPUTE_SCHEDULING,
        flag=Flag(("--compute-scheduling",),
                  "how models share the cores: partition (default; models compute concurrently, each call on "
                  "cores // active models threads), fair (one model's backend call at a time, models in turn) or "
                  "shared (no coordination)"))
    gil_switch_interval_us: float | None = key(
        None,
        "sys.setswitchinterval while serving, microseconds; null: Python's 5000. 10 helps encoder-only servers (a "
        "torch thread takes the GIL back after each op) but slows translation's decode loop (service/server.py "
        "has the measurements)",
        bounds=Bounds(1.0, MAX_SWITCH_INTERVAL_US, unit=" microseconds", note=" (or null: Python's 5000)"),
        flag=Flag(("--gil-switch-interval-us",),
                  "sys.setswitchinterval while serving, in microseconds (default: Python's own, 5000): how long a "
                  "backend thread may wait to take the GIL back from the event loop; 10 speeds encoder models "
                  "under load and slows translation's decode loop", metavar="US"))
    # Connection management (grpc channel arguments: service/server.py connection_options)
    max_connection_age: float | None = _conn(
        300.0, "GOAWAY after this (+-10 % jitter): clients reconnect and re-resolve DNS, so long-lived clients of a "
        "headless Service reach replicas the autoscaler added; 0 or null: connections live forever",
        "--max-connection-age",
        "GOAWAY to each connection after S (default {default}; 0: off): clients reconnect and re-resolve DNS, so "
        "they reach replicas added later")
    max_connection_age_grace: float = _conn(
        30.0, "then in-flight calls get this long before the connection is closed", "--max-connection-age-grace",
        "in-flight calls' time after that GOAWAY before the connection closes (default {default})")
    keepalive_time: float = _conn(60.0, "server pings each connection this often (0: never) ...", "--keepalive-time",
                                  "server keepalive ping interval (default {default}; 0: no pings)")
    keepalive_timeout: float = _conn(20.0, "... and drops it when a ping is unanswered this long",
                                     "--keepalive-timeout",
                                     "drop a connection whose ping is unanswered this long (default {default})")
    keepalive_min_ping_interval: float = _conn(
        10.0, "clients may ping this often (a client keepalive_time below it gets GOAWAY too_many_pings)",
        "--keepalive-min-ping-interval",
        "shortest client keepalive interval accepted (default {default}; faster clients get GOAWAY too_many_pings)")
    keepalive_permit_without_calls: bool = key(
        True, "clients may ping connections with no call open",
        flag=Flag(("--keepalive-permit-without-calls",), "clients may ping connections without open calls "
                                                         "(default: yes)", action="boolean", group="connection"))
    # Per-call limits of the gRPC port (service/frontends/grpc_transport.py CallGuard, write_message)
    max_concurrent_rpcs: int | None = key(
        256, "gRPC calls served at once (health probes not counted); more are RESOURCE_EXHAUSTED at once, unread; "
        "null: no cap", bounds=Bounds(1, note=" (or null: no cap)"))
    max_concurrent_streams: int = key(
        100, "gRPC calls at once per connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); a client queues the rest",
        bounds=Bounds(1, MAX_MESSAGE_BYTES))
    request_read_timeout: float = key(
        60.0, "seconds a gRPC call has to send its request message after it starts; later: DEADLINE_EXCEEDED; 0: "
        "no limit", bounds=_SECONDS)
    stream_write_timeout: float = key(
        60.0, "seconds a stream message (TranslateStream) may wait for the client to read it; longer: the stream "
        "ends DEADLINE_EXCEEDED and its work is dropped; 0: no limit", bounds=_SECONDS)
    # Transport security and auth (service/auth.py): all off by default. Paths in a config file are relative
    # to that file.
    tls_cert: Path | None = _security(None, "PEM certificate chain; with tls_key: TLS on the gRPC port", "--tls-cert",
                                      "PEM certificate chain: serve gRPC over TLS (needs --tls-key)", "FILE")
    tls_key: Path | None = _security(None, "PEM private key, unencrypted", "--tls-key",
                                     "PEM private key of --tls-cert (unencrypted)", "FILE")
    tls_client_ca: Path | None = _security(
        None, "PEM CA bundle: clients must present a certificate it signed (mTLS)", "--tls-client-ca",
        "PEM CA bundle: require client certificates signed by it (mTLS; needs TLS)", "FILE")
    auth_token_file: Path | None = _security(
        None, "bearer tokens, one per line ('#' comments); calls without one are UNAUTHENTICATED",
        "--auth-token-file",
        "bearer tokens, one per line: calls without 'authorization: Bearer <token>' are UNAUTHENTICATED (health "
        "checks stay open unless auth_health: true)", "FILE")
    auth_health: bool = _security(False, "true: grpc.health.v1 on the gRPC port needs a token too", None)
    reflection: bool = _security(
        True, "grpc.reflection.v1 + v1alpha (needs a token when auth is on); false: no reflection service",
        "--no-reflection", "do not serve grpc.reflection (config key reflection: false)", action="store_false")
    metrics_host: str | None = _security(None, "address of the /metrics server (null: host); other paths are 404",
                                         "--metrics-host", "address of the /metrics server (default: --host)", "HOST")
    health_port: int | None = _security(
        None,
        "plaintext listener serving only grpc.health.v1 (kubelet probes cannot speak TLS or send tokens); 0 picks "
        "a free port; null: none", "--health-port",
        "also serve grpc.health.v1 alone, in plaintext, on PORT (for kubelet probes when TLS or auth is on; 0 "
        "picks a free port)", "PORT",
        bounds=Bounds(0, MAX_PORT, note=" (leave it out for no health-only listener)"))
    health_host: str | None = _security(
        None, "the health listener's address (null: host); the kubelet probes the pod IP, so in Kubernetes it must "
              "not be 127.0.0.1", "--health-host", "address of --health-port (default: --host)", "HOST")
    http_port: int | None = _security(
        None,
        "HTTP/JSON API (KServe v2 REST, /v1/classify, /v1/answer, /v1/translate, /metrics) on this port, same TLS "
        "and tokens as gRPC; 0 picks a free port; null: off", "--http-port",
        "also serve the HTTP/JSON API (KServe v2 REST, /v1/classify|answer|translate, /metrics) on PORT, with the "
        "gRPC port's TLS and tokens (0 picks a free port)", "PORT",
        bounds=Bounds(0, MAX_PORT, note=" (leave it out for no HTTP/JSON API)"))
    http_host: str | None = _security(None, "the HTTP listener's address (null: host)", "--http-host",
                                      "address of --http-port (default: --host)", "HOST")
    # The HTTP listener's connection hygiene (service/frontends/http_guard.py): nginx's defaults
    http_header_timeout: float = key(
        60.0, "seconds an HTTP client has to send a request's head (from the connection's start, then from the "
        "first byte of each later request); slower: the connection is closed",
        bounds=Bounds(0, MAX_CONNECTION_SECONDS, lo_open=True, unit=" seconds"))
    http_body_timeout: float = key(
        60.0, "seconds an HTTP request body may pause between two reads; longer: 408 and the connection is closed",
        bounds=Bounds(0, MAX_CONNECTION_SECONDS, lo_open=True, unit=" seconds"))
    http_keepalive_timeout: float = key(
        75.0, "seconds an idle HTTP connection stays open after a reply",
        bounds=Bounds(0, MAX_CONNECTION_SECONDS, lo_open=True, unit=" seconds"))
    http_max_connections: int | None = key(
        None, "open HTTP connections at most; more are closed at once; null: half the open-files limit (which the "
        "server raises to the hard limit at start), at most 10000",
        bounds=Bounds(1, note=" (or null: derived from the open-files limit)"))
    # The model repository (service/repository/): directories of models, loaded, swapped and unloaded while serving
    model_repositories: tuple[Path, ...] = key(
        (), "model repository directories: each sub-directory is a model (a checkpoint, or numbered version "
        "sub-directories; docs/operations.md \"Model repository\"); with any, the built-in default models are not "
        "added",
        flag=Flag(("--model-repository",), "a model repository directory (repeatable): each sub-directory is a "
                                           "model, a checkpoint or numbered versions DIR/NAME/1/, DIR/NAME/2/",
                  metavar="DIR", action="append"))
    model_control_mode: str = key(
        "none",
        "none: the repositories' models load at start, nothing changes later; poll: the repositories are re-read "
        "every repository_poll_secs (new models load, removed ones unload, new versions and changed files swap "
        "in); explicit: only load_models at start, then the repository API's load / unload",
        choices=MODEL_CONTROL_MODES,
        flag=Flag(("--model-control-mode",), "none (default), poll or explicit, as Triton's"))
    repository_poll_secs: float = key(
        15.0, "model_control_mode poll: seconds between two scans of the repositories",
        bounds=Bounds(0, MAX_DRAIN_SECONDS, lo_open=True, unit=" seconds"),
        flag=Flag(("--repository-poll-secs",), "seconds between repository scans in poll mode (default {default})",
                  metavar="S"))
    load_models: tuple[str, ...] = key(
        (), "model_control_mode explicit: the repository models loaded at start ('*': all of them)",
        flag=Flag(("--load-model",), "explicit mode: load this repository model at start (repeatable; '*': all)",
                  metavar="NAME", action="append"))
    memory_limit_mb: int = key(
        0, "MiB the loaded models' weights may take together, estimated from each checkpoint's weight files and "
        "dtype before loading (two versions count during a swap); a load over it fails and the serving version "
        "stays; 0: no limit",
        bounds=Bounds(0, lo_note=" (no limit)"),
        flag=Flag(("--memory-limit-mb",), "MiB of model weights that may be loaded at once (estimated before "
                                          "loading; 0: no limit)", metavar="MIB"))
    admin_token_file: Path | None = _security(
        None, "bearer tokens of the repository API (load / unload / index), one per line, as auth_token_file; "
        "null: that API is open without auth_token_file and refused with it", "--admin-token-file",
        "bearer tokens for the model repository API (same format as --auth-token-file)", "FILE")
    models: tuple[ModelConfig, ...] = field(default_factory=tuple)

    def model(self, name: str) -> ModelConfig:
        """The served model called ``name``.

        Raises:
            KeyError: no such model.
        """
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


SERVER_KEYS = keys(ServerConfig)
MODEL_KEYS = keys(ModelConfig)
