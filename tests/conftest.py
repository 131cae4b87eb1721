"""Shared test fixtures.

Tokenizer fixtures (session-scoped, trained in about a second from ../shared/data, or from the repo's
copy of it when ../shared is absent):

* ``unigram_tokenizer_dir`` — a small Unigram ``tokenizer.json`` (``tokenizers`` library, trained with
  ``relserve.models.training.tokenizer.train_unigram_tokenizer(unicode_form="NFC")``) whose pipeline equals what
  transformers 5 ``DebertaV2Tokenizer`` rebuilds (NFC, whitespace runs -> " ", strip right, Metaspace
  prepend "always"), TemplateProcessing ``[CLS] $A [SEP]`` / ``[CLS] $A [SEP] $B:1 [SEP]:1``, special ids
  ``[PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3 [MASK]=4``, ``model_max_length`` 512.
* ``spm_tokenizer_dir`` — a small ``spm.model`` (``sentencepiece`` library, Unigram, ``[PAD]=0 [CLS]=1
  [SEP]=2 [UNK]=3 [MASK]=4`` as in DeBERTa-v3) plus ``tokenizer_config.json`` with the huge
  ``model_max_length`` placeholder DeBERTa-v3 configs carry (C08).

Both load with ``transformers.AutoTokenizer.from_pretrained(dir)`` (tokenizer_class DebertaV2Tokenizer).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The shared-data policy (../shared/data, else the committed cut in loadtest/data, else skip) is fixtures/data.py.
# The suite's numbers must not depend on the CI machine's CPU: with AVX512-BF16 / AMX, ``dtype: auto`` would run
# the bf16 gate at every server start and serve bf16 where it passes. Tests of ``auto`` set the override themselves.
os.environ.setdefault("RELSERVE_CPU_BF16", "off")
# Under pytest-xdist two workers share the cores, each with torch's OpenMP threads, and so do the servers they
# start (which inherit this environment): with OpenMP's default spin-waiting a thread waits at a barrier for a
# descheduled peer, and an in-process QA evaluation beside a busy server took 20x its time (313 s instead of 16 s).
# Threads that sleep while they wait leave the core to the other process. Set before torch loads OpenMP.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# What a server keeps between starts (ONNX graphs, dtype decisions, probe timings: <XDG_CACHE_HOME>/relserve/onnx)
# lives for one session, shared by its servers (child processes inherit it), never read from an earlier session.
_SESSION_CACHE = tempfile.mkdtemp(prefix="relserve-test-cache-")
os.environ["XDG_CACHE_HOME"] = _SESSION_CACHE
atexit.register(shutil.rmtree, _SESSION_CACHE, True)

from fixtures.data import SHARED_DATA
from fixtures.data import read_jsonl as _jsonl
from relserve.models.training.tokenizer import SPECIAL_TOKENS_MAP


def _training_lines() -> list[str]:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not found (tokenizer fixtures train on the shared data)")
    lines = [r["text"] for r in _jsonl(SHARED_DATA / "sentiment" / "train.jsonl", 400)]
    for r in _jsonl(SHARED_DATA / "qa" / "xquad_en_train.jsonl", 60):
        lines += [r["context"], r["question"]]
    lines += [r["source"] for r in _jsonl(SHARED_DATA / "translation" / "de_en_train.jsonl", 200)]
    for r in _jsonl(SHARED_DATA / "qa" / "xquad_zh_sample.jsonl", 6):
        lines.append(r["context"])
    return lines


def _write_config(directory: Path, extra: dict) -> None:
    cfg = {
        "tokenizer_class": "DebertaV2Tokenizer",
        "do_lower_case": False,
        **SPECIAL_TOKENS_MAP,
        **extra,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")


@pytest.fixture(scope="session")
def unigram_tokenizer_dir(tmp_path_factory) -> Path:
    from relserve.models.training.tokenizer import train_unigram_tokenizer

    d = tmp_path_factory.mktemp("unigram_tok")
    return train_unigram_tokenizer(
        _training_lines(), d, vocab_size=1200, model_max_length=512, unicode_form="NFC", max_piece_length=12
    )


@pytest.fixture(scope="session")
def spm_tokenizer_dir(tmp_path_factory) -> Path:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_lines()),
        model_writer=buf,
        model_type="unigram",
        vocab_size=1200,
        character_coverage=0.995,
        pad_id=0,
        pad_piece="[PAD]",
        bos_id=1,
        bos_piece="[CLS]",
        eos_id=2,
        eos_piece="[SEP]",
        unk_id=3,
        unk_piece="[UNK]",
        control_symbols=["[MASK]"],
        num_threads=1,
        minloglevel=2,
    )
    d = tmp_path_factory.mktemp("spm_tok")
    (d / "spm.model").write_bytes(buf.getvalue())
    _write_config(d, {"vocab_type": "spm", "model_max_length": int(1e30)})
    return d


@pytest.fixture(scope="session")
def defaults_serving():
    """``(ServerProcess, InferenceStub, channel)`` of one ``relserve serve`` on the built-in default models
    (``fixtures.server.defaults_server``), shared by every module that needs just that server; drained at the end of
    the session, failing unless it exits 0 with no traceback in its log."""
    from fixtures.server import defaults_server

    with defaults_server() as running:
        yield running


@pytest.fixture(scope="session")
def hf_tokenizer():
    """Factory: transformers AutoTokenizer for a directory (the oracle), cached per directory."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    cache: dict[str, object] = {}

    def get(directory) -> object:
        key = os.fspath(directory)
        if key not in cache:
            cache[key] = AutoTokenizer.from_pretrained(key)
        return cache[key]

    return get


