"""Iteration-level vs request-level batching for translation, under the same Poisson load.

    python -m relserve.loadtest.bench.translation                       # defaults/translate-de-en, 6 req/s, 20 s
    python -m relserve.loadtest.bench.translation --rate 4 --duration 10 --beam-size 5 --json
    python -m relserve.loadtest.bench.translation --backend onnx --rate 20 --duration 12
    python -m relserve.loadtest.bench.translation --capacity          # saturation + p99 at 50 / 80 % (~6 min)
    python -m relserve.loadtest.bench.translation --capacity --sat-duration 5 --sat-warmup 1.5 --load-duration 6

``--capacity`` (:func:`run_capacity`) keeps both schedulings up at once and measures, on the committed
short everyday sentences ``loadtest/data/tatoeba_de_en_dev.jsonl`` (Tatoeba, CC BY 2.0 FR), each one's
saturation throughput with ``--clients`` closed-loop callers, n_best 1 and 5 (``--sat-repeats`` slices per
scheduling, the two taking turns so that a change in background load falls on both), then latency under the same
Poisson arrivals at ``--load-fractions`` of the capacity; it prints iteration / request throughput and
request / iteration p99 ratios. ``max_batch_size`` defaults to 64 there, so that a request-level group is
bounded by the same hypothesis budget (256 / beam 5) as the iteration-level loop, not by the encoder batch.

Without ``--capacity``, one run serves the same model twice, one scheduling after the other (``scheduling: iteration``, then
``request``), each in a fresh in-process gRPC server on a free loopback port, and replays the *same*
arrival schedule against both: Poisson arrivals (``--rate`` requests/s, seeded) of single sentences drawn
(seeded) from the shared German dev set (``../shared/data/translation/de_en_dev.jsonl`` next to the repo)
or, in a fresh clone, the committed sample ``loadtest/data/de_en_dev.jsonl``. Each request is one
``Translate`` call with one text. Reported per mode: completed requests, throughput (requests/s and
output tokens/s over the span from first arrival to last reply), p50/p99 latency, decoder steps and mean
hypotheses per step; then the ratios iteration / request.

Both modes use the same knobs (``--max-active-hypotheses``, ``--max-batch-size``, ``--max-queue-delay``),
so the only difference is whether queued requests may join between decoder steps. Both modes also drop a
finished text from the step (so request-level here is already better than naive padding-to-completion).
With ``--model`` any RNNsearch checkpoint directory is used; without one and without the default, a tiny
random checkpoint is built (numbers then only show scheduling overheads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time
from pathlib import Path

from . import harness

REPO = Path(__file__).resolve().parents[2]
SHARED_DEV = REPO.parent / "shared" / "data" / "translation" / "de_en_dev.jsonl"
SAMPLE_DEV = REPO / "loadtest" / "data" / "de_en_dev.jsonl"
EVERYDAY = REPO / "loadtest" / "data" / "tatoeba_de_en_dev.jsonl"  # short everyday sentences (--capacity)
DEFAULT_MODEL = REPO / "defaults" / "translate-de-en"


def load_sentences(path: Path | None = None) -> tuple[list[str], Path]:
    for p in ([path] if path else [SHARED_DEV, SAMPLE_DEV]):
        if p is not None and p.is_file():
            rows = [json.loads(line)["source"] for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
            if rows:
                return rows, p
    raise SystemExit(f"no dev sentences: neither {SHARED_DEV} nor {SAMPLE_DEV} exists")


def schedule(sentences: list[str], rate: float, duration: float, seed: int) -> list[tuple[float, str]]:
    """(offset seconds, text) pairs: exponential inter-arrival times, texts drawn with replacement."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            return out
        out.append((t, rng.choice(sentences)))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


class _Server:
    """An InferenceServer with one translation model on its own event-loop thread."""

    def __init__(self, model_dir: Path, scheduling: str, args) -> None:
        from relserve.service.config import ModelConfig, ServerConfig
        from relserve.service.registry import build_runner
        from relserve.service.server import InferenceServer

        mc = ModelConfig(name="mt", path=model_dir, device=args.device, backend=args.backend, dtype=args.dtype,
                         scheduling=scheduling,
                         max_active_hypotheses=args.max_active_hypotheses, max_batch_size=args.max_batch_size,
                         max_queue_delay=args.max_queue_delay, max_queue_size=100000,
                         torch_intra_op_threads=args.threads,
                         **({} if args.encode_batch_delay_ms is None
                            else {"encode_batch_delay_ms": args.encode_batch_delay_ms}))
        cfg = ServerConfig(host="127.0.0.1", port=0, metrics_port=None, drain_timeout=1.0, models=(mc,))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = InferenceServer(cfg, [build_runner(mc)])
        self.port = self._call(self.server.start())
        self._call(self.server.load_models(), timeout=600)
        self.runner = self.server.registry.runners["mt"]

    def _call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self._call(self.server.stop(0.5))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


