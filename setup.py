"""Build hook: generate the gRPC stubs at build time (``build_py``), so a wheel carries them.

Everything else about the package is in pyproject.toml. ``PROTOS`` (the list of .proto files) is read from
service/_proto/__init__.py without importing it, and protoc runs via service/_proto/_protoc.py loaded by path:
nothing of relserve is importable while it is being built.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_PKG = ROOT / "service" / "_proto"


def _protos() -> list[tuple[str, str]]:
    tree = ast.parse((PROTO_PKG / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PROTOS" for t in node.targets):
            return [tuple(p) for p in ast.literal_eval(node.value)]
    raise RuntimeError("service/_proto/__init__.py defines no PROTOS")


def _protoc():
    spec = importlib.util.spec_from_file_location("_relserve_protoc", PROTO_PKG / "_protoc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    """build_py, then protoc into the built ``relserve/service/_proto`` (in place for editable installs)."""

    def run(self) -> None:
        super().run()
        out = PROTO_PKG if self.editable_mode else Path(self.build_lib) / "relserve" / "service" / "_proto"
        out.mkdir(parents=True, exist_ok=True)
        _protoc().generate(_protos(), ROOT / "proto", out)


setup(cmdclass={"build_py": BuildPyWithStubs})
