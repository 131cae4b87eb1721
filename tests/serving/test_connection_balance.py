"""Client-side load balancing over several ``relserve serve`` processes (fake models, real gRPC, real process
path: fixtures/server.py FakeServerProcess).

Each server serves ``shared`` plus a model only it has (``only-a``, ``only-b``), so the ListModels reply
names the process that answered it.

* Two processes, one channel with ``round_robin`` over the static target ``ipv4:127.0.0.1:P1,127.0.0.1:P2``:
  both answer, about evenly.
* Scale-out: a headless-Service-like DNS name (a tiny DNS responder on loopback, used through the channel
  target ``dns://127.0.0.1:<dns port>/relserve.test:<port>``) first lists one server; a second server starts
  later on another loopback address with the same port and joins the DNS answer. A gRPC client re-resolves
  only when a connection goes away, so without ``max_connection_age`` it would never reach the new one;
  with ``max_connection_age: 1`` the first server's GOAWAY makes it re-resolve, connect to both, and the new
  server gets traffic. Everything is polled with generous bounds; nothing is timed.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import grpc
import pytest

from fixtures.server import FakeServerProcess
from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc

ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
NAME = "relserve.test"


def _models(tag: str) -> dict:
    return {"shared": {}, f"only-{tag}": {}}


def _answered_by(stub: pb_grpc.InferenceStub) -> str:
    names = {m.name for m in stub.ListModels(pb.ListModelsRequest(), timeout=10, wait_for_ready=True).models}
    only = sorted(n for n in names if n.startswith("only-"))
    assert "shared" in names and len(only) == 1, names
    return only[0].removeprefix("only-")


def _poll_until_seen(stub: pb_grpc.InferenceStub, tag: str, timeout: float) -> list[str]:
    """Call until server ``tag`` answers (at most ``timeout`` s, 20 ms apart); returns who answered."""
    seen: list[str] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        seen.append(_answered_by(stub))
        if seen[-1] == tag:
            return seen
        time.sleep(0.02)
    return seen


def test_round_robin_over_two_processes_reaches_both():
    with FakeServerProcess(_models("a")) as a, FakeServerProcess(_models("b")) as b:
        target = f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}"
        with grpc.insecure_channel(target, options=[("grpc.service_config", ROUND_ROBIN)]) as ch:
            stub = pb_grpc.InferenceStub(ch)
            # round_robin starts picking as soon as one address is connected: wait until both are
            warmup = _poll_until_seen(stub, "b", 30) + _poll_until_seen(stub, "a", 30)
            assert {"a", "b"} <= set(warmup), warmup
            answers = [_answered_by(stub) for _ in range(40)]
            replies = [stub.Classify(pb.ClassifyRequest(model="shared", texts=["good", "bad"]), timeout=10)
                       for _ in range(10)]
    assert answers.count("a") >= 10 and answers.count("b") >= 10, answers
    assert all([r.labels[0].label for r in reply.results] == ["positive", "negative"] for reply in replies)


class _DNS:
    """A loopback DNS responder (UDP) for one name: A records = ``self.addresses`` (TTL 0), empty answers
    for other record types of that name, NXDOMAIN for other names. Enough for grpc's c-ares resolver."""

    def __init__(self, name: str, addresses: list[str]) -> None:
        self.name = name
        self.addresses = list(addresses)
        self.a_queries = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _answer(self, query: bytes) -> bytes:
        qid, flags = struct.unpack(">HH", query[:4])
        i, labels = 12, []
        while query[i]:
            labels.append(query[i + 1:i + 1 + query[i]].decode("ascii", "replace"))
            i += 1 + query[i]
        qtype = struct.unpack(">H", query[i + 1:i + 3])[0]
        question = query[12:i + 5]
        ours = ".".join(labels).lower() == self.name
        records = b""
        count = 0
        if ours and qtype == 1:  # A
            self.a_queries += 1
            for address in self.addresses:
                records += struct.pack(">HHHIH", 0xC00C, 1, 1, 0, 4) + socket.inet_aton(address)
                count += 1
        # response, authoritative, recursion desired (copied) and available; rcode 0 or NXDOMAIN
        reply_flags = 0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | (0 if ours else 3)
        return struct.pack(">HHHHHH", qid, reply_flags, 1, count, 0, 0) + question + records

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, peer = self.sock.recvfrom(512)
            except socket.timeout:
                continue
            try:
                self.sock.sendto(self._answer(query), peer)
            except (IndexError, struct.error):  # not a query we understand: no answer
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def _free_port_on_both(hosts: tuple[str, ...]) -> int:
    for _ in range(50):
        probe = socket.socket()
        probe.bind((hosts[0], 0))
        port = probe.getsockname()[1]
        probe.close()
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    pytest.skip(f"no port free on all of {hosts}")


def test_server_added_later_gets_traffic_after_max_connection_age():
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
    except OSError:
        pytest.skip("127.0.0.2 is not a loopback address here")
    port = _free_port_on_both(("127.0.0.1", "127.0.0.2"))
    dns = _DNS(NAME, ["127.0.0.1"])
    conn = {"max_connection_age": 1.0, "max_connection_age_grace": 1.0}
    options = [("grpc.service_config", ROUND_ROBIN),
               ("grpc.dns_min_time_between_resolutions_ms", 200)]  # grpc's default cool-down is 30 s
    try:
        with FakeServerProcess(_models("a"), host="127.0.0.1", port=port, **conn) as a, \
                grpc.insecure_channel(f"dns://127.0.0.1:{dns.port}/{NAME}:{port}", options=options) as ch:
            stub = pb_grpc.InferenceStub(ch)
            assert [_answered_by(stub) for _ in range(5)] == ["a"] * 5
            with FakeServerProcess(_models("b"), host="127.0.0.2", port=port, **conn) as b:
                dns.addresses = ["127.0.0.1", "127.0.0.2"]  # the autoscaler added a pod
                seen = _poll_until_seen(stub, "b", 60)
                assert seen[-1] == "b", f"the new server never got a call ({len(seen)} calls, DNS A queries " \
                                        f"{dns.a_queries})\n{a.log_text()[-2000:]}\n{b.log_text()[-2000:]}"
                answers = _poll_until_seen(stub, "a", 30) + [_answered_by(stub) for _ in range(20)]
                assert {"a", "b"} <= set(answers), answers
            assert dns.a_queries >= 2  # it re-resolved (after a GOAWAY of max_connection_age)
    finally:
        dns.close()