async def _drive(port: int, plan: list[tuple[float, str]], beam_size: int, timeout: float,
                 n_bests: tuple[int, ...] = (0,)) -> dict:
    """Replay ``plan`` open-loop; request i asks for ``n_bests[i % len(n_bests)]`` hypotheses (0: the default,
    1). Latencies are also reported per n_best (``p99_s_by_n_best``)."""
    import grpc

    from relserve.service._proto import inference_pb2 as pb
    from relserve.service._proto import inference_pb2_grpc as pb_grpc

    latencies: list[float] = []
    by_n_best: dict[int, list[float]] = {}
    out_tokens = 0
    errors: dict[str, int] = {}
    last_done = 0.0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        await stub.ListModels(pb.ListModelsRequest())  # connect before the clock starts
        t0 = time.monotonic()

        async def one(i: int, offset: float, text: str) -> None:
            nonlocal out_tokens, last_done
            n_best = n_bests[i % len(n_bests)]
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            start = time.monotonic()
            try:
                reply = await stub.Translate(pb.TranslateRequest(model="mt", texts=[text], beam_size=beam_size,
                                                                 n_best=n_best), timeout=timeout)
                out_tokens += len(reply.results[0].hypotheses[0].token_ids)
                latencies.append(time.monotonic() - start)
                by_n_best.setdefault(max(1, n_best), []).append(latencies[-1])
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
            last_done = max(last_done, time.monotonic())

        await asyncio.gather(*(one(i, o, t) for i, (o, t) in enumerate(plan)))
    span = max(1e-9, last_done - t0)
    return {
        "requests": len(plan), "completed": len(latencies), "errors": errors, "span_s": round(span, 3),
        "throughput_rps": len(latencies) / span, "output_tokens_per_s": out_tokens / span,
        "p50_s": _percentile(latencies, 50), "p99_s": _percentile(latencies, 99),
        "mean_s": statistics.fmean(latencies) if latencies else float("nan"),
        "p99_s_by_n_best": {k: _percentile(v, 99) for k, v in sorted(by_n_best.items())},
    }


async def _saturate(port: int, sentences: list[str], clients: int, duration: float, warmup: float,
                    beam_size: int, n_best: int, seed: int, timeout: float) -> dict:
    """Closed loop: ``clients`` callers each send one-text Translate calls back to back (texts drawn seeded)
    for ``warmup + duration`` seconds; completions inside the last ``duration`` seconds are counted, so the
    throughput is the server's at saturation (the queue never empties while ``clients`` exceeds what the
    loop can hold). Calls still running at the end are awaited (not counted), so the next phase starts idle."""
    import grpc

    from relserve.service._proto import inference_pb2 as pb
    from relserve.service._proto import inference_pb2_grpc as pb_grpc

    done = 0
    replies = 0  # every reply, warm-up and drain included (what the CPU time of the slice paid for)
    out_tokens = 0
    latencies: list[float] = []
    errors: dict[str, int] = {}
    details: dict[str, str] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        await stub.ListModels(pb.ListModelsRequest())
        t0 = time.monotonic()
        count_from, end = t0 + warmup, t0 + warmup + duration

        async def caller(c: int) -> None:
            nonlocal done, out_tokens, replies
            rng = random.Random(seed * 100003 + c)
            while time.monotonic() < end:
                start = time.monotonic()
                try:
                    reply = await stub.Translate(pb.TranslateRequest(
                        model="mt", texts=[rng.choice(sentences)], beam_size=beam_size, n_best=n_best),
                        timeout=timeout)
                except grpc.aio.AioRpcError as exc:
                    errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                    details.setdefault(exc.code().name, exc.details())  # the first of each code, to say why
                    continue
                now = time.monotonic()
                replies += 1
                if count_from <= now <= end:
                    done += 1
                    out_tokens += len(reply.results[0].hypotheses[0].token_ids)
                    latencies.append(now - start)

        await asyncio.gather(*(caller(c) for c in range(clients)))
    return {"clients": clients, "completed": done, "replies": replies, "errors": errors, "error_details": details,
            "seconds": duration,
            "output_tokens": out_tokens, "latencies": latencies}


