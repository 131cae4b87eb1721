"""The ONNX graph cache of a served model, used by both ONNX backends: find its graphs, check where they
came from, export (or re-export) them when there are none or they are broken.

Where, in order: the checkpoint directory, its ``onnx/`` folder (what ``relserve export CKPT CKPT/onnx``
writes), else ``<onnx_cache_dir>/<checkpoint sha256>/``, exported there on first load (written to a
temporary directory and renamed, so a crashed export never leaves half a graph in the cache; entries are
made readable by other users of a shared cache volume).

Provenance: a graph's metadata (``relserve.checkpoint_sha256``) and the ``export_report.json`` beside it
name the checkpoint it was exported from; another checkpoint's graphs are refused exactly
(:class:`GraphMismatch`). Graphs that record nothing rely on the backend's load-time parity self-check.
Graphs beside the checkpoint are the user's and are never rewritten; a broken cache entry is deleted and
exported again, once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from relserve.models.checkpoint import checkpoint_hash
from relserve.models.onnx.runtime import EXPORT_VERSION, METADATA_CHECKPOINT, REPORT_NAME

from ..config import ModelConfig
from ..errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")


class GraphMismatch(RuntimeError):
    """The ONNX graph does not reproduce the torch checkpoint; the model is not served."""


def _export_into(cache: Path, export: Callable[[Path], None]) -> None:
    """``export(tmp)`` into a temporary directory renamed to ``cache`` (a crashed export leaves nothing)."""
    tmp = Path(tempfile.mkdtemp(prefix=cache.name[:16] + ".", dir=cache.parent))
    try:
        export(tmp)
        for f in tmp.rglob("*"):  # readable by other users of a shared cache volume, whatever the umask
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, cache)
        except OSError:  # another process won the race: use its graphs
            if not cache.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_report(config: ModelConfig, d: Path, digest: str) -> None:
    """Refuse graphs whose ``export_report.json`` names another checkpoint hash (the parity self-check only
    sees the warm-up inputs, so weights that differ elsewhere could pass it)."""
    try:
        recorded = json.loads((d / REPORT_NAME).read_text(encoding="utf-8")).get("checkpoint_sha256")
    except (OSError, ValueError, AttributeError):
        return  # no report (a hand-placed graph): the parity self-check is the only guard
    if recorded and recorded != digest:
        raise GraphMismatch(
            f"model {config.name!r}: the ONNX graphs in {d} were exported from another checkpoint (their "
            f"{REPORT_NAME} records sha256 {recorded[:12]}..., this checkpoint is {digest[:12]}...: other weights "
            f"or config, or an older export format); re-export them with `relserve export {config.path} {d}`")


def check_graph_origin(config: ModelConfig, session, graph: Path, digest: str) -> None:
    """Refuse a graph whose metadata (``relserve.checkpoint_sha256``, written by ``relserve export``) names
    another checkpoint: exact, whatever the weights differ in. Graphs without it rely on the parity check."""
    recorded = session.get_modelmeta().custom_metadata_map.get(METADATA_CHECKPOINT)
    if not recorded:
        log.warning("model %r: graph %s does not record which checkpoint it was exported from; only the load-time "
                    "parity check guards it (re-export with `relserve export` to record it)", config.name, graph)
    elif recorded != digest:
        raise GraphMismatch(
            f"model {config.name!r}: graph {graph} was exported from another checkpoint (its metadata records "
            f"sha256 {recorded[:12]}..., this checkpoint is {digest[:12]}...: other weights or config, or an "
            f"older export format)")


def _open(config: ModelConfig, d: Path, open_and_check: Callable[[Path, str], T], digest: str, advice: str) -> T:
    try:
        return open_and_check(d, digest)
    except ConfigError:
        raise
    except GraphMismatch as exc:
        raise GraphMismatch(f"{exc}; {advice}") from exc
    except Exception as exc:  # ORT: unreadable protobuf, shapes that do not fit the checkpoint, ...
        text = " ".join(str(exc).split())[:600] or type(exc).__name__
        raise GraphMismatch(f"model {config.name!r}: the ONNX graphs in {d} do not work with checkpoint "
                            f"{config.path} ({type(exc).__name__}: {text}); {advice}") from exc


def load_graphs(config: ModelConfig, names: Sequence[str], export: Callable[[Path], None],
                open_and_check: Callable[[Path, str], T]) -> tuple[T, Path]:
    """Find a model's ONNX graphs (``names``, all in one directory) and return (``open_and_check(dir)``, dir).

    Where: the checkpoint directory, its ``onnx/`` folder (what ``relserve export CKPT CKPT/onnx`` writes),
    else ``<onnx_cache_dir>/<checkpoint sha256>/``, filled by ``export(tmp_dir)`` on first load.
    ``open_and_check(dir, checkpoint_sha256)`` opens the sessions, calls :func:`check_graph_origin` and raises
    :class:`GraphMismatch` when the graphs do not reproduce the checkpoint; any other error there is re-raised
    as a GraphMismatch naming the model and the directory; every GraphMismatch gets the fix appended.

    Graphs beside the checkpoint are used as they are: a directory missing one of ``names``, or whose
    ``export_report.json`` records another checkpoint hash, is refused with advice to re-export. A cache entry
    that is incomplete, unreadable or mismatching is deleted and exported again, once.
    """
    path = Path(config.path)
    digest = checkpoint_hash(path, EXPORT_VERSION)
    for d in (path, path / "onnx"):
        if os.path.lexists(d / names[0]) and not (d / names[0]).is_file():
            raise GraphMismatch(f"model {config.name!r}: {d / names[0]} is not a readable file (a directory or a "
                                f"dangling link); remove it, or re-export with `relserve export {path} {d}`")
        if (d / names[0]).is_file():
            advice = f"re-export them with `relserve export {path} {d}`"
            missing = [n for n in names if not (d / n).is_file()]
            if missing:
                raise GraphMismatch(f"model {config.name!r}: {d} has {names[0]} but not {', '.join(missing)}; "
                                    f"{advice}")
            _check_report(config, d, digest)
            result = _open(config, d, open_and_check, digest, advice)
            log.info("model %r: using the exported graphs in %s", config.name, d)
            return result, d
    root = config.resolved_onnx_cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"model {config.name!r}: onnx_cache_dir {str(root)!r} cannot be used as a directory "
                          f"({exc.strerror or exc})") from exc
    cache = root / digest
    for attempt in (1, 2):
        if not all((cache / n).is_file() for n in names):
            if cache.is_symlink() or (cache.exists() and not cache.is_dir()):
                cache.unlink()  # a stray file or link where the entry belongs
            elif cache.is_dir():
                log.warning("model %r: export cache entry %s is incomplete; exporting again", config.name, cache)
                shutil.rmtree(cache, ignore_errors=True)
            log.info("model %r: no ONNX graphs yet; exporting %s to %s", config.name, path, cache)
            _export_into(cache, export)
        try:
            result = _open(config, cache, open_and_check, digest, f"delete {cache} to export again")
            log.info("model %r: using the cached graphs in %s", config.name, cache)
            return result, cache
        except GraphMismatch as exc:
            if attempt == 2:
                raise
            log.warning("model %r: cached graphs unusable (%s); deleting %s and exporting again", config.name,
                        exc, cache)
            if cache.is_symlink():
                cache.unlink()
            else:
                shutil.rmtree(cache, ignore_errors=True)
    raise AssertionError("unreachable")
