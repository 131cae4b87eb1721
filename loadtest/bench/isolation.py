"""Isolation between models: a light model's latency while another model is saturated, per compute option.

    python -m relserve.loadtest.bench.isolation            # 2 repeats, ~10 min on 2 cores
    python -m relserve.loadtest.bench.isolation --quick    # 1 repeat, shorter phases, ~3 min
    python -m relserve.loadtest.bench.isolation --quick --options a,f   # before vs default, ~1 min
    python -m relserve.loadtest.bench.isolation --options a,c --repeats 3

One ``relserve serve`` child process per option, each serving the default ``sentiment`` and ``qa`` models
(``defaults/``; torch backend, torch's default thread count), all started before the first measurement.
The options differ only in the server's ``compute_scheduling`` and the models' ``max_batch_time_ms``
(``service/scheduling/cores.py``, ``service/scheduling/cost_model.py``):

* ``a`` — ``shared``, no cap: every model's thread computes whenever it likes, with torch's default pool
  (one thread per core) — the behaviour before core sharing;
* ``b`` — ``fair``, no cap: one backend call at a time across models, models in turn;
* ``c`` — ``fair`` + ``max_batch_time_ms`` 20: batches split into pieces expected to take <= 20 ms, and a
  torch call that held the cores 20 ms yields between encoder sub-layers to a waiting model;
* ``d`` — ``shared`` + ``max_batch_time_ms`` 20: the splitting alone;
* ``e`` — ``partition``, no cap: concurrent, each call ``cores // active models`` intra-op threads;
* ``f`` — ``partition`` + ``max_batch_time_ms`` 20 (the server's default).

For every option, interleaved with the others (the order rotates each repeat, so slow drift on a shared
machine hits every option alike), two phases run against its server, the clients in their own processes
on the same machine:

1. idle: ``--light-clients`` closed-loop clients send Classify with one short sentence each
   (``loadtest/data/sentiment_dev.jsonl``, at most 80 characters) for ``--idle-s`` seconds;
2. loaded: ``--qa-clients`` closed-loop clients flood Answer with 2-3 KB contexts (XQuAD paragraphs of
   ``loadtest/data/qa_dev.jsonl`` joined; two 512-token windows each); after ``--lead-s`` seconds (the QA
   queue is full by then) the same light clients run for ``--loaded-s`` seconds; then the QA flood goes on
   alone for ``--qa-alone-s`` seconds (the QA throughput a model gets when it has the machine to itself:
   what ``partition`` costs).

Printed per option: the light model's idle and loaded p50 / p99 (ms), the p99 ratio loaded / idle (its own
idle, and option ``a``'s idle), the QA throughput (requests/s completed during the light window, and
alone: the price of isolation) and whether the ratio meets the 3x target; the median over the repeats, plus every
repeat. ``--out DIR`` also gets ``bench_isolation.json`` with every sample's summary.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from . import harness
from ..serverproc import ServerProcess

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"
TARGET_RATIO = 3.0

# option -> (description, compute_scheduling, max_batch_time_ms, torch_intra_op_threads)
OPTIONS: dict[str, tuple[str, str, float, int]] = {
    "a": ("shared cores, no cap (before)", "shared", 0.0, 0),
    "b": ("fair compute slot, no cap", "fair", 0.0, 0),
    "c": ("fair slot + 20 ms cap", "fair", 20.0, 0),
    "d": ("shared cores + 20 ms cap", "shared", 20.0, 0),
    "e": ("partition, no cap", "partition", 0.0, 0),
    "f": ("partition + 20 ms cap (default)", "partition", 20.0, 0),
}


def light_texts(max_chars: int = 80) -> list[str]:
    """Short sentiment sentences (one per request)."""
    rows = [json.loads(line) for line in (DATA / "sentiment_dev.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()]
    return [r["text"] for r in rows if len(r["text"]) <= max_chars]


def qa_requests(min_chars: int = 2000, max_chars: int = 3000) -> list[tuple[str, str]]:
    """(question, context) with contexts of 2-3 KB: consecutive XQuAD paragraphs joined, the question of
    the first one (its answer is in the context)."""
    rows = [json.loads(line) for line in (DATA / "qa_dev.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()]
    out = []
    i = 0
    while i < len(rows):
        question, parts, j = rows[i]["question"], [], i
        while j < len(rows) and sum(len(p) + 1 for p in parts) < min_chars:
            parts.append(rows[j]["context"])
            j += 1
        context = " ".join(parts)
        if len(context) >= min_chars:
            if len(context) > max_chars:
                context = context[:context.rfind(" ", 0, max_chars)]
            out.append((question, context))
        i = j
    return out


# ------------------------------------------------------------------------------------ client processes

def _drive(target: str, kind: str, clients: int, begin_at: float, duration: float, seed: int) -> dict[str, Any]:
    """Client process: ``clients`` closed-loop clients of ``kind`` (``light`` | ``qa``) on one channel, from
    the wall-clock time ``begin_at`` for ``duration`` seconds. Returns per OK request (start, end) wall times
    and latencies, and the error codes."""
    return asyncio.run(_drive_async(target, kind, clients, begin_at, duration, seed))


async def _drive_async(target: str, kind: str, clients: int, begin_at: float, duration: float,
                       seed: int) -> dict[str, Any]:
    import random

    import grpc

    from relserve.service._proto import inference_pb2 as pb
    from relserve.service._proto import inference_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    if kind == "light":
        pool = [pb.ClassifyRequest(model="sentiment", texts=[t]) for t in light_texts()]
        method = "Classify"
    else:
        pool = [pb.AnswerRequest(model="qa", question=q, context=c) for q, c in qa_requests()]
        method = "Answer"
    ends: list[tuple[float, float]] = []
    errors: dict[str, int] = {}
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        call = getattr(stub, method)
        await call(pool[0], timeout=60, wait_for_ready=True)  # connected before the clock starts
        await asyncio.sleep(max(0.0, begin_at - time.time()))
        stop = begin_at + duration

        async def client() -> None:
            while time.time() < stop:
                req = rng.choice(pool)
                t0 = time.time()
                try:
                    await call(req, timeout=60)
                    ends.append((t0, time.time()))
                except grpc.aio.AioRpcError as exc:
                    errors[exc.code().name] = errors.get(exc.code().name, 0) + 1

        await asyncio.gather(*(client() for _ in range(clients)))
    return {"ok": ends, "errors": errors}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


def _rate(ok: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Requests per second served in [lo, hi]: each request counts with the share of its own duration that
    falls in the window. QA batches finish in bursts (8 requests every few seconds without splitting), so
    counting completions in a window of a few seconds would be off by a whole burst."""
    served = sum(max(0.0, min(e, hi) - max(s, lo)) / (e - s) for s, e in ok if e > s)
    return served / (hi - lo) if hi > lo else float("nan")


