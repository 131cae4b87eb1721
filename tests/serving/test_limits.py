"""Bounded work per request through a real grpc.aio server on loopback (issue 10, items 3 and 4): the
classification character budget (a 4 MiB text is served truncated, exactly as its tokenized prefix), the
per-request limits (texts, characters, QA windows, translation source tokens) refused with INVALID_ARGUMENT
naming the config key, ``doc_stride`` capped at half a window's context room, and admission before work (queue
places reserved before tokenizing; a refused request is never tokenized; reservations come back after errors
and cancellations). Tiny random checkpoints from tests/fixtures; fake runners only where a slow tokenizer must
be staged."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest

pytest.importorskip("torch")

from fixtures.data import qa_rows  # noqa: E402
from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.fake_serving import FakeTokenizer, runner as fake_runner, server_config  # noqa: E402
from fixtures.server import Running  # noqa: E402
from fixtures.translation import make_tiny_checkpoint, sentence_pairs  # noqa: E402
from relserve.models.tokenization import load_tokenizer, qa_window_count  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service.config import MIB, ModelConfig  # noqa: E402
from relserve.service.registry import build_runner  # noqa: E402

MAX_SEQ_LEN = 128
QUESTION = "Where does Ann live?"


def _prose(n_chars: int) -> str:
    rows = [r["context"] for r in qa_rows("xquad_en_dev.jsonl")]
    text = " ".join(rows)
    return (text + " ") * (n_chars // (len(text) + 1)) + text[: n_chars % (len(text) + 1)]


class _SlowCountingTokenizer(FakeTokenizer):
    """Tokenization that takes 0.5 s and counts its calls (to see that a refused request was not tokenized)."""

    def __init__(self) -> None:
        self.calls = 0

    def batch_encode(self, texts, pairs=None, max_length=None):
        self.calls += 1
        time.sleep(0.5)
        return super().batch_encode(texts, pairs, max_length)


def _with_tokenizer(runner, tokenizer):
    """``runner`` whose fake backend loads with ``tokenizer``."""
    load = runner.backend.load
    runner.backend.load = lambda: dataclasses.replace(load(), tokenizer=tokenizer)
    return runner


@pytest.fixture(scope="module")
def checkpoints(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("limits-ckpt")
    return {
        "cls": make_deberta_checkpoint(root / "cls", task="classification", tokenizer_dir=unigram_tokenizer_dir,
                                       labels=("a", "b", "c"), init="spread", seed=1).path,
        "qa": make_deberta_checkpoint(root / "qa", task="question-answering", tokenizer_dir=unigram_tokenizer_dir,
                                      init="spread", seed=2).path,
        "tr": make_tiny_checkpoint(root / "tr", seed=3),
    }


@pytest.fixture(scope="module")
def srv(checkpoints):
    # compute in-process: worker processes have their own tests (test_worker_process.py, test_worker_pool.py)
    common = dict(device="cpu", max_seq_len=MAX_SEQ_LEN, max_queue_delay=0.002, worker_process=False)
    slow = _with_tokenizer(fake_runner("limits-slowtok", config={"max_queue_size": 2, "max_queue_delay": 0.0}),
                           _SlowCountingTokenizer())
    runners = [
        build_runner(ModelConfig(name="cls", path=checkpoints["cls"], **common)),
        build_runner(ModelConfig(name="cls-big", path=checkpoints["cls"], max_request_chars=8 * MIB, **common)),
        build_runner(ModelConfig(name="qa", path=checkpoints["qa"], doc_stride=32, **common)),
        build_runner(ModelConfig(name="qa-small", path=checkpoints["qa"], doc_stride=32, max_qa_windows=3, **common)),
        build_runner(ModelConfig(name="tr", path=checkpoints["tr"], device="cpu", max_source_tokens=64,
                                 max_request_texts=4, max_request_chars=200_000, max_queue_delay=0.002)),
        slow,
    ]
    limit = 8 * MIB
    s = Running(server_config(max_receive_message_length=limit, max_send_message_length=limit, metrics_port=None),
                runners, channel_options=[("grpc.max_send_message_length", limit),
                                          ("grpc.max_receive_message_length", limit)])
    s.wait_serving(timeout=120)
    yield s
    s.close()


@pytest.fixture(scope="module")
def tok(checkpoints):
    return load_tokenizer(checkpoints["cls"])


def _code(call, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kw)
    return err.value.code(), err.value.details()


def _all_queues_empty(srv) -> bool:
    for r in srv.server.registry.runners.values():
        s = r.scheduler
        held = getattr(s, "reserved", None)
        held = s.reserved_places if held is None else held
        if s.queue_depth or held:
            return False
    return True


def _wait_until(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# ---------------------------------------------------------------------- classification: the character budget

def test_4mib_classify_is_served_truncated_exactly_as_its_prefix(srv, tok):
    text = _prose(4 * MIB)
    assert len(text) == 4 * MIB
    reply = srv.stub.Classify(pb.ClassifyRequest(model="cls-big", texts=[text]), timeout=60)
    (r,) = reply.results
    assert r.truncated and r.num_tokens == MAX_SEQ_LEN
    # the shortest whitespace-cut prefix holding max_seq_len - 1 tokens: tokenized on its own it gives the same
    # model input, so the same label and scores
    (lead,) = tok.leading_tokens([text], [MAX_SEQ_LEN - 1])
    assert not lead.complete and lead.chars < 20_000
    short = srv.stub.Classify(pb.ClassifyRequest(model="cls-big", texts=[text[: lead.chars]]), timeout=60)
    (s,) = short.results
    assert s.truncated and s.num_tokens == MAX_SEQ_LEN
    assert [(x.label, round(x.score, 6)) for x in r.labels] == [(x.label, round(x.score, 6)) for x in s.labels]


def test_4mib_classify_over_the_default_char_limit_is_refused_naming_the_key(srv):
    code, details = _code(srv.stub.Classify, pb.ClassifyRequest(model="cls", texts=[_prose(4 * MIB)]), timeout=60)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_request_chars" in details and "1000000" in details and "4194304 characters" in details


def test_too_many_texts_or_characters_are_refused_naming_the_key(srv):
    code, details = _code(srv.stub.Classify, pb.ClassifyRequest(model="cls", texts=["fine"] * 257))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_request_texts" in details and "256" in details
    code, details = _code(srv.stub.Classify, pb.ClassifyRequest(model="cls", texts=["a" * 600_000],
                                                                text_pairs=["b" * 400_001]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_request_chars" in details
    code, details = _code(srv.stub.Translate, pb.TranslateRequest(model="tr", texts=["Guten Morgen."] * 5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_request_texts" in details and "at most 4" in details


def test_translation_source_over_max_source_tokens_is_refused(srv):
    text = " ".join(s for s, _ in sentence_pairs(400)) * 3  # over 100k characters, far over 64 tokens
    assert len(text) < 200_000
    code, details = _code(srv.stub.Translate, pb.TranslateRequest(model="tr", texts=[text]), timeout=30)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_source_tokens 64" in details
    ok = srv.stub.Translate(pb.TranslateRequest(model="tr", texts=["Guten Morgen."]), timeout=30)
    assert ok.results[0].num_source_tokens > 1


# ---------------------------------------------------------------------- QA: doc_stride and the window limit

def _room(tok, question: str) -> int:
    q = tok.tokenize(question)[0][: (MAX_SEQ_LEN - 3) // 2]
    return MAX_SEQ_LEN - 3 - len(q)


def test_doc_stride_over_half_the_room_is_invalid_argument_naming_the_limit(srv, tok):
    context = _prose(3000)
    room = _room(tok, QUESTION)
    limit = room // 2
    n_ctx = len(tok.tokenize(context)[0])
    ok = srv.stub.Answer(pb.AnswerRequest(model="qa", question=QUESTION, context=context, doc_stride=limit))
    assert ok.num_windows == qa_window_count(n_ctx, room, room - limit) > 1
    code, details = _code(srv.stub.Answer, pb.AnswerRequest(model="qa", question=QUESTION, context=context,
                                                            doc_stride=limit + 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"doc_stride {limit + 1} is over the limit of {limit} tokens for this question" in details
    # the abuse: room - 1 (one token of progress per window)
    code, details = _code(srv.stub.Answer, pb.AnswerRequest(model="qa", question=QUESTION, context=context,
                                                            doc_stride=room - 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "over the limit of" in details


def test_default_doc_stride_is_lowered_for_a_long_question(srv, tok):
    question = "where " * 200  # cut to 62 tokens: room 63, half of it 31 < the configured default 32
    assert _room(tok, question) // 2 < 32
    context = _prose(3000)
    reply = srv.stub.Answer(pb.AnswerRequest(model="qa", question=question, context=context))
    room = _room(tok, question)
    assert reply.num_windows == qa_window_count(len(tok.tokenize(context)[0]), room, room - room // 2)


def test_unset_doc_stride_is_lowered_to_a_short_window_models_limit(unigram_tokenizer_dir, tmp_path, caplog):
    """A QA checkpoint with 128 positions: the default 128 is over its limit of 62, so an unset doc_stride
    becomes 62 at load (logged) and requests with doc_stride 0 use it; a configured 128 is still refused."""
    import logging

    from relserve.service.config import ConfigError

    ckpt = make_deberta_checkpoint(tmp_path / "qa128", task="question-answering",
                                   tokenizer_dir=unigram_tokenizer_dir, init="spread", seed=4,
                                   max_position_embeddings=128).path
    with pytest.raises(ConfigError, match=r"model 'qa128': doc_stride 128 is over the limit of 62 tokens for "
                                          r"max_seq_len 128"):
        build_runner(ModelConfig(name="qa128", path=ckpt, device="cpu", doc_stride=128, warmup=False)).load()
    with caplog.at_level(logging.INFO, logger="relserve.service.runner"):
        probe = build_runner(ModelConfig(name="qa128", path=ckpt, device="cpu", warmup=False))
        probe.load()
    assert probe.max_seq_len == 128 and probe.config.doc_stride == 62
    assert "model 'qa128': doc_stride 62 (the default 128 is over the limit of 62 tokens for max_seq_len 128)" \
        in caplog.text
    s = Running(server_config(metrics_port=None),
                [build_runner(ModelConfig(name="qa128", path=ckpt, device="cpu", max_queue_delay=0.002))])
    try:
        s.wait_serving(30)
        tok = load_tokenizer(ckpt)
        question, context = "Ann?", _prose(3000)
        room = 128 - 3 - len(tok.tokenize(question)[0])
        reply = s.stub.Answer(pb.AnswerRequest(model="qa128", question=question, context=context), timeout=60)
        stride = min(62, room // 2)  # the model's default, lowered to this question's limit if need be
        assert reply.num_windows == qa_window_count(len(tok.tokenize(context)[0]), room, room - stride)
        assert reply.num_windows > 1 and reply.answers
    finally:
        s.close()


def test_huge_qa_context_is_refused_naming_max_qa_windows(srv):
    code, details = _code(srv.stub.Answer, pb.AnswerRequest(model="qa", question=QUESTION,
                                                            context=_prose(999_000)), timeout=30)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "(max_qa_windows 64)" in details and "at least" in details


def test_window_limit_is_exact(srv, tok):
    room = _room(tok, QUESTION)
    step = room - 32
    for n_windows, code in ((3, None), (4, grpc.StatusCode.INVALID_ARGUMENT)):
        # a context of exactly room + (n - 1) * step tokens makes n windows
        words = ["Ann"] * 2000
        context = " ".join(words)
        n_tok = len(tok.tokenize(context)[0])
        per_word = n_tok / len(words)
        target = room + (n_windows - 1) * step
        k = int(target / per_word)
        while len(tok.tokenize(" ".join(words[:k]))[0]) > target:
            k -= 1
        while len(tok.tokenize(" ".join(words[: k + 1]))[0]) <= target:
            k += 1
        context = " ".join(words[:k])
        assert qa_window_count(len(tok.tokenize(context)[0]), room, step) == n_windows
        request = pb.AnswerRequest(model="qa-small", question=QUESTION, context=context)
        if code is None:
            assert srv.stub.Answer(request).num_windows == 3
        else:
            got, details = _code(srv.stub.Answer, request)
            assert got == code and "(max_qa_windows 3)" in details and "the limit is 3 windows" in details


def test_queues_and_reservations_are_empty_after_the_refusals(srv):
    assert _wait_until(lambda: _all_queues_empty(srv))


# ---------------------------------------------------------------------- admission before work

def test_queue_full_is_refused_before_tokenizing_and_reservations_come_back(srv):
    slow = srv.server.registry.runners["limits-slowtok"]
    tasks = slow.meta.tokenizer
    before = tasks.calls
    first = srv.stub.Classify.future(pb.ClassifyRequest(model="limits-slowtok", texts=["good", "good good"]), timeout=20)
    assert _wait_until(lambda: tasks.calls == before + 1)  # it is tokenizing, holding both places
    assert slow.batcher.reserved == 2 and slow.batcher.queue_depth == 0
    code, details = _code(srv.stub.Classify, pb.ClassifyRequest(model="limits-slowtok", texts=["bad"]), timeout=20)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queue_size is 2" in details and "2 held by requests being tokenized" in details
    assert tasks.calls == before + 1  # the refused request was not tokenized
    assert [r.labels[0].label for r in first.result(timeout=20).results] == ["positive", "positive"]

    cancelled = srv.stub.Classify.future(pb.ClassifyRequest(model="limits-slowtok", texts=["x", "y"]), timeout=20)
    assert _wait_until(lambda: slow.batcher.reserved == 2)
    cancelled.cancel()
    assert _wait_until(lambda: slow.batcher.reserved == 0 and slow.batcher.queue_depth == 0)
    again = srv.stub.Classify(pb.ClassifyRequest(model="limits-slowtok", texts=["good", "bad"]), timeout=20)
    assert [r.labels[0].label for r in again.results] == ["positive", "negative"]

