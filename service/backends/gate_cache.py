"""The ``dtype: auto`` agreement gate's decisions, kept so that a server start does not run the gate again.

The gate (:mod:`.precision`) runs the gate text twice (float32, then a bfloat16 copy) and takes seconds to tens
of seconds per model; its outcome depends only on what this module puts in the decision's **key**:

* the sha256 of the checkpoint's files that the gate reads (``config.json``, the weights, the tokenizer files,
  ``calibration.jsonl``) and of the gate text it falls back to (``loadtest/data``);
* what the numbers depend on in this process: the device (a CPU's bfloat16-relevant ``/proc/cpuinfo`` flags and
  the ``RELSERVE_CPU_BF16`` mode; a CUDA device's name and capability) and the torch build (version, oneDNN);
* the relserve version, and the model keys the gate reads (its own ``dtype_gate_*`` keys, sequence and batch
  limits, QA and translation decoding keys).

Where, in order:

1. the cache entry ``<onnx_cache_dir>/dtype-gate/<key sha256>.json`` (the ONNX graph cache's directory, created
   0700 and checked like it by :mod:`.file_trust`);
2. a decision shipped beside the checkpoint, ``<checkpoint>/dtype_decision.json`` (what
   ``relserve dtype-decisions`` writes; the built-in defaults carry one), as trusted as the weights beside it;
3. else the gate runs and its decision is written to the cache (to a temporary file renamed into place).

Verification: an entry records its key in full and the sha256 of its own content (``entry_sha256``). One that
is unreadable, malformed, untrusted (a link, another uid's, group/other-writable), tampered with (digest
mismatch) or made for another key is ignored (logged) and the gate runs; the cache entry is then replaced.
Nothing in an entry is trusted beyond choosing between float32 and bfloat16 for exactly its key.

The same cache keeps, per model, the batch cost model's warm-up probe timings (``<key sha256>.probes.json``,
:func:`probe_key`: the checkpoint, what it runs on, the CPU's flags and cores, the keys that shape its calls), so
that a start on the same machine fits the cost model without running the probes (seconds per model). They are
never shipped: timings belong to one machine, and the live calls refine the fit from the first batch on.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..config import ModelConfig
from ..cpu_features import CPU_BF16_FLAGS, available_cores, cpu_bf16_mode, cpu_flags
from ..errors import ConfigError
from . import file_trust

log = logging.getLogger(__name__)

FORMAT = "relserve-dtype-gate-1"
CACHE_SUBDIR = "dtype-gate"
SHIPPED_NAME = "dtype_decision.json"
# the checkpoint files the gate's outcome depends on (those present are hashed, by name and content)
GATE_INPUT_FILES = ("config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "added_tokens.json", "spm.model", "vocab.json", "merges.txt",
                    "source.spm", "target.spm", "calibration.jsonl")
# x86 flags whose presence changes which kernels oneDNN runs in float32 or bfloat16
NUMERIC_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_int8",
                     *CPU_BF16_FLAGS)
# model keys the gate's items, batches and comparisons read
GATE_MODEL_KEYS = ("dtype", "dtype_gate_agreement", "dtype_gate_max_prob_diff", "dtype_gate_items", "max_seq_len",
                   "max_batch_size", "max_batch_tokens", "doc_stride", "max_answer_len", "align_to_words",
                   "max_qa_windows", "spm_normalization", "torch_unpadded", "max_source_tokens", "max_output_tokens",
                   "max_len_a", "max_len_b", "length_penalty")
# model keys that shape a model's backend calls (the batch cost model's probe timings depend on them)
PROBE_MODEL_KEYS = ("max_seq_len", "max_batch_size", "max_batch_tokens", "torch_unpadded", "torch_intra_op_threads",
                    "onnx_intra_op_threads", "onnx_graph_optimization", "instances", "worker_process", "heap_trim_mb")
_DTYPES = ("float32", "bfloat16")


# false while ``relserve dtype-decisions`` runs the gate afresh: a shipped decision must not stand in for it
read_shipped = True


@dataclass(frozen=True)
class Decision:
    """A kept gate decision: the dtype that serves, the gate's reason when it ran, and where it was found."""

    dtype: str
    reason: str
    where: Path


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def relserve_version() -> str:
    try:
        return metadata.version("relserve")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def device_fingerprint(device: str) -> dict[str, Any]:
    """What the gate's numbers depend on in this process besides the model: the device and the torch build.

    Raises:
        ConfigError: a bad ``RELSERVE_CPU_BF16`` value.
    """
    import torch  # only where a torch backend decides (the runner's probe key reads the version without it)

    out: dict[str, Any] = {"torch": torch.__version__, "mkldnn": bool(torch.backends.mkldnn.is_available())}
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        out.update(device="cuda", cuda_name=torch.cuda.get_device_name(index),
                   cuda_capability=list(torch.cuda.get_device_capability(index)), cuda=torch.version.cuda)
    else:
        flags = cpu_flags()
        out.update(device="cpu", cpu_flags=sorted(f for f in NUMERIC_CPU_FLAGS if f in flags),
                   cpu_bf16_mode=cpu_bf16_mode())
    return out


