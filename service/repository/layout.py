"""What a model repository directory holds (no torch; file system reads only).

A repository ``DIR`` is scanned (:func:`scan`) into one :class:`RepoModel` per sub-directory ``DIR/NAME/``:

* ``DIR/NAME/config.json`` present: the directory is one checkpoint, version ``"1"``;
* else every ``DIR/NAME/<positive integer>/`` is a version (each a checkpoint directory).

``DIR/NAME/relserve.yaml`` (optional) holds model config keys exactly as a ``models:`` entry of the server config
(without ``name`` and ``path``; validated by the same code, relative paths relative to ``DIR/NAME``) plus
``version_policy``: ``{latest: N}`` (default ``{latest: 1}``), ``all`` or ``{specific: [1, 3]}``, as Triton's.

A model the scan refuses keeps its place in the result with :attr:`RepoModel.problem` set (the index lists it
with that reason; the rest of the repository loads): a name that is not a model name, a directory or file that
is a symbolic link resolving outside its repository, a version directory whose name is not a positive integer,
a ``relserve.yaml`` that does not parse or names an unknown key, the same name in two repositories. Hidden
entries (``.git``, Kubernetes' ``..data`` of a ConfigMap volume) and ``lost+found`` are skipped; files beside the
versions are ignored.

Each version carries a fingerprint (relative path, size and mtime in ns of every file under it), so a poll sees
a changed file. :func:`estimate_weight_bytes` estimates a checkpoint's weight memory from its files, before any
loading (``memory_limit``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..config.loader import model_from_mapping
from ..config.schema import MODEL_KEYS, NAME_RE, ModelConfig
from ..errors import ConfigError, InvalidArgument

POLICY_FILE = "relserve.yaml"
CHECKPOINT_MARKER = "config.json"
# entries of a repository or a model directory that are not models / versions (a PVC's root, VCS data)
SKIPPED = ("lost+found",)
# bytes per weight of each dtype as served; auto may keep float32 (its gate falls back to it), int8 keeps the
# float32 graph beside the quantized one: both count as float32
DTYPE_BYTES = {"float32": 4, "auto": 4, "int8": 4, "float16": 2, "bfloat16": 2}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1}
Fingerprint = tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions serve: the ``latest`` N, ``all``, or the ``specific`` ones."""

    kind: str = "latest"  # "latest" | "all" | "specific"
    latest: int = 1
    specific: tuple[int, ...] = ()

    def select(self, versions: Sequence[str]) -> list[str]:
        """The served versions among ``versions`` (numbers as text), ascending."""
        ordered = sorted(versions, key=int)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if int(v) in self.specific]
        return ordered[-self.latest:]

    def describe(self) -> str:
        return {"all": "all", "specific": f"specific {list(self.specific)}"}.get(self.kind, f"latest {self.latest}")


@dataclass(frozen=True)
class RepoVersion:
    """One version directory of a model."""

    version: str          # a positive integer as text ("1" for a model that is one checkpoint)
    path: Path            # the checkpoint directory
    fingerprint: Fingerprint


@dataclass(frozen=True)
class RepoModel:
    """One model of a repository; ``problem`` set: refused by the scan (nothing of it loads)."""

    name: str
    repository: Path      # the repository directory as configured
    path: Path            # DIR/NAME
    versions: dict[str, RepoVersion] = field(default_factory=dict)  # by version, ascending
    policy: VersionPolicy = VersionPolicy()
    options: Mapping[str, Any] = field(default_factory=dict)  # model keys from relserve.yaml
    problem: str = ""

    def selected(self) -> list[str]:
        """The versions its policy serves, ascending."""
        return self.policy.select(list(self.versions))

    def config(self, version: str, overrides: Mapping[str, Any] | None = None) -> ModelConfig:
        """The model config of ``version``: relserve.yaml's keys, then ``overrides`` (the load API's ``config``).

        Raises:
            ConfigError: a key unknown or out of range (names it and the model's directory).
        """
        raw = {**self.options, **(overrides or {}), "name": self.name, "path": str(self.versions[version].path)}
        return model_from_mapping(raw, self.path, f"repository model {self.name!r} ({str(self.path)!r})")