def _latency(ok: list[tuple[float, float]], since: float) -> dict[str, float]:
    lat = [(e - s) * 1000 for s, e in ok if s >= since]
    return {"n": len(lat), "p50": _pct(lat, 50), "p99": _pct(lat, 99)}


# ------------------------------------------------------------------------------------ one measurement

def measure(option: str, srv: ServerProcess, pool: concurrent.futures.Executor, args: argparse.Namespace,
            seed: int) -> dict[str, Any]:
    """Idle phase then loaded phase of one option against its server."""
    settle = 1.0  # the first second of each light phase is not counted (connection, caches)
    begin = time.time() + 0.5
    idle = pool.submit(_drive, srv.target, "light", args.light_clients, begin, args.idle_s + settle, seed).result()
    idle_lat = _latency(idle["ok"], begin + settle)

    begin = time.time() + 0.5
    light_begin = begin + args.lead_s
    qa = pool.submit(_drive, srv.target, "qa", args.qa_clients, begin,
                     args.lead_s + settle + args.loaded_s + args.qa_alone_s, seed)
    light = pool.submit(_drive, srv.target, "light", args.light_clients, light_begin, args.loaded_s + settle, seed)
    light_res, qa_res = light.result(), qa.result()
    window = (light_begin + settle, light_begin + settle + args.loaded_s)
    loaded_lat = _latency(light_res["ok"], window[0])
    alone = (window[1] + settle, window[1] + args.qa_alone_s)  # the light clients' last calls end first
    out = {
        "option": option, "idle": idle_lat, "loaded": loaded_lat,
        "ratio": loaded_lat["p99"] / idle_lat["p99"] if idle_lat["p99"] > 0 else float("nan"),
        "qa_rps": _rate(qa_res["ok"], *window),
        "qa_alone_rps": _rate(qa_res["ok"], *alone),
        "errors": {"idle": idle["errors"], "light": light_res["errors"], "qa": qa_res["errors"]},
    }
    print(f"  [{option}] idle p50 {idle_lat['p50']:.1f} p99 {idle_lat['p99']:.1f} ms (n={idle_lat['n']}) | loaded "
          f"p50 {loaded_lat['p50']:.1f} p99 {loaded_lat['p99']:.1f} ms (n={loaded_lat['n']}) | ratio "
          f"{out['ratio']:.2f} | QA {out['qa_rps']:.2f} req/s, alone {out['qa_alone_rps']:.2f}"
          + (f" | errors {out['errors']}" if any(out['errors'].values()) else ""), flush=True)
    return out


