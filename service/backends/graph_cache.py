"""The ONNX graph cache of a served model, used by both ONNX backends: find its graphs, check where they
came from, export (or re-export) them when there are none or they are broken.

Where, in order: ``onnx_path`` when set (an OUT_DIR of ``relserve export``, served as it is: never
exported again, refused before any port is bound when its report names another checkpoint hash:
:func:`check_export_dir`), the checkpoint directory, its ``onnx/`` folder (what ``relserve export CKPT CKPT/onnx``
writes), else ``<onnx_cache_dir>/<checkpoint sha256>/``, exported there on first load; graphs derived from
those (the int8 graph of ``dtype: int8``) only in ``<onnx_cache_dir>/<checkpoint sha256>-<variant>/`` (written to a
temporary directory and renamed, so a crashed export never leaves half a graph in the cache; no entry file
is writable by group or others, whatever the umask).

Who may have written them (:mod:`.file_trust`): the cache directory is created 0700 and refused
(:class:`ConfigError`) when it exists owned by another uid or writable by group or others. Every graph file
and ``export_report.json`` is opened once without following links; a link, or a file owned by another uid
(root, the server's uid and, beside the checkpoint, the checkpoint directory's owner are trusted) or
writable by group or others, is refused. The bytes read from that descriptor are what is hashed and what
ONNX Runtime loads (sessions are made from bytes), so what is verified is what runs.

Integrity: every export records the sha256 of each file it wrote (``file_sha256`` in ``export_report.json``);
a graph whose bytes do not match is refused. A cache entry must record them; graphs beside the checkpoint
without a report are served with a warning (hand-placed graphs), guarded by the next two checks.

Provenance: a graph's metadata (``relserve.checkpoint_sha256``) and the ``export_report.json`` beside it
name the checkpoint it was exported from; another checkpoint's graphs are refused exactly
(:class:`GraphMismatch`). Graphs that record nothing rely on the backend's load-time parity self-check.

One policy for anything refused: graphs beside the checkpoint are the user's and are never rewritten, so the
model is not served (:class:`GraphMismatch` naming the file and the fix); a cache entry that is incomplete,
unreadable, untrusted, tampered with (sha256 mismatch, logged as a WARNING naming the file and both digests)
or mismatching is deleted and exported again into a fresh entry (atomic rename), once. A graph exported in
this very load is never exported again: the same export of the same checkpoint gives the same graph, so a
refusal there (a failed parity check above all: :class:`ParityMismatch`) is reported with the fix that can
help (the tolerance keys), not "delete the entry".
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

from relserve.models.checkpoint import checkpoint_hash
from relserve.models.onnx.runtime import EXPORT_VERSION, METADATA_CHECKPOINT, REPORT_DIGESTS, REPORT_NAME

from ..config import ModelConfig
from ..errors import ConfigError
from . import file_trust
from .progress import log_phase

log = logging.getLogger(__name__)
T = TypeVar("T")


class GraphMismatch(RuntimeError):
    """The ONNX graph does not reproduce the torch checkpoint; the model is not served."""


class ParityMismatch(GraphMismatch):
    """The graph's outputs differ from the torch checkpoint's beyond ``onnx_parity_tolerance`` /
    ``onnx_parity_rtol`` (the load-time self-check). For a graph exported in this load, exporting again gives
    the same graph: the fix is the tolerance (or backend=torch), not the cache."""


def _export_into(cache: Path, export: Callable[[Path], None]) -> None:
    """``export(tmp)`` into a temporary directory renamed to ``cache`` (a crashed export leaves nothing)."""
    tmp = Path(tempfile.mkdtemp(prefix=cache.name[:16] + ".", dir=cache.parent))
    try:
        export(tmp)
        for f in tmp.rglob("*"):  # never group/other-writable (a umask of 002 would be refused at load)
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, cache)
        except OSError:  # another process won the race: use its graphs
            if not cache.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# errors of the disk under the cache (full, read-only, not ours to write), not of the graphs in it
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})


def _disk_error(config: ModelConfig, where: Path, exc: BaseException) -> ConfigError | None:
    """A :class:`ConfigError` naming ``where``, the checkpoint and the fix, when ``exc`` (or an error it was
    raised from: exporters wrap what they hit) is the disk refusing a write; None for anything else."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
            path = Path(config.path)
            return ConfigError(
                f"model {config.name!r}: cannot write the ONNX graph cache {str(where)!r} for checkpoint "
                f"{str(path)!r}: {exc.strerror or exc} ({errno.errorcode.get(exc.errno, exc.errno)}"
                f"{f', {exc.filename}' if exc.filename else ''}); free space there or make it writable, point "
                f"onnx_cache_dir at a writable directory, or export the graphs beside the checkpoint once with "
                f"`relserve export {path} {path / 'onnx'}`")
        exc = exc.__cause__ or exc.__context__
    return None


