"""Reloadable secrets: the TLS certificate, key and client-CA files and the bearer-token files re-read while the
server runs, on SIGHUP and when a file changes on disk, without a restart.

Each watched secret is a group of files (the TLS group: ``tls_cert``, ``tls_key``, ``tls_client_ca``; each
token file alone) with a ``load`` (read and check every file of the group, return the new value) and an
``apply`` (put it in force). :class:`SecretsWatch` polls each file's ``(inode, size, mtime_ns)`` every
``interval_s`` (0.25 s: a rotation is in force within about half a second); ``os.stat`` follows symlinks, so
Kubernetes' Secret volumes, which swap a ``..data`` symlink, are seen too. SIGHUP re-reads every group at
once. A group whose files fail to load (unreadable, not PEM, a key that is not the certificate's, a token file
with no token or a bad line) keeps its previous value in force and logs one warning line naming the file and
why; it is tried again at the next change. Loads run in a thread (``asyncio.to_thread``): reading and checking
PEM files is blocking I/O.

What applying means for each secret lives in ``service/server.py``: gRPC's certificate comes from
:func:`grpc.dynamic_ssl_server_credentials`, whose fetcher (:class:`TlsReloader`) hands the new configuration
to the next handshake; the HTTP listener's ``ssl.SSLContext`` switches each new connection to the current
context in its SNI callback (called for every ClientHello, with or without a server name); connections already
open keep the certificate they shook hands with. Token files replace the interceptor's token set
(:meth:`relserve.service.auth.TokenAuthInterceptor.set_tokens`), so a removed token is refused on its next call.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc

from . import auth
from .errors import ConfigError

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25  # between two looks at the files' stat: a change is in force within about 0.5 s


def _signature(paths: Sequence[Path]) -> tuple:
    """What identifies the files' current contents without reading them: ``(inode, size, mtime_ns)`` each (None:
    missing or unreadable, itself a change)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


@dataclass
class Secret:
    """One watched group of files: ``load()`` reads and checks them (raising :class:`ConfigError` naming the
    file), ``apply(value)`` puts the loaded value in force."""

    name: str  # for log lines: what the files are, or their config key
    paths: Sequence[Path]
    load: Callable[[], Any]
    apply: Callable[[Any], None]
    signature: tuple = field(default=())
    reloads: int = 0  # loads applied since the start
    failures: int = 0  # loads refused since the start (the previous value kept)


class SecretsWatch:
    """Re-reads :class:`Secret` groups when their files change (polled) or on SIGHUP; see the module docstring.

    Args:
        secrets: the groups, each already loaded and applied once at start.
        interval_s: seconds between two polls.
    """

    def __init__(self, secrets: Sequence[Secret], interval_s: float = POLL_INTERVAL_S) -> None:
        self.secrets = list(secrets)
        self.interval_s = interval_s
        for secret in self.secrets:
            secret.signature = _signature(secret.paths)
        self._task: asyncio.Task | None = None
        self._sighup = False
        self._reloads: set[asyncio.Task] = set()  # SIGHUP's reloads in progress
        self._lock = asyncio.Lock()  # a SIGHUP and a poll never load the same group at once

    async def start(self) -> None:
        """Start polling on the running loop, and re-read everything on SIGHUP (when this is the main thread's
        loop: signal handlers can be set there only)."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._poll(), name="relserve-secrets-watch")
        try:
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._sighup = True
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no SIGHUP here
            log.debug("SIGHUP not handled in this thread; secrets reload on file changes only")

    def _on_sighup(self) -> None:
        task = asyncio.get_running_loop().create_task(self.reload(force=True))
        self._reloads.add(task)  # the loop holds tasks weakly: kept until done
        task.add_done_callback(self._reloads.discard)

    async def stop(self) -> None:
        if self._sighup:
            try:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            except (ValueError, RuntimeError):
                pass
            self._sighup = False
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.reload(force=False)
            except Exception:  # a bug here must not end the watch; logged with its traceback
                log.exception("reloading secrets failed")

    async def reload(self, force: bool = True) -> int:
        """Load and apply each group whose files changed (every group when ``force``: SIGHUP). Returns how many
        were applied; a group that fails keeps its previous value (one warning line naming the file)."""
        applied = 0
        async with self._lock:
            for secret in self.secrets:
                signature = _signature(secret.paths)
                if not force and signature == secret.signature:
                    continue
                secret.signature = signature  # a broken file is reported once, not at every poll
                try:
                    value = await asyncio.to_thread(secret.load)
                except ConfigError as exc:
                    secret.failures += 1
                    log.warning("secrets: kept the previous %s in force: %s", secret.name, exc)
                    continue
                secret.apply(value)
                secret.reloads += 1
                applied += 1
                log.info("secrets: reloaded %s from %s", secret.name, ", ".join(str(p) for p in secret.paths))
        return applied


# ---------------------------------------------------------------------- TLS


@dataclass(frozen=True)
class TlsFiles:
    """The checked contents of ``tls_cert``, ``tls_key`` and ``tls_client_ca`` (None: no client CA)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None
    paths: tuple[Path, Path, Path | None]