def server_args(option: str) -> list[str]:
    _desc, mode, cap, threads = OPTIONS[option]
    models = []
    for name in ("sentiment", "qa"):
        models += ["--model", f"{name}={REPO / 'defaults' / name},max_batch_time_ms={cap:g},"
                              f"torch_intra_op_threads={threads}"]
    return [*models, "--compute-scheduling", mode, "--drain-timeout", "5"]


def summarize(results: list[dict[str, Any]], options: list[str]) -> list[dict[str, Any]]:
    """Median over repeats per option; the ratio also against option a's idle p99 when a ran."""
    rows = []
    base_idle = None
    if "a" in options:
        base_idle = statistics.median(r["idle"]["p99"] for r in results if r["option"] == "a")
    for opt in options:
        rs = [r for r in results if r["option"] == opt]
        med = lambda f: statistics.median(f(r) for r in rs)  # noqa: E731
        row = {
            "option": opt, "description": OPTIONS[opt][0], "repeats": len(rs),
            "idle_p50": med(lambda r: r["idle"]["p50"]), "idle_p99": med(lambda r: r["idle"]["p99"]),
            "loaded_p50": med(lambda r: r["loaded"]["p50"]), "loaded_p99": med(lambda r: r["loaded"]["p99"]),
            "ratio": med(lambda r: r["ratio"]), "qa_rps": med(lambda r: r["qa_rps"]),
            "qa_alone_rps": med(lambda r: r["qa_alone_rps"]),
        }
        row["ratio_vs_a_idle"] = harness.ratio(row["loaded_p99"], base_idle)
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\nlight model (sentiment, 1 short text/request) while QA is saturated; median over repeats")
    print(f"{'opt':<4}{'what':<38}{'idle p50':>9}{'idle p99':>9}{'load p50':>9}{'load p99':>9}"
          f"{'p99 x':>7}{'x a-idle':>9}{'QA r/s':>8}{'alone':>7}  <=3x")
    for r in rows:
        vs_a = f"{r['ratio_vs_a_idle']:.2f}" if r["ratio_vs_a_idle"] is not None else "-"
        print(f"{r['option']:<4}{r['description']:<38}{r['idle_p50']:>9.1f}{r['idle_p99']:>9.1f}"
              f"{r['loaded_p50']:>9.1f}{r['loaded_p99']:>9.1f}{r['ratio']:>7.2f}{vs_a:>9}{r['qa_rps']:>8.2f}{r['qa_alone_rps']:>7.2f}"
              f"  {'yes' if r['ratio'] <= TARGET_RATIO else 'no'}")
    print("(ms; 'p99 x' = loaded p99 / the option's own idle p99; 'x a-idle' = loaded p99 / option a's idle p99;\n"
          " 'QA r/s' = QA requests/s completed while the light clients ran, 'alone' = after they stopped)")


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("isolation", __doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, phases of 5 s idle, 8 s loaded, 5 s QA "
                                                         "alone (~3 min for the six options)")
    ap.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated subset of {list(OPTIONS)}")
    harness.add_common_args(ap, repeats=None, repeats_help="interleaved repeats (default 2; --quick 1)")
    ap.add_argument("--idle-s", type=float, default=None, help="idle phase seconds (default 12; --quick 5)")
    ap.add_argument("--loaded-s", type=float, default=None, help="loaded phase seconds (default 20; --quick 8)")
    ap.add_argument("--lead-s", type=float, default=None,
                    help="QA flood runs this long before the light clients (default 3; --quick 2)")
    ap.add_argument("--qa-alone-s", type=float, default=None,
                    help="QA flood goes on alone this long after the light clients (default 12; --quick 5)")
    ap.add_argument("--light-clients", type=int, default=2)
    ap.add_argument("--qa-clients", type=int, default=8)
    ap.add_argument("--out", default=None, help="directory for bench_isolation.json")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.idle_s = args.idle_s or (5.0 if args.quick else 12.0)
    args.loaded_s = args.loaded_s or (8.0 if args.quick else 20.0)
    args.qa_alone_s = args.qa_alone_s or (5.0 if args.quick else 12.0)
    args.lead_s = args.lead_s or (2.0 if args.quick else 3.0)
    options = [o.strip() for o in args.options.split(",") if o.strip()]
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        ap.error(f"unknown option(s) {unknown}; choose from {list(OPTIONS)}")
    for name in ("sentiment", "qa"):
        if not (REPO / "defaults" / name / "config.json").is_file():
            print(f"isolation: defaults/{name} is missing (the default models are needed)", file=sys.stderr)
            return 2

    print(f"{platform.node()}: {os.cpu_count()} cores; options {options}; {args.repeats} repeat(s); idle "
          f"{args.idle_s:g} s, loaded {args.loaded_s:g} s after a {args.lead_s:g} s QA lead; "
          f"{args.light_clients} light + {args.qa_clients} QA clients", flush=True)
    servers: dict[str, ServerProcess] = {}
    ctx = multiprocessing.get_context("spawn")
    try:
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(options)) as starter:
            procs = {o: ServerProcess(server_args(o), start_timeout=300) for o in options}
            for o, fut in {o: starter.submit(p.start) for o, p in procs.items()}.items():
                fut.result()
                servers[o] = procs[o]
        print(f"{len(servers)} servers ready in {time.monotonic() - t0:.0f} s", flush=True)
        results = []
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
            list(pool.map(int, range(2)))  # the client processes exist before the first measurement
            for rep in range(args.repeats):
                order = options[rep % len(options):] + options[:rep % len(options)]
                print(f"repeat {rep + 1}/{args.repeats}: {' '.join(order)}", flush=True)
                for opt in order:
                    results.append({**measure(opt, servers[opt], pool, args, seed=rep), "repeat": rep})
    finally:
        for srv in servers.values():
            srv.close()
    rows = summarize(results, options)
    print_table(rows)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        harness.write_json(out / "bench_isolation.json",
                           {"args": {k: v for k, v in vars(args).items()}, "cpu_count": os.cpu_count(), "summary": rows,
                            "runs": results})
        print(f"wrote {out / 'bench_isolation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
