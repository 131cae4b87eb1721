"""The HTTP listener's connection hygiene, where aiohttp's own options stop (the transport: :mod:`.http_transport`).

aiohttp 3.x closes a connection idle between requests after ``keepalive_timeout`` (the timer also runs from
the connection's start), bounds the head's line and field sizes, and ``client_max_size`` bounds a body it reads
itself. It has no limit on the time a request head may take once it began to arrive, no cap on open
connections, answers a half-closed client nothing (``eof_received`` lets asyncio close the socket before the
reply), and asyncio reports every failed ``accept()`` (EMFILE: out of descriptors) through the loop's exception
handler with a traceback, up to the listen backlog (100) times per wake-up. Hence:

* :class:`ConnectionGuard`, the protocol factory the listening socket gets in place of aiohttp's ``Server``
  (aiohttp's low-level server is documented as a ``loop.create_server`` protocol factory; the guard wraps it):
  it counts connections and closes those over ``max_connections`` at once, closes a connection whose request
  head has not arrived ``header_timeout`` seconds after its first byte (or after the connection opened), and
  keeps a half-closed connection open for writing until its request is answered.
* :class:`ThrottledLog`: a warning at most once per interval, with the count of what it stands for; used for
  refused connections and for :func:`accept_error_handler`, the loop's exception handler that routes EMFILE /
  ENFILE / ENOBUFS / ENOMEM accept errors to it (everything else goes to the handler it replaced).
* :func:`raise_open_files_limit` and :func:`default_max_connections`: the process's descriptor limit.
* :class:`ServerLog`: aiohttp's connection-handler logger, with a request its parser refuses logged as one
  warning line instead of an ERROR with a traceback.

No torch; nothing here knows routes or models.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp.http_exceptions import HttpProcessingError

log = logging.getLogger(__name__)

# accept() errors that mean "out of descriptors or memory for now" (asyncio retries these after a second)
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# the HTTP listener's default cap: half the descriptor limit (gRPC connections, the models' files, the worker
# pipes and the metrics port need the rest), and no more than this many idle connections' memory
MAX_DEFAULT_CONNECTIONS = 10_000


@dataclass(frozen=True)
class ListenerLimits:
    """The HTTP listener's timeouts (seconds) and connection cap (None: :func:`default_max_connections`): the
    server keys ``http_header_timeout``, ``http_body_timeout``, ``http_keepalive_timeout`` and
    ``http_max_connections`` (:meth:`from_config`)."""

    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_connections: int | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> "ListenerLimits":
        """The limits a ``ServerConfig`` declares."""
        return cls(cfg.http_header_timeout, cfg.http_body_timeout, cfg.http_keepalive_timeout,
                   cfg.http_max_connections)


class ThrottledLog:
    """A warning for something that may happen thousands of times a second, logged at most once per
    ``interval`` seconds with how many times it happened since the last line.

    The first occurrence is logged at once; later ones within the interval are counted, and ``schedule``
    (``loop.call_later``; None: nothing scheduled) logs their count when the interval ends, so a burst is never
    left unreported.

    Args:
        logger: where the lines go.
        what: the event in words, e.g. ``"accept() on the HTTP port failed"``.
        interval: seconds between two lines, at least.
        clock: monotonic seconds (tests pass a fake one).
        schedule: ``schedule(delay_s, callback)``, e.g. ``loop.call_later``.
    """

    def __init__(self, logger: logging.Logger, what: str, interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 schedule: Callable[[float, Callable[[], None]], Any] | None = None) -> None:
        self.logger, self.what, self.interval = logger, what, interval
        self.clock, self.schedule = clock, schedule
        self.total = 0          # every occurrence since creation
        self.lines = 0          # lines logged
        self._pending = 0       # occurrences not yet in a line
        self._detail = ""
        self._last: float | None = None  # when the last line was logged
        self._flush_scheduled = False

    def hit(self, detail: str = "") -> None:
        """One occurrence; ``detail`` (e.g. the error) is shown in the next line."""
        self.total += 1
        self._pending += 1
        self._detail = detail
        now = self.clock()
        if self._last is None or now - self._last >= self.interval:
            self._emit(now)
        elif not self._flush_scheduled and self.schedule is not None:
            self._flush_scheduled = True
            self.schedule(self._last + self.interval - now, self.flush)

    def flush(self) -> None:
        """Log the occurrences not yet reported (the scheduled call at the interval's end; when a hit has been
        logged since it was scheduled, it waits for the next interval's end)."""
        self._flush_scheduled = False
        if not self._pending:
            return
        now = self.clock()
        wait = 0.0 if self._last is None else self._last + self.interval - now
        if wait > 0 and self.schedule is not None:
            self._flush_scheduled = True
            self.schedule(wait, self.flush)
            return
        self._emit(now)

    def _emit(self, now: float) -> None:
        since = "" if self._last is None else f" in the last {now - self._last:.1f} s"
        times = "once" if self._pending == 1 else f"{self._pending} times"
        self.logger.warning("%s %s%s (%d in all)%s", self.what, times, since, self.total,
                            f": {self._detail}" if self._detail else "")
        self._pending = 0
        self._last = now
        self.lines += 1


def accept_error_handler(throttle: ThrottledLog, previous: Callable[[asyncio.AbstractEventLoop, dict], Any] | None
                         ) -> Callable[[asyncio.AbstractEventLoop, dict], None]:
    """A loop exception handler (``loop.set_exception_handler``) that counts accept() failures for want of
    descriptors or memory in ``throttle`` (asyncio's selector loop reports each one, with a traceback, from
    ``BaseSelectorEventLoop._accept_connection``: message "socket.accept() out of system resource") and passes
    every other context to ``previous`` (None: the loop's default handler)."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS and "accept" in context.get("message", ""):
            throttle.hit(f"{exc.strerror or exc} (errno {errno.errorcode.get(exc.errno, exc.errno)})")
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handle.throttle = throttle  # type: ignore[attr-defined]  # who installed it (HttpApi.stop restores)
    return handle


def raise_open_files_limit() -> tuple[int, int, int]:
    """Raise this process's RLIMIT_NOFILE soft limit to its hard limit (an unlimited hard limit: to the
    kernel's ``fs.nr_open``, the most setrlimit accepts) and log both. Returns ``(soft before, soft now,
    hard)`` (``resource.RLIM_INFINITY`` is -1); a refusal (a sandbox) leaves the limit as it was and is logged."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20  # Linux's default nr_open
    now = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            now = target
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-files limit (RLIMIT_NOFILE) from %d to %d: %s", soft, target, exc)

    def shown(n: int) -> str:
        return "unlimited" if n == resource.RLIM_INFINITY else str(n)

    log.info("open-files limit (RLIMIT_NOFILE): soft %s%s, hard %s", shown(soft),
             f" raised to {shown(now)}" if now != soft else "", shown(hard))
    return soft, now, hard


