"""Cost-model batch forming through a real grpc.aio server on a free loopback port (issue 11 item 4): a model's
batch cost model is fitted from warm-up probes on the device at load, a mixed-length burst of concurrent
Classify requests is answered exactly as each request alone (within 1e-5), and the padding efficiency of every
backend call is exported as ``relserve_batch_padding_efficiency``, equal to what the backend actually ran.

Two models on the same tiny checkpoint: ``measured`` plans with the cost model its warm-up fitted; ``split``
gets a cost model fitted from synthetic probes in which padding is expensive, so its burst is certainly cut
into several sub-batches whatever this machine's timings are (what is under test there is that split
sub-batches answer correctly and are counted right, not the timings)."""

from __future__ import annotations

import random
import urllib.request

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.fake_serving import server_config  # noqa: E402
from fixtures.server import Running  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service.backends.base import UNBUDGETED  # noqa: E402
from relserve.service.backends.torch_encoder import TorchBackend  # noqa: E402
from relserve.service.scheduling.cost_model import BatchCostModel, cost_features  # noqa: E402
from relserve.service.config import ModelConfig  # noqa: E402
from relserve.service.runner import ModelRunner  # noqa: E402

WORDS = "the film was a delight from start to finish but the ending dragged on far too long".split()


class RecordingBackend(TorchBackend):
    """The real torch backend, recording the token counts of every call once ``recording`` is set."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.recording = False
        self.calls: list[list[int]] = []

    def run(self, batch, budget=UNBUDGETED):
        if self.recording:
            self.calls.append([len(item.input_ids) for item in batch])
        return super().run(batch, budget)


class PaddingIsExpensive(ModelRunner):
    """Replaces the measured fit by one from synthetic probes: 1 ms per call, 10 us per real token, 50 ns per
    n x L^2 (the attention core dominates as soon as a batch pads a long row)."""

    def load(self) -> None:
        super().load()
        self.batch_cost = BatchCostModel()
        rng = random.Random(0)
        for _ in range(12):
            lengths = [rng.randint(2, 120) for _ in range(rng.randint(1, 12))]
            _, real, _, att = cost_features(lengths)
            self.batch_cost.observe(lengths, 1e-3 + 1e-5 * real + 5e-8 * att, warmup=True)


@pytest.fixture(scope="module")
def served(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cost-batching")
    path = make_deberta_checkpoint(root / "cls", tokenizer_dir=unigram_tokenizer_dir, labels=("a", "b", "c"),
                                   init="spread", seed=3).path
    common = dict(path=path, device="cpu", dtype="float32", max_seq_len=128, max_batch_size=32,
                  # long enough for the whole burst to be waiting when the batch is formed (no timing is asserted)
                  max_queue_delay=0.15, max_request_batch_share=1.0)
    backends = {}
    runners = []
    for name, cls in (("measured", ModelRunner), ("split", PaddingIsExpensive)):
        cfg = ModelConfig(name=name, **common)
        backends[name] = RecordingBackend(cfg)
        runners.append(cls(cfg, backends[name]))
    srv = Running(server_config(), runners)
    srv.wait_serving(timeout=150)
    yield srv, {r.name: r for r in runners}, backends
    srv.close()


def texts(n: int, seed: int) -> list[str]:
    """Widely mixed lengths: 1 to ~110 words (about 3 to 120 tokens under max_seq_len 128)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice((1, 2, 3, 5, 8, 40, 110)))) for _ in range(n)]


def scores(reply) -> dict[str, float]:
    return {ls.label: ls.score for ls in reply.results[0].labels}


def efficiency_metric(srv, model: str) -> tuple[float, float]:
    """(count, sum) of relserve_batch_padding_efficiency for ``model``."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
    count = total = 0.0
    for fam in text_string_to_metric_families(body):
        if fam.name != "relserve_batch_padding_efficiency":
            continue
        for s in fam.samples:
            if s.labels.get("model") != model:
                continue
            if s.name.endswith("_count"):
                count = s.value
            elif s.name.endswith("_sum"):
                total = s.value
    return count, total


@pytest.mark.parametrize("model", ["measured", "split"])
def test_mixed_burst_answers_as_each_request_alone(served, model):
    srv, runners, backends = served
    runner, backend = runners[model], backends[model]
    coef = runner.batch_cost.coefficients()
    assert runner.batch_cost.fitted and coef is not None and min(coef) >= 0  # fitted at warm-up
    batch = texts(24, seed=1)
    lengths = [len(runner.meta.tokenizer.encode(t, max_length=128).input_ids) for t in batch]
    assert max(lengths) > 5 * min(lengths)  # a mixed-length burst

    backend.calls.clear()
    backend.recording = True
    before = efficiency_metric(srv, model)
    futures = [srv.stub.Classify.future(pb.ClassifyRequest(model=model, texts=[t], top_k=0), timeout=120)
               for t in batch]
    together = [scores(f.result()) for f in futures]
    backend.recording = False
    burst_calls = list(backend.calls)
    after = efficiency_metric(srv, model)
    alone = [scores(srv.stub.Classify(pb.ClassifyRequest(model=model, texts=[t], top_k=0), timeout=60))
             for t in batch]

    for got, want in zip(together, alone):
        assert sorted(got) == sorted(want) == ["a", "b", "c"]
        np.testing.assert_allclose([got[k] for k in "abc"], [want[k] for k in "abc"], rtol=0, atol=1e-5)
    assert sorted(n for call in burst_calls for n in call) == sorted(lengths)  # each text computed once
    if model == "split":
        assert len(burst_calls) > 1  # padding is expensive: the burst ran as several sub-batches
    # one observation per backend call, of real / (size x longest) for exactly what the backend ran
    want = [sum(c) / (len(c) * max(c)) for c in burst_calls]
    assert after[0] - before[0] == len(burst_calls)
    assert after[1] - before[1] == pytest.approx(sum(want), rel=1e-9)
    if model == "split":
        mixed = sum(lengths) / (len(lengths) * max(lengths))  # one padded batch of the whole burst
        assert sum(sum(c) for c in burst_calls) / sum(len(c) * max(c) for c in burst_calls) > mixed