def check_name(name: str) -> None:
    """A model name as a request gives it (the load / unload API).

    Raises:
        InvalidArgument: empty, a path (separators, ``..``), or not a model name (same rule as ModelConfig.name).
    """
    if not name:
        raise InvalidArgument("model name is empty")
    shown = repr(name[:64])
    if "/" in name or "\\" in name or os.sep in name or name in (".", "..") or ".." in name:
        raise InvalidArgument(f"model name {shown} is a path (separators or '..'); give the name of a directory "
                              f"of the repository")
    if not NAME_RE.match(name):
        raise InvalidArgument(f"model name {shown} must match {NAME_RE.pattern}")


def _outside(path: Path, root_real: str) -> bool:
    """Whether ``path`` resolves (symbolic links followed) outside the repository ``root_real``."""
    real = os.path.realpath(path)
    return real != root_real and not real.startswith(root_real.rstrip(os.sep) + os.sep)


def fingerprint(path: Path, root_real: str) -> Fingerprint:
    """(relative path, size, mtime_ns) of every file under ``path``, sorted.

    Raises:
        ConfigError: a file or directory under it is a symbolic link resolving outside the repository.
    """
    rows = []
    # links are followed, so a link to a directory above it (``ln -s . a``) would be walked again at every
    # level: each real directory is walked once (two such links made the walk exponential)
    seen = {os.path.realpath(path)}
    for base, dirs, files in os.walk(path, followlinks=True):
        for d in list(dirs):
            if _outside(Path(base) / d, root_real):
                raise ConfigError(f"{str(Path(base) / d)!r} is a symbolic link out of the repository")
            real = os.path.realpath(Path(base) / d)
            if real in seen:
                dirs.remove(d)
            else:
                seen.add(real)
        for f in files:
            full = Path(base) / f
            if _outside(full, root_real):
                raise ConfigError(f"{str(full)!r} is a symbolic link out of the repository")
            try:
                st = full.stat()
            except OSError:  # removed between the listing and the stat: the next poll sees the change
                continue
            rows.append((str(full.relative_to(path)), st.st_size, st.st_mtime_ns))
    return tuple(sorted(rows))


def parse_policy(value: Any, where: str) -> VersionPolicy:
    """``version_policy`` of relserve.yaml.

    Raises:
        ConfigError: not ``all``, ``{latest: N >= 1}`` or ``{specific: [positive integers]}``.
    """
    if value == "all" or value == {"all": {}} or value == {"all": None}:
        return VersionPolicy("all")
    if isinstance(value, dict) and len(value) == 1:
        (kind, arg), = value.items()
        if kind == "latest" and isinstance(arg, int) and not isinstance(arg, bool) and arg >= 1:
            return VersionPolicy("latest", latest=arg)
        if kind == "specific" and isinstance(arg, list) and arg and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in arg):
            return VersionPolicy("specific", specific=tuple(sorted(set(arg))))
    raise ConfigError(f"{where}: version_policy must be all, {{latest: N}} (N >= 1) or {{specific: [1, 3]}} "
                      f"(positive version numbers), got {value!r}")


def _read_policy_file(model_dir: Path) -> tuple[VersionPolicy, dict[str, Any]]:
    """relserve.yaml's version policy and model keys (defaults when the file is absent).

    Raises:
        ConfigError: unreadable, not YAML, not a mapping, an unknown key, a bad version_policy.
    """
    path = model_dir / POLICY_FILE
    if not path.exists():
        return VersionPolicy(), {}
    where = str(path)
    try:
        import yaml

        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{where!r} cannot be read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where!r} is not valid YAML: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where!r}: top level must be a mapping of model keys")
    allowed = set(MODEL_KEYS) - {"name", "path"}
    unknown = sorted(str(k) for k in set(raw) - allowed - {"version_policy"})
    if unknown:
        raise ConfigError(f"{where!r}: unknown key(s) {unknown}; allowed: version_policy and {sorted(allowed)}")
    policy = parse_policy(raw.pop("version_policy"), repr(where)) if "version_policy" in raw else VersionPolicy()
    return policy, raw


