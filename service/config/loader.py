"""Where configuration is read: the YAML file, the ``relserve serve`` flags, ``--model`` specs and a KServe model
directory with its ``RELSERVE_MODEL_*`` variables, merged into the one :class:`ServerConfig` of a process.

Precedence: built-in defaults < ``--config FILE`` < command-line flags. Models come from the file's ``models:``
section, from ``--model NAME=DIR[,key=value...]`` and from ``--model-dir`` (a command-line entry with the same
name as a file entry replaces it). With no model anywhere, the default models shipped in ``<repo>/defaults/`` are
served. docs/configuration.md describes every key.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import ConfigError
from . import model_dir
from .schema import (
    DEFAULT_MODELS, DEFAULTS_DIR, FLAG_GROUPS, MODEL_KEYS, OPTIONAL_DEFAULT_MODELS, SERVER_KEYS, KeySpec,
    ModelConfig, ServerConfig, number,
)
from .validation import validate_model, validate_server

# Every ServerConfig field name, "models" included (named in the unknown-key refusal).
_SERVER_FIELDS = {*SERVER_KEYS, "models"}
# Server keys naming files: relative paths are relative to the config file (flags: to the cwd).
_SERVER_PATH_KEYS = tuple(name for name, spec in SERVER_KEYS.items() if spec.is_path)


def _coerce(where: str, spec: KeySpec, value: Any) -> Any:
    """``value`` as the key's type (YAML and ``key=value`` strings alike), or ConfigError naming the key; a list
    key takes a list (or one value) and gives a tuple."""
    key, typ = spec.name, spec.type
    if spec.is_list:
        if value is None:
            return ()
        items = value if isinstance(value, (list, tuple)) else [value]
        one = dataclasses.replace(spec, is_list=False, nullable=False)
        return tuple(_coerce(where, one, item) for item in items)
    if value is None and spec.nullable:
        return None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(.inf)
            raise ConfigError(f"{where}: {key} must be an integer, got {value!r}") from None
    if typ is float:
        # bool is an int subclass: float(True) == 1.0 would turn `max_queue_delay: true` into one second
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be a number, got {str(value).lower()}")
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an integer past float's range
            raise ConfigError(f"{where}: {key} must be a number, got {value!r}") from None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key} must be a string, got {value!r}")
    return value


def _model_from_mapping(raw: Mapping[str, Any], base_dir: Path, where: str) -> ModelConfig:
    unknown = set(raw) - set(MODEL_KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(MODEL_KEYS)}"
        )
    for key in ("name", "path"):
        if key not in raw or raw[key] in (None, ""):
            raise ConfigError(f"{where}: {key!r} is required")
    values = {k: _coerce(where, MODEL_KEYS[k], v) for k, v in raw.items()}
    path = Path(values["path"]).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    values["path"] = path
    if values.get("onnx_cache_dir") is not None:
        if not str(values["onnx_cache_dir"]).strip():
            raise ConfigError(f"{where}: onnx_cache_dir is empty; give a directory, or leave the key out for the "
                              f"default cache")
        cache = Path(values["onnx_cache_dir"]).expanduser()
        values["onnx_cache_dir"] = cache if cache.is_absolute() else base_dir / cache
    if values.get("onnx_path") is not None:
        graphs = Path(values["onnx_path"]).expanduser()
        values["onnx_path"] = graphs if graphs.is_absolute() else base_dir / graphs
    return validate_model(ModelConfig(**values))


def model_from_mapping(raw: Mapping[str, Any], base_dir: Path, where: str) -> ModelConfig:
    """One model entry (``name``, ``path`` and any model keys, as a ``models:`` entry of the config file) ->
    a validated :class:`ModelConfig`; relative paths are relative to ``base_dir``, messages start with ``where``.

    Raises:
        ConfigError: an unknown key, a missing name or path, a value of the wrong type or out of range.
    """
    return _model_from_mapping(raw, base_dir, where)


def parse_model_spec(spec: str, base_dir: Path | None = None) -> dict[str, Any]:
    """``NAME=DIR[,key=value...]`` (the ``--model`` flag) -> a raw model mapping.

    Raises:
        ConfigError: the spec is malformed.
    """
    head, *rest = spec.split(",")
    if "=" not in head:
        raise ConfigError(f"--model {spec!r}: expected NAME=DIR[,key=value...]")
    name, path = (s.strip() for s in head.split("=", 1))
    raw: dict[str, Any] = {"name": name, "path": path}
    for item in rest:
        if "=" not in item:
            raise ConfigError(f"--model {spec!r}: option {item!r} is not key=value")
        key, value = (s.strip() for s in item.split("=", 1))
        if key in ("name", "path"):
            raise ConfigError(f"--model {spec!r}: {key} is given by NAME=DIR, not as an option")
        raw[key] = value
    # checked here, not only in _model_from_mapping: name and path are refused as options, so the list of
    # allowed option keys must leave them out (as --model-options does)
    unknown = set(raw) - set(MODEL_KEYS)
    if unknown:
        raise ConfigError(f"--model {spec!r}: unknown key(s) {sorted(unknown)}; "
                          f"allowed: {sorted(set(MODEL_KEYS) - {'name', 'path'})}")
    return raw


def load_config(
    config_file: str | Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    model_specs: Sequence[str] = (),
    dir_models: Sequence[tuple[str, Mapping[str, Any]]] = (),
    defaults_dir: Path = DEFAULTS_DIR,
) -> ServerConfig:
    """Build the one :class:`ServerConfig` of a process.

    Args:
        config_file: YAML file (optional).
        overrides: server-level keys from the command line; None values are ignored.
        model_specs: ``--model NAME=DIR[,key=value...]`` strings; relative DIRs are relative to the cwd.
        dir_models: ``(where, raw model mapping)`` entries of ``--model-dir`` (:func:`model_dir.dir_models`);
            like ``--model`` entries they replace file entries of the same name.
        defaults_dir: where the built-in default models live (``<repo>/defaults``).

    Raises:
        ConfigError: anything invalid, with a message naming the key and the allowed values.
    """
    raw: dict[str, Any] = {}
    base_dir = Path.cwd()
    if config_file is not None:
        path = Path(config_file)
        try:
            import yaml

            loaded = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r}: top level must be a mapping")
        raw = dict(loaded)
        base_dir = path.resolve().parent

    models_raw = raw.pop("models", None) or []
    if isinstance(models_raw, dict):  # also accept {name: {path: ..., ...}}
        models_raw = [{"name": k, **(v or {})} for k, v in models_raw.items()]
    if not isinstance(models_raw, list):
        raise ConfigError("models must be a list of model entries")

    unknown = set(raw) - set(SERVER_KEYS)
    if unknown:
        raise ConfigError(f"config: unknown key(s) {sorted(unknown)}; allowed: {sorted(_SERVER_FIELDS)}")
    for key in _SERVER_PATH_KEYS:  # a config file's paths are relative to the file
        raw[key] = _server_paths(key, raw[key], base_dir) if key in raw else None
        if raw[key] is None:
            del raw[key]
    for key, value in (overrides or {}).items():
        if value is not None:
            if key not in SERVER_KEYS:
                raise ConfigError(f"unknown server option {key!r}")
            raw[key] = _server_paths(key, value, Path.cwd()) if key in _SERVER_PATH_KEYS else value
    server_values = {k: _coerce("config", SERVER_KEYS[k], v) for k, v in raw.items()}
    for key in _SERVER_PATH_KEYS:
        if server_values.get(key) is not None:
            value = server_values[key]
            server_values[key] = tuple(Path(v) for v in value) if SERVER_KEYS[key].is_list else Path(value)

    models: dict[str, ModelConfig] = {}
    for i, entry in enumerate(models_raw):
        if not isinstance(entry, dict):
            raise ConfigError(f"models[{i}] must be a mapping with at least name and path")
        m = _model_from_mapping(entry, base_dir, f"models[{i}] ({entry.get('name', '?')})")
        if m.name in models:
            raise ConfigError(f"model name {m.name!r} appears twice in models")
        models[m.name] = m
    from_cli: set[str] = set()
    for spec in model_specs:
        m = _model_from_mapping(parse_model_spec(spec), Path.cwd(), f"--model {spec!r}")
        if m.name in from_cli:
            raise ConfigError(f"--model names must be unique: {m.name!r} is given twice")
        from_cli.add(m.name)
        models[m.name] = m  # the command line replaces a file entry of the same name
    for where, entry in dir_models:
        m = _model_from_mapping(entry, Path.cwd(), where)
        if m.name in from_cli:
            raise ConfigError(f"{where}: model name {m.name!r} is also given by --model")
        from_cli.add(m.name)
        models[m.name] = m
    if not models and not server_values.get("model_repositories"):  # a repository server may start with none
        for name, sub in DEFAULT_MODELS:
            path = defaults_dir / sub
            if not path.is_dir():
                raise ConfigError(
                    f"no model configured and the default model directory {str(path)!r} is missing; "
                    f"pass --model NAME=DIR or a config file with models"
                )
            models[name] = validate_model(ModelConfig(name=name, path=path))
        for name, sub in OPTIONAL_DEFAULT_MODELS:
            path = defaults_dir / sub
            if (path / "config.json").is_file():
                models[name] = validate_model(ModelConfig(name=name, path=path))

    cfg = ServerConfig(**server_values, models=tuple(models.values()))
    return validate_server(cfg)


def _server_paths(key: str, value: Any, base_dir: Path) -> Any:
    """:func:`_server_path` of a file key's value, or of each item of a list key's."""
    if SERVER_KEYS[key].is_list and isinstance(value, (list, tuple)):
        return [_server_path(key, v, base_dir) for v in value]
    return _server_path(key, value, base_dir)


def _server_path(key: str, value: Any, base_dir: Path) -> Any:
    """A file key's value made absolute against ``base_dir`` (non-strings are left for _coerce to refuse)."""
    if not isinstance(value, str):
        return value
    if not value.strip():
        raise ConfigError(f"{key} is empty; give a file, or leave the key out")
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else base_dir / path)


