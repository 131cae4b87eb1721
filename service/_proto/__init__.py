"""Generated gRPC stubs for the .proto files under proto/ (one flat module pair per file).

The stubs are never committed. Where they come from:

- Wheels (``pip install .``, ``pip wheel .``, ``pip install git+...``): ``setup.py``'s ``build_py`` runs
  protoc into the build directory, so the wheel carries ``*_pb2*.py`` next to this file, plus the .proto
  files themselves as package data (``relserve/proto/<dir>/<name>.proto``, the same ``../../proto`` relative
  path as in the checkout). grpcio-tools is a build requirement only; an installed wheel never runs protoc.
- Source checkouts (editable installs; recognised by ``pyproject.toml`` beside ``proto/``): the same
  ``build_py`` generates them in place at ``pip install -e .``, ``python -m relserve.service._proto`` (the
  Makefile) regenerates them, and importing this package regenerates them when they are missing or older
  than their .proto, so editing a .proto needs no extra step. That needs grpcio-tools in the venv: the
  ``[dev]`` extra (``[test]`` includes it), which the Makefile installs.

``PROTOS`` lists every file: ``proto/<dir>/<name>.proto`` becomes ``<name>_pb2`` and ``<name>_pb2_grpc``
here, the grpc module importing its message module relatively.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from . import _protoc

_HERE = Path(__file__).resolve().parent
_PROTO_TREE = _HERE.parents[1] / "proto"
# (directory under proto/, file name): relserve's own API first.
PROTOS = (
    ("relserve/v1", "inference.proto"),
    ("kserve/v2", "grpc_predict_v2.proto"),
    ("grpc/reflection/v1", "reflection.proto"),
)


# A source checkout (editable install) has pyproject.toml two levels up; an installed wheel does not.
_CHECKOUT = (_HERE.parents[1] / "pyproject.toml").exists()


def _outputs(name: str) -> tuple[Path, Path]:
    return _protoc.outputs(_HERE, name)


def _stale() -> bool:
    for directory, name in PROTOS:
        source = _PROTO_TREE / directory / name
        outputs = _outputs(name)
        if not _CHECKOUT:
            # An installed wheel: the stubs were generated at build time. Its files' mtimes are whatever the
            # installer wrote, so they say nothing; a missing stub is a broken build (generate() then says
            # why, e.g. no grpcio-tools).
            if not all(p.exists() for p in outputs):
                return True
            continue
        if any(not p.exists() or p.stat().st_mtime < source.stat().st_mtime for p in outputs):
            return True
    return False


def generate() -> None:
    """Run protoc (from grpcio-tools) on every file of ``PROTOS`` into this package's directory.

    Raises:
        RuntimeError: grpcio-tools is missing or protoc failed (the message names the file).
    """
    _protoc.generate(PROTOS, _PROTO_TREE, _HERE)


if _stale():
    generate()

inference_pb2 = importlib.import_module(f"{__name__}.inference_pb2")
inference_pb2_grpc = importlib.import_module(f"{__name__}.inference_pb2_grpc")

__all__ = ["PROTOS", "inference_pb2", "inference_pb2_grpc", "generate"]

if __name__ == "__main__":  # pragma: no cover - build step
    generate()
    sys.exit(0)
