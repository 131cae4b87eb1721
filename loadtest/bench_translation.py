"""Iteration-level vs request-level batching for translation, under the same Poisson load.

    python -m relserve.loadtest.bench_translation                       # defaults/translate-de-en, 6 req/s, 20 s
    python -m relserve.loadtest.bench_translation --rate 4 --duration 10 --beam-size 5 --json
    python -m relserve.loadtest.bench_translation --backend onnx --rate 20 --duration 12

One run serves the same model twice, one scheduling after the other (``scheduling: iteration``, then
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

REPO = Path(__file__).resolve().parents[1]
SHARED_DEV = REPO.parent / "shared" / "data" / "translation" / "de_en_dev.jsonl"
SAMPLE_DEV = REPO / "loadtest" / "data" / "de_en_dev.jsonl"
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

        mc = ModelConfig(name="mt", path=model_dir, device=args.device, backend=args.backend, scheduling=scheduling,
                         max_active_hypotheses=args.max_active_hypotheses, max_batch_size=args.max_batch_size,
                         max_queue_delay=args.max_queue_delay, max_queue_size=100000)
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


async def _drive(port: int, plan: list[tuple[float, str]], beam_size: int, timeout: float) -> dict:
    import grpc

    from relserve.service._proto import inference_pb2 as pb
    from relserve.service._proto import inference_pb2_grpc as pb_grpc

    latencies: list[float] = []
    out_tokens = 0
    errors: dict[str, int] = {}
    last_done = 0.0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        await stub.ListModels(pb.ListModelsRequest())  # connect before the clock starts
        t0 = time.monotonic()

        async def one(offset: float, text: str) -> None:
            nonlocal out_tokens, last_done
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            start = time.monotonic()
            try:
                reply = await stub.Translate(pb.TranslateRequest(model="mt", texts=[text], beam_size=beam_size),
                                             timeout=timeout)
                out_tokens += len(reply.results[0].hypotheses[0].token_ids)
                latencies.append(time.monotonic() - start)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
            last_done = max(last_done, time.monotonic())

        await asyncio.gather(*(one(o, t) for o, t in plan))
    span = max(1e-9, last_done - t0)
    return {
        "requests": len(plan), "completed": len(latencies), "errors": errors, "span_s": round(span, 3),
        "throughput_rps": len(latencies) / span, "output_tokens_per_s": out_tokens / span,
        "p50_s": _percentile(latencies, 50), "p99_s": _percentile(latencies, 99),
        "mean_s": statistics.fmean(latencies) if latencies else float("nan"),
    }


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help=f"RNNsearch checkpoint dir (default {DEFAULT_MODEL})")
    ap.add_argument("--data", type=Path, help="JSON lines with 'source' (default: shared dev set, else sample)")
    ap.add_argument("--rate", type=float, default=6.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per mode")
    ap.add_argument("--beam-size", type=int, default=5)
    ap.add_argument("--max-active-hypotheses", type=int, default=256)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-queue-delay", type=float, default=0.005)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="torch", choices=("torch", "onnx"),
                    help="torch, or onnx (ONNX Runtime; exports into the default cache on first use)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request deadline, seconds")
    ap.add_argument("--modes", default="iteration,request", help="comma-separated schedulings, in run order")
    ap.add_argument("--json", action="store_true", help="also print a JSON summary")
    args = ap.parse_args(argv)

    model_dir = args.model or DEFAULT_MODEL
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"{model_dir}: no config.json (an RNNsearch checkpoint directory)")
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
            "throughput_iteration_over_request": it["throughput_rps"] / rq["throughput_rps"],
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
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