def _scan_model(repository: Path, root_real: str, model_dir: Path) -> RepoModel:
    """One ``DIR/NAME`` (see the module docstring); a refusal becomes ``problem``."""
    name = model_dir.name

    def refused(why: str) -> RepoModel:
        return RepoModel(name=name, repository=repository, path=model_dir, problem=why)

    if not NAME_RE.match(name):
        return refused(f"{str(model_dir)!r}: {name!r} is not a model name (it must match {NAME_RE.pattern})")
    if _outside(model_dir, root_real):
        return refused(f"{str(model_dir)!r} is a symbolic link out of the repository")
    try:
        policy, options = _read_policy_file(model_dir)
        if (model_dir / CHECKPOINT_MARKER).exists():
            dirs = {"1": model_dir}
        else:
            dirs = {}
            for entry in sorted(model_dir.iterdir()):
                if entry.name.startswith(".") or entry.name in SKIPPED or not entry.is_dir():
                    continue
                if not (entry.name.isdigit() and entry.name.isascii() and int(entry.name) >= 1):
                    raise ConfigError(f"{str(entry)!r}: a version directory's name must be a positive integer "
                                      f"(or the model directory must hold {CHECKPOINT_MARKER} itself)")
                if str(int(entry.name)) in dirs:
                    raise ConfigError(f"{str(entry)!r}: version {int(entry.name)} appears twice")
                dirs[str(int(entry.name))] = entry
        versions = {}
        for v in sorted(dirs, key=int):
            if _outside(dirs[v], root_real):
                raise ConfigError(f"{str(dirs[v])!r} is a symbolic link out of the repository")
            versions[v] = RepoVersion(v, dirs[v], fingerprint(dirs[v], root_real))
        model = RepoModel(name=name, repository=repository, path=model_dir, versions=versions, policy=policy,
                          options=options)
        if versions:  # relserve.yaml's keys checked now, against a real version directory
            try:
                model.config(sorted(versions, key=int)[-1])
            except ConfigError as exc:
                raise ConfigError(f"{str(model_dir / POLICY_FILE)!r}: {exc}") from None
        return model
    except ConfigError as exc:
        return refused(str(exc))
    except OSError as exc:
        return refused(f"{str(model_dir)!r} cannot be read ({exc.strerror or exc})")


def scan(repositories: Sequence[Path]) -> dict[str, RepoModel]:
    """Every model of ``repositories``, by name (sorted).

    A name found in two repositories is kept once, refused (``problem`` names both directories).

    Raises:
        ConfigError: a repository is not a readable directory (checked at start too).
    """
    found: dict[str, RepoModel] = {}
    for repo in repositories:
        repo = Path(repo)
        if not repo.is_dir():
            raise ConfigError(f"model repository {str(repo)!r} is not a directory")
        root_real = os.path.realpath(repo)
        try:
            entries = sorted(repo.iterdir())
        except OSError as exc:
            raise ConfigError(f"model repository {str(repo)!r} cannot be listed ({exc.strerror or exc})") from None
        for entry in entries:
            if entry.name.startswith(".") or entry.name in SKIPPED or not entry.is_dir():
                continue
            model = _scan_model(repo, root_real, entry)
            if model.name in found:
                first = found[model.name]
                found[model.name] = RepoModel(
                    name=model.name, repository=first.repository, path=first.path,
                    problem=f"model {model.name!r} is in two repositories ({str(first.path)!r} and "
                            f"{str(entry)!r}); rename one")
                continue
            found[model.name] = model
    return dict(sorted(found.items()))


def estimate_weight_bytes(config: ModelConfig) -> int:
    """Bytes the weights of ``config``'s checkpoint take once loaded, before loading: the tensors of
    ``model.safetensors`` (from its header) at the served dtype's width (:data:`DTYPE_BYTES`), else
    ``pytorch_model.bin``'s size (taken as float32) scaled the same way; times ``instances`` (each worker
    process holds a copy). Tokenizers, activations and the runtime itself are not counted.

    Raises:
        OSError: the weights cannot be read (the load fails on it too).
    """
    width = DTYPE_BYTES.get(config.dtype, 4)
    root = Path(config.path)
    st = root / "model.safetensors"
    total = 0
    if st.exists():
        with open(st, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            try:
                header = json.loads(fh.read(min(n, 100 << 20)).decode("utf-8"))
            except ValueError:
                header = {}
        for name, entry in (header.items() if isinstance(header, dict) else ()):
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            count = 1
            for d in entry.get("shape", []):
                count *= int(d)
            is_float = str(entry.get("dtype", "F32")).startswith(("F", "BF"))
            total += count * (width if is_float else _SAFETENSORS_BYTES.get(str(entry.get("dtype")), 4))
    elif (root / "pytorch_model.bin").exists():
        total = (root / "pytorch_model.bin").stat().st_size * width // 4
    return total * max(1, config.instances)
