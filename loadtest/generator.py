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


# The method relserve's server checks (service/auth.py): gRPC metadata ``authorization: Bearer <token>``.
AUTH_METADATA_KEY = "authorization"


@dataclass(frozen=True)
class Security:
    """How the load generator talks to a TLS and/or token-protected server (the CLI's ``--tls*`` / ``--token``).

    Attributes:
        tls: use TLS (implied by any of the PEM fields).
        root_certificates: PEM of the CA that signed the server's certificate; None: the system trust store.
        client_cert, client_key: PEM of the client certificate and its key (servers with ``tls_client_ca``).
        server_name: the name checked against the server's certificate instead of the target's host
            (``grpc.ssl_target_name_override``), e.g. when connecting by IP to a certificate for a DNS name.
        token: bearer token sent on every call (ListModels included), already stripped and checked.
    """

    tls: bool = False
    root_certificates: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    server_name: str | None = None
    token: str | None = None

    @property
    def uses_tls(self) -> bool:
        return self.tls or any(v is not None for v in (self.root_certificates, self.client_cert, self.client_key))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The per-call metadata (None without a token)."""
        return ((AUTH_METADATA_KEY, f"Bearer {self.token}"),) if self.token is not None else None


def channel(target: str, security: Security | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to ``target``: plaintext, or TLS / mTLS per ``security`` (the token is not part of
    the channel: :class:`Engine` and :func:`list_models` send ``security.metadata`` with each call)."""
    if security is None or not security.uses_tls:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    options = list(CHANNEL_OPTIONS)
    if security.server_name:
        options.append(("grpc.ssl_target_name_override", security.server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=security.root_certificates,
                                               private_key=security.client_key,
                                               certificate_chain=security.client_cert)
    return grpc.aio.secure_channel(target, credentials, options=options)


async def list_models(ch: grpc.aio.Channel, timeout: float = 10.0, metadata=None) -> list[Any]:
    """The server's ListModels reply's models (``metadata``: e.g. :attr:`Security.metadata`)."""
    stub = pb_grpc.InferenceStub(ch)
    reply = await stub.ListModels(pb.ListModelsRequest(), timeout=timeout, wait_for_ready=True, metadata=metadata)
    return list(reply.models)


class Engine:
    """Sends :class:`Call` objects over one channel and records the outcome.

    Args:
        ch: a grpc.aio channel (one per run).
        timeout: per-request deadline in seconds.
        on_done: called after every completion with (code) (progress bars).
        metadata: sent with every call (the bearer token, :attr:`Security.metadata`).
    """

    def __init__(self, ch: grpc.aio.Channel, *, timeout: float = 30.0,
                 on_done: Callable[[str], None] | None = None, metadata=None) -> None:
        self.stub = pb_grpc.InferenceStub(ch)
        self.timeout = timeout
        self.metadata = metadata
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
            await getattr(self.stub, call.method)(call.request, timeout=self.timeout, metadata=self.metadata)
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