def default_max_connections(soft_limit: int | None = None) -> int:
    """The HTTP listener's connection cap when ``http_max_connections`` is unset: half the soft open-files
    limit (``soft_limit``; None: the process's now), at most :data:`MAX_DEFAULT_CONNECTIONS`, at least 1."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY:
        return MAX_DEFAULT_CONNECTIONS
    return max(1, min(soft_limit // 2, MAX_DEFAULT_CONNECTIONS))


class ConnectionGuard:
    """The listening socket's protocol factory: ``loop.create_server(guard, ...)`` where ``inner`` is aiohttp's
    low-level ``Server`` (``web.AppRunner.server``).

    Args:
        inner: the protocol factory of each admitted connection (aiohttp's RequestHandler factory).
        max_connections: open connections at most; the next one is closed at once (a RST: nothing was read).
        header_timeout: seconds for a request head, from the connection's start (first request) or from its
            first byte (later requests); past it the connection is closed without a reply, as nginx's
            ``client_header_timeout`` (aiohttp's keepalive timer, ``keepalive_timeout`` seconds after the last
            reply, also closes a connection whose next head is incomplete by then).

    ``request_started(request)`` and ``request_finished(request, response)`` (the transport's outermost
    middleware) mark a head as complete and its reply as due; counters for tests and logs: ``open``,
    ``refused``, ``header_timeouts``.
    """

    def __init__(self, inner: Callable[[], asyncio.Protocol], *, max_connections: int, header_timeout: float) -> None:
        self.inner = inner
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.open = 0
        self.refused = 0
        self.header_timeouts = 0
        self._by_transport: dict[Any, _Connection] = {}
        self.refusals = ThrottledLog(log, f"refused a connection on the HTTP port (at its cap of {max_connections} "
                                          f"open connections, http_max_connections)")

    def __call__(self) -> asyncio.Protocol:
        return _Connection(self)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let the refusal log schedule its count (``loop.call_later``)."""
        self.refusals.schedule = loop.call_later

    def of(self, request: Any) -> "_Connection | None":
        """The guarded connection a request arrived on (None: gone already)."""
        return self._by_transport.get(request.transport)

    def request_started(self, request: Any) -> None:
        """The request's head has arrived (the header timer stops) and its handler runs."""
        conn = self.of(request)
        if conn is not None:
            conn.busy = True
            conn.head_seen, conn.tail = False, b""
            conn.request = request
            conn.cancel_header_timer()
            if conn.eof:
                conn.end_body()

    def request_finished(self, request: Any, response: Any) -> None:
        """The handler returned ``response`` (written after this): a half-closed connection closes after it."""
        conn = self.of(request)
        if conn is None:
            return
        conn.busy = False
        conn.request = None
        if conn.eof and response is not None:
            response.force_close()


class _Connection(asyncio.Protocol):
    """One admitted connection: forwards to aiohttp's handler, with the header timer and the half-close rule."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.inner: Any = None
        self.transport: Any = None
        self.busy = False          # a request's handler runs (its head arrived)
        self.eof = False           # the client half-closed its side
        self.head_seen = False     # a head's end (CRLF CRLF) arrived since the last request started
        self.tail = b""            # the last 3 bytes received (a CRLF CRLF split between two reads)
        self.request: Any = None
        self._header_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        guard = self.guard
        if guard.open >= guard.max_connections:
            guard.refused += 1
            guard.refusals.hit()
            transport.abort()  # the descriptor is free at once; no handler exists
            return
        guard.open += 1
        self.transport = transport
        guard._by_transport[transport] = self
        self.inner = guard.inner()
        self.inner.connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if not self.busy and self._header_timer is None:
            self._arm_header_timer()  # the first byte of the next request head
        if not self.head_seen:
            joined = self.tail + data
            self.head_seen = b"\r\n\r\n" in joined
            self.tail = joined[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        """The client shut down its sending side (``shutdown(SHUT_WR)``): a request whose whole body arrived,
        or whose head arrived and waits for its handler, still gets its reply, then the connection closes; one
        whose body never can complete is closed unanswered at once (its read ends: CANCELLED, as a client gone
        mid-body), and so is a connection with no complete head (it can never have one). aiohttp's own handler
        returns None here, so asyncio closed the socket before any reply."""
        if self.inner is None or self.transport.get_extra_info("sslcontext") is not None:
            return None  # TLS: asyncio's SSL transport closes on EOF whatever this returns (and warns if True)
        self.eof = True
        if self.busy:
            return True if self.body_complete() else None
        return True if self.head_seen else None

    def body_complete(self) -> bool:
        """Whether the running request's body has all arrived (no request: True)."""
        return self.request is None or self.request.content.is_eof()

    def end_body(self) -> None:
        """The client sends nothing more, and the request that just started has an incomplete body: it can never
        complete, so the connection closes (the read ends as on a client gone mid-body) rather than waiting for
        the body timeout."""
        if not self.body_complete() and self.transport is not None:
            self.transport.close()

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.inner is None:
            return
        self.cancel_header_timer()
        self.guard.open -= 1
        self.guard._by_transport.pop(self.transport, None)
        inner, self.inner, self.request = self.inner, None, None
        inner.connection_lost(exc)

    # ------------------------------------------------------------------ header timer

    def _arm_header_timer(self) -> None:
        loop = asyncio.get_running_loop()
        self._header_timer = loop.call_later(self.guard.header_timeout, self._header_timed_out)

    def cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.busy or self.transport is None:
            return
        self.guard.header_timeouts += 1
        log.debug("closed an HTTP connection whose request head took over %.1f s", self.guard.header_timeout)
        self.transport.abort()


class ServerLog(logging.LoggerAdapter):
    """The logger of aiohttp's connection handler (``aiohttp.web_protocol.RequestHandler``, its ``logger``
    option): ``aiohttp.server``, except that a request aiohttp's parser refuses before any route runs (no
    colon in a header line, a negative Content-Length, a bad chunk size, not HTTP at all) is the client's
    mistake: one warning line without a traceback, where aiohttp logs an ERROR with one."""

    def __init__(self, refusals: logging.Logger) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self.refusals = refusals  # where the refused requests' warning lines go (the transport's logger)

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            remote = args[0] if args else "?"
            reason = " ".join(str(exc_info.message or exc_info).split())  # one line
            self.refusals.warning("refused a malformed HTTP request from %s: %s %s", remote, exc_info.code,
                                  reason[:300])
        else:
            super().exception(msg, *args, exc_info=exc_info, **kw)
