"""``relserve export CHECKPOINT_DIR OUT_DIR [--opset 18] [--no-parity]``: the ONNX export command line.

An encoder checkpoint (DeBERTa-v2/v3 classification or QA) goes to :mod:`relserve.models.onnx.export`
(``model.onnx``), a translation checkpoint (``model_type`` "rnnsearch") to
:mod:`relserve.models.onnx.export_rnnsearch` (``encoder.onnx`` + ``decoder_step.onnx``); both write
``export_report.json``. Exit codes: 0 ok, 1 parity failure or export error, 2 bad checkpoint, opset or OUT_DIR.
``relserve export`` and ``python -m relserve.models.onnx.cli`` are the same command.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from ..checkpoint import CheckpointError, is_translation_checkpoint
from .export import DEFAULT_OPSET, check_opset, export_checkpoint
from .export_rnnsearch import export_translation_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="HF-style DeBERTa-v2/v3 checkpoint directory, or an RNNsearch translation checkpoint")
    parser.add_argument("out", metavar="OUT_DIR", help="where model.onnx (translation: encoder.onnx, decoder_step.onnx) and export_report.json go")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (>= 17, default {DEFAULT_OPSET})")
    parser.add_argument("--no-parity", action="store_true", help="skip the parity report against torch")
    return parser


def _out_dir_problem(out: Path) -> str | None:
    """Why ``out`` could not become a directory (nothing is created here), or None."""
    p = out.absolute()
    while not os.path.lexists(p):
        p = p.parent
    if p == out.absolute():
        return None if p.is_dir() else ("it exists and is not a directory; give a directory (the graphs and "
                                        "export_report.json are written inside it)")
    if not p.is_dir():
        return f"{p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable"
    return None


def _parity_line(report: dict[str, Any]) -> str:
    """One summary line of a report's parity section (encoder-task or translation report)."""
    parity = report["parity"]
    cases = parity["cases"]
    worst = max(max(c.get("max_abs_diff", 0.0), c.get("encoder_max_abs_diff", 0.0),
                    c.get("decoder_step_max_abs_diff", 0.0)) for c in cases)
    line = (f"parity: {len(cases)} cases, max |diff| {worst:.2e}, max |diff|/(atol + rtol*|ref|) "
            f"{parity['max_scaled_diff']:.3g} (atol {parity['atol']:g}, rtol {parity['rtol']:g})")
    if "search" in parity:
        line += "; searches " + ", ".join(f"{k} {'identical' if v['identical_tokens'] else 'DIFFER'}"
                                          for k, v in parity["search"].items())
    return line


def run(args: argparse.Namespace) -> int:
    """``relserve export`` body. Exit codes: 0 ok, 1 parity failure or export error, 2 bad checkpoint, opset or
    OUT_DIR."""
    try:
        check_opset(args.opset)
    except ValueError as exc:
        print(f"relserve export: {exc}", file=sys.stderr)
        return 2
    problem = _out_dir_problem(Path(args.out))
    if problem:
        print(f"relserve export: cannot create OUT_DIR {args.out!r}: {problem}", file=sys.stderr)
        return 2
    try:
        if is_translation_checkpoint(args.checkpoint):
            report = export_translation_checkpoint(args.checkpoint, args.out, opset=args.opset,
                                                   parity=not args.no_parity)
        else:
            report = export_checkpoint(args.checkpoint, args.out, opset=args.opset, parity=not args.no_parity).report
    except CheckpointError as exc:  # TranslationCheckpointError is one
        print(f"relserve export: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as exc:
        print(f"relserve export: {exc}", file=sys.stderr)
        return 1
    if "parity" in report:
        print(_parity_line(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="relserve export",
        description="export a checkpoint to ONNX (custom relative-position ops) with a parity report against torch"))
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