def add_config_flags(serve: argparse.ArgumentParser) -> None:
    """The ``relserve serve`` flags that feed :func:`config_from_args`: ``--config``, ``--model``, the model
    directory flags, and one flag per server key that declares one (schema ``Flag``)."""
    serve.add_argument("--config", metavar="FILE", help="YAML config file (flags below override it)")
    serve.add_argument("--model", action="append", default=[], metavar="NAME=DIR[,key=value...]",
                       help="serve the checkpoint DIR as NAME, e.g. --model sst2=./ckpt,max_batch_size=8 "
                            "(repeatable; default: the built-in models in defaults/)")
    kserve = serve.add_argument_group(
        "model directory (KServe: the storage initializer's /mnt/models; each flag falls back to the environment "
        "variable named, see service/config/model_dir.py)")
    kserve.add_argument("--model-dir", "--model_dir", dest="model_dir", metavar="DIR",
                        help="a checkpoint (DIR/config.json: one model, named by --model-name) or one checkpoint "
                             f"sub-directory per model, named after it [${model_dir.ENV_DIR}]")
    kserve.add_argument("--model-name", "--model_name", dest="model_name", metavar="NAME",
                        help=f"name of a single-checkpoint --model-dir (KServe: {{{{.Name}}}}) [${model_dir.ENV_NAME}]")
    kserve.add_argument("--model-options", "--model_options", dest="model_options", metavar="KEY=VALUE,...",
                        action="append", default=[],
                        help="model config keys for every model of --model-dir, e.g. device=cuda,dtype=float16 "
                             f"(repeatable, later keys win; after those of ${model_dir.ENV_OPTIONS})")
    groups = {name: serve.add_argument_group(title) for name, title in FLAG_GROUPS.items()}
    for spec in SERVER_KEYS.values():
        flag = spec.flag
        if flag is None:
            continue
        target = groups[flag.group] if flag.group else serve
        common = {"dest": flag.dest or spec.name, "help": flag.help.replace("{default}", number(spec.default))}
        if flag.action == "store_false":
            target.add_argument(*flag.names, action="store_const", const=False, default=None, **common)
        elif flag.action == "boolean":
            target.add_argument(*flag.names, action=argparse.BooleanOptionalAction, default=None, **common)
        elif flag.action == "append":  # a list key: the flag repeated; absent leaves the file's list alone
            target.add_argument(*flag.names, metavar=flag.metavar, action="append", default=None, **common)
        else:
            typed = {"type": spec.type} if spec.type in (int, float) else {}
            target.add_argument(*flag.names, metavar=flag.metavar, choices=spec.choices, **typed, **common)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """The one place command-line flags meet the config file (and the ``RELSERVE_MODEL_*`` variables of
    ``environ``, default ``os.environ``, where their flags are absent)."""
    overrides: dict[str, Any] = {}
    for spec in SERVER_KEYS.values():
        if spec.flag is not None:
            value = getattr(args, spec.flag.dest or spec.name)
            for name in (spec.name, *spec.flag.also_sets):
                overrides[name] = value
    return load_config(args.config, overrides=overrides, model_specs=args.model,
                       dir_models=_dir_models(args, os.environ if environ is None else environ))


