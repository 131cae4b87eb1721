"""grpc.health.v1.Health (Check and Watch) whose Watch streams a drain can end.

The reference asyncio servicer (``grpc_health.v1.health.aio.HealthServicer``) answers Watch with a loop
that only ends when the client leaves, so one open watcher held a drain for the whole grace period (the
gRPC server waits for every call). This one keeps the reference behaviour (Check of an unknown service is
NOT_FOUND; Watch sends the current status, then every change, SERVICE_UNKNOWN for an unknown service;
after :meth:`enter_graceful_shutdown` every service is NOT_SERVING for good) and adds
:meth:`end_watches`: each open stream gets its last status, then ends with UNAVAILABLE ("server is
shutting down"), and Watch calls that arrive later get the current status and end at once. Clients that
watch health (client-side health checking, probes) treat the end as "this replica is gone" and retry
elsewhere. No torch; asyncio only.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SHUTTING_DOWN = "server is shutting down; retry on another replica"


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Serving status per service name ("" is the whole server); all methods run on the server's loop."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Event()  # set (and replaced) on every change: one wake-up for all watchers
        self._shutting_down = False
        self._ended = False
        self._watchers = 0
        self._no_watchers = asyncio.Event()
        self._no_watchers.set()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def set(self, service: str, status: int) -> None:
        """Set ``service``'s status (``HealthCheckResponse.SERVING`` ...); ignored after
        :meth:`enter_graceful_shutdown`, as in the reference servicer."""
        self.set_now(service, status)

    def set_now(self, service: str, status: int) -> None:
        """:meth:`set` from a plain callback on the server's loop (a model's readiness listener)."""
        if self._shutting_down:
            return
        self._status[service] = status
        self._notify()

    def clear_now(self, service: str) -> None:
        """``service`` is no longer known (a model unloaded): Check answers NOT_FOUND and Watch SERVICE_UNKNOWN,
        what grpc.health.v1 says of a service it never knew; ignored after :meth:`enter_graceful_shutdown`."""
        if self._shutting_down or service not in self._status:
            return
        del self._status[service]
        self._notify()

    async def enter_graceful_shutdown(self) -> None:
        """Every known service becomes NOT_SERVING for good (open Watch streams are told at once)."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for service in self._status:
            self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
        self._notify()

    @property
    def watchers(self) -> int:
        """Open Watch streams (calls not yet finished)."""
        return self._watchers

    async def end_watches(self, timeout: float) -> bool:
        """End every open Watch stream (last status, then UNAVAILABLE) and refuse to hold new ones; wait up
        to ``timeout`` seconds for the streams to finish. Returns whether they all did."""
        self._ended = True
        self._notify()
        if self._watchers == 0:
            return True
        try:
            await asyncio.wait_for(self._no_watchers.wait(), max(0.0, timeout))
        except asyncio.TimeoutError:
            return False
        return True

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:64]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        self._watchers += 1
        self._no_watchers.clear()
        context.add_done_callback(self._watch_done)  # counted until the status has gone out, not just returned
        last = None
        while True:
            changed = self._changed  # taken before reading: a change during the write below wakes us at once
            status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                try:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                except grpc.aio.InternalError:
                    return  # the watcher left between two changes: nothing can reach it any more
                last = status
            if self._ended:
                break
            await changed.wait()
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details(SHUTTING_DOWN)

    def _watch_done(self, _context) -> None:
        self._watchers -= 1
        if self._watchers == 0:
            self._no_watchers.set()
