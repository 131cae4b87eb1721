"""ONNX Runtime backend: the same contract as :class:`TorchBackend`, running an exported graph.

Where the graph comes from, in order: ``<checkpoint>/model.onnx``, ``<checkpoint>/onnx/model.onnx`` (what
``relserve export CKPT CKPT/onnx`` writes), else ``<onnx_cache_dir>/<checkpoint sha256>/model.onnx``, exported
there on first load (:mod:`relserve.models.onnx.export`; written to a temporary directory and renamed, so a
crashed export never leaves a half graph in the cache).

Providers: CUDA first when the model's device allows it (``auto`` / ``cuda[:N]``) and both ONNX Runtime and
torch see a CUDA device, else CPU. The provider the session really got is what ``ModelMeta.device`` says
(e.g. ``CPUExecutionProvider``, ``CUDAExecutionProvider:0``), so ListModels and ``relserve_model_info`` show
it. Inputs and outputs go through IO binding as torch tensors on the session's device
(:func:`relserve.models.onnx.runtime.run_bound`): on CUDA no extra host copy, and the CPU runs the same code.
The same loading rules serve translation graphs (:mod:`.translation_onnx`).

At load the graph and the torch checkpoint run the warm-up batch (a short sequence and a full-length one);
when they differ by more than ``onnx_parity_tolerance`` the model is refused with :class:`GraphMismatch`.
Custom ops run as the graph's portable functions, or as native kernels when the library built by
``make onnx-native`` exists (``models/onnx/native/build/librelserve_onnx_ops.so``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError
from . import TASK_CLASSIFICATION, TASK_QA, ModelMeta
from .padding import pad_batch

log = logging.getLogger(__name__)
T = TypeVar("T")

NATIVE_LIBRARY = Path(__file__).resolve().parents[2] / "models" / "onnx" / "native" / "build" / "librelserve_onnx_ops.so"


class GraphMismatch(RuntimeError):
    """The ONNX graph does not reproduce the torch checkpoint; the model is not served."""


def native_library() -> str | None:
    """The native custom-op library when it has been built (``make onnx-native``), else None."""
    return os.fspath(NATIVE_LIBRARY) if NATIVE_LIBRARY.is_file() else None


def select_providers(config: ModelConfig) -> list:
    """ONNX Runtime providers for a model's ``device``: CUDA first when allowed and usable, else CPU.

    Raises:
        ConfigError: ``cuda[:N]`` was asked for but ONNX Runtime or torch sees no CUDA device.
    """
    import onnxruntime as ort

    want = config.device
    if want == "cpu":
        return ["CPUExecutionProvider"]
    import torch

    cuda = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
    if want.startswith("cuda") and not cuda:
        why = ("torch sees no CUDA device (torch.cuda.is_available() is False)"
               if "CUDAExecutionProvider" in ort.get_available_providers()
               else f"this ONNX Runtime has no CUDAExecutionProvider (it has {ort.get_available_providers()})")
        raise ConfigError(f"model {config.name!r}: device {want!r} requested but {why}")
    if not cuda:
        return ["CPUExecutionProvider"]
    index = int(want.split(":", 1)[1]) if ":" in want else 0
    return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]


def provider_device(providers: list, provider: str) -> tuple[str, str]:
    """(torch device for tensors, the label ListModels shows) of the provider a session really got."""
    if provider == "CUDAExecutionProvider":
        index = str(providers[0][1]["device_id"])
        return "cuda:" + index, f"{provider}:{index}"
    return "cpu", provider


def _export_into(cache: Path, export: Callable[[Path], None]) -> None:
    """``export(tmp)`` into a temporary directory renamed to ``cache`` (a crashed export leaves nothing)."""
    tmp = Path(tempfile.mkdtemp(prefix=cache.name[:16] + ".", dir=cache.parent))
    try:
        export(tmp)
        for f in tmp.rglob("*"):  # readable by other users of a shared cache volume, whatever the umask
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, cache)
        except OSError:  # another process won the race: use its graphs
            if not cache.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_report(config: ModelConfig, d: Path, digest: str) -> None:
    """Refuse graphs whose ``export_report.json`` names another checkpoint hash (the parity self-check only
    sees the warm-up inputs, so weights that differ elsewhere could pass it)."""
    from relserve.models.onnx.runtime import REPORT_NAME

    try:
        recorded = json.loads((d / REPORT_NAME).read_text(encoding="utf-8")).get("checkpoint_sha256")
    except (OSError, ValueError, AttributeError):
        return  # no report (a hand-placed graph): the parity self-check is the only guard
    if recorded and recorded != digest:
        raise GraphMismatch(
            f"model {config.name!r}: the ONNX graphs in {d} were exported from another checkpoint (their "
            f"{REPORT_NAME} records sha256 {recorded[:12]}..., this checkpoint is {digest[:12]}...: other weights "
            f"or config, or an older export format); re-export them with `relserve export {config.path} {d}`")


def check_graph_origin(config: ModelConfig, session, graph: Path, digest: str) -> None:
    """Refuse a graph whose metadata (``relserve.checkpoint_sha256``, written by ``relserve export``) names
    another checkpoint: exact, whatever the weights differ in. Graphs without it rely on the parity check."""
    from relserve.models.onnx.runtime import METADATA_CHECKPOINT

    recorded = session.get_modelmeta().custom_metadata_map.get(METADATA_CHECKPOINT)
    if not recorded:
        log.warning("model %r: graph %s does not record which checkpoint it was exported from; only the load-time "
                    "parity check guards it (re-export with `relserve export` to record it)", config.name, graph)
    elif recorded != digest:
        raise GraphMismatch(
            f"model {config.name!r}: graph {graph} was exported from another checkpoint (its metadata records "
            f"sha256 {recorded[:12]}..., this checkpoint is {digest[:12]}...: other weights or config, or an "
            f"older export format)")


def _open(config: ModelConfig, d: Path, open_and_check: Callable[[Path, str], T], digest: str, advice: str) -> T:
    try:
        return open_and_check(d, digest)
    except ConfigError:
        raise
    except GraphMismatch as exc:
        raise GraphMismatch(f"{exc}; {advice}") from exc
    except Exception as exc:  # ORT: unreadable protobuf, shapes that do not fit the checkpoint, ...
        text = " ".join(str(exc).split())[:600] or type(exc).__name__
        raise GraphMismatch(f"model {config.name!r}: the ONNX graphs in {d} do not work with checkpoint "
                            f"{config.path} ({type(exc).__name__}: {text}); {advice}") from exc


def load_graphs(config: ModelConfig, names: Sequence[str], export: Callable[[Path], None],
                open_and_check: Callable[[Path, str], T]) -> tuple[T, Path]:
    """Find a model's ONNX graphs (``names``, all in one directory) and return (``open_and_check(dir)``, dir).

    Where: the checkpoint directory, its ``onnx/`` folder (what ``relserve export CKPT CKPT/onnx`` writes),
    else ``<onnx_cache_dir>/<checkpoint sha256>/``, filled by ``export(tmp_dir)`` on first load.
    ``open_and_check(dir, checkpoint_sha256)`` opens the sessions, calls :func:`check_graph_origin` and raises
    :class:`GraphMismatch` when the graphs do not reproduce the checkpoint; any other error there is re-raised
    as a GraphMismatch naming the model and the directory; every GraphMismatch gets the fix appended.

    Graphs beside the checkpoint are used as they are: a directory missing one of ``names``, or whose
    ``export_report.json`` records another checkpoint hash, is refused with advice to re-export. A cache entry
    that is incomplete, unreadable or mismatching is deleted and exported again, once.
    """
    from relserve.models.checkpoint import checkpoint_hash

    path = Path(config.path)
    digest = checkpoint_hash(path)
    for d in (path, path / "onnx"):
        if os.path.lexists(d / names[0]) and not (d / names[0]).is_file():
            raise GraphMismatch(f"model {config.name!r}: {d / names[0]} is not a readable file (a directory or a "
                                f"dangling link); remove it, or re-export with `relserve export {path} {d}`")
        if (d / names[0]).is_file():
            advice = f"re-export them with `relserve export {path} {d}`"
            missing = [n for n in names if not (d / n).is_file()]
            if missing:
                raise GraphMismatch(f"model {config.name!r}: {d} has {names[0]} but not {', '.join(missing)}; "
                                    f"{advice}")
            _check_report(config, d, digest)
            result = _open(config, d, open_and_check, digest, advice)
            log.info("model %r: using the exported graphs in %s", config.name, d)
            return result, d
    root = config.resolved_onnx_cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"model {config.name!r}: onnx_cache_dir {str(root)!r} cannot be used as a directory "
                          f"({exc.strerror or exc})") from exc
    cache = root / digest
    for attempt in (1, 2):
        if not all((cache / n).is_file() for n in names):
            if cache.is_symlink() or (cache.exists() and not cache.is_dir()):
                cache.unlink()  # a stray file or link where the entry belongs
            elif cache.is_dir():
                log.warning("model %r: export cache entry %s is incomplete; exporting again", config.name, cache)
                shutil.rmtree(cache, ignore_errors=True)
            log.info("model %r: no ONNX graphs yet; exporting %s to %s", config.name, path, cache)
            _export_into(cache, export)
        try:
            result = _open(config, cache, open_and_check, digest, f"delete {cache} to export again")
            log.info("model %r: using the cached graphs in %s", config.name, cache)
            return result, cache
        except GraphMismatch as exc:
            if attempt == 2:
                raise
            log.warning("model %r: cached graphs unusable (%s); deleting %s and exporting again", config.name,
                        exc, cache)
            if cache.is_symlink():
                cache.unlink()
            else:
                shutil.rmtree(cache, ignore_errors=True)
    raise AssertionError("unreachable")


def open_with_native_fallback(name: str, open_fn: Callable[[str | None], Any]) -> tuple[Any, str | None]:
    """``open_fn(native_library())``; when the native library is present but fails to load, log it and open
    with the portable functions instead. Returns (what ``open_fn`` returned, the library used or None)."""
    lib = native_library()
    try:
        return open_fn(lib), lib
    except Exception as exc:
        if lib is None:
            raise
        log.warning("model %r: native custom-op library %s not usable (%s); using the portable functions",
                    name, lib, exc)
        return open_fn(None), None


class OnnxBackend:
    """Backend over an exported ONNX graph; see :mod:`relserve.service.backends` for the contract."""

    name = "onnxruntime"
    is_padded = True
    max_batch_size: int | None = None

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.session: Any = None
        self.meta: ModelMeta | None = None
        self.graph: Path | None = None
        self.provider = "CPUExecutionProvider"
        self.device = "cpu"
        self.max_seq_len = 0
        self.parity_diff: float | None = None
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        self._pad_id = 0
        self._vocab_size = 6
        self._lock = threading.Lock()

    # -------------------------------------------------------------- loading

    def load(self) -> ModelMeta:
        from relserve.models.checkpoint import load_checkpoint
        from relserve.models.onnx.export import export_checkpoint, graph_io_names
        from relserve.models.onnx.runtime import GRAPH_NAME, make_session

        name = self.config.name
        if self.config.dtype != "float32":
            raise ConfigError(f"model {name!r}: the onnx backend runs float32 graphs only, got dtype "
                              f"{self.config.dtype}; use backend torch for half precision")
        providers = select_providers(self.config)
        loaded = load_checkpoint(self.config.path, device="cpu")
        cfg, tok = loaded.config, loaded.tokenizer
        if loaded.task not in (TASK_CLASSIFICATION, TASK_QA):
            raise ConfigError(f"model {name!r}: task {loaded.task!r} is not served")
        self._pad_id = int(getattr(tok, "pad_token_id", 0) or 0)
        self._vocab_size = int(cfg.vocab_size)
        labels: tuple[str, ...] = ()
        if loaded.task == TASK_CLASSIFICATION:
            labels = tuple(str(cfg.id2label.get(i, f"LABEL_{i}")) for i in range(cfg.num_labels))
        limits = [x for x in (getattr(tok, "model_max_length", None), cfg.max_position_embeddings) if x]
        max_positions = int(min(limits)) if limits else None
        self.max_seq_len = self.config.resolved_max_seq_len(max_positions)

        def export(tmp: Path) -> None:
            export_checkpoint(self.config.path, tmp, parity=False, loaded=loaded,
                              progress=lambda m: log.info("model %r: %s", name, m))

        def open_and_check(d: Path, digest: str) -> str | None:
            self.graph = d / GRAPH_NAME
            self.session, lib = open_with_native_fallback(name, lambda native: make_session(
                self.graph, providers=providers, intra_op_threads=self.config.onnx_intra_op_threads,
                graph_optimization=self.config.onnx_graph_optimization, native_library=native))
            check_graph_origin(self.config, self.session, self.graph, digest)
            self.provider = self.session.get_providers()[0]
            self.device, device = provider_device(providers, self.provider)
            self._inputs = [i.name for i in self.session.get_inputs()]
            self._outputs = [o.name for o in self.session.get_outputs()]
            want_in, want_out = graph_io_names(cfg, loaded.task)
            if self._inputs != want_in or self._outputs != want_out:
                raise GraphMismatch(f"model {name!r}: graph {self.graph} has inputs {self._inputs} and outputs "
                                    f"{self._outputs}, but the checkpoint's {loaded.task} model needs {want_in} -> "
                                    f"{want_out}")
            self.meta = ModelMeta(
                task=loaded.task, family="deberta-v2", backend=self.name, device=device, dtype="float32",
                tokenizer=tok, labels=labels, problem_type=cfg.problem_type, max_positions=max_positions,
                extra={"graph": os.fspath(self.graph), "native_ops": bool(lib)},
            )
            self._self_check(loaded.model)
            return lib

        lib, _ = load_graphs(self.config, (GRAPH_NAME,), export, open_and_check)
        log.info("model %r: ONNX Runtime %s on %s (%s custom ops), parity %.2e", name, self.graph, self.provider,
                 "native" if lib else "portable", self.parity_diff)
        return self.meta

    def _warmup_batch(self) -> list[Any]:
        tok = self.meta.tokenizer
        cls_id = int(getattr(tok, "cls_token_id", 1) or 1)
        sep_id = int(getattr(tok, "sep_token_id", 2) or 2)
        # The long item strides through the whole vocabulary, so the self-check reads embedding rows everywhere.
        span = max(1, self._vocab_size - 5)
        spread = [5 + (i * 7919) % span for i in range(self.max_seq_len - 2)]
        return [_Item([cls_id, 5, 6, 7, sep_id]), _Item([cls_id] + spread + [sep_id])]

    def _self_check(self, model) -> None:
        """Graph vs torch on the warm-up batch; raises GraphMismatch beyond the tolerance."""
        import torch

        batch = self._warmup_batch()
        got = self.run(batch)
        feeds = self._feeds(batch)
        with torch.inference_mode():
            out = model(*(torch.from_numpy(feeds[k]) for k in self._inputs))
        outs = [out] if self.meta.task == TASK_CLASSIFICATION else list(out)
        want = [o.float().numpy() for o in outs]
        worst = 0.0
        for i, item in enumerate(batch):
            n = len(item.input_ids)
            if self.meta.task == TASK_CLASSIFICATION:
                worst = max(worst, float(np.max(np.abs(got[i] - want[0][i]))))
            else:
                for k in range(2):
                    worst = max(worst, float(np.max(np.abs(got[i][k] - want[k][i, :n]))))
        self.parity_diff = worst
        if not worst <= self.config.onnx_parity_tolerance:
            raise GraphMismatch(
                f"model {self.config.name!r}: ONNX graph {self.graph} differs from the torch checkpoint "
                f"{self.config.path} by {worst:.3g} on the warm-up batch (tolerance {self.config.onnx_parity_tolerance}); "
                f"refusing to serve it")

    # -------------------------------------------------------------- contract

    def warmup(self) -> None:
        if self.meta is None:
            raise RuntimeError("warmup() before load()")
        for res in self.run(self._warmup_batch()):
            if isinstance(res, Exception):
                raise res

    def _feeds(self, batch: Sequence[Any]) -> dict[str, np.ndarray]:
        ids, mask, types = pad_batch(batch, self._pad_id)
        all_feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return {k: all_feeds[k] for k in self._inputs}  # only what the graph declares (C02)

    def _run_session(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Inputs and outputs bound as torch tensors on the session's device (IO binding; the same path on
        CPU and CUDA, so the CPU tests exercise it)."""
        import torch

        from relserve.models.onnx.runtime import run_bound

        dev = torch.device(self.device)
        B, T = feeds["input_ids"].shape
        width = (len(self.meta.labels),) if self.meta.task == TASK_CLASSIFICATION else (T,)
        outs = {k: torch.empty((B,) + width, dtype=torch.float32, device=dev) for k in self._outputs}
        run_bound(self.session, {k: torch.from_numpy(v).to(dev) for k, v in feeds.items()}, outs)
        return [o.cpu().numpy() for o in outs.values()]

    def run(self, batch: Sequence[Any]) -> list[Any]:
        if self.session is None or self.meta is None:
            raise RuntimeError("run() before load()")
        lengths = [len(item.input_ids) for item in batch]
        feeds = self._feeds(batch)
        with self._lock:
            outs = self._run_session(feeds)
        if self.meta.task == TASK_QA:
            start, end = (np.asarray(o, dtype=np.float32) for o in outs)
            return [(start[i, :n].copy(), end[i, :n].copy()) for i, n in enumerate(lengths)]
        logits = np.asarray(outs[0], dtype=np.float32)
        return [logits[i].copy() for i in range(len(batch))]

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        return {}  # ONNX Runtime's arena is not observable from Python

    def close(self) -> None:
        self.session = None


class _Item:
    def __init__(self, ids: list[int]) -> None:
        self.input_ids = ids
        self.token_type_ids = [0] * len(ids)
