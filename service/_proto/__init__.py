"""Generated gRPC stubs for the .proto files under proto/ (one flat module pair per file).

The stubs are generated at build/test time (``python -m relserve.service._proto``, run by the
Makefile) and are never committed. Importing this package generates them when they are missing or
older than their .proto, so an editable install works even if the build step was skipped.

``PROTOS`` lists every file: ``proto/<dir>/<name>.proto`` becomes ``<name>_pb2`` and ``<name>_pb2_grpc``
here, the grpc module importing its message module relatively.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PROTO_TREE = _HERE.parents[1] / "proto"
# (directory under proto/, file name): relserve's own API first.
PROTOS = (
    ("relserve/v1", "inference.proto"),
)


def _outputs(name: str) -> tuple[Path, Path]:
    stem = name.removesuffix(".proto")
    return _HERE / f"{stem}_pb2.py", _HERE / f"{stem}_pb2_grpc.py"


def _stale() -> bool:
    for directory, name in PROTOS:
        source = _PROTO_TREE / directory / name
        outputs = _outputs(name)
        if not source.exists():  # installed without sources: trust what was generated at build time
            if not all(p.exists() for p in outputs):
                return True
            continue
        if any(not p.exists() or p.stat().st_mtime < source.stat().st_mtime for p in outputs):
            return True
    return False


def generate() -> None:
    """Run protoc (from grpcio-tools) on every file of ``PROTOS`` and make the grpc modules import relatively.

    Raises:
        RuntimeError: protoc failed (the message names the file).
    """
    from grpc_tools import protoc  # build-time tool; imported only when generating

    for directory, name in PROTOS:
        root = _PROTO_TREE / directory
        args = [
            "protoc",
            f"-I{root}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={_HERE}",
            f"--grpc_python_out={_HERE}",
            str(root / name),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {root / name}")
        stem = name.removesuffix(".proto")
        grpc_file = _outputs(name)[1]
        # protoc writes a top-level import (``import a_pb2 as a__pb2``); the stubs live inside this package.
        alias = stem.replace("_", "__") + "__pb2"
        text = grpc_file.read_text().replace(f"import {stem}_pb2 as {alias}", f"from . import {stem}_pb2 as {alias}")
        grpc_file.write_text(text)


if _stale():
    generate()

inference_pb2 = importlib.import_module(f"{__name__}.inference_pb2")
inference_pb2_grpc = importlib.import_module(f"{__name__}.inference_pb2_grpc")

__all__ = ["PROTOS", "inference_pb2", "inference_pb2_grpc", "generate"]

if __name__ == "__main__":  # pragma: no cover - build step
    generate()
    sys.exit(0)
