"""The grpc health servicer (service/health.py) on its own, with a context that stands for a call whose
client has gone: the moment a real server cannot be made to show on demand."""

from __future__ import annotations

import asyncio

from grpc._cython.cygrpc import ExecuteBatchError
from grpc_health.v1 import health_pb2

from relserve.service.health import HealthServicer


class _GoneContext:
    def __init__(self) -> None:
        self.writes = 0
        self.done = []

    def add_done_callback(self, callback) -> None:
        self.done.append(callback)

    async def write(self, message) -> None:
        self.writes += 1
        raise ExecuteBatchError('Failed "execute_batch"')  # grpc's refusal of a write to an ended call


def test_a_watch_whose_client_left_returns_quietly_instead_of_raising():
    async def scenario():
        health = HealthServicer()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        context = _GoneContext()
        await asyncio.wait_for(health.Watch(health_pb2.HealthCheckRequest(service=""), context), 5)
        assert context.writes == 1 and health.watchers == 1  # counted until grpc finishes the call
        for callback in context.done:
            callback(context)
        assert health.watchers == 0
        assert await health.end_watches(0.1)

    asyncio.run(scenario())
