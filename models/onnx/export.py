"""ONNX export of DeBERTa-style classification, token-classification and QA checkpoints, with a parity report
against torch.

    relserve export CHECKPOINT_DIR OUT_DIR [--opset 18] [--no-parity]

writes ``OUT_DIR/model.onnx`` and ``OUT_DIR/export_report.json`` (the command line is
:mod:`relserve.models.onnx.cli`; a translation checkpoint, ``model_type`` "rnnsearch", goes to
:mod:`relserve.models.onnx.export_rnnsearch`: an encoder and a decoder-step graph).
The graph:

* comes from the dynamo exporter (``torch.onnx.export(..., dynamo=True)``) traced on a 2 x 8-token sample
  with dynamic ``batch`` and ``sequence`` axes; no sequence-length maths is frozen;
* carries the relative-position work as ``com.relserve`` nodes (:mod:`relserve.models.onnx.ops`), each with a
  model-local FunctionProto so stock ONNX Runtime runs it with no extra library;
* has exactly the inputs the model uses: ``input_ids``, ``attention_mask`` and, only when
  ``type_vocab_size > 0``, ``token_type_ids``; outputs ``logits`` (classification ``[batch, labels]``,
  token classification ``[batch, sequence, labels]``) or ``start_logits`` / ``end_logits`` (QA);
* passes ``onnx.checker.check_model(full_check=True)``.

The parity report runs the graph on ONNX Runtime (CPU) and the torch model on the same inputs: batches of
1, 2 and 4 at several lengths, including lengths past the log-bucket threshold (``position_buckets // 2``)
and 300 tokens, and one padded batch of all lengths. Over real tokens each case records the maximum
absolute difference and the maximum of ``|diff| / (atol + rtol * |torch|)`` (:mod:`relserve.models.onnx.tolerance`),
which must be at most 1 (atol 1e-4, rtol 1e-4 by default).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from ..checkpoint import checkpoint_hash, load_checkpoint
from ..deberta import DebertaConfig
from . import ops as onnx_ops
from .runtime import EXPORT_VERSION, GRAPH_NAME, METADATA_CHECKPOINT, REPORT_DIGESTS, REPORT_NAME, make_session
from .tolerance import Agreement

DEFAULT_OPSET = 18
PARITY_TOLERANCE = 1e-4  # atol: float32 graph vs torch on outputs of order 1 differs by ~1e-6 to 1e-5
# rtol: ONNX Runtime sums in another order than torch, so float32 differences grow with the output; a correct
# v3 classifier with logits near 40 differs by 6.1e-4 (1.5e-5 relative). 1e-4 leaves ~6x headroom over that
# and is still far below what a wrong op gives (relative errors of order 1e-2 to 1).
PARITY_RTOL = 1e-4
SAMPLE_BATCH, SAMPLE_LENGTH = 2, 8

__all__ = [
    "GRAPH_NAME",
    "REPORT_NAME",
    "ExportResult",
    "graph_io_names",
    "export_model",
    "export_checkpoint",
    "file_digests",
    "parity_report",
]


@dataclass
class ExportResult:
    graph: str  # path of model.onnx
    inputs: list[str]
    outputs: list[str]
    report: dict[str, Any]


_LOGITS_TASKS = ("classification", "token-classification")  # one "logits" output; QA has two


def graph_io_names(config: DebertaConfig, task: str) -> tuple[list[str], list[str]]:
    """The graph's input and output names for a model: only the inputs it uses."""
    inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if config.type_vocab_size > 0 else [])
    outputs = ["logits"] if task in _LOGITS_TASKS else ["start_logits", "end_logits"]
    return inputs, outputs