def process_cpu_s() -> float:
    """CPU seconds this process used so far, all threads (here: server, backend and the in-process clients;
    :mod:`.serving`: its load generator)."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def pooled(slices: list[dict]) -> tuple[float, list[float], dict[str, int]]:
    """What interleaved saturation slices (:func:`_saturate`'s results) add up to: counted seconds, every
    latency (seconds) and the error counts by kind."""
    errors: dict[str, int] = {}
    for r in slices:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return sum(r["seconds"] for r in slices), [x for r in slices for x in r["latencies"]], errors


def _merge_saturation(slices: list[dict]) -> dict:
    """One figure from a scheduling's interleaved saturation slices: completions over counted seconds."""
    seconds, latencies, errors = pooled(slices)
    done = sum(r["completed"] for r in slices)
    return {"clients": slices[0]["clients"], "slices": len(slices), "completed": done, "errors": errors,
            "seconds": seconds, "throughput_rps": done / seconds,
            "output_tokens_per_s": sum(r["output_tokens"] for r in slices) / seconds,
            "p50_s": _percentile(latencies, 50), "p99_s": _percentile(latencies, 99),
            "slice_rps": [round(r["completed"] / r["seconds"], 2) for r in slices],
            # CPU per request counts the warm-up and the drain too, and the clients: a load-independent view of
            # the cost (throughput on shared cores moves with whatever else runs)
            "cpu_ms_per_request": 1000 * sum(r["cpu_s"] for r in slices) / max(1, sum(r["replies"] for r in slices))}


def run_mode(model_dir: Path, scheduling: str, plan, args) -> dict:
    srv = _Server(model_dir, scheduling, args)
    try:
        loop = srv.runner.loop
        steps0 = loop.steps
        loop.plans.clear()
        result = asyncio.run(_drive(srv.port, plan, args.beam_size, args.timeout))
        steps = loop.steps - steps0
        result["decoder_steps"] = steps
        result["encoder_batches"] = loop.encoder_batches
        kept = list(loop.plans)
        result["mean_hypotheses_per_step"] = (sum(p.total for p in kept) / len(kept)) if kept else 0.0
        result["mean_texts_per_step"] = (sum(len(p.seq_ids) for p in kept) / len(kept)) if kept else 0.0
    finally:
        srv.close()
    result["scheduling"] = scheduling
    return result


def _loop_counters(srv: "_Server") -> tuple[int, int, int]:
    loop = srv.runner.loop
    return loop.encoder_batches, loop.encoded_sequences, loop.steps


def _counted(srv: "_Server", before: tuple[int, int, int], result: dict) -> dict:
    batches, seqs, steps = (a - b for a, b in zip(_loop_counters(srv), before))
    result.update(encoder_batches=batches, decoder_steps=steps,
                  texts_per_encode=seqs / batches if batches else 0.0)
    return result


def run_capacity(model_dir: Path, sentences: list[str], args) -> dict:
    """Saturation throughput of both schedulings (closed loop, n_best 1 and 5), then p99 under Poisson load at
    ``--load-fractions`` of the capacity (requests alternate n_best 1 and 5). The capacity is the lower of
    the two schedulings' n_best-1 saturation throughputs, so neither is overloaded in the load phases. Both
    servers stay up; each phase waits for the other's compute share to lapse (``scheduling.cores.ACTIVE_WINDOW_S``)."""
    from relserve.service.scheduling.cores import ACTIVE_WINDOW_S

    modes = ("iteration", "request")
    servers: dict[str, _Server] = {}
    out: dict = {"saturation": {}, "load": {}}
    try:
        for mode in modes:
            servers[mode] = _Server(model_dir, mode, args)
        for n_best in (1, 5):
            # the cores are shared with whatever else runs: the schedulings take turns (ABBA...) in slices, so
            # a change in background load falls on both alike
            slices: dict[str, list[dict]] = {m: [] for m in modes}
            before = {m: _loop_counters(servers[m]) for m in modes}
            for rep in range(args.sat_repeats):
                for mode in (modes if rep % 2 == 0 else modes[::-1]):
                    time.sleep(ACTIVE_WINDOW_S + 0.2)
                    cpu0 = process_cpu_s()
                    r = asyncio.run(_saturate(
                        servers[mode].port, sentences, args.clients, args.sat_duration, args.sat_warmup,
                        args.beam_size, n_best, args.seed + rep, args.timeout))
                    r["cpu_s"] = process_cpu_s() - cpu0
                    slices[mode].append(r)
            for mode in modes:
                r = _counted(servers[mode], before[mode], _merge_saturation(slices[mode]))
                out["saturation"][f"{mode}/n_best={n_best}"] = r
                print(f"saturation {mode:>9} n_best {n_best}: {r['throughput_rps']:.2f} req/s (slices "
                      f"{r['slice_rps']})  {r['output_tokens_per_s']:.1f} tok/s  p50 {r['p50_s'] * 1000:.0f} ms  "
                      f"p99 {r['p99_s'] * 1000:.0f} ms  texts/encode {r['texts_per_encode']:.1f}  "
                      f"steps {r['decoder_steps']}  CPU {r['cpu_ms_per_request']:.1f} ms/request  "
                      f"errors {r['errors'] or '-'}", flush=True)
        sat = out["saturation"]
        capacity = min(sat[f"{m}/n_best=1"]["throughput_rps"] for m in modes)
        out["capacity_rps"] = capacity
        for frac in args.load_fractions:
            plan = schedule(sentences, frac * capacity, args.load_duration, args.seed + 1)
            for mode in modes:
                time.sleep(ACTIVE_WINDOW_S + 0.2)
                before = _loop_counters(servers[mode])
                r = asyncio.run(_drive(servers[mode].port, plan, args.beam_size, args.timeout, n_bests=(1, 5)))
                out["load"][f"{mode}/{frac:g}"] = _counted(servers[mode], before, r)
                by = "  ".join(f"p99[n_best {k}] {v * 1000:.0f} ms" for k, v in r["p99_s_by_n_best"].items())
                print(f"load {frac:.0%} of {capacity:.1f} req/s {mode:>9}: {r['completed']}/{r['requests']} ok  "
                      f"p50 {r['p50_s'] * 1000:.0f} ms  p99 {r['p99_s'] * 1000:.0f} ms  {by}  "
                      f"texts/encode {r['texts_per_encode']:.1f}  errors {r['errors'] or '-'}", flush=True)
    finally:
        for srv in servers.values():
            srv.close()
    ratios = {f"throughput_iteration_over_request/n_best={n}":
              sat[f"iteration/n_best={n}"]["throughput_rps"] / max(sat[f"request/n_best={n}"]["throughput_rps"], 1e-9)
              for n in (1, 5)}
    for n in (1, 5):
        ratios[f"cpu_per_request_request_over_iteration/n_best={n}"] = (
            sat[f"request/n_best={n}"]["cpu_ms_per_request"] / max(sat[f"iteration/n_best={n}"]["cpu_ms_per_request"], 1e-9))
    for frac in args.load_fractions:
        it, rq = out["load"][f"iteration/{frac:g}"], out["load"][f"request/{frac:g}"]
        ratios[f"p99_request_over_iteration/{frac:g}"] = rq["p99_s"] / it["p99_s"]
    out["ratios"] = ratios
    print("ratios: " + ", ".join(
        [f"throughput x{ratios[f'throughput_iteration_over_request/n_best={n}']:.2f} (n_best {n})" for n in (1, 5)]
        + [f"CPU per request x{ratios[f'cpu_per_request_request_over_iteration/n_best={n}']:.2f} less (n_best {n})"
           for n in (1, 5)]
        + [f"p99 at {f:.0%} x{ratios[f'p99_request_over_iteration/{f:g}']:.2f} lower" for f in args.load_fractions])
        + " with iteration-level batching (target: throughput >= 1.5x, p99 > 1x)")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of :func:`main` (also how :mod:`.cpu` gets :func:`run_capacity`'s settings)."""
    ap = harness.parser("translation", __doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help=f"RNNsearch checkpoint dir (default {DEFAULT_MODEL})")
    ap.add_argument("--data", type=Path, help="JSON lines with 'source' (default: shared dev set, else sample)")
    ap.add_argument("--rate", type=float, default=6.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per mode")
    ap.add_argument("--beam-size", type=int, default=5)
    ap.add_argument("--max-active-hypotheses", type=int, default=256)
    ap.add_argument("--max-batch-size", type=int, default=None,
                    help="encoder batch cap (default 32; with --capacity 64, so that request-level groups are "
                         "bounded by the same hypothesis budget as the iteration-level loop)")
    ap.add_argument("--encode-batch-delay-ms", type=float, default=None,
                    help="the model key encode_batch_delay_ms (default: the server's default)")
    ap.add_argument("--max-queue-delay", type=float, default=0.005)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="the model key dtype (both schedulings use the same)")
    harness.add_common_args(ap, threads=0,
                            threads_help="the model key torch_intra_op_threads (0: the server's default share of "
                                         "the cores)",
                            json="print", json_help="also print a JSON summary (one line)")
    ap.add_argument("--backend", default="torch", choices=("torch", "onnx"),
                    help="torch, or onnx (ONNX Runtime; exports into the default cache on first use)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request deadline, seconds")
    ap.add_argument("--modes", default="iteration,request", help="comma-separated schedulings, in run order")
    ap.add_argument("--capacity", action="store_true",
                    help="saturation throughput (closed loop) of both schedulings with n_best 1 and 5, then p99 "
                         "under Poisson load at --load-fractions of capacity; text: the committed Tatoeba sample")
    ap.add_argument("--clients", type=int, default=64, help="--capacity: concurrent closed-loop callers")
    ap.add_argument("--sat-duration", type=float, default=20.0, help="--capacity: seconds counted per phase")
    ap.add_argument("--sat-warmup", type=float, default=3.0, help="--capacity: seconds before counting starts")
    ap.add_argument("--sat-repeats", type=int, default=2,
                    help="--capacity: saturation slices per scheduling and n_best, the schedulings taking turns")
    ap.add_argument("--load-duration", type=float, default=30.0, help="--capacity: seconds of arrivals per load")
    ap.add_argument("--load-fractions", type=lambda v: tuple(float(x) for x in v.split(",")), default=(0.5, 0.8),
                    help="--capacity: comma-separated fractions of capacity for the p99 phases")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_batch_size is None:
        args.max_batch_size = 64 if args.capacity else 32

    model_dir = args.model or DEFAULT_MODEL
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"{model_dir}: no config.json (an RNNsearch checkpoint directory)")
    if args.capacity:
        sentences, data_path = load_sentences(args.data or EVERYDAY)
        print(f"model {model_dir}  data {data_path} ({len(sentences)} sentences)  capacity run: {args.clients} "
              f"closed-loop clients, {args.sat_repeats} x {args.sat_warmup}+{args.sat_duration}s saturation slices "
              f"per scheduling and n_best, "
              f"{args.load_duration}s per load phase, beam {args.beam_size}, max_active_hypotheses "
              f"{args.max_active_hypotheses}, max_batch_size {args.max_batch_size}, encode_batch_delay_ms "
              f"{'default' if args.encode_batch_delay_ms is None else args.encode_batch_delay_ms}", flush=True)
        results = run_capacity(model_dir, sentences, args)
        harness.emit_json(args, [results])
        return 0
    sentences, data_path = load_sentences(args.data)
    plan = schedule(sentences, args.rate, args.duration, args.seed)
    print(f"model {model_dir}  data {data_path} ({len(sentences)} sentences)  {len(plan)} requests, "
          f"Poisson {args.rate}/s over {args.duration}s, beam {args.beam_size}, "
          f"max_active_hypotheses {args.max_active_hypotheses}, max_batch_size {args.max_batch_size}")
    results = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        r = run_mode(model_dir, mode, plan, args)
        results[mode] = r
        print(f"{mode:>9}: {r['completed']}/{r['requests']} ok in {r['span_s']:.1f}s  "
              f"{r['throughput_rps']:.2f} req/s  {r['output_tokens_per_s']:.1f} tok/s  "
              f"p50 {r['p50_s'] * 1000:.0f} ms  p99 {r['p99_s'] * 1000:.0f} ms  "
              f"encodes {r['encoder_batches']}  steps {r['decoder_steps']}  hyps/step {r['mean_hypotheses_per_step']:.1f}  "
              f"texts/step {r['mean_texts_per_step']:.1f}  errors {r['errors'] or '-'}")
    if "iteration" in results and "request" in results:
        it, rq = results["iteration"], results["request"]
        ratios = {
            "throughput_iteration_over_request": harness.ratio(it["throughput_rps"], rq["throughput_rps"]),
            "tokens_per_s_iteration_over_request": it["output_tokens_per_s"] / max(rq["output_tokens_per_s"], 1e-9),
            "p50_request_over_iteration": rq["p50_s"] / it["p50_s"],
            "p99_request_over_iteration": rq["p99_s"] / it["p99_s"],
        }
        results["ratios"] = ratios
        def latency(label: str, request_over_iteration: float) -> str:
            if request_over_iteration >= 1:
                return f"{label} latency x{request_over_iteration:.2f} lower"
            return f"{label} latency x{1 / request_over_iteration:.2f} HIGHER"

        print(f"ratios: throughput x{ratios['throughput_iteration_over_request']:.2f} (iteration/request), "
              f"{latency('p50', ratios['p50_request_over_iteration'])}, "
              f"{latency('p99', ratios['p99_request_over_iteration'])} with iteration-level batching")
    harness.emit_json(args, [results])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
