"""The load engine: open loop (Poisson arrivals at a rate) or closed loop (N clients), on one grpc.aio channel.

Every request is recorded as ``(kind, start, latency, status code name)``. In the open loop ``start`` is the
*scheduled* arrival time and latency is measured from it, so a client that falls behind still charges the
delay to the server (no coordinated omission). Both loops are bounded by a request count and/or a duration;
requests already sent when the duration ends are awaited (each has its own deadline, ``timeout``).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc

from .scenarios import Call, Scenario

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
CLIENT_OVERLOAD = "CLIENT_OVERLOAD"  # open loop: more than max_inflight requests outstanding; not sent


@dataclass
class Records:
    """What happened to each request, in completion order (times in seconds from the run start)."""

    kinds: list[str] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    codes: list[str] = field(default_factory=list)
    started_at: float = 0.0        # time.time() of the run start (wall clock)
    elapsed: float = 0.0           # run start -> last completion
    sent: int = 0

    def add(self, kind: str, start: float, latency: float, code: str) -> None:
        self.kinds.append(kind)
        self.starts.append(start)
        self.latencies.append(latency)
        self.codes.append(code)

    def __len__(self) -> int:
        return len(self.codes)


def channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


async def list_models(ch: grpc.aio.Channel, timeout: float = 10.0) -> list[Any]:
    stub = pb_grpc.InferenceStub(ch)
    reply = await stub.ListModels(pb.ListModelsRequest(), timeout=timeout, wait_for_ready=True)
    return list(reply.models)


class Engine:
    """Sends :class:`Call` objects over one channel and records the outcome.

    Args:
        ch: a grpc.aio channel (one per run).
        timeout: per-request deadline in seconds.
        on_done: called after every completion with (code) (progress bars).
    """

    def __init__(self, ch: grpc.aio.Channel, *, timeout: float = 30.0,
                 on_done: Callable[[str], None] | None = None) -> None:
        self.stub = pb_grpc.InferenceStub(ch)
        self.timeout = timeout
        self.on_done = on_done or (lambda _code: None)
        self.records = Records()
        self._t0 = 0.0

    def _begin(self) -> None:
        self.records = Records(started_at=time.time())
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    async def send(self, call: Call, scheduled: float | None = None) -> str:
        """Send one call; record it. Returns the status code name."""
        start = self.now() if scheduled is None else scheduled
        self.records.sent += 1
        code = "CANCELLED"  # stays so only if this task is cancelled (the error propagates)
        try:
            await getattr(self.stub, call.method)(call.request, timeout=self.timeout)
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
        finally:
            end = self.now()
            self.records.add(call.kind, start, end - start, code)
            self.records.elapsed = max(self.records.elapsed, end)
        self.on_done(code)
        return code

    async def closed_loop(self, scenario: Scenario, concurrency: int, *, requests: int | None,
                          duration: float | None, unavailable_backoff: float = 0.05) -> Records:
        """``concurrency`` clients, each sending its next request when the previous one is answered
        (``unavailable_backoff`` seconds later after an UNAVAILABLE answer)."""
        if requests is None and duration is None:
            raise ValueError("bound the run with requests and/or duration")
        self._begin()
        budget = [requests if requests is not None else float("inf")]

        async def client() -> None:
            while budget[0] > 0 and (duration is None or self.now() < duration):
                budget[0] -= 1
                if await self.send(scenario.next()) == "UNAVAILABLE" and unavailable_backoff > 0:
                    await asyncio.sleep(unavailable_backoff)  # server gone or draining: don't spin

        await asyncio.gather(*(client() for _ in range(max(1, concurrency))))
        return self.records

    async def open_loop(self, scenario: Scenario, rate: float, *, requests: int | None, duration: float | None,
                        seed: int = 0, max_inflight: int = 2000) -> Records:
        """Poisson arrivals at ``rate`` per second; latency counts from the scheduled arrival."""
        if requests is None and duration is None:
            raise ValueError("bound the run with requests and/or duration")
        if rate <= 0:
            raise ValueError("rate must be > 0")
        self._begin()
        rng = random.Random(seed)
        pending: set[asyncio.Task] = set()
        arrival = 0.0
        n = 0
        while requests is None or n < requests:
            arrival += rng.expovariate(rate)
            if duration is not None and arrival > duration:
                break
            delay = arrival - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            n += 1
            call = scenario.next()
            if len(pending) >= max_inflight:
                self.records.sent += 1
                self.records.add(call.kind, arrival, 0.0, CLIENT_OVERLOAD)
                self.on_done(CLIENT_OVERLOAD)
                continue
            task = asyncio.create_task(self.send(call, scheduled=arrival))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return self.records