def gate_key(config: ModelConfig, task: str, device: str, text_files: Iterable[Path]) -> dict[str, Any]:
    """The key of ``config``'s gate decision on ``device`` (see the module doc). ``text_files``: the gate text
    files it may read (those that exist are hashed).

    Raises:
        OSError: a checkpoint file cannot be read.
        ConfigError: a bad ``RELSERVE_CPU_BF16`` value.
    """
    path = Path(config.path)
    files = {n: _sha256_file(path / n) for n in GATE_INPUT_FILES if (path / n).is_file()}
    text = {p.name: _sha256_file(p) for p in text_files if p.is_file()}
    return {
        "task": task,
        "checkpoint_files": files,
        "gate_text": text,
        "model_keys": {k: getattr(config, k) for k in GATE_MODEL_KEYS},
        "relserve": relserve_version(),
        **device_fingerprint(device),
    }


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical(key)).hexdigest()


def make_entry(key: Mapping[str, Any], dtype: str, reason: str) -> dict[str, Any]:
    """A decision entry (cache file or one of a shipped file's ``entries``), sealed with its own sha256."""
    return _seal(key, {"dtype": dtype, "reason": reason})


def _seal(key: Mapping[str, Any], payload: Mapping[str, Any], kind: str = "dtype") -> dict[str, Any]:
    body = {"format": FORMAT, "kind": kind, "key": dict(key), "key_sha256": key_digest(key), **payload,
            "decided_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return {**body, "entry_sha256": hashlib.sha256(_canonical(body)).hexdigest()}


def _valid_probes(probes: Any) -> bool:
    return isinstance(probes, list) and bool(probes) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], list) and p[0]
        and all(isinstance(n, int) and n > 0 for n in p[0]) and isinstance(p[1], (int, float)) and p[1] > 0
        for p in probes)


def check_entry(entry: Any, key: Mapping[str, Any], kind: str = "dtype") -> str | None:
    """Why ``entry`` cannot be used for ``key`` (malformed, tampered with, another key or kind), or None."""
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return f"not a {FORMAT} entry"
    body = {k: v for k, v in entry.items() if k != "entry_sha256"}
    if hashlib.sha256(_canonical(body)).hexdigest() != entry.get("entry_sha256"):
        return "its entry_sha256 does not match its content (changed after it was written)"
    if entry.get("kind", "dtype") != kind:
        return f"it is a {entry.get('kind')!r} entry, not a {kind!r} one"
    if kind == "dtype" and (entry.get("dtype") not in _DTYPES or not isinstance(entry.get("reason"), str)):
        return "its dtype or reason is malformed"
    if kind == "probes" and not _valid_probes(entry.get("probes")):
        return "its probes are malformed"
    if _canonical(entry.get("key")) != _canonical(_json_roundtrip(key)):
        theirs = entry.get("key") if isinstance(entry.get("key"), dict) else {}
        differ = sorted(k for k in set(theirs) | set(key) if _canonical(theirs.get(k)) != _canonical(
            _json_roundtrip(key).get(k)))
        return f"it was made for another key (differs in {', '.join(differ) or 'its form'})"
    return None