def _dir_models(args: argparse.Namespace, environ: Mapping[str, str]) -> list:
    """``--model-dir`` and ``--model-name``, each falling back to its environment variable, and the model options
    of ``$RELSERVE_MODEL_OPTIONS`` then of each ``--model-options`` (a KServe InferenceService's args come after
    its runtime's, so it can add to or override the runtime's options), as ``load_config`` ``dir_models`` entries.

    Raises:
        ConfigError: a name or options without a directory, or what ``model_dir.dir_models`` refuses.
    """
    def pick(flag: str, value: str | None, env: str) -> tuple[str | None, str]:
        if value is not None:
            return value, flag
        if environ.get(env):
            return environ[env], f"${env}"
        return None, f"{flag} (or ${env})"

    directory, dir_source = pick("--model-dir", args.model_dir, model_dir.ENV_DIR)
    name, name_source = pick("--model-name", args.model_name, model_dir.ENV_NAME)
    env_options = environ.get(model_dir.ENV_OPTIONS)
    options = [(f"${model_dir.ENV_OPTIONS}", env_options)] if env_options else []
    options += [("--model-options", text) for text in args.model_options]
    if directory is None:
        for value, source in ((name, name_source), *((text, src) for src, text in options)):
            if value is not None:
                raise ConfigError(f"{source} is given but no model directory: add --model-dir DIR "
                                  f"(or set ${model_dir.ENV_DIR})")
        return []
    # what an option may set: every model config key but the two the directory gives (parse_options refuses
    # those by name); checked here so the unknown-key message lists only keys this flag accepts
    allowed = sorted(set(MODEL_KEYS) - {"name", "path"})
    parsed = {}
    for source, text in options:
        items = model_dir.parse_options(text, source)
        unknown = sorted(set(items) - set(allowed))
        if unknown:
            raise ConfigError(f"{source} {text!r}: unknown key(s) {unknown}; allowed: {allowed}")
        parsed.update(items)
    return model_dir.dir_models(directory, name, parsed, dir_source=dir_source, name_source=name_source)