def _check_report(config: ModelConfig, d: Path, digest: str, report: Mapping[str, Any] | None) -> None:
    """Refuse graphs whose ``export_report.json`` names another checkpoint hash (the parity self-check only
    sees the warm-up inputs, so weights that differ elsewhere could pass it)."""
    recorded = (report or {}).get("checkpoint_sha256")
    if recorded and recorded != digest:
        raise GraphMismatch(
            f"model {config.name!r}: the ONNX graphs in {d} were exported from another checkpoint (their "
            f"{REPORT_NAME} records sha256 {recorded[:12]}..., this checkpoint is {digest[:12]}...: other weights "
            f"or config, or an older export format)")  # the caller appends the fix


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


def _parse_report(data: bytes | None) -> dict[str, Any] | None:
    try:
        report = json.loads(data.decode("utf-8")) if data is not None else None
    except ValueError:  # UnicodeDecodeError is one
        return None
    return report if isinstance(report, dict) else None


def _check_digests(config: ModelConfig, d: Path, graphs: Mapping[str, bytes], report: Mapping[str, Any] | None,
                   required: bool) -> None:
    """Each graph's sha256 against the one its export recorded (``file_sha256`` in the report).

    Raises:
        GraphMismatch: a digest differs (naming the file, the recorded and the actual digest), or none is
            recorded and ``required`` (a cache entry: the server's own exports always record them).
    """
    recorded = (report or {}).get(REPORT_DIGESTS)
    if not isinstance(recorded, dict):
        if required:
            raise GraphMismatch(f"model {config.name!r}: {d / REPORT_NAME} is missing or records no sha256 of the "
                                f"graph files ({REPORT_DIGESTS}), so the graphs cannot be verified")
        log.warning("model %r: %s records no sha256 of its graph files (no %s from `relserve export`); the graphs "
                    "are not verified against their export, only provenance metadata and the load-time parity "
                    "check guard them", config.name, d, REPORT_NAME)
        return
    for name, data in graphs.items():
        actual = hashlib.sha256(data).hexdigest()
        expected = recorded.get(name)
        if expected != actual:
            raise GraphMismatch(f"model {config.name!r}: graph {d / name} has sha256 {actual}, but its export "
                                f"recorded {expected or 'none'} in {d / REPORT_NAME}: the file was changed after "
                                f"it was exported, refusing it")


def _read_verified(config: ModelConfig, d: Path, names: Sequence[str], digest: str, trusted: frozenset[int],
                   cache_root: Path | None = None) -> dict[str, bytes]:
    """``{name: bytes}`` of the graphs in ``d``, each read from one descriptor opened without following links
    and checked for owner and mode, then checked against the report's checkpoint hash and file digests.
    ``cache_root``: ``d`` is a cache entry, opened relative to the re-checked cache directory (no link
    followed), whose report must record the digests.

    Raises:
        ConfigError: the cache directory is no longer private (see :func:`file_trust.check_private_dir`).
        GraphMismatch: anything refused in ``d`` (the message names the file and why).
    """
    try:
        try:
            if cache_root is None:
                dfd = file_trust.open_dir(d)
            else:
                rfd = file_trust.open_dir(cache_root)
                try:
                    file_trust.check_private_dir(rfd, cache_root, f"model {config.name!r}: onnx_cache_dir")
                    dfd = file_trust.open_dir(d.name, parent_fd=rfd, follow=False)
                finally:
                    os.close(rfd)
        except OSError as exc:
            raise file_trust.Refused(f"{d} cannot be opened as a directory without following links "
                                     f"({exc.strerror or exc})") from exc
        try:
            if cache_root is not None:
                file_trust.check_dir(dfd, d, trusted)
            graphs = {n: file_trust.read_file(dfd, n, d / n, trusted) for n in names}
            report = _parse_report(file_trust.read_file(dfd, REPORT_NAME, d / REPORT_NAME, trusted, missing_ok=True))
        finally:
            os.close(dfd)
    except file_trust.Refused as exc:
        raise GraphMismatch(f"model {config.name!r}: refusing {exc}") from exc
    _check_report(config, d, digest, report)
    _check_digests(config, d, graphs, report, required=cache_root is not None)
    return graphs


