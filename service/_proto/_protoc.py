"""protoc over a list of .proto files, with no import-time side effects: shared by the package's
import-time generation (source checkouts) and by ``setup.py``'s ``build_py`` (wheels), which loads this file
by path before anything of relserve is importable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable


def outputs(out_dir: Path, name: str) -> tuple[Path, Path]:
    """The message and grpc module that ``name`` (``x.proto``) becomes in ``out_dir``: ``x_pb2.py``, ``x_pb2_grpc.py``."""
    stem = name.removesuffix(".proto")
    return out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2_grpc.py"


def generate(protos: Iterable[tuple[str, str]], proto_tree: Path, out_dir: Path) -> None:
    """Run protoc (grpcio-tools) on ``proto_tree/<dir>/<name>`` for every ``(dir, name)`` into ``out_dir``, and
    make each grpc module import its message module relatively (the stubs live inside a package).

    Raises:
        RuntimeError: grpcio-tools is not installed, or protoc failed (the message names the file).
    """
    try:
        from grpc_tools import protoc  # build-time tool; imported only when generating
    except ImportError as exc:
        raise RuntimeError(
            "generating the gRPC stubs needs grpcio-tools (a build requirement; in a source checkout: "
            "pip install -c constraints.txt -e '.[dev]', or reinstall the package)") from exc

    for directory, name in protos:
        root = Path(proto_tree) / directory
        args = [
            "protoc",
            f"-I{root}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(root / name),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {root / name}")
        stem = name.removesuffix(".proto")
        grpc_file = outputs(Path(out_dir), name)[1]
        # protoc writes a top-level import (``import a_pb2 as a__pb2``); the stubs live inside this package.
        alias = stem.replace("_", "__") + "__pb2"
        text = grpc_file.read_text().replace(f"import {stem}_pb2 as {alias}", f"from . import {stem}_pb2 as {alias}")
        grpc_file.write_text(text)
