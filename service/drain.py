"""What a drain needs beyond the gRPC server itself: a count of running calls and a hard exit deadline.

The drain sequence (``InferenceServer.drain`` / ``stop`` in service/server.py, ``serve`` in service/main.py):

1. the registry refuses new Inference calls with UNAVAILABLE and health turns NOT_SERVING (open Watch streams
   are told at once);
2. wait until the Inference calls already running are answered (:class:`InflightCalls`), at most until
   the drain deadline; at the deadline the models are closed, so calls still waiting end UNAVAILABLE;
3. Watch streams end (``service/health.py``);
4. in-process (:meth:`InferenceServer.stop`): ``grpc.aio.Server.stop`` with what is left of the grace
   period. The process (``relserve serve``) instead exits here (:func:`exit_now`), without grpc core's
   shutdown: that shutdown resets every call it has received but not yet handed to Python, and each of
   those ends CANCELLED at its client (grpc/grpc#41785). Calls that arrive within about a millisecond of
   it meet that, also when the drain first refused calls in Python and waited for the running ones: with 16
   closed-loop clients a bare grpc.aio server showed CANCELLED after every one of 10 stops; relserve's old
   stop in 2 of 5 SIGTERMs (10 of 1,668 calls). Closing the connections with the process ends such calls
   UNAVAILABLE ("Socket closed" / "Connection reset by peer"), which clients retry: 0 of 5,187 calls in 15
   SIGTERMs.

:class:`ExitDeadline` is the backstop: whatever hangs (a backend thread in a long batch, a stuck close),
the process ends ``margin`` seconds after the drain deadline; ThreadPoolExecutor threads would otherwise
be joined at interpreter exit. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import sys
import threading
from typing import Any, Callable, Iterator

import grpc

log = logging.getLogger(__name__)


class InflightCalls(grpc.aio.ServerInterceptor):
    """Counts the running calls of one service (method prefix ``/package.Service/``, or a tuple of such
    prefixes: relserve.v1 and KServe v2's ModelInfer): from the moment
    its handler starts until it returns, for unary-request handlers (the Inference RPCs); other handler
    shapes pass uncounted. Runs on the server's event loop."""

    def __init__(self, method_prefix: str | tuple[str, ...]) -> None:
        self.method_prefix = method_prefix
        self.running = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.method_prefix) or handler.request_streaming:
            return handler
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap(handler.unary_stream), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            self._wrap(handler.unary_unary), request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def _begin(self) -> None:
        self.running += 1
        self._idle.clear()

    def _end(self) -> None:
        self.running -= 1
        if self.running == 0:
            self._idle.set()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count one running call for the block's duration: how calls of another transport (the HTTP/JSON
        API, service/frontends/http_transport.py) join the drain's wait."""
        self._begin()
        try:
            yield
        finally:
            self._end()

    def _wrap(self, behavior: Callable) -> Callable:
        if inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext):
                self._begin()
                try:
                    async for reply in behavior(request, context):
                        yield reply
                finally:
                    self._end()

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self._begin()
            try:
                return await behavior(request, context)
            finally:
                self._end()

        return call

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no call is running. Returns whether none is."""
        if self.running == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout))
        except asyncio.TimeoutError:
            return self.running == 0
        return True


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # a broken stream must not keep the process alive
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def exit_now(code: int) -> None:
    """End the process at once with ``code`` (logs flushed first): no interpreter shutdown, so no join of
    backend threads and no grpc core shutdown (see the module docstring)."""
    _flush_logs()
    os._exit(code)


class ExitDeadline:
    """A daemon thread that ends the process with ``code`` at ``seconds`` from :meth:`start` unless
    :meth:`cancel` came first; used from the signal on, so a hung drain still exits in time."""

    def __init__(self, seconds: float, code: int = 1) -> None:
        self.seconds = seconds
        self.code = code
        self._timer: threading.Timer | None = None

    def _fire(self) -> None:
        log.error("drain did not finish within %.1f s; exiting now", self.seconds)
        exit_now(self.code)

    def start(self) -> "ExitDeadline":
        self._timer = threading.Timer(self.seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