def _open(config: ModelConfig, d: Path, open_and_check: Callable[[], T], advice: str,
          parity_advice: str | None = None) -> T:
    """``open_and_check()``, every failure a GraphMismatch (the same class: a ParityMismatch stays one) with
    ``advice`` appended, or ``parity_advice`` when given and the graphs failed the parity check."""
    try:
        return open_and_check()
    except ConfigError:
        raise
    except GraphMismatch as exc:
        fix = parity_advice if parity_advice is not None and isinstance(exc, ParityMismatch) else advice
        raise type(exc)(f"{exc}; {fix}") from exc
    except Exception as exc:  # ORT: unreadable protobuf, shapes that do not fit the checkpoint, ...
        text = " ".join(str(exc).split())[:600] or type(exc).__name__
        raise GraphMismatch(f"model {config.name!r}: the ONNX graphs in {d} do not work with checkpoint "
                            f"{config.path} ({type(exc).__name__}: {text}); {advice}") from exc


def load_graphs(config: ModelConfig, names: Sequence[str], export: Callable[[Path], None],
                open_and_check: Callable[[Path, str, Mapping[str, bytes]], T],
                variant: str | None = None) -> tuple[T, Path]:
    """Find a model's ONNX graphs (``names``, all in one directory) and return (``open_and_check(...)``, dir).

    ``variant`` (e.g. ``int8-q1``, :data:`relserve.models.onnx.quantize.CACHE_VARIANT`): graphs derived from the
    exported ones (the int8 graph), found only in the cache, as ``<onnx_cache_dir>/<checkpoint sha256>-<variant>/``,
    never beside the checkpoint; ``export`` writes them there and its report must record their sha256, which
    is verified like any cache entry's (same repairs, same refusals).

    Where: the checkpoint directory, its ``onnx/`` folder (what ``relserve export CKPT CKPT/onnx`` writes),
    else ``<onnx_cache_dir>/<checkpoint sha256>/``, filled by ``export(tmp_dir)`` on first load.
    ``open_and_check(dir, checkpoint_sha256, graphs)`` opens the sessions from ``graphs`` (``{name: bytes}``,
    the verified bytes: never re-read the files), calls :func:`check_graph_origin` and raises
    :class:`GraphMismatch` when the graphs do not reproduce the checkpoint; any other error there is re-raised
    as a GraphMismatch naming the model and the directory; every GraphMismatch gets the fix appended.

    Graphs beside the checkpoint are used as they are: a directory missing one of ``names``, a graph file that
    is a link, owned by another uid or group/other-writable, or whose ``export_report.json`` records another
    checkpoint hash or another sha256, is refused with advice. A cache entry that is incomplete, unreadable,
    untrusted, tampered with or mismatching is deleted and exported again, once; an entry exported in this
    call is not (a :class:`ParityMismatch` there names the tolerance keys instead).

    Raises:
        ConfigError: the cache directory cannot be created, or is owned by another uid or group/other-writable.
        GraphMismatch: the graphs are refused (after the one re-export, for the cache).
    """
    path = Path(config.path)
    digest = checkpoint_hash(path, EXPORT_VERSION)
    if config.onnx_path is not None and variant is None:
        return _load_export_dir(config, names, open_and_check, digest)
    for d in (path, path / "onnx") if variant is None else ():
        if os.path.lexists(d / names[0]) and not (d / names[0]).is_file():
            raise GraphMismatch(f"model {config.name!r}: {d / names[0]} is not a readable file (a directory or a "
                                f"dangling link); remove it, or re-export with `relserve export {path} {d}`")
        if (d / names[0]).is_file():
            advice = f"re-export them with `relserve export {path} {d}`"
            missing = [n for n in names if not (d / n).is_file()]
            if missing:
                raise GraphMismatch(f"model {config.name!r}: {d} has {names[0]} but not {', '.join(missing)}; "
                                    f"{advice}")
            try:
                trusted = file_trust.trusted_owners(os.stat(path).st_uid)  # as trusted as the weights beside them
                graphs = _read_verified(config, d, names, digest, trusted)
            except GraphMismatch as exc:
                raise GraphMismatch(f"{exc}; {advice}") from exc
            result = _open(config, d, lambda: open_and_check(d, digest, graphs), advice)
            log.info("model %r: using the exported graphs in %s", config.name, d)
            return result, d
    root = Path(os.path.abspath(config.resolved_onnx_cache_dir()))
    file_trust.make_private_dir(root, f"model {config.name!r} (checkpoint {str(path)!r}): onnx_cache_dir")
    cache = root / (digest if variant is None else f"{digest}-{variant}")
    try:
        return _load_cached(config, names, export, open_and_check, root, cache, digest, variant)
    except OSError as exc:  # the disk refused a write (full, read-only): a ConfigError naming it, exit 2
        disk = _disk_error(config, cache, exc)
        if disk is not None:
            raise disk from exc
        raise