class _WithTypes(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(input_ids, attention_mask, token_type_ids)


class _WithoutTypes(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids, attention_mask)


def _max_length(config: DebertaConfig) -> int | None:
    return config.max_position_embeddings if config.position_biased_input else None


_EXPORTER_LOGGERS = ("torch.onnx", "onnxscript", "onnx_ir")  # "torchvision is not installed", pass-by-pass INFO


def max_opset() -> int:
    """The newest opset both torch's exporter declares (``torch.onnx._constants.ONNX_MAX_OPSET``) and the
    installed onnx knows; asking the exporter for more silently yields its own base opset."""
    import onnx

    top = onnx.defs.onnx_opset_version()
    try:
        from torch.onnx import _constants

        top = min(top, int(_constants.ONNX_MAX_OPSET))
    except (ImportError, AttributeError):  # pragma: no cover - a torch without the constant
        pass
    return top


def check_opset(opset: int) -> None:
    """Raises ``ValueError`` unless 17 <= ``opset`` <= :func:`max_opset`."""
    top = max_opset()
    if not 17 <= opset <= top:
        raise ValueError(f"opset {opset}: need 17..{top} (17 for LayerNormalization; {top} is the newest torch's "
                         f"exporter supports)")


def graph_opset(proto) -> int:
    """The ai.onnx opset a ModelProto imports."""
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def _drop_initializer_value_info(proto) -> None:
    """Remove ``value_info`` entries that name an initializer. They only repeat the initializer's own dims, and
    go stale when a tool rewrites that weight: ONNX Runtime's ``quantize_dynamic`` then fails in its strict
    shape inference ("Inferred shape and existing shape differ in dimension 0: (768) vs (2)" for
    ``model.classifier.weight``). Without them every shape is inferred from the initializers themselves."""
    names = {init.name for init in proto.graph.initializer}
    keep = [vi for vi in proto.graph.value_info if vi.name not in names]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(keep)


def dynamo_export(module: nn.Module, sample: dict[str, torch.Tensor], outputs: list[str], dynamic: dict, opset: int,
                  table: dict | None = None, metadata: dict[str, str] | None = None):
    """``torch.onnx.export(dynamo=True)`` of ``module(**sample)`` with our custom-op translations (plus
    ``table``), exporter chatter silenced, model-local functions added; returns the ModelProto.

    Raises:
        ValueError: an opset outside 17..newest, or one the exporter could not produce.
        RuntimeError: the graph's inputs are not ``list(sample)``.
    """
    check_opset(opset)
    onnx_ops.register_schemas()
    loggers = [logging.getLogger(n) for n in _EXPORTER_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(module, (), kwargs=sample, dynamo=True, input_names=list(sample),
                                        output_names=outputs, dynamic_shapes=dynamic, opset_version=opset,
                                        custom_translation_table={**onnx_ops.custom_translation_table(),
                                                                  **(table or {})},
                                        verbose=False, optimize=True)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    proto = program.model_proto
    if graph_opset(proto) != opset:
        raise ValueError(f"the exporter produced opset {graph_opset(proto)}, not the requested {opset} "
                         f"(some op has no opset-{opset} form); use --opset {graph_opset(proto)}")
    _drop_initializer_value_info(proto)
    onnx_ops.add_local_functions(proto)
    for key, value in (metadata or {}).items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, str(value)
    got = [i.name for i in proto.graph.input]
    if got != list(sample):
        raise RuntimeError(f"exported graph inputs {got} differ from the declared {list(sample)}")
    return proto


def export_model(
    model: nn.Module,
    config: DebertaConfig,
    task: str,
    path: str | os.PathLike,
    *,
    opset: int = DEFAULT_OPSET,
    check: bool = True,
    metadata: dict[str, str] | None = None,
):
    """Export ``model`` (ours, any device; exported on CPU in float32) to ``path``; returns the ModelProto.
    ``metadata`` goes into the graph's ``metadata_props``.

    Raises:
        ValueError: an opset outside 17..newest (see :func:`dynamo_export`).
    """
    import onnx

    inputs, outputs = graph_io_names(config, task)
    model = model.to("cpu", torch.float32).eval()
    wrapper = (_WithTypes(model) if "token_type_ids" in inputs else _WithoutTypes(model)).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, max(6, config.vocab_size), (SAMPLE_BATCH, SAMPLE_LENGTH), generator=g)
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "token_type_ids" in inputs:
        sample["token_type_ids"] = torch.zeros_like(ids)
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    seq = torch.export.Dim("sequence", min=1, max=_max_length(config) or (1 << 16))
    dynamic = {name: {0: batch, 1: seq} for name in inputs}
    proto = dynamo_export(wrapper, sample, outputs, dynamic, opset, metadata=metadata)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    onnx.save_model(proto, path)
    if check:
        onnx.checker.check_model(path, full_check=True)
    return proto


def _case_inputs(config: DebertaConfig, inputs: list[str], lengths: list[int], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    T = max(lengths)
    ids = np.zeros((len(lengths), T), dtype=np.int64)
    mask = np.zeros((len(lengths), T), dtype=np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(5, max(6, config.vocab_size), n)
        mask[b, :n] = 1
    feeds = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in inputs:
        tt = np.zeros_like(ids)
        for b, n in enumerate(lengths):
            tt[b, n // 2 : n] = 1
        feeds["token_type_ids"] = tt
    return feeds


def _torch_outputs(model: nn.Module, feeds: dict[str, np.ndarray], task: str) -> list[np.ndarray]:
    p = next(model.parameters())
    with torch.inference_mode():
        out = model(*(torch.from_numpy(feeds[k]).to(p.device) for k in feeds))
    outs = [out] if task in _LOGITS_TASKS else list(out)
    return [o.float().cpu().numpy() for o in outs]


def _agreement(got: list[np.ndarray], want: list[np.ndarray], lengths: list[int], task: str, atol: float,
               rtol: float) -> Agreement:
    agree = Agreement(atol, rtol)
    for x, y in zip(got, want):
        for i, n in enumerate(lengths):  # real tokens only: padded QA positions mean nothing
            agree.add(*((x[i], y[i]) if task == "classification" else (x[i, :n], y[i, :n])))
    return agree


def parity_cases(config: DebertaConfig) -> list[list[int]]:
    """Lengths per case: single sequences of 3 and 40 tokens, past the log-bucket threshold and at 300, batches
    of 2 and 4, and a padded batch of all lengths. Capped at the model's maximum length."""
    cap = _max_length(config) or 100_000
    lengths = [3, 40]
    if config.position_buckets > 0:
        lengths.append(config.position_buckets // 2 + 9)  # first log buckets
    lengths.append(300)
    lengths = sorted({min(n, cap) for n in lengths})
    cases = [[n] for n in lengths]
    cases += [[40, 40], [17, 17, 17, 17]]
    cases.append(list(reversed(lengths)))  # padded batch of all
    return cases


def parity_report(path: str | os.PathLike, model: nn.Module, config: DebertaConfig, task: str, *,
                  session=None, tolerance: float = PARITY_TOLERANCE, rtol: float = PARITY_RTOL,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Graph (ONNX Runtime) vs torch on :func:`parity_cases`, passing where ``|diff| <= tolerance + rtol * |torch|``.

    Returns ``{"passed", "tolerance" (= "atol"), "atol", "rtol", "max_abs_diff", "max_scaled_diff",
    "providers", "cases": [...]}``; each case has ``max_abs_diff`` and ``max_scaled_diff`` (at most 1 passes)."""
    session = session or make_session(path)
    inputs = [i.name for i in session.get_inputs()]
    cases = []
    total = Agreement(tolerance, rtol)
    for k, lengths in enumerate(parity_cases(config)):
        feeds = _case_inputs(config, inputs, lengths, seed=k)
        t0 = time.perf_counter()
        got = session.run(None, feeds)
        t_ort = time.perf_counter() - t0
        want = _torch_outputs(model, feeds, task)
        agree = _agreement(got, want, lengths, task, tolerance, rtol)
        total.merge(agree)
        cases.append({"batch": len(lengths), "lengths": lengths, "max_abs_diff": agree.max_abs_diff,
                      "max_scaled_diff": agree.max_scaled_diff, "passed": agree.passed,
                      "ort_seconds": round(t_ort, 4)})
        if progress:
            progress(f"  parity batch={len(lengths)} lengths={lengths}: max |diff| {agree.max_abs_diff:.2e}, "
                     f"scaled {agree.max_scaled_diff:.3g} {'ok' if agree.passed else 'FAIL'}")
    return {"passed": all(c["passed"] for c in cases), "tolerance": tolerance, **total.as_dict(),
            "providers": list(session.get_providers()), "cases": cases}


class ExportParityError(RuntimeError):
    """The exported graph(s) differ from torch beyond the tolerance; the staging folder is kept for inspection."""


STAGING_PREFIX = ".export-"


def file_digests(directory: str | os.PathLike) -> dict[str, str]:
    """``{file name: sha256 hex}`` of every file in ``directory`` but the export report: the graphs and any
    external-data file next to them. The report records it (``file_sha256``) and the server checks it before
    loading a graph (``service/backends/graph_cache.py``)."""
    out = {}
    for f in sorted(Path(directory).iterdir()):
        if f.is_file() and f.name != REPORT_NAME:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            out[f.name] = h.hexdigest()
    return out


@contextlib.contextmanager
def staged_dir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """A fresh hidden folder inside ``out_dir`` to export into. Its files replace those of ``out_dir`` only when
    the block succeeds, so a failed export never leaves a mix of old and new graphs that a server would pick
    up. On :class:`ExportParityError` the folder stays for inspection (the error names it); on any other
    failure it is removed. A successful export also removes folders left by earlier failed ones. The files
    lose any group/other write bit a umask such as 002 gave them: the server refuses such graph files."""
    final = Path(out_dir)
    final.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=final))
    try:
        yield tmp
    except ExportParityError:
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for f in sorted(tmp.iterdir()):
        os.chmod(f, f.stat().st_mode & ~0o022)
        os.replace(f, final / f.name)
    tmp.rmdir()
    for old in final.glob(STAGING_PREFIX + "*"):
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *, opset: int = DEFAULT_OPSET,
                      parity: bool = True, progress: Callable[[str], None] | None = print,
                      loaded=None, atol: float = PARITY_TOLERANCE, rtol: float = PARITY_RTOL) -> ExportResult:
    """Load a checkpoint, export it to ``out_dir/model.onnx``, check it, write ``export_report.json``.

    The graph records the checkpoint's hash (:func:`checkpoint_hash`) in its metadata
    (``relserve.checkpoint_sha256``), so a server can tell whose weights it carries; the report records that
    hash and the sha256 of the graph file (``file_sha256``, :func:`file_digests`). Files are written through
    :func:`staged_dir`. ``loaded`` may pass an already loaded ``LoadedCheckpoint`` (the server's ONNX backend
    does). The parity check passes where ``|graph - torch| <= atol + rtol * |torch|`` (:func:`parity_report`).

    Raises:
        relserve.models.checkpoint.CheckpointError: the checkpoint cannot be loaded.
        ValueError: an opset outside what the exporter can produce.
        RuntimeError: the parity check failed (graph and report are left in the staging folder it names;
            ``out_dir`` is unchanged).
    """
    check_opset(opset)
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    if loaded is None:
        say(f"[1/4] loading {checkpoint_dir}")
        loaded = load_checkpoint(checkpoint_dir, load_tokenizer=False)
    model, config, task = loaded.model, loaded.config, loaded.task
    model = model.to("cpu", torch.float32).eval()
    digest = checkpoint_hash(checkpoint_dir, EXPORT_VERSION)
    with staged_dir(out_dir) as out:
        say(f"[2/4] exporting {task} model ({config.num_hidden_layers} layers, hidden {config.hidden_size}) "
            f"with the dynamo exporter, opset {opset}")
        t1 = time.perf_counter()
        graph = out / GRAPH_NAME
        proto = export_model(model, config, task, graph, opset=opset, check=False,
                             metadata={METADATA_CHECKPOINT: digest})
        t_export = time.perf_counter() - t1
        say(f"[3/4] onnx.checker.check_model(full_check=True) on {GRAPH_NAME}")
        import onnx

        onnx.checker.check_model(os.fspath(graph), full_check=True)
        inputs, outputs = graph_io_names(config, task)
        custom = sorted({n.op_type for n in proto.graph.node if n.domain == onnx_ops.DOMAIN})
        report: dict[str, Any] = {
            "checkpoint": os.fspath(checkpoint_dir),
            "checkpoint_sha256": digest,
            "export_version": EXPORT_VERSION,
            "task": task,
            "opset": opset,
            "inputs": inputs,
            "outputs": outputs,
            "dynamic_axes": {"batch": 0, "sequence": 1},
            "custom_domain": onnx_ops.DOMAIN,
            "custom_ops": custom,
            "graph_bytes": graph.stat().st_size,
            REPORT_DIGESTS: file_digests(out),
            "export_seconds": round(t_export, 2),
        }
        if parity:
            say("[4/4] parity against torch (ONNX Runtime CPU, portable custom-op functions)")
            report["parity"] = parity_report(graph, model, config, task, tolerance=atol, rtol=rtol, progress=say)
        report["total_seconds"] = round(time.perf_counter() - t0, 2)
        (out / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        if parity and not report["parity"]["passed"]:
            p = report["parity"]
            raise ExportParityError(f"exported graph differs from torch beyond |diff| <= atol + rtol*|ref|: max |diff| "
                                    f"{p['max_abs_diff']:.3g}, max |diff|/(atol + rtol*|ref|) {p['max_scaled_diff']:.3g}"
                                    f" (atol {p['atol']:g}, rtol {p['rtol']:g}); {out_dir} is unchanged, the graph "
                                    f"and {REPORT_NAME} are in {out}")
    final = Path(out_dir)
    say(f"wrote {final / GRAPH_NAME} and {final / REPORT_NAME}")
    return ExportResult(graph=os.fspath(final / GRAPH_NAME), inputs=inputs, outputs=outputs, report=report)
