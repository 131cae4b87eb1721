"""loadtest/bench/gil.py: py-spy's GIL-only samples turned into seconds held by thread role. The parser runs on a
literal sample; the sampler runs py-spy on a real child process where py-spy is installed (skipped otherwise)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relserve.loadtest.bench import gil

RAW = """\
thread (0x7f01): MainThread;_run (asyncio/events.py:80);handler (service/api.py:10) 30
thread (0x7f02): relserve-tok-sentiment_0;_encode (models/tokenization.py:611) 10
thread (0x7f03): relserve-sentiment_0;run (service/backends/torch_encoder.py:90) 50
thread (0x7f02): relserve-tok-sentiment_0;encode (models/tokenization.py:190) 5
thread (0x7f04): Thread-2 (_poll_wrapper);_poll (grpc/_server.py:1) 5

"""


def test_parse_raw_sums_samples_by_thread_and_role():
    out = gil.parse_raw(RAW, rate=100)
    assert out["samples"] == 100 and out["held_s"] == pytest.approx(1.0)
    assert out["by_thread"]["relserve-tok-sentiment_0"] == pytest.approx(0.15)
    assert out["by_role"] == pytest.approx({"model executor": 0.5, "event loop": 0.3, "tokenizer": 0.15, "other": 0.05})
    assert list(out["by_role"])[0] == "model executor"  # largest first


SPIN = """
import threading, time
def spin():
    end = time.monotonic() + 30
    while time.monotonic() < end:
        sum(range(1000))
t = threading.Thread(target=spin, name="relserve-tok-spin_0")
t.start()
print("ready", flush=True)
t.join()
"""


@pytest.mark.alone  # the spinning thread must get a core to hold the GIL most of the window
@pytest.mark.skipif(gil.available() is None, reason="py-spy is not installed")
def test_sampler_sees_a_thread_that_holds_the_gil():
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        report = gil.GilSampler(child.pid, seconds=2, rate=100).result()
    finally:
        child.kill()
        child.wait()
    if "error" in report:
        pytest.skip(f"py-spy cannot attach here: {report['error']}")
    # one thread spins in Python for the whole window: it holds the GIL most of the time, as a tokenizer
    assert report["held_fraction"] > 0.5
    assert max(report["by_role"], key=report["by_role"].get) == "tokenizer"