def _export_report(config: ModelConfig, d: Path) -> dict[str, Any]:
    """The ``export_report.json`` of ``onnx_path`` ``d``.

    Raises:
        ConfigError: ``d`` is not a directory, or has no readable report that records the checkpoint hash and the
            sha256 of its graph files.
    """
    where = f"model {config.name!r}: onnx_path {str(d)!r}"
    if not d.is_dir():
        raise ConfigError(f"{where} is not a directory; give the OUT_DIR of `relserve export {config.path} OUT_DIR`")
    try:
        report = _parse_report((d / REPORT_NAME).read_bytes())
    except OSError as exc:
        raise ConfigError(f"{where} has no readable {REPORT_NAME} ({exc.strerror or exc}); it must be an OUT_DIR of "
                          f"`relserve export {config.path} OUT_DIR`") from None
    if report is None or not report.get("checkpoint_sha256") or not isinstance(report.get(REPORT_DIGESTS), dict):
        raise ConfigError(f"{where}: {d / REPORT_NAME} records no checkpoint_sha256 or no {REPORT_DIGESTS}; "
                          f"re-export with `relserve export {config.path} {d}`")
    return report


def check_export_dir(config: ModelConfig) -> None:
    """Before any port is bound: ``onnx_path`` is an export of exactly the checkpoint at ``path`` (the checkpoint
    hash its report records), with every graph file the report lists. The graphs' bytes are verified at load.

    Raises:
        ConfigError: naming the model, both directories and both hashes (or the missing file), and the fix.
    """
    d, path = Path(config.onnx_path), Path(config.path)
    report = _export_report(config, d)
    digest = checkpoint_hash(path, EXPORT_VERSION)
    recorded = report["checkpoint_sha256"]
    if recorded != digest:
        raise ConfigError(
            f"model {config.name!r}: onnx_path {str(d)!r} was exported from another checkpoint: its {REPORT_NAME} "
            f"records checkpoint sha256 {recorded}, but the checkpoint at {str(path)!r} has sha256 {digest} (other "
            f"weights or config, or an older export format); export this checkpoint with `relserve export {path} "
            f"{d}`, or point path at the checkpoint the graphs came from")
    missing = [n for n in report[REPORT_DIGESTS] if not (d / n).is_file()]
    if missing:
        raise ConfigError(f"model {config.name!r}: onnx_path {str(d)!r} lacks {', '.join(missing)}, which its "
                          f"{REPORT_NAME} lists; re-export with `relserve export {path} {d}`")