def _json_roundtrip(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` as it reads back from JSON (tuples become lists, Paths are refused by json: none are keys)."""
    return json.loads(_canonical(obj))


def cache_dir(config: ModelConfig) -> Path:
    return Path(os.path.abspath(config.resolved_onnx_cache_dir())) / CACHE_SUBDIR


def _read(d: Path, name: str, trusted: frozenset[int]) -> bytes | None:
    """The bytes of ``d/name`` through :mod:`.file_trust` (no link followed, owner and mode checked); None
    when missing. Raises file_trust.Refused / OSError."""
    try:
        dfd = file_trust.open_dir(d)
    except FileNotFoundError:
        return None
    try:
        return file_trust.read_file(dfd, name, d / name, trusted, missing_ok=True)
    finally:
        os.close(dfd)


def _parse(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError is one
        return None


def lookup(config: ModelConfig, key: Mapping[str, Any]) -> Decision | None:
    """The decision kept for ``key``: the cache entry, else one shipped beside the checkpoint; None when
    neither holds a usable one (each refusal logged once here, naming the file and why)."""
    digest = key_digest(key)
    where = cache_dir(config) / f"{digest}.json"
    try:
        data = _read(where.parent, where.name, file_trust.trusted_owners())
    except (file_trust.Refused, OSError, ConfigError) as exc:
        log.warning("model %r: dtype decision cache entry %s ignored: %s", config.name, where, exc)
        data = None
    if data is not None:
        entry = _parse(data)
        why = check_entry(entry, key)
        if why is None:
            return Decision(entry["dtype"], entry["reason"], where)
        log.warning("model %r: dtype decision cache entry %s ignored: %s; running the gate again", config.name,
                    where, why)
    shipped = Path(config.path) / SHIPPED_NAME
    if not read_shipped:
        return None
    try:
        data = _read(shipped.parent, shipped.name, file_trust.trusted_owners(os.stat(config.path).st_uid))
    except (file_trust.Refused, OSError) as exc:
        log.warning("model %r: shipped dtype decision %s ignored: %s", config.name, shipped, exc)
        return None
    if data is None:
        return None
    doc = _parse(data)
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        log.warning("model %r: shipped dtype decision %s ignored: no entries list", config.name, shipped)
        return None
    whys = []
    for entry in entries:
        why = check_entry(entry, key)
        if why is None:
            return Decision(entry["dtype"], entry["reason"], shipped)
        whys.append(why)
    log.info("model %r: no shipped dtype decision in %s fits this machine (%s); the gate runs", config.name, shipped,
             "; ".join(whys) or "no entries")
    return None


def store(config: ModelConfig, key: Mapping[str, Any], dtype: str, reason: str) -> Path | None:
    """Write the decision for ``key`` into the cache (temporary file renamed into place, mode 0644 in a 0700
    directory); returns its path, or None when the cache cannot be written (logged: the model still serves)."""
    return _store(config, key, make_entry(key, dtype, reason), f"{key_digest(key)}.json")


def probe_key(config: ModelConfig, meta: Any, shapes: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The key of a model's batch cost model probe timings: its checkpoint files, what it runs on (``meta``:
    backend, device, dtype; the CPU's flags and cores, the torch version), the keys that shape its calls, the
    probe ``shapes`` and the relserve version. Reads no torch module.

    Raises:
        OSError: a checkpoint file cannot be read.
    """
    path = Path(config.path)
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    flags = cpu_flags()
    return {
        "checkpoint_files": {n: _sha256_file(path / n) for n in GATE_INPUT_FILES if (path / n).is_file()},
        "runs_on": [meta.backend, meta.device, meta.dtype],
        "cpu_flags": sorted(f for f in NUMERIC_CPU_FLAGS if f in flags), "cores": available_cores(),
        "torch": torch_version, "relserve": relserve_version(),
        "model_keys": {k: getattr(config, k) for k in PROBE_MODEL_KEYS},
        "shapes": [list(s) for s in shapes],
    }


def lookup_probes(config: ModelConfig, key: Mapping[str, Any]) -> list[tuple[list[int], float]] | None:
    """The probe timings ``[(lengths, seconds)]`` kept for ``key`` in the cache, or None (a refused entry is
    logged and ignored)."""
    where = cache_dir(config) / f"{key_digest(key)}.probes.json"
    try:
        data = _read(where.parent, where.name, file_trust.trusted_owners())
    except (file_trust.Refused, OSError, ConfigError) as exc:
        log.warning("model %r: kept probe timings %s ignored: %s", config.name, where, exc)
        return None
    if data is None:
        return None
    entry = _parse(data)
    why = check_entry(entry, key, kind="probes")
    if why is not None:
        log.warning("model %r: kept probe timings %s ignored: %s; probing again", config.name, where, why)
        return None
    return [(list(lengths), float(seconds)) for lengths, seconds in entry["probes"]]


def store_probes(config: ModelConfig, key: Mapping[str, Any],
                 probes: Sequence[tuple[Sequence[int], float]]) -> Path | None:
    """Keep the probe timings for ``key`` (as :func:`store`)."""
    entry = _seal(key, {"probes": [[list(lengths), float(s)] for lengths, s in probes]}, kind="probes")
    return _store(config, key, entry, f"{key_digest(key)}.probes.json")


def _write_json(target: Path, doc: Any, prefix: str) -> None:
    """Write ``doc`` as indented, key-sorted JSON to ``target`` through a temporary file named ``prefix``... in
    the same directory, renamed over it: a reader sees the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".json", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _store(config: ModelConfig, key: Mapping[str, Any], entry: Mapping[str, Any], name: str) -> Path | None:
    d = cache_dir(config)
    target = d / name
    try:
        file_trust.make_private_dir(d.parent, f"model {config.name!r}: onnx_cache_dir")
        file_trust.make_private_dir(d, f"model {config.name!r}: dtype decision cache")
        _write_json(target, entry, ".entry.")
    except (OSError, ConfigError) as exc:
        log.warning("model %r: cannot keep %s (%s); it is measured again at the next start", config.name, target,
                    exc)
        return None
    return target


def ship(model_dir: Path, entry: Mapping[str, Any]) -> Path:
    """Add ``entry`` to ``<model_dir>/dtype_decision.json`` (replacing one of the same key; entries for other
    machines stay), written to a temporary file and renamed. Returns the file's path.

    Raises:
        OSError: the file cannot be written.
    """
    target = Path(model_dir) / SHIPPED_NAME
    entries: list[Any] = []
    if target.is_file():
        doc = _parse(target.read_bytes())
        if isinstance(doc, dict) and isinstance(doc.get("entries"), list):
            entries = [e for e in doc["entries"] if isinstance(e, dict) and e.get("key_sha256") != entry["key_sha256"]]
    entries.append(dict(entry))
    doc = {"about": "dtype: auto agreement-gate decisions for this checkpoint, one per machine class; written by "
                    "`relserve dtype-decisions` (service/backends/gate_cache.py), used when the key matches exactly",
           "entries": entries}
    _write_json(target, doc, ".dtype_decision.")
    return target
