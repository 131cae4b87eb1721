"""Who may talk to the server: TLS / mTLS server credentials and bearer-token auth (a grpc.aio interceptor).

* TLS: ``tls_cert`` + ``tls_key`` (PEM) become :func:`grpc.ssl_server_credentials`; with ``tls_client_ca`` the
  server also requires a client certificate signed by that CA (mTLS, ``require_client_auth=True``). The files
  are checked once with the standard library's :mod:`ssl` (:func:`check_tls_files`) so that a missing file, a
  non-PEM file or a key that does not match the certificate is a :class:`ConfigError` at start-up, not a
  handshake failure on the first call.
* Tokens: ``auth_token_file`` holds one token per line (blank lines and ``#`` comment lines are ignored;
  :func:`read_tokens`). Clients send the gRPC metadata ``authorization: Bearer <token>``.
  :class:`TokenAuthInterceptor` compares the sent token with every configured one in constant time (sha256 of
  both sides, :func:`hmac.compare_digest` against each, no early exit, so neither the position of a match nor
  a token's length shows in the timing); a missing, malformed or unknown token ends the call with
  UNAUTHENTICATED before the request is decoded. The status message never repeats what was sent.
  Clients (relserve.client, the load-test CLI) check their token with the same rule (:func:`resolve_token`).
* Admin tokens: ``admin_token_file`` (the same format) guards the model repository API (Triton's repository
  extension: index, load, unload) with :class:`AdminTokenInterceptor`. Those methods need a token of that
  file: none sent is UNAUTHENTICATED, any other token (an inference token included) PERMISSION_DENIED. An
  admin token is not an inference token unless it is in ``auth_token_file`` too. Without ``admin_token_file``
  the repository API is PERMISSION_DENIED when ``auth_token_file`` is set, and open (as Triton's) when
  neither is.
* All are re-read while the server runs (:mod:`.secrets_watch`: SIGHUP and file changes); the server's
  gRPC credentials then come from :func:`grpc.dynamic_ssl_server_credentials`, and
  :meth:`TokenAuthInterceptor.set_tokens` replaces the tokens.

Reference behaviour: gRPC's own auth guide (metadata ``authorization``) and RFC 6750 §2.1 (``Bearer`` is a
case-insensitive scheme followed by one space and the token). Imports nothing of relserve but ``errors``, so
``config`` can validate with these functions.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import ssl
import time
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Sequence

import grpc

from .errors import ConfigError, shown

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
BEARER = "bearer"
REFUSED_LOG_INTERVAL_S = 10.0  # at most one log line per interval about refused calls
METHOD_LOG_LIMIT = 128  # characters of a refused call's method name that reach the log


# ---------------------------------------------------------------------- files

def read_file(key: str, path: Path) -> bytes:
    """The bytes of ``path`` for config key ``key``.

    Raises:
        ConfigError: the file cannot be read (message names the key, the path and the OS error).
    """
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {str(path)!r}: {exc.strerror or exc}") from None


def read_tokens(path: Path, key: str = "auth_token_file") -> tuple[bytes, ...]:
    """The bearer tokens in ``path`` (config key ``auth_token_file``): one per line, surrounding whitespace
    stripped; blank lines and lines starting with ``#`` are skipped. ``key``: how messages name the file (the
    server's config key by default; a client passes its own parameter's name).

    Raises:
        ConfigError: the file is unreadable, holds no token, or a line is not a valid token (whitespace inside,
        or characters outside printable ASCII, which gRPC metadata cannot carry). Messages name the line number,
        never the token.
    """
    raw = read_file(key, path)
    tokens: list[bytes] = []
    for number, line in enumerate(raw.splitlines(), start=1):
        token = line.strip()
        if not token or token.startswith(b"#"):
            continue
        if not _printable_token(token):
            raise ConfigError(f"{key} {str(path)!r}, line {number}: a token must be printable ASCII "
                              f"without spaces (gRPC metadata carries it as 'authorization: Bearer <token>')")
        tokens.append(token)
    if not tokens:
        raise ConfigError(f"{key} {str(path)!r} holds no token (one per line; blank lines and '#' "
                          f"comments are ignored)")
    return tuple(tokens)


def _printable_token(token: bytes) -> bool:
    """Printable ASCII without spaces: what gRPC metadata can carry in ``authorization: Bearer <token>``."""
    return all(0x21 <= b <= 0x7E for b in token)


def resolve_token(token: str | None, token_file: str | os.PathLike | None, *,
                  names: tuple[str, str] = ("token", "token_file")) -> str | None:
    """Client side: the bearer token to send (None: none), from ``token`` or ``token_file``, surrounding
    whitespace stripped (``relserve.client.Client`` and the load-test CLI's ``--token`` / ``--token-file``).

    Checked up front because grpc refuses invalid metadata only when a call starts, as an INTERNAL "Invalid
    metadata" status plus C-core errors on stderr. The rule and the file format are the server's
    (:func:`read_tokens`): printable ASCII without spaces; in a file, one token per line, blank and ``#`` lines
    skipped; a client sends one, so the file must hold exactly one.

    Args:
        names: how messages name the two parameters (the load-test CLI passes its flag names).

    Raises:
        ValueError: both given, the token is empty or not valid header text, or the file is unreadable or
            does not hold exactly one token (messages name the parameter, never the token).
    """
    token_name, file_name = names
    if token is not None and token_file is not None:
        raise ValueError(f"{token_name} and {file_name}: give one of them, not both")
    if token_file is not None:
        try:
            # worded for the caller: its parameter's name, not the server's config key
            tokens = read_tokens(Path(token_file), key=file_name)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if len(tokens) != 1:
            raise ValueError(f"{file_name} {str(token_file)!r} holds {len(tokens)} tokens; the client sends one")
        return tokens[0].decode("ascii")
    if token is None:
        return None
    if not isinstance(token, str):
        raise ValueError(f"{token_name} must be a str, got {type(token).__name__}")
    token = token.strip()
    if not token:
        raise ValueError(f"{token_name} is empty (after stripping surrounding whitespace); pass None for no token")
    if not (token.isascii() and _printable_token(token.encode("ascii"))):
        raise ValueError(f"{token_name} must be printable ASCII without spaces or control characters (gRPC "
                         f"metadata carries it as 'authorization: Bearer <token>')")
    return token


def check_tls_files(cert: Path, key: Path, client_ca: Path | None) -> None:
    """Check the PEM files of ``tls_cert``, ``tls_key`` and ``tls_client_ca`` the way OpenSSL will load them.

    Raises:
        ConfigError: a file is unreadable, is not PEM, the key does not belong to the certificate, the key is
        encrypted (gRPC cannot take a passphrase), or the client CA file holds no certificate.
    """
    expected = (("tls_cert", cert, b"-----BEGIN CERTIFICATE-----", "certificate"),
                ("tls_key", key, b"PRIVATE KEY-----", "private key"),
                ("tls_client_ca", client_ca, b"-----BEGIN CERTIFICATE-----", "CA certificate"))
    for name, path, marker, what in expected:
        if path is not None and marker not in read_file(name, path):
            raise ConfigError(f"{name}: {str(path)!r} holds no PEM {what} (no '{marker.decode()}' line)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

    def no_passphrase() -> bytes:
        raise ConfigError(f"tls_key: {str(key)!r} is encrypted; gRPC needs an unencrypted PEM key")

    try:
        context.load_cert_chain(str(cert), str(key), password=no_passphrase)
    except ssl.SSLError as exc:
        why = ("the key is not the certificate's" if exc.reason == "KEY_VALUES_MISMATCH"
               else f"OpenSSL: {exc.reason or exc}")
        raise ConfigError(f"tls_cert / tls_key: cannot use {str(cert)!r} with the key {str(key)!r}: {why}") from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=str(client_ca))
        except ssl.SSLError as exc:
            raise ConfigError(f"tls_client_ca: {str(client_ca)!r} holds no usable CA certificate: "
                              f"{exc.reason or exc}") from None


def server_credentials(cert: Path, key: Path, client_ca: Path | None = None) -> grpc.ServerCredentials:
    """TLS credentials for ``add_secure_port``; with ``client_ca`` clients must present a certificate it signed.

    Raises:
        ConfigError: as :func:`check_tls_files`.
    """
    check_tls_files(cert, key, client_ca)
    roots = read_file("tls_client_ca", client_ca) if client_ca is not None else None
    return grpc.ssl_server_credentials([(read_file("tls_key", key), read_file("tls_cert", cert))],
                                       root_certificates=roots, require_client_auth=client_ca is not None)


# ---------------------------------------------------------------------- bearer tokens

class _RefusedLog:
    """One log line per interval about refused calls, with how many were refused since the last line: a
    client retrying with a wrong token must not flood the log."""

    def __init__(self, interval_s: float = REFUSED_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.next_at = 0.0
        self.suppressed = 0

    def note(self, method: str, reason: str, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.suppressed += 1
            return
        # the method name is the client's :path: quoted and capped, so it cannot forge log lines or flood the log
        log.warning("refused %s: %s (%s; %d more refused since the last report)",
                    shown(method, METHOD_LOG_LIMIT), reason, code.name, self.suppressed)
        self.next_at, self.suppressed = now + self.interval_s, 0


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[bytes | None, str]:
    """The bearer token of ``metadata``, or None and why there is none (safe to send: it quotes nothing)."""
    values = [v for k, v in (metadata or ()) if k.lower() == AUTH_METADATA_KEY]
    if not values:
        return None, "missing 'authorization' metadata; send 'authorization: Bearer <token>'"
    if len(values) > 1:
        return None, "more than one 'authorization' metadata entry; send exactly one 'Bearer <token>'"
    value = values[0].encode("latin-1", "replace") if isinstance(values[0], str) else values[0]
    scheme, _, token = value.partition(b" ")
    token = token.strip()
    if scheme.lower() != BEARER.encode() or not token:
        return None, "the 'authorization' metadata is not of the form 'Bearer <token>'"
    return token, ""


def _accepted(token: bytes, digests: Sequence[bytes]) -> bool:
    """Whether ``token`` is one of ``digests``' tokens: every one compared, whatever matched before (no early
    exit, so neither the position of a match nor a token's length shows in the timing)."""
    sent = _digest(token)
    accepted = False
    for known in digests:
        accepted |= hmac.compare_digest(sent, known)
    return accepted


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a configured bearer token with UNAUTHENTICATED.

    Args:
        tokens: the accepted tokens (:func:`read_tokens`).
        open_methods: method-name prefixes (``/package.Service/``) that need no token, e.g. grpc.health.v1
            so that kubelet probes, which cannot send metadata, keep working.
        on_refused: called with the full method name of each refused call (the server counts it in
            ``relserve_requests_total{code="UNAUTHENTICATED"}``).

    The refused request is never decoded: the refusal handler takes the raw bytes and aborts.
    """

    def __init__(self, tokens: Sequence[bytes], *, open_methods: Iterable[str] = (),
                 on_refused: Callable[[str], None] | None = None) -> None:
        if not tokens:
            raise ValueError("TokenAuthInterceptor needs at least one token")
        self._digests = tuple(_digest(t) for t in tokens)
        self._open = tuple(open_methods)
        self._on_refused = on_refused
        self._log = _RefusedLog()

    def set_tokens(self, tokens: Sequence[bytes]) -> None:
        """Replace the accepted tokens (a reloaded token file, :mod:`.secrets_watch`): from the next call on, a
        removed token is refused. One attribute swap: a check running meanwhile sees the old set or the new.

        Raises:
            ValueError: no token.
        """
        if not tokens:
            raise ValueError("TokenAuthInterceptor needs at least one token")
        self._digests = tuple(_digest(t) for t in tokens)

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None when ``metadata`` carries an accepted token, else why not (safe to send: it quotes nothing)."""
        token, reason = _bearer(metadata)
        if token is None:
            return reason
        # the attribute is read once (set_tokens swaps it whole)
        return None if _accepted(token, self._digests) else "the bearer token is not valid for this server"

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(self._open):
            return await continuation(handler_call_details)
        reason = self.check(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if reason is None:
            return handler
        self._log.note(method, reason)
        if self._on_refused is not None:
            self._on_refused(method)
        return _refusal(handler, reason)


class AdminTokenInterceptor(grpc.aio.ServerInterceptor):
    """Guards the admin methods (the model repository API) with the tokens of ``admin_token_file``; every
    other method passes untouched (:class:`TokenAuthInterceptor`, when installed, checks those and leaves these
    to this one: its ``open_methods`` include them).

    Args:
        tokens: the admin tokens (:func:`read_tokens`); None: the server has none, and with inference tokens
            configured every admin call is PERMISSION_DENIED (without any auth the server installs no guard:
            the repository API is open, as Triton's).
        methods: method-name prefixes (``/package.Service/Method``) that need an admin token.
        on_refused: called with the full method name and the status of each refused call (metrics).

    A refused request is never decoded, as :class:`TokenAuthInterceptor`'s.
    """

    def __init__(self, tokens: Sequence[bytes] | None, *, methods: Iterable[str],
                 on_refused: Callable[[str, grpc.StatusCode], None] | None = None) -> None:
        self._digests: tuple[bytes, ...] | None = None
        if tokens is not None:
            self.set_tokens(tokens)
        self._methods = tuple(methods)
        self._on_refused = on_refused
        self._log = _RefusedLog()

    def set_tokens(self, tokens: Sequence[bytes]) -> None:
        """Replace the admin tokens (a reloaded ``admin_token_file``): from the next call on, a removed token is
        refused.

        Raises:
            ValueError: no token.
        """
        if not tokens:
            raise ValueError("AdminTokenInterceptor needs at least one token")
        self._digests = tuple(_digest(t) for t in tokens)

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[grpc.StatusCode, str] | None:
        """None when ``metadata`` carries an admin token, else the refusal's status and why (safe to send)."""
        digests = self._digests
        if digests is None:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    "the model repository API needs an admin token and this server has none: set "
                    "admin_token_file (the inference tokens of auth_token_file do not open it)")
        token, reason = _bearer(metadata)
        if token is None:
            return grpc.StatusCode.UNAUTHENTICATED, f"the model repository API needs an admin token: {reason}"
        if not _accepted(token, digests):
            return (grpc.StatusCode.PERMISSION_DENIED,
                    "the bearer token is not an admin token of this server (admin_token_file); the model "
                    "repository API takes admin tokens only")
        return None

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if not method.startswith(self._methods):
            return handler
        refused = self.check(handler_call_details.invocation_metadata)
        if refused is None:
            return handler
        code, reason = refused
        self._log.note(method, reason, code)
        if self._on_refused is not None:
            self._on_refused(method, code)
        return _refusal(handler, reason, code)


def _refusal(handler: grpc.RpcMethodHandler | None, reason: str,
             code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` (unary-unary for an unknown method, so that an
    unauthenticated caller learns nothing about which methods exist) that aborts with ``code``. No
    deserializer: the request bytes are never parsed."""

    async def refuse(_request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, reason)

    request_streaming = bool(handler and handler.request_streaming)
    response_streaming = bool(handler and handler.response_streaming)
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