def _load_export_dir(config: ModelConfig, names: Sequence[str],
                     open_and_check: Callable[[Path, str, Mapping[str, bytes]], T], digest: str) -> tuple[T, Path]:
    """:func:`load_graphs` from ``onnx_path``: the export is the user's, served as it is and never rewritten;
    nothing is exported into the cache. Its report must record the checkpoint hash and the graphs' sha256."""
    t0 = time.monotonic()
    d, path = Path(config.onnx_path), Path(config.path)
    advice = f"re-export with `relserve export {path} {d}`"
    report = _export_report(config, d)
    missing = [n for n in names if not (d / n).is_file()]
    if missing:
        raise GraphMismatch(f"model {config.name!r}: onnx_path {d} has no {', '.join(missing)} (a "
                            f"{'translation' if len(names) > 1 else 'classification / QA'} model's graphs); {advice}")
    if report["checkpoint_sha256"] != digest:  # changed since the pre-bind check
        raise GraphMismatch(f"model {config.name!r}: onnx_path {d} records checkpoint sha256 "
                            f"{report['checkpoint_sha256']}, the checkpoint at {path} has {digest}; {advice}")
    try:
        trusted = file_trust.trusted_owners(os.stat(path).st_uid, os.stat(d).st_uid)
        graphs = _read_verified(config, d, names, digest, trusted)
    except GraphMismatch as exc:
        raise GraphMismatch(f"{exc}; {advice}") from exc
    result = _open(config, d, lambda: open_and_check(d, digest, graphs), advice)
    log_phase(config.name, "ONNX graphs verified and opened", time.monotonic() - t0, f"relserve export in {d}")
    return result, d


def _load_cached(config: ModelConfig, names: Sequence[str], export: Callable[[Path], None],
                 open_and_check: Callable[[Path, str, Mapping[str, bytes]], T], root: Path, cache: Path,
                 digest: str, variant: str | None) -> tuple[T, Path]:
    """:func:`load_graphs` in the cache entry ``cache`` under ``root`` (exported there when missing or
    broken, once).

    Raises:
        as :func:`load_graphs`; OSError (or an exporter's error raised from one) when the disk refuses a write.
    """
    path = Path(config.path)
    exported_now = False
    for attempt in (1, 2):
        if not all((cache / n).is_file() for n in names):
            if cache.is_symlink() or (cache.exists() and not cache.is_dir()):
                cache.unlink()  # a stray file or link where the entry belongs
            elif cache.is_dir():
                log.warning("model %r: export cache entry %s is incomplete; exporting again", config.name, cache)
                shutil.rmtree(cache, ignore_errors=True)
            if variant is None:  # a variant's build logs what it does (e.g. "quantizing ... to int8")
                log.info("model %r: no ONNX graphs yet; exporting %s to %s", config.name, path, cache)
            t0 = time.monotonic()
            try:
                _export_into(cache, export)
                log_phase(config.name, "ONNX export" if variant is None else f"ONNX {variant} graph built",
                          time.monotonic() - t0, str(cache))
            except Exception as exc:  # exporters wrap the OSError of a full or read-only disk in their own
                disk = _disk_error(config, cache, exc)
                if disk is not None:
                    raise disk from exc
                raise
            exported_now = True
        try:
            advice = f"delete {cache} to export again"
            try:
                graphs = _read_verified(config, cache, names, digest, file_trust.trusted_owners(), cache_root=root)
            except GraphMismatch as exc:
                raise GraphMismatch(f"{exc}; {advice}") from exc
            parity_advice = None
            if exported_now:
                # a fresh export that fails: exporting it again reproduces the failure, so no "delete" advice
                fresh = "the graphs were exported from this checkpoint just now, so exporting again would give " \
                        "the same graphs"
                advice = f"{fresh}; serve the model with backend=torch"
                parity_advice = (f"{fresh}; raise onnx_parity_tolerance (atol) / onnx_parity_rtol if this "
                                 f"difference is acceptable, or serve the model with backend=torch")
            t0 = time.monotonic()
            result = _open(config, cache, lambda: open_and_check(cache, digest, graphs), advice, parity_advice)
            log_phase(config.name, "ONNX graphs verified and opened", time.monotonic() - t0,
                      f"{'exported now' if exported_now else 'cached'} in {cache}")
            return result, cache
        except GraphMismatch as exc:
            if attempt == 2 or exported_now:
                raise
            log.warning("model %r: cached graphs unusable (%s); deleting %s and exporting again", config.name,
                        exc, cache)
            if cache.is_symlink():
                cache.unlink()
            else:
                shutil.rmtree(cache, ignore_errors=True)
    raise AssertionError("unreachable")