def load_tls(cert: Path, key: Path, client_ca: Path | None) -> TlsFiles:
    """Read and check the TLS files (:func:`.auth.check_tls_files`: PEM, the key is the certificate's, the CA
    file holds a certificate).

    Raises:
        ConfigError: naming the file and why.
    """
    auth.check_tls_files(cert, key, client_ca)
    return TlsFiles(auth.read_file("tls_cert", cert), auth.read_file("tls_key", key),
                    auth.read_file("tls_client_ca", client_ca) if client_ca is not None else None,
                    (cert, key, client_ca))


class TlsReloader:
    """The server's TLS material for both listeners, replaced by :meth:`apply`.

    * gRPC: :meth:`credentials` are :func:`grpc.dynamic_ssl_server_credentials`; gRPC calls the fetcher at each
      new handshake, which returns the new configuration once after a change (None: keep the current one).
    * HTTP: :meth:`ssl_context` is the listener's context; its SNI callback sets each new connection's context to
      the current one (:meth:`apply` builds a new ``ssl.SSLContext`` from the files).
    """

    def __init__(self, files: TlsFiles, make_context: Callable[[Path, Path, Path | None], ssl.SSLContext]) -> None:
        self._make_context = make_context
        self._lock = threading.Lock()  # the fetcher runs on a gRPC core thread
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self.files = files
        self._context = make_context(*files.paths)
        self._listener_context: ssl.SSLContext | None = None

    @staticmethod
    def _configuration(files: TlsFiles) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(files.key, files.cert)], root_certificates=files.client_ca)

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials that follow :meth:`apply` from the next handshake on."""
        return grpc.dynamic_ssl_server_credentials(self._configuration(self.files), self._fetch,
                                                   require_client_authentication=self.files.client_ca is not None)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def ssl_context(self) -> ssl.SSLContext:
        """The HTTP listener's context: the current files' at first, switched per connection after a reload."""
        if self._listener_context is None:
            listener = self._make_context(*self.files.paths)
            listener.sni_callback = self._choose_context
            self._listener_context = listener
        return self._listener_context

    def _choose_context(self, connection: ssl.SSLObject, _server_name: str | None, _context: ssl.SSLContext) -> None:
        connection.context = self._context
        return None

    def apply(self, loaded: tuple[TlsFiles, ssl.SSLContext]) -> None:
        """Put the loaded files (and the HTTP context built from them) in force for new handshakes on both
        listeners; connections already open keep theirs."""
        files, context = loaded
        with self._lock:
            self._pending = self._configuration(files)
        self._context = context
        self.files = files

    def load(self) -> tuple[TlsFiles, ssl.SSLContext]:
        """The files at the same paths, read and checked, and the HTTP context built from them.

        Raises:
            ConfigError: naming the file and why.
        """
        cert, key, client_ca = self.files.paths
        files = load_tls(cert, key, client_ca)
        try:
            return files, self._make_context(cert, key, client_ca)
        except (ssl.SSLError, OSError) as exc:  # changed again since the check
            raise ConfigError(f"tls_cert / tls_key: cannot load {str(cert)!r}: {exc}") from None


def tls_secret(reloader: TlsReloader) -> Secret:
    """The TLS group of files, watched for :class:`SecretsWatch`."""
    paths = [p for p in reloader.files.paths if p is not None]
    return Secret("TLS certificate, key and client CA", paths, reloader.load, reloader.apply)


def token_secret(key: str, path: Path, apply: Callable[[tuple[bytes, ...]], None]) -> Secret:
    """A token file (config key ``key``), watched: ``apply`` gets the new tokens (:func:`.auth.read_tokens`)."""
    return Secret(key, [path], lambda: auth.read_tokens(path, key), apply)
