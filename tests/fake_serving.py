"""Fake tokenizer and backends for serving tests: no torch, no checkpoint, milliseconds per batch.

Used by tests/test_server_fake.py (and by the subprocess it starts for the SIGTERM test), through the
server's seam: ``InferenceServer(config, runners=[ModelRunner(model_cfg, FakeBackend(...))])``.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from relserve.service.backends import TASK_CLASSIFICATION, TASK_QA, ModelMeta
from relserve.service.config import ModelConfig, ServerConfig
from relserve.service.runner import ModelRunner

CLS, SEP, PAD = 1, 2, 0
LABELS = ("negative", "positive")


@dataclass
class FakeEncoding:
    input_ids: list[int]
    token_type_ids: list[int]
    truncated: bool = False


@dataclass
class FakeWindow:
    input_ids: list[int]
    token_type_ids: list[int]
    context_offsets: list = field(default_factory=list)


class FakeTokenizer:
    """Whitespace tokenizer: each word is one token; id 10 = "good", 11 = "bad", other words 12+."""

    cls_token_id, sep_token_id, pad_token_id = CLS, SEP, PAD
    model_max_length = None

    @staticmethod
    def _words(text: str) -> list[tuple[int, tuple[int, int]]]:
        out = []
        for m in re.finditer(r"\S+", text):
            w = m.group().lower()
            out.append((10 if w == "good" else 11 if w == "bad" else 12 + len(w) % 50, m.span()))
        return out

    def encode(self, text, pair=None, max_length=None):
        a = [i for i, _ in self._words(text)]
        b = [i for i, _ in self._words(pair)] if pair else []
        budget = (max_length or 10**9) - (3 if pair else 2)
        truncated = len(a) + len(b) > budget
        while len(a) + len(b) > budget:  # longest first
            if len(a) >= len(b):
                a.pop()
            else:
                b.pop()
        ids = [CLS, *a, SEP] + ([*b, SEP] if pair else [])
        types = [0] * (len(a) + 2) + ([1] * (len(b) + 1) if pair else [])
        return FakeEncoding(ids, types, truncated)

    def batch_encode(self, texts, pairs=None, max_length=None):
        pairs = pairs or [None] * len(texts)
        return [self.encode(t, p, max_length) for t, p in zip(texts, pairs)]

    def qa_windows(self, question, context, max_seq_len, doc_stride):
        q = [i for i, _ in self._words(question)][: (max_seq_len - 3) // 2]
        c = self._words(context)
        room = max_seq_len - 3 - len(q)
        stride = doc_stride if doc_stride < room else room // 2
        head = [CLS, *q, SEP]
        windows, start = [], 0
        while True:
            chunk = c[start:start + room]
            ids = head + [i for i, _ in chunk] + [SEP]
            types = [0] * len(head) + [1] * (len(chunk) + 1)
            offsets = [None] * len(head) + [span for _, span in chunk] + [None]
            windows.append(FakeWindow(ids, types, offsets))
            if start + room >= len(c):
                return windows
            start += room - stride


class FakeBackend:
    """Classification: logits [#bad, #good] (so "good" texts are positive). QA: the answer is the first
    context word of each window. Knobs: ``delay`` per batch, ``fail`` (raise), ``warm_gate``
    (warm-up blocks until the event is set)."""

    name = "fake"
    is_padded = True
    max_batch_size = None

    def __init__(self, task: str = TASK_CLASSIFICATION, *, delay: float = 0.0, fail: bool = False,
                 warm_gate: threading.Event | None = None) -> None:
        self.task = task
        self.delay = delay
        self.fail = fail
        self.warm_gate = warm_gate
        self.batches: list[int] = []

    def load(self) -> ModelMeta:
        return ModelMeta(task=self.task, family="fake-deberta", backend=self.name, device="cpu", dtype="float32",
                         tokenizer=FakeTokenizer(), labels=LABELS if self.task == TASK_CLASSIFICATION else (),
                         max_positions=64)

    def warmup(self) -> None:
        if self.warm_gate is not None and not self.warm_gate.wait(30):
            raise TimeoutError("warm-up gate never opened")

    def run(self, batch):
        self.batches.append(len(batch))
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("fake backend failure")
        out = []
        for item in batch:
            ids = item.input_ids
            if self.task == TASK_CLASSIFICATION:
                out.append(np.array([ids.count(11), ids.count(10)], dtype=np.float32))
            else:
                t = len(ids)
                start = np.full(t, -5.0, dtype=np.float32)
                end = np.full(t, -5.0, dtype=np.float32)
                start[0] = end[0] = -10.0
                ctx = [i for i, tt in enumerate(item.token_type_ids) if tt == 1][:-1]
                if ctx:
                    start[ctx[0]] = end[ctx[0]] = 5.0
                out.append((start, end))
        return out

    def memory_stats(self):
        return {}

    def close(self) -> None:
        pass


def model_config(name: str, **kw) -> ModelConfig:
    kw.setdefault("max_seq_len", 64)
    kw.setdefault("doc_stride", 16)
    kw.setdefault("max_batch_tokens", 4096)
    return ModelConfig(name=name, path=Path("."), **kw)


def runner(name: str, task: str = TASK_CLASSIFICATION, *, config: dict | None = None, **backend_kw) -> ModelRunner:
    return ModelRunner(model_config(name, **(config or {})), FakeBackend(task, **backend_kw))


def server_config(**kw) -> ServerConfig:
    kw.setdefault("host", "127.0.0.1")
    kw.setdefault("port", 0)
    kw.setdefault("metrics_port", 0)
    kw.setdefault("drain_timeout", 2.0)
    return ServerConfig(**kw)
