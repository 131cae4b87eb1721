"""Generated gRPC stubs for proto/relserve/v1/inference.proto.

The stubs are generated at build/test time (``python -m relserve.service._proto``, run by the
Makefile) and are never committed. Importing this package generates them when they are missing or
older than the .proto, so an editable install works even if the build step was skipped.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PROTO_ROOT = _HERE.parents[1] / "proto" / "relserve" / "v1"
_PROTO = _PROTO_ROOT / "inference.proto"
_OUTPUTS = (_HERE / "inference_pb2.py", _HERE / "inference_pb2_grpc.py")


def _stale() -> bool:
    if not _PROTO.exists():  # installed without sources: trust what was generated at build time
        return not all(p.exists() for p in _OUTPUTS)
    return any(not p.exists() or p.stat().st_mtime < _PROTO.stat().st_mtime for p in _OUTPUTS)


def generate() -> None:
    """Run protoc (from grpcio-tools) on the .proto and make the grpc module import relatively.

    Raises:
        RuntimeError: protoc failed.
    """
    from grpc_tools import protoc  # build-time tool; imported only when generating

    args = [
        "protoc",
        f"-I{_PROTO_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={_HERE}",
        f"--grpc_python_out={_HERE}",
        str(_PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {_PROTO}")
    grpc_file = _OUTPUTS[1]
    # protoc writes a top-level import; the stubs live inside this package.
    text = grpc_file.read_text().replace(
        "import inference_pb2 as inference__pb2", "from . import inference_pb2 as inference__pb2"
    )
    grpc_file.write_text(text)


if _stale():
    generate()

inference_pb2 = importlib.import_module(f"{__name__}.inference_pb2")
inference_pb2_grpc = importlib.import_module(f"{__name__}.inference_pb2_grpc")

__all__ = ["inference_pb2", "inference_pb2_grpc", "generate"]

if __name__ == "__main__":  # pragma: no cover - build step
    generate()
    sys.exit(0)
