"""The dependency rules of the package (DESIGN.md "Layout"), checked on the source and in a fresh interpreter.

Every module under models/, service/ and loadtest/ is parsed (no import runs); every import statement counts,
function-level ones included, relative ones resolved against the module's package. ``from P import n`` is an
edge to the module ``P.n`` when that is a module of the package, else to ``P``. The rules:

(a) no import cycle between the package's modules (an import moved into a function still counts);
(b) models/ imports neither service/ nor loadtest/;
(c) the scheduling and API modules (scheduling/*, frontends.grpc_v1, config, errors) import no torch, directly
    or through any relserve module they import at module level (importing a module also runs its parent
    packages' ``__init__``); also checked by importing them in a fresh interpreter;
(d) models/deberta.py and models/rnnsearch.py reach no onnx / onnxruntime / onnxscript, directly or through other
    relserve modules (function-level imports included: calling such a function would import it);
(e) product code imports nothing from tests/;
(f) the serving layers point one way, frontends -> tasks -> runtime (runner, registry) -> scheduling -> backends
    -> models, never upward; the shared modules (errors, metrics, config, auth, ...) import no layer of service/;
    no wire surface in frontends/ imports another (they share only the codec modules).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# package directory -> dotted package (pyproject's [tool.setuptools.package-dir])
PACKAGE_DIRS = {"models": "relserve.models", "service": "relserve.service", "loadtest": "relserve.loadtest"}
SCHEDULING_AND_API = ("scheduling", "scheduling.base", "scheduling.batcher", "scheduling.decode_loop",
                      "scheduling.cores", "scheduling.cost_model", "scheduling.pushback",
                      "frontends.grpc_v1", "config", "errors", "drain", "health")
MODEL_FILES = ("relserve.models.deberta", "relserve.models.rnnsearch")
ONNX_PACKAGES = {"onnx", "onnxruntime", "onnxscript"}


@dataclass(frozen=True)
class Import:
    """One import statement's target as seen from ``source`` (``line`` in its file)."""

    source: str
    target: str  # dotted name: a relserve module, or an external top-level package
    line: int
    module_level: bool  # not inside a function (module level, or a class body)
    internal: bool


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)  # relserve module -> file
    imports: list[Import] = field(default_factory=list)

    def edges(self, *, module_level_only: bool = False) -> dict[str, list[Import]]:
        out: dict[str, list[Import]] = {m: [] for m in self.modules}
        for imp in self.imports:
            if imp.internal and (imp.module_level or not module_level_only):
                out[imp.source].append(imp)
        return out


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    parts = [PACKAGE_DIRS[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


class _Collector(ast.NodeVisitor):
    """Import statements of one module as (candidate targets, most specific first; line; module level)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.depth = 0  # enclosing functions
        self.found: list[tuple[list[str], int, bool]] = []

    def _function(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            parts = alias.name.split(".")
            self.found.append(([".".join(parts[:i]) for i in range(len(parts), 0, -1)], node.lineno, self.depth == 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve_relative(self.module, self.is_package, node.level, node.module) if node.level else node.module
        for alias in node.names:
            self.found.append(([f"{base}.{alias.name}", base], node.lineno, self.depth == 0))


@lru_cache(maxsize=1)
def build_graph() -> Graph:
    """Parse every module of the package into its import graph (no module is executed)."""
    graph = Graph()
    for d in PACKAGE_DIRS:
        for path in sorted((REPO / d).rglob("*.py")):
            graph.modules[_module_name(path)] = path
    for module, path in graph.modules.items():
        collector = _Collector(module, path.name == "__init__.py")
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        for candidates, line, module_level in collector.found:
            # relserve.client is the directory service/client (pyproject's package-dir), named so here
            candidates = ["relserve.service.client" + c.removeprefix("relserve.client")
                          if c == "relserve.client" or c.startswith("relserve.client.") else c for c in candidates]
            if candidates[0].startswith("relserve."):
                target = next((c for c in candidates if c in graph.modules), None)
                if target is None:
                    raise AssertionError(f"{path.relative_to(REPO)}:{line}: {candidates[0]} is no module of the package")
                if target != module:
                    graph.imports.append(Import(module, target, line, module_level, True))
            else:
                graph.imports.append(Import(module, candidates[-1].split(".")[0], line, module_level, False))
    return graph


def _where(imp: Import) -> str:
    return f"{build_graph().modules[imp.source].relative_to(REPO)}:{imp.line}"


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def _reaches(start: str, externals: set[str], *, module_level_only: bool) -> list[list[Import]]:
    """Import chains from ``start`` to any of ``externals`` (one shortest chain per external reached)."""
    graph = build_graph()
    edges = graph.edges(module_level_only=module_level_only)
    externals_of: dict[str, list[Import]] = {m: [] for m in graph.modules}
    for imp in graph.imports:
        if not imp.internal and imp.target in externals and (imp.module_level or not module_level_only):
            externals_of[imp.source].append(imp)
    # breadth first; importing a module also runs its parent packages (implicit edges)
    chain: dict[str, list[Import]] = {start: []}
    queue = [start]
    found: dict[str, list[Import]] = {}
    while queue:
        m = queue.pop(0)
        for imp in externals_of[m]:
            found.setdefault(imp.target, chain[m] + [imp])
        nexts = [(imp.target, chain[m] + [imp]) for imp in edges[m]]
        nexts += [(p, chain[m]) for p in _parents(m) if p in graph.modules]
        for target, via in nexts:
            if target not in chain:
                chain[target] = via
                queue.append(target)
    return list(found.values())


def _show(chain: list[Import]) -> str:
    return " -> ".join(f"{imp.target} ({_where(imp)}{'' if imp.module_level else ', in a function'})" for imp in chain)


def _cycles() -> list[list[Import]]:
    """One cycle per strongly connected component of the relserve import graph (Tarjan)."""
    edges = build_graph().edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for imp in edges[v]:
            w = imp.target
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            connect(v)
    cycles = []
    for comp in components:  # a shortest way back to the component's first module
        members, start = set(comp), comp[0]
        chain: dict[str, list[Import]] = {start: []}
        queue = [start]
        cycle = None
        while queue and cycle is None:
            m = queue.pop(0)
            for imp in edges[m]:
                if imp.target == start:
                    cycle = chain[m] + [imp]
                    break
                if imp.target in members and imp.target not in chain:
                    chain[imp.target] = chain[m] + [imp]
                    queue.append(imp.target)
        cycles.append(cycle)
    return cycles


# ---------------------------------------------------------------------------------------------------------- the graph


def test_the_graph_sees_every_kind_of_import():
    """The parser itself: relative, function-level and ``from P import submodule`` imports are edges."""
    graph = build_graph()
    assert {"relserve.models.deberta", "relserve.service.scheduling.batcher", "relserve.loadtest.cli"} <= set(graph.modules)
    assert len(graph.modules) > 40
    internal = [i for i in graph.imports if i.internal]
    assert any(not i.module_level for i in internal), "no function-level import found: the parser misses them"
    assert not any(i.target.startswith("relserve.relserve") for i in internal)
    # service/frontends/grpc_transport.py: ``from .. import metrics`` is an edge to the module relserve.service.metrics
    api = {i.target for i in internal if i.source == "relserve.service.frontends.grpc_transport"}
    assert "relserve.service.metrics" in api and "relserve.service" not in api


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(
        f"  {c[0].source} -> {_show(c)}" for c in cycles)


def test_models_do_not_import_service_or_loadtest():
    bad = [imp for imp in build_graph().imports if imp.internal and imp.source.startswith("relserve.models")
           and imp.target.startswith(("relserve.service", "relserve.loadtest"))]
    assert not bad, "models/ must not import service/ or loadtest/:\n" + "\n".join(
        f"  {_where(i)}: {i.source} imports {i.target}" for i in bad)


@pytest.mark.parametrize("name", SCHEDULING_AND_API)
def test_scheduling_and_api_modules_import_no_torch(name):
    chains = _reaches(f"relserve.service.{name}", {"torch"}, module_level_only=True)
    assert not chains, f"relserve.service.{name} imports torch at import time: " + _show(chains[0])


@pytest.mark.parametrize("module", MODEL_FILES)
def test_model_files_do_not_reach_onnx(module):
    chains = _reaches(module, ONNX_PACKAGES, module_level_only=False)
    assert not chains, f"{module} reaches ONNX:\n" + "\n".join(f"  {module} -> {_show(c)}" for c in chains)


def test_product_code_imports_no_test_code():
    tests = REPO / "tests"
    # what a test run puts on sys.path: tests/ itself (conftest, the fixtures package) and each test file's folder
    test_names = {"tests", *(p.stem for p in tests.glob("*.py")),
                  *(p.parent.name for p in tests.glob("*/__init__.py")), *(p.stem for p in tests.rglob("test_*.py"))}
    bad = [imp for imp in build_graph().imports if not imp.internal and imp.target in test_names]
    assert not bad, "product code imports test modules (move what it needs into the package):\n" + "\n".join(
        f"  {_where(i)}: {i.source} imports {i.target}" for i in bad)


# ------------------------------------------------------------------------------------------ layer directions

# a request's path through service/, outermost first: a module may import its own layer or any layer after it
LAYERS = (
    ("frontends", ("relserve.service.frontends",)),
    ("tasks", ("relserve.service.tasks",)),
    ("runtime", ("relserve.service.runner", "relserve.service.registry", "relserve.service.repository")),
    ("scheduling", ("relserve.service.scheduling",)),
    ("backends", ("relserve.service.backends",)),
    ("models", ("relserve.models",)),
)
# what every layer may use and that uses no layer of service/ (models/ is a layer of its own)
SHARED = ("relserve.service.errors", "relserve.service.metrics", "relserve.service.config", "relserve.service.auth",
          "relserve.service.secrets_watch", "relserve.service.cpu_features", "relserve.service.drain", "relserve.service.health",
          "relserve.service.reflection", "relserve.service._proto", "relserve.service.tracing")
# the wiring above every layer (it builds them all): free to import any of them
WIRING = ("relserve.service", "relserve.service.server", "relserve.service.main")
# one module per wire surface; the other frontends/ modules are the codecs and transports the surfaces share
# (http_transport: the HTTP listener every HTTP surface registers its routes on)
SURFACES = ("relserve.service.frontends.grpc_v1", "relserve.service.frontends.kserve_v2_grpc",
            "relserve.service.frontends.http_v2", "relserve.service.frontends.http_v1",
            "relserve.service.frontends.kserve_v1", "relserve.service.frontends.hf_inference",
            "relserve.service.frontends.tei", "relserve.service.frontends.http_repository")


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _layer(module: str) -> int | None:
    return next((rank for rank, (_, prefixes) in enumerate(LAYERS) if _under(module, prefixes)), None)


def test_every_service_module_has_a_place():
    """A new module in service/ is put in a layer, the shared modules or the wiring, so the rules below see it."""
    homeless = [m for m in build_graph().modules if m.startswith("relserve.service") and _layer(m) is None
                and not _under(m, SHARED) and m not in WIRING and not _under(m, ("relserve.service.client",))]
    assert not homeless, f"service modules in no layer (add them to LAYERS, SHARED or WIRING): {homeless}"


def test_layers_import_only_downward():
    bad = []
    for imp in build_graph().imports:
        if not imp.internal:
            continue
        src, dst = _layer(imp.source), _layer(imp.target)
        if src is not None and dst is not None and dst < src:
            bad.append(f"  {_where(imp)}: {LAYERS[src][0]} module {imp.source} imports {LAYERS[dst][0]} module "
                       f"{imp.target}")
        elif _under(imp.source, SHARED) and (dst is not None and dst < len(LAYERS) - 1):
            bad.append(f"  {_where(imp)}: shared module {imp.source} imports the {LAYERS[dst][0]} layer ({imp.target})")
        elif src is not None and imp.target in WIRING[1:]:
            bad.append(f"  {_where(imp)}: {imp.source} imports the wiring module {imp.target}")
    assert not bad, ("imports against the direction frontends -> tasks -> runtime -> scheduling -> backends -> "
                     "models:\n" + "\n".join(bad))


def test_no_wire_surface_imports_another():
    bad = [imp for imp in build_graph().imports if imp.internal and _under(imp.source, ("relserve.service.frontends",))
           and imp.source not in SURFACES and _under(imp.target, SURFACES)
           or imp.internal and imp.source in SURFACES and _under(imp.target, SURFACES) and imp.target != imp.source]
    assert not bad, "a frontend imports a wire surface (surfaces share codecs, never each other):\n" + "\n".join(
        f"  {_where(i)}: {i.source} imports {i.target}" for i in bad)


def test_layer_rules_catch_an_upward_import(monkeypatch):
    """The checks above can fail: a backend importing a task, and one surface importing another, are found."""
    graph = build_graph()
    fake = [Import("relserve.service.backends.base", "relserve.service.tasks.classify", 1, True, True),
            Import("relserve.service.frontends.http_v2", "relserve.service.frontends.grpc_v1", 1, False, True)]
    monkeypatch.setattr(graph, "imports", graph.imports + fake)
    with pytest.raises(AssertionError, match="backends module relserve.service.backends.base imports tasks"):
        test_layers_import_only_downward()
    with pytest.raises(AssertionError, match="frontends.http_v2 imports relserve.service.frontends.grpc_v1"):
        test_no_wire_surface_imports_another()


# ---------------------------------------------------------------------------------------------- at run time

# the rule (c) modules, plus the rest of the serving path that must stay free of torch and onnxruntime until a
# backend is created
NO_TORCH_AT_IMPORT = [f"relserve.service.{n}" for n in SCHEDULING_AND_API] + [
    "relserve.service.runner", "relserve.service.metrics", "relserve.service.server", "relserve.service.main",
    "relserve.service.backends", "relserve.service.frontends.http_transport", "relserve.service.frontends.http_v2",
    "relserve.service.frontends.http_v1", "relserve.service.frontends.kserve_v2_grpc",
    "relserve.service.frontends.oip_codec", "relserve.service.tasks.classify", "relserve.service.tasks.qa",
    "relserve.service.tasks.translate", "relserve.service.frontends.kserve_v1",
    "relserve.service.frontends.hf_inference", "relserve.service.frontends.tei", "relserve.service.tasks.tokens",
]


@pytest.mark.parametrize("module", NO_TORCH_AT_IMPORT)
def test_importing_serving_modules_loads_no_torch_or_onnxruntime(module):
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        "bad = [m for m in ('torch', 'onnxruntime') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, f"importing {module}: {proc.stderr[-2000:]}"
