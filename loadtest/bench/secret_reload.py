"""Token rotation under load: how soon a token removed from ``auth_token_file`` is refused, and whether the
other tokens' calls notice anything.

    python -m relserve.loadtest.bench.secret_reload                      # about 20 s
    python -m relserve.loadtest.bench.secret_reload --clients 4 --rounds 5 --json out.json

Starts ``relserve serve`` with the sentiment default model and ``--auth-token-file`` on free loopback ports.
``--clients`` closed-loop threads call Classify (one short text) back to back, each with a token of its own
that stays in the file; one more thread calls with the token that is removed. Each round writes the file
without that token (a new file renamed over the old, as a rotation tool or a Kubernetes Secret volume does)
and measures the time from the rename to the removed token's first UNAUTHENTICATED; then puts the token back
and waits until it is accepted again. The last round changes the file in place with its size and mtime kept
(which the file poll cannot see) and sends SIGHUP: the time from the signal to the first refusal.

Prints, per round, the seconds to the first refusal (target <= 1 s), then the other tokens' calls and how
many failed (target 0), and the server's reload log lines.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc

from . import harness
from ..serverproc import ServerProcess

REPO = Path(__file__).resolve().parents[2]
REMOVED = "removed-token-0000000000"
REQUEST = pb.ClassifyRequest(model="sentiment", texts=["a good film"])


def _kept(i: int) -> str:
    return f"kept-token-{i:010d}"


def _write(path: Path, tokens: list[str]) -> None:
    """A new file renamed over ``path``: readers see the old contents or the new, never half of them."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text("".join(t + "\n" for t in tokens))
    os.replace(tmp, path)


class _Client(threading.Thread):
    """Classify back to back with ``token``; counts calls and failures, and notes when calls start being
    refused (UNAUTHENTICATED) or accepted again."""

    def __init__(self, target: str, token: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")]
        self.stop = stop
        self.calls = self.failed = 0
        self.refused_since: float | None = None  # monotonic time of the first refusal of the current run of them
        self.failures: dict[str, int] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.stub.Classify(REQUEST, metadata=self.metadata, timeout=10)
                self.refused_since = None
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    if self.refused_since is None:
                        self.refused_since = time.monotonic()
                else:
                    self.failures[exc.code().name] = self.failures.get(exc.code().name, 0) + 1
                self.failed += 1
            self.calls += 1
        self.channel.close()


def _until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.002)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("secret_reload", __doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=3, help="closed-loop clients with kept tokens (default 3)")
    ap.add_argument("--rounds", type=int, default=4, help="removals by file change (default 4), then one by SIGHUP")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of load between two rounds (default 1)")
    harness.add_common_args(ap, threads=1, threads_help="OMP_NUM_THREADS of the server (default 1)", json="file")
    args = ap.parse_args(argv)
    kept = [_kept(i) for i in range(args.clients)]
    with tempfile.TemporaryDirectory(prefix="relserve-secret-reload-") as tmp:
        tokens = Path(tmp) / "tokens"
        _write(tokens, [*kept, REMOVED])
        server_args = ["--model", f"sentiment={REPO / 'defaults' / 'sentiment'}", "--auth-token-file", str(tokens),
                       "--drain-timeout", "2"]
        print(f"{harness.cpu_name()}; {args.clients} clients with kept tokens, 1 with the removed one", flush=True)
        results: list[dict[str, Any]] = []
        with ServerProcess(server_args, env={"OMP_NUM_THREADS": str(args.threads)}, start_timeout=300) as srv:
            stop = threading.Event()
            others = [_Client(srv.target, t, stop) for t in kept]
            victim = _Client(srv.target, REMOVED, stop)
            for c in (*others, victim):
                c.start()
            time.sleep(args.settle)
            for round_ in range(args.rounds + 1):
                by_signal = round_ == args.rounds
                if by_signal:
                    # same size, same mtime, same inode: only SIGHUP makes the server read it again
                    before = os.stat(tokens)
                    text = tokens.read_text()
                    with open(tokens, "r+") as f:  # the removed token's line overwritten by a comment of its length
                        f.write(text.replace(REMOVED, "#" + "x" * (len(REMOVED) - 1)))
                    os.utime(tokens, ns=(before.st_atime_ns, before.st_mtime_ns))
                    t0 = time.monotonic()
                    os.kill(srv.pid, signal.SIGHUP)
                else:
                    t0 = time.monotonic()
                    _write(tokens, kept)
                refused = _until(lambda: victim.refused_since is not None and victim.refused_since >= t0, 10.0)
                seconds = (victim.refused_since - t0) if refused else None
                results.append({"round": round_ + 1, "trigger": "SIGHUP" if by_signal else "file change",
                                "seconds_to_refusal": seconds})
                shown = f"{seconds:.3f} s" if seconds is not None else "not refused within 10 s"
                print(f"round {round_ + 1} ({'SIGHUP' if by_signal else 'file change'}): removed token refused "
                      f"after {shown}", flush=True)
                if not by_signal:
                    _write(tokens, [*kept, REMOVED])  # back, for the next round
                    if not _until(lambda: victim.refused_since is None, 10.0):
                        print("  the restored token was not accepted again within 10 s")
                    time.sleep(args.settle)
            stop.set()
            for c in (*others, victim):
                c.join(timeout=15)
            log_lines = [line for line in srv.log_text().splitlines() if "secrets:" in line]
        calls = sum(c.calls for c in others)
        failed = sum(c.failed for c in others)
        codes: dict[str, int] = {}
        for c in others:
            for code, n in c.failures.items():
                codes[code] = codes.get(code, 0) + n
    times = [r["seconds_to_refusal"] for r in results if r["seconds_to_refusal"] is not None]
    if times:
        print(f"seconds to refusal: median {statistics.median(times):.3f}, max {max(times):.3f} (target <= 1 s)")
    print(f"other tokens: {calls} calls, {failed} failed {codes or ''} (target 0); removed-token client: "
          f"{victim.calls} calls")
    print(f"server log lines about secrets: {len(log_lines)}")
    for line in log_lines[:8]:
        print("  " + line[:240])
    harness.emit_json(args, results, {"cpu": harness.cpu_name(), "clients": args.clients, "rounds": results,
                                      "other_calls": calls, "other_failed": failed, "log_lines": log_lines})
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
