"""``dtype: auto`` without a model: CPU bfloat16 detection (service/cpu_features.py) and its RELSERVE_CPU_BF16
override, the dtype and gate keys of service/config/, and the gate's text and arithmetic
(service/backends/precision.py: gate_items, judge, plan). The gate on real checkpoints is in
tests/serving/test_dtype_auto_server.py."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from relserve.service.config import DTYPE_GATE_MIN_ITEMS, ConfigError, ModelConfig, load_config
from relserve.service.cpu_features import CPU_BF16_ENV, bf16_support, cpu_flags

CPUINFO_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n"
CPUINFO_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 amx_tile amx_bf16\n"


def _cpuinfo(tmp_path, text):
    p = tmp_path / "cpuinfo"
    p.write_text(text)
    return p


def test_cpu_flags_decide_bfloat16_support(tmp_path):
    avx2, bf16 = _cpuinfo(tmp_path, CPUINFO_AVX2), tmp_path / "bf16"
    bf16.write_text(CPUINFO_BF16)
    assert cpu_flags(avx2) == {"fpu", "sse2", "avx", "avx2", "fma"}
    ok, why = bf16_support({}, avx2)
    assert not ok and "no AVX512-BF16/AMX-BF16" in why and "avx512_bf16" in why
    ok, why = bf16_support({}, bf16)
    assert ok and why == "this CPU has avx512_bf16 and amx_bf16"
    ok, why = bf16_support({}, tmp_path / "missing")
    assert not ok and "cannot be read" in why


def test_the_override_assumes_or_switches_off_support(tmp_path):
    avx2, bf16 = _cpuinfo(tmp_path, CPUINFO_AVX2), tmp_path / "bf16"
    bf16.write_text(CPUINFO_BF16)
    assert bf16_support({CPU_BF16_ENV: "assume"}, avx2) == (True, f"{CPU_BF16_ENV}=assume (CPU bfloat16 support "
                                                                  f"assumed, not detected)")
    assert bf16_support({CPU_BF16_ENV: "OFF"}, bf16)[0] is False
    assert bf16_support({CPU_BF16_ENV: "detect"}, bf16)[0] is True
    with pytest.raises(ConfigError, match="RELSERVE_CPU_BF16='yes' is not one of"):
        bf16_support({CPU_BF16_ENV: "yes"}, bf16)


def test_auto_is_the_default_dtype_and_the_gate_keys_load(tmp_path):
    cfg = load_config(model_specs=[f"a={tmp_path}", f"b={tmp_path},dtype_gate_agreement=0.95,"
                                                    f"dtype_gate_max_prob_diff=0.1,dtype_gate_items=500"])
    a, b = cfg.model("a"), cfg.model("b")
    assert (a.dtype, a.dtype_gate_agreement, a.dtype_gate_max_prob_diff, a.dtype_gate_items) == ("auto", 0.99, 0.05,
                                                                                                  256)
    assert (b.dtype_gate_agreement, b.dtype_gate_max_prob_diff, b.dtype_gate_items) == (0.95, 0.1, 500)
    # auto (and float32) are accepted with the onnx backend, which serves them as float32
    assert load_config(model_specs=[f"c={tmp_path},backend=onnx"]).model("c").dtype == "auto"


@pytest.mark.parametrize("spec, fragment", [
    ("dtype_gate_agreement=0", "dtype_gate_agreement must be > 0 and <= 1"),
    ("dtype_gate_agreement=1.5", "dtype_gate_agreement must be > 0 and <= 1"),
    ("dtype_gate_max_prob_diff=-0.1", "dtype_gate_max_prob_diff must be between 0 and 1"),
    ("dtype_gate_items=199", f"dtype_gate_items must be >= {DTYPE_GATE_MIN_ITEMS}"),
    ("dtype=int4", "dtype 'int4' is not one of ['auto', 'float32', 'float16', 'bfloat16', 'int8']"),
    ("backend=onnx,dtype=bfloat16", "float32 graphs only"),
])
def test_gate_key_errors_are_clear(tmp_path, spec, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load_config(model_specs=[f"a={tmp_path},{spec}"])


def test_explicit_bfloat16_on_cpu_follows_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "off")
    with pytest.raises(ConfigError, match="dtype bfloat16 on CPU needs a CPU with AVX512-BF16 or AMX-BF16, but "
                                          "RELSERVE_CPU_BF16=off"):
        load_config(model_specs=[f"a={tmp_path},dtype=bfloat16,device=cpu"])
    monkeypatch.setenv(CPU_BF16_ENV, "assume")
    assert load_config(model_specs=[f"a={tmp_path},dtype=bfloat16,device=cpu"]).model("a").dtype == "bfloat16"
    with pytest.raises(ConfigError, match="needs a CUDA device"):  # float16 stays CUDA-only
        load_config(model_specs=[f"a={tmp_path},dtype=float16,device=cpu"])


# ---------------------------------------------------------------------- the gate's pieces (torch imported)


def test_plan_on_a_cpu(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from relserve.service.backends.precision import plan

    monkeypatch.setenv(CPU_BF16_ENV, "off")
    p = plan(ModelConfig(name="m", path=tmp_path), "cpu")
    assert (p.dtype, p.gate) == ("float32", False) and p.reason.startswith("dtype: auto -> float32: RELSERVE_CPU")
    monkeypatch.setenv(CPU_BF16_ENV, "assume")
    assert plan(ModelConfig(name="m", path=tmp_path), "cpu").gate is True
    p = plan(ModelConfig(name="m", path=tmp_path, warmup=False), "cpu")
    assert (p.dtype, p.gate) == ("float32", False) and "warm-up is disabled (warmup: false)" in p.reason
    p = plan(ModelConfig(name="m", path=tmp_path, dtype="float32"), "cpu")
    assert (p.dtype, p.gate, p.reason) == ("float32", False, "dtype: float32 configured")


def test_gate_text_committed_and_shipped(tmp_path):
    pytest.importorskip("torch")
    from relserve.service.backends.precision import LOADTEST_DATA, gate_items

    items, source = gate_items(tmp_path, "classification", 256)
    rows = [json.loads(line) for line in (LOADTEST_DATA / "sentiment_dev.jsonl").read_text().splitlines()]
    assert source.endswith("sentiment_dev.jsonl") and items == [{"text": r["text"]} for r in rows[:256]]
    items, source = gate_items(tmp_path, "translation", 1000)
    assert source.endswith("de_en_dev.jsonl") and len(items) == 300
    # QA: the 100 committed questions with their paragraphs, then (question, one sentence of it) pairs
    items, source = gate_items(tmp_path, "question-answering", 256)
    qa = [json.loads(line) for line in (LOADTEST_DATA / "qa_dev.jsonl").read_text().splitlines()]
    assert len(items) == 256 and items[:100] == [{"question": r["question"], "context": r["context"]} for r in qa]
    assert items[100]["question"] == qa[0]["question"] and items[100]["context"] in qa[0]["context"]
    assert len(items[100]["context"]) < len(qa[0]["context"])
    # a calibration.jsonl in the checkpoint directory wins; rows without the task's fields are skipped
    (tmp_path / "calibration.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"text": "good", "text_pair": "fine"}, {"text": " "}, {"label": "x"}, {"text": "bad"})) + "\n")
    items, source = gate_items(tmp_path, "classification", 256)
    assert source == str(tmp_path / "calibration.jsonl")
    assert items == [{"text": "good", "text_pair": "fine"}, {"text": "bad"}]
    (tmp_path / "calibration.jsonl").write_text('{"text": "good"}\nnot json\n')
    assert gate_items(tmp_path, "classification", 256) == ([], f"{tmp_path / 'calibration.jsonl'} line 2 is not JSON")


def test_judge_counts_agreement_and_the_largest_probability_difference(tmp_path):
    pytest.importorskip("torch")
    from relserve.service.backends.precision import Outcome, judge

    ref = [Outcome(0, np.array([0.9, 0.1])), Outcome(1, np.array([0.4, 0.6])), Outcome((3, 9), np.array([0.5])),
           Outcome((1, 2), np.array([0.7]))]
    got = [Outcome(0, np.array([0.88, 0.12])), Outcome(0, np.array([0.52, 0.48])), Outcome((3, 9), np.array([0.5])),
           Outcome((1, 2), np.array([0.7]))]
    r = judge(ref, got, "src")
    assert r.items == 4 and r.agreement == 0.75 and r.max_prob_diff == pytest.approx(0.12)
    cfg = ModelConfig(name="m", path=tmp_path, dtype_gate_agreement=0.75, dtype_gate_max_prob_diff=0.12 + 1e-9)
    assert r.passed(cfg)
    cfg = dataclasses.replace(cfg, dtype_gate_max_prob_diff=0.1)
    assert not r.passed(cfg) and "agreement 0.7500 (needs >= 0.75), max probability difference 0.12" in r.describe(cfg)
    assert judge([Outcome(0, np.array([0.5]))], [Outcome(0, np.array([np.nan]))], "s").max_prob_diff == float("inf")


def test_decide_keeps_float32_when_a_gate_run_fails_and_swaps_back(tmp_path):
    pytest.importorskip("torch")
    from relserve.service.backends.precision import Outcome, Plan, decide

    cfg = ModelConfig(name="m", path=tmp_path)  # no calibration.jsonl: the committed sentiment text
    calls, serving = [], ["float32"]

    def outcomes(items):
        calls.append((serving[0], len(items)))
        if serving[0] == "bfloat16" and fail_in_bf16:
            raise RuntimeError("no bfloat16 kernel for op X")
        return [Outcome(0, np.array([0.9 if serving[0] == "float32" else 0.89, 0.1])) for _ in items]

    def to(dtype):
        return lambda: (serving.__setitem__(0, dtype), calls.append(dtype))

    plan_ = Plan("float32", "this CPU has avx512_bf16", gate=True)
    fail_in_bf16 = False
    dtype, reason = decide(cfg, plan_, "classification", outcomes, to("bfloat16"), to("float32"))
    assert calls == [("float32", 256), "bfloat16", ("bfloat16", 256)] and serving == ["bfloat16"]
    assert dtype == "bfloat16" and "agreement 1.0000 (needs >= 0.99), max probability difference 0.01" in reason
    calls.clear(), serving.__setitem__(0, "float32")
    fail_in_bf16 = True
    dtype, reason = decide(cfg, plan_, "classification", outcomes, to("bfloat16"), to("float32"))
    assert (dtype, serving, calls[-1]) == ("float32", ["float32"], "float32")
    assert reason == ("dtype: auto -> float32: this CPU has avx512_bf16, but the bfloat16 run failed: no bfloat16 "
                      "kernel for op X")
    # a stricter limit on the probability difference fails the same numbers, and the float32 model serves again
    calls.clear(), serving.__setitem__(0, "float32")
    fail_in_bf16 = False
    dtype, reason = decide(dataclasses.replace(cfg, dtype_gate_max_prob_diff=0.005), plan_, "classification", outcomes,
                           to("bfloat16"), to("float32"))
    assert (dtype, serving) == ("float32", ["float32"]) and "but bfloat16 failed the agreement gate on 256" in reason
    # no gate asked for: nothing runs
    calls.clear()
    assert decide(cfg, Plan("float32", "dtype: float32 configured"), "classification", outcomes, to("bfloat16"),
                  to("float32")) == ("float32", "dtype: float32 configured") and calls == []