# test files that run a real client library from its own venv (tests/fixtures/client_venvs.py)
_CLIENT_VENV_USERS = ("test_real_clients.py", "test_kserve_v2.py", "test_kserve.py", "test_repository_api.py")

# pytest-xdist (`make test` runs `-n 2 --dist loadfile`, pyproject.toml): a module is one work unit, so its
# module-scoped servers start once. Modules that share a session-scoped server are one unit too, so that server
# starts in one worker only (``pytest_xdist_make_scheduler``; xdist's own loadgroup cannot be used: with pytest 9.2
# its xdist_group marks are silently ignored, pytest-dev/pytest-xdist#1386).
_SHARED_SESSION_UNITS = {
    "tests/e2e/test_e2e_defaults.py": "defaults_serving",
    "tests/e2e/test_fuzz.py": "defaults_serving",
}
# The modules that take longest (module totals of `--durations=0`, 2026-12: about 15-270 s each under -n 2), started
# first so that no worker is left alone with one of them at the end; the modules of client-library venvs come a few
# places in, which leaves the venv builds (tests/fixtures/client_venvs.py, about 90 s on a fresh clone) time to
# finish in the background. Every other module keeps its collection order behind these.
_LONG_MODULES = (
    "tests/e2e/test_e2e_defaults.py",
    "tests/e2e/test_fuzz.py",
    "tests/onnx/test_onnx_export.py",
    "tests/models/test_defaults.py",
    "tests/onnx/test_onnx_translation.py",
    "tests/serving/test_worker_process.py",
    "tests/deploy/test_kserve.py",
    "tests/serving/test_onnx_server.py",
    "tests/models/test_deberta_v1_parity.py",
    "tests/serving/test_worker_pool.py",
    "tests/e2e/test_e2e_spm_normalization.py",
    "tests/serving/test_worker_health.py",
    "tests/deploy/test_wheel.py",
    "tests/e2e/test_e2e_hf_checkpoints.py",
    "tests/serving/test_drain.py",
    "tests/onnx/test_graph_cache.py",
    "tests/models/test_training_encoders.py",
    "tests/e2e/test_transcript.py",
    "tests/serving/test_kserve_v2.py",
    "tests/serving/test_real_clients.py",
)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice; optional: a run without xdist
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with the modules of ``_SHARED_SESSION_UNITS`` in one work unit, units in collection order
    (``pytest_collection_modifyitems`` puts the long modules first), not xdist's largest-test-count first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedSessionLoadFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return _SHARED_SESSION_UNITS.get(module, module)

    config.option.loadscopereorder = False
    return SharedSessionLoadFile(config, log)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "alone: while this test (setup and teardown included) runs, the other pytest-xdist workers run nothing: "
        "for tests that measure their processes' memory or CPU, or need the cores to themselves",
    )


def _run_lock_path(config) -> Path | None:
    """The lock file the workers of one xdist run share, in the run's base temporary directory (each worker's
    basetemp is a folder in it); None outside xdist workers."""
    if not hasattr(config, "workerinput"):
        return None
    return config._tmp_path_factory.getbasetemp().parent / "relserve-alone.lock"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, every test holds a shared lock and an ``alone`` test an exclusive one. The gate lock, taken
    before either, gives a waiting ``alone`` test priority: the other worker finishes its current test, then waits
    at the gate instead of starting the next one."""
    path = _run_lock_path(item.config)
    if path is None:
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    with contextlib.ExitStack() as stack:
        gate = stack.enter_context(open(path.with_suffix(".gate"), "a"))
        main = stack.enter_context(open(path, "a"))
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(main, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(main, fcntl.LOCK_UN)


def pytest_collection_modifyitems(session, config, items):
    """Start building the client-library venvs as soon as a test that needs them is selected: pip runs in
    background subprocesses while the tests before them run, instead of stalling the first of them (about 90 s
    on a fresh clone). Nothing is built for a run that selects none of them.

    Moves the modules of ``_LONG_MODULES`` to the front, in that order (a stable sort: each module's tests stay
    together and in file order)."""
    rank = {module: i for i, module in enumerate(_LONG_MODULES)}

    def module_rank(item) -> int:
        return rank.get(item.nodeid.split("::", 1)[0], len(rank))

    items.sort(key=module_rank)
    if any(Path(str(item.fspath)).name in _CLIENT_VENV_USERS for item in items):
        from fixtures import client_venvs

        client_venvs.start(client_venvs.TRITONCLIENT, client_venvs.KSERVE, client_venvs.HUGGINGFACE_HUB)
