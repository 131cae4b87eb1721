"""Memory of the default server under requests of ever new shapes: Classify calls on ``sentiment`` of 1-32 texts of
1-512 tokens each (random, seeded), from a few concurrent clients against ``relserve serve`` on the built-in
default models (a child process on a free loopback port).

    python -m relserve.loadtest.bench.shape_soak                          # 10,000 requests, the default server
    python -m relserve.loadtest.bench.shape_soak --requests 2000 --compare   # heap_trim_mb 0 (before), then default
    python -m relserve.loadtest.bench.shape_soak --requests 150 --warm 50 --backend onnx   # sentiment alone on ORT

Prints the resident memory of the server process and of each worker process after the first ``--warm`` requests
and at the end, the largest total seen (sampled every ``--sample-s`` during the soak), and the throughput
(requests and texts per second). ``--compare`` runs the same requests against a server whose models have
``heap_trim_mb: 0`` (freed heap never trimmed: the behaviour before the bound) and then the default one, and
prints both side by side. The targets (issue "bounded memory"): every worker within 200 MB of its RSS after the
first 500 requests, the server in all never above 2 GB.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

from . import harness
from ..serverproc import ServerProcess

REPO = Path(__file__).resolve().parents[2]
MB = 1e6
GROWTH_TARGET_MB = 200   # issue "bounded memory": every worker within this of its RSS after the warm requests
PEAK_TARGET_MB = 2000    # ... and the server with its workers never above this during the soak
# one WordPiece token each in the default models' vocabulary (lower-case English words)
WORDS = ("the good bad movie was not very great and it is a film of this that but so time story love "
         "best worst really like one all".split())


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def snapshot(server_pid: int) -> dict[str, int]:
    """``{"server": bytes, "worker <pid>": bytes, ...}`` resident now (workers: the server's child processes)."""
    out = {}
    for name, pid in [("server", server_pid)] + [(f"worker {p}", p) for p in harness.child_pids(server_pid)]:
        try:
            out[name] = _rss(pid)
        except (OSError, ValueError, IndexError):
            pass
    return out


def requests(n: int, seed: int, max_texts: int, max_tokens: int) -> list[list[str]]:
    """``n`` Classify requests: each 1..max_texts texts of 1..max_tokens tokens ([CLS] and [SEP] included)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        texts = []
        for _ in range(rng.randint(1, max_texts)):
            words = max(1, rng.randint(1, max_tokens) - 2)
            texts.append(" ".join(rng.choice(WORDS) for _ in range(words)))
        out.append(texts)
    return out


def soak(srv: ServerProcess, reqs: list[list[str]], warm: int, clients: int, sample_s: float,
         progress: int = 0) -> dict[str, Any]:
    """Send ``reqs`` (``clients`` at a time); the RSS after ``warm`` requests and at the end, and the peak.

    ``progress`` > 0 prints the count, the failures, the RSS now and the peak so far every ``progress`` requests
    (a soak of hours shows its curve while it runs, and a cut-off run still leaves its figures)."""
    import grpc

    from relserve.service._proto import inference_pb2 as pb
    from relserve.service._proto import inference_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(srv.target, options=[("grpc.max_receive_message_length", 64 << 20)])
    stub = pb_grpc.InferenceStub(channel)
    done = 0
    failed = 0
    lock = threading.Lock()
    warm_seen = threading.Event()
    result: dict[str, Any] = {"peak_total": 0, "at_warm": None}
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            total = sum(snapshot(srv.pid).values())
            result["peak_total"] = max(result["peak_total"], total)
            stop.wait(sample_s)

    def one(texts: list[str]) -> None:
        nonlocal done, failed
        try:
            stub.Classify(pb.ClassifyRequest(model="sentiment", texts=texts), timeout=600)
        except grpc.RpcError:
            with lock:
                failed += 1
        with lock:
            done += 1
            now_done = done
            if done == warm:
                result["at_warm"] = snapshot(srv.pid)
                result["warm_time"] = time.monotonic()
                warm_seen.set()
        if progress and now_done % progress == 0:
            print(f"  {now_done} requests, {time.monotonic() - t0:.0f} s, {failed} failed: "
                  f"{_fmt(snapshot(srv.pid))}; peak so far {result['peak_total'] / MB:.0f} MB", flush=True)

    threading.Thread(target=sampler, daemon=True).start()
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, reqs))
    elapsed = time.monotonic() - t0
    stop.set()
    channel.close()
    result["at_end"] = snapshot(srv.pid)
    result["peak_total"] = max(result["peak_total"], sum(result["at_end"].values()))
    texts = sum(len(r) for r in reqs)
    after_warm = reqs[warm:]
    warm_elapsed = time.monotonic() - result.get("warm_time", t0)
    result.update(requests=len(reqs), failed=failed, seconds=elapsed, req_per_s=len(reqs) / elapsed,
                  texts_per_s=texts / elapsed,
                  texts_per_s_after_warm=sum(len(r) for r in after_warm) / max(1e-9, warm_elapsed))
    return result


def _fmt(snap: dict[str, int] | None) -> str:
    if not snap:
        return "-"
    parts = [f"{k} {v / MB:.0f}" for k, v in snap.items()]
    return ", ".join(parts) + f"; total {sum(snap.values()) / MB:.0f} MB"


def _growth(res: dict[str, Any]) -> float:
    """The largest growth of one worker between the warm snapshot and the end, MB (nan: no warm snapshot)."""
    a, b = res.get("at_warm") or {}, res["at_end"]
    grown = [b[k] - a[k] for k in b if k.startswith("worker") and k in a]
    return max(grown) / MB if grown else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("shape_soak", __doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000, help="Classify requests in all (default 10,000)")
    ap.add_argument("--warm", type=int, default=500, help="requests before the reference snapshot (default 500)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--max-texts", type=int, default=32, help="texts per request: 1..this (default 32)")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens per text: 1..this (default 512)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-s", type=float, default=0.25, help="seconds between RSS samples (the peak)")
    ap.add_argument("--progress", type=int, default=500, help="print memory every this many requests (0: never)")
    ap.add_argument("--backend", choices=("torch", "onnx"),
                    help="serve only sentiment, on this backend (default: the default server, every default model)")
    ap.add_argument("--compare", action="store_true",
                    help="first a server with heap_trim_mb 0 on every model (before the bound), then the default")
    harness.add_common_args(ap, json="file")
    args = ap.parse_args(argv)
    reqs = requests(args.requests, args.seed, args.max_texts, args.max_tokens)
    variants = [("default", [])]
    if args.backend:
        variants = [(f"sentiment {args.backend}",
                     ["--model", f"sentiment={REPO / 'defaults' / 'sentiment'},backend={args.backend}"])]
    if args.compare and args.backend:
        variants.insert(0, ("heap_trim_mb=0", [*variants[0][1][:-1], variants[0][1][-1] + ",heap_trim_mb=0"]))
    elif args.compare:
        # the default models as a model directory, so one option reaches them all
        variants.insert(0, ("heap_trim_mb=0", ["--model-dir", str(REPO / "defaults"), "--model-options",
                                               "heap_trim_mb=0"]))
    print(f"{args.requests} requests of 1-{args.max_texts} texts x 1-{args.max_tokens} tokens, "
          f"{args.clients} clients; CPU {harness.cpu_name()}", flush=True)
    rows = []
    for name, extra in variants:
        with ServerProcess([*extra, "--drain-timeout", "5"], start_timeout=600) as srv:
            print(f"[{name}] serving; after start: {_fmt(snapshot(srv.pid))}", flush=True)
            res = soak(srv, reqs, min(args.warm, len(reqs)), args.clients, args.sample_s, args.progress)
        rows.append((name, res))
        print(f"[{name}] after {args.warm} requests: {_fmt(res['at_warm'])}")
        print(f"[{name}] at the end ({res['requests']} requests, {res['failed']} failed): {_fmt(res['at_end'])}")
        print(f"[{name}] peak total {res['peak_total'] / MB:.0f} MB; largest worker growth since request "
              f"{args.warm}: {_growth(res):+.0f} MB; {res['req_per_s']:.2f} requests/s, "
              f"{res['texts_per_s']:.1f} texts/s ({res['texts_per_s_after_warm']:.1f} after the warm snapshot)",
              flush=True)
        growth, peak = _growth(res), res["peak_total"] / MB
        print(f"[{name}] targets: every worker within {GROWTH_TARGET_MB} MB of its RSS at request {args.warm} "
              f"({growth:+.0f}) {'PASS' if growth <= GROWTH_TARGET_MB else 'MISS'}; server in all never above "
              f"{PEAK_TARGET_MB} MB ({peak:.0f}) {'PASS' if peak <= PEAK_TARGET_MB else 'MISS'}; "
              f"no failed call ({res['failed']}) {'PASS' if res['failed'] == 0 else 'MISS'}", flush=True)
    if len(rows) == 2:
        (a, ra), (b, rb) = rows
        print(f"side by side ({a} -> {b}): peak total {ra['peak_total'] / MB:.0f} -> {rb['peak_total'] / MB:.0f} MB, "
              f"worker growth {_growth(ra):+.0f} -> {_growth(rb):+.0f} MB, texts/s {ra['texts_per_s']:.1f} -> "
              f"{rb['texts_per_s']:.1f} ({harness.fmt_ratio(harness.ratio(rb['texts_per_s'], ra['texts_per_s']))})")
    if args.json:
        harness.write_json(args.json, {"variants": [{"name": n, **{k: v for k, v in r.items() if k != "warm_time"}}
                                                    for n, r in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
