"""A model directory as KServe fills it -> the models to serve (``--model-dir`` / ``RELSERVE_MODEL_DIR``).

KServe's storage initializer downloads an InferenceService's ``storageUri`` into ``/mnt/models`` before the
server starts, and a ServingRuntime's args name that directory and the InferenceService (``{{.Name}}``)
(deploy/kserve/). Two layouts are recognised:

* **one checkpoint**: the directory itself holds ``config.json`` (a Hugging Face DeBERTa v1/v2/v3 checkpoint
  or an RNNsearch directory, as ``--model NAME=DIR`` takes) -> one model, named by ``--model-name``, which is
  then required. A top-level ``config.json`` wins over sub-directories (training output with
  ``checkpoint-*/`` folders is one model).
* **one sub-directory per model** (like Triton's model repository): no ``config.json`` at the top; every
  sub-directory holding one is a model named after the sub-directory, in name order. ``--model-name`` does
  not rename them (KServe passes the InferenceService name whatever the layout). Hidden entries and
  sub-directories without ``config.json`` (``lost+found`` on a PVC) are skipped.

Whether a checkpoint actually loads is decided by the backend at load time, as for ``--model``. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError

CHECKPOINT_MARKER = "config.json"
ENV_NAME, ENV_DIR, ENV_OPTIONS = "RELSERVE_MODEL_NAME", "RELSERVE_MODEL_DIR", "RELSERVE_MODEL_OPTIONS"


def parse_options(text: str, where: str) -> dict[str, str]:
    """``key=value[,key=value...]`` (``--model-options``: model config keys for every model of the directory).

    Raises:
        ConfigError: an item is not key=value, or sets name/path (those come from the directory).
    """
    out: dict[str, str] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if "=" not in item:
            raise ConfigError(f"{where} {text!r}: option {item!r} is not key=value")
        key, value = (s.strip() for s in item.split("=", 1))
        if key in ("name", "path"):
            raise ConfigError(f"{where} {text!r}: {key} comes from the model directory, not from an option")
        out[key] = value
    return out


def models_from_dir(model_dir: str | Path, model_name: str | None, *, dir_source: str = "--model-dir",
                    name_source: str = "--model-name") -> list[tuple[str, Path]]:
    """The ``(name, checkpoint directory)`` pairs a model directory holds (layouts: module docstring).

    Args:
        model_dir: the directory (KServe: ``/mnt/models``).
        model_name: the name of a single-checkpoint directory (KServe: the InferenceService name).
        dir_source, name_source: where the values came from (flag or environment variable), for messages.

    Raises:
        ConfigError: the directory is missing, holds no checkpoint, or is one checkpoint and no name is given.
    """
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{dir_source} {str(root)!r} is not a directory")
    if (root / CHECKPOINT_MARKER).is_file():
        if not model_name:
            raise ConfigError(f"{dir_source} {str(root)!r} is one checkpoint (it has {CHECKPOINT_MARKER}): give its "
                              f"model name with {name_source}")
        return [(model_name, root)]
    subs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    found = [(p.name, p) for p in subs if (p / CHECKPOINT_MARKER).is_file()]
    if not found:
        seen = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
        raise ConfigError(f"{dir_source} {str(root)!r} holds no checkpoint: neither {CHECKPOINT_MARKER} in it nor a "
                          f"sub-directory with one (found: {seen or 'nothing'})")
    return found


def dir_models(model_dir: str | Path, model_name: str | None, options: dict[str, Any], *,
               dir_source: str = "--model-dir", name_source: str = "--model-name") -> list[tuple[str, dict[str, Any]]]:
    """:func:`models_from_dir` as ``(where, raw model mapping)`` entries for ``load_config(dir_models=...)``,
    each with ``options`` (config keys, validated by the loader like a ``--model`` entry's)."""
    return [(f"{dir_source} {str(model_dir)!r} (model {name!r})", {"name": name, "path": str(path), **options})
            for name, path in models_from_dir(model_dir, model_name, dir_source=dir_source, name_source=name_source)]
