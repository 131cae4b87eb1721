"""One model process with T intra-op threads against T single-thread processes, on the calls a server makes.

    python -m relserve.loadtest.bench.instances                 # ~2 min on 2 cores
    python -m relserve.loadtest.bench.instances --batch 16 --rounds 3 --busy-ms 1

Why: served with 32 closed-loop clients, the default worker process computes calls of about 11 texts, and those
calls run far below the offline ideal of sorted batches of 32 (``bench.cpu --parts server``). Small calls leave a
2-thread OpenMP pool waiting at its barriers, more so when the serving process wakes on one of the cores. This
measures what T single-thread model processes (Triton's instance count) would gain, with no server in the way.

What runs: the v3-small-shaped random classifier and 8000-piece tokenizer of :mod:`.cpu` (built in a
temporary directory), the sentence workload in a seeded shuffled order cut into batches of ``--batch``, tokenized
once; each variant's processes (spawned, each a :class:`relserve.service.backends.torch_encoder.TorchBackend`
loaded and warmed, bfloat16 where the CPU has it, else float32) wait at a common start and run their share of
the batches (batch i to process i mod P) ``--rounds`` times; throughput = texts / the slowest process's time. The
two variants alternate ``--repeats`` times. ``--busy-ms`` > 0 adds a process that is busy that many ms in every
10 (the serving process's own work beside the model).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from . import harness


def _model_process(checkpoint: str, dtype: str, threads: int, batches: list[list[list[int]]], rounds: int,
                   ready: Any, go: Any, out: Any) -> None:
    from relserve.service.backends.torch_encoder import TorchBackend
    from relserve.service.backends.worker import WireItem
    from relserve.service.config import ModelConfig

    be = TorchBackend(ModelConfig(name="m", path=Path(checkpoint), device="cpu", dtype=dtype, max_batch_size=64,
                                  torch_intra_op_threads=threads))
    be.load()
    be.warmup()
    calls = [[WireItem(ids, None) for ids in b] for b in batches]
    for b in calls[:5]:
        be.run(b)
    ready.release()
    go.wait()
    start = time.perf_counter()
    n = 0
    for _ in range(rounds):
        for b in calls:
            be.run(b)
            n += len(b)
    out.put((n, time.perf_counter() - start))
    be.close()


def _busy_process(busy_s: float, stop: Any) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < busy_s:
            pass
        time.sleep(max(0.0, 0.010 - busy_s))


def run_variant(checkpoint: Path, dtype: str, processes: int, threads: int, batches: list[list[list[int]]],
                rounds: int, busy_ms: float) -> float:
    """Texts per second of ``processes`` model processes with ``threads`` threads each over ``batches``."""
    ctx = mp.get_context("spawn")
    ready, go, stop, out = ctx.Semaphore(0), ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_model_process, args=(str(checkpoint), dtype, threads, batches[i::processes],
                                                       rounds, ready, go, out)) for i in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire()
    busy = ctx.Process(target=_busy_process, args=(busy_ms / 1000, stop)) if busy_ms > 0 else None
    if busy is not None:
        busy.start()
    go.set()
    results = [out.get() for _ in procs]
    stop.set()
    for p in procs + ([busy] if busy else []):
        p.join()
    return sum(n for n, _ in results) / max(s for _, s in results)


def main(argv: list[str] | None = None) -> int:
    from relserve.models.tokenization import load_tokenizer
    from relserve.service.cpu_features import bf16_support

    from . import cpu as bc

    ap = harness.parser("instances", __doc__.split("\n\n")[0])
    harness.add_common_args(ap, threads=2, threads_help="T: threads of the one process, and processes of the other",
                            repeats=2, repeats_help="alternations of the two variants")
    ap.add_argument("--batch", type=int, default=11, help="texts per call (11: the served mean at 32 clients)")
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the batches per timing")
    ap.add_argument("--busy-ms", type=float, default=0.0, help="a process busy this many ms in every 10")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    dtype = "bfloat16" if bf16_support()[0] else "float32"
    with tempfile.TemporaryDirectory(prefix="relserve-bench-instances-") as tmp:
        root = Path(tmp)
        tok_dir, tok_origin = bc.build_tokenizer(root / "tokenizer")
        tok = load_tokenizer(tok_dir)
        texts, text_origin = bc.workload_sentences(args.sentences)
        small = bc.Encoder(root / "small", bc.V3_SMALL, int(tok.vocab_size), args.threads, tokenizer_dir=tok_dir)
        random.Random(args.seed).shuffle(texts)
        ids = [tok.encode(t, max_length=512).input_ids for t in texts]
        batches = [ids[i:i + args.batch] for i in range(0, len(ids), args.batch)]
        print(f"{text_origin}; {len(batches)} calls of {args.batch} texts (arrival order), {dtype}, busy process "
              f"{args.busy_ms:g} ms / 10 ms", flush=True)
        got: dict[str, list[float]] = {"one": [], "many": []}
        for _ in range(args.repeats):
            got["one"].append(run_variant(small.checkpoint, dtype, 1, args.threads, batches, args.rounds, args.busy_ms))
            got["many"].append(run_variant(small.checkpoint, dtype, args.threads, 1, batches, args.rounds,
                                           args.busy_ms))
            print(f"  1 process x {args.threads} threads {got['one'][-1]:.1f} texts/s; {args.threads} processes x 1 "
                  f"thread {got['many'][-1]:.1f} texts/s", flush=True)
    med = harness.medians(got)
    one, many = med["one"], med["many"]
    print(f"medians: 1 x {args.threads}: {one:.1f}, {args.threads} x 1: {many:.1f} texts/s; "
          f"ratio {harness.ratio(many, one):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
