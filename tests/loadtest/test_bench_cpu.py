"""Smoke test of the issue-11 CPU benchmark (loadtest/bench/cpu.py) on a tiny shape with tiny counts: every path
runs, the rows carry real positive numbers, the FLOP count matches onnx_encoder's for equal lengths, and the targets
table turns the measured ratios into PASS / MISS. No timing is asserted (the script prints ratios)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

import torch  # noqa: E402

from relserve.loadtest.bench import cpu as bench_cpu, onnx_encoder as bench_onnx  # noqa: E402

TINY = bench_cpu.Shape(layers=1, hidden=32, heads=2, intermediate=64, buckets=16)


def test_encoder_flops_matches_bench_onnx_and_counts_real_tokens_only():
    for B, T in ((1, 7), (8, 128), (8, 512)):
        assert bench_cpu.encoder_flops([[T] * B], bench_cpu.V3_BASE) == bench_onnx.encoder_flops(B, T, 12)
    # a batch of lengths 3 and 5 costs less than a batch padded to 5 and 5, more than one sequence of 5
    mixed = bench_cpu.encoder_flops([[3, 5]], TINY)
    assert bench_cpu.encoder_flops([[5]], TINY) < mixed < bench_cpu.encoder_flops([[5, 5]], TINY)


def _positive(mapping: dict) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in mapping.values())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from relserve.models.tokenization import load_tokenizer

    root = tmp_path_factory.mktemp("bench_cpu")
    torch.set_num_threads(1)
    tok_dir, origin = bench_cpu.build_tokenizer(root / "tok", shared_train=None)
    assert "committed load-test text" in origin
    tok = load_tokenizer(tok_dir)
    enc = bench_cpu.Encoder(root / "m", TINY, int(tok.vocab_size), 1, tokenizer_dir=tok_dir, log=lambda _m: None)
    return enc, tok


def test_offline_rows_have_every_path_with_real_numbers(tiny, capsys):
    enc, tok = tiny
    assert (enc.checkpoint / "tokenizer.json").is_file() and enc.int8_report["quantization"]["quantized_matmuls"] > 0
    shape_row = bench_cpu.bench_shape(enc, 8, 128, int(tok.vocab_size), repeats=1)
    texts, origin = bench_cpu.workload_sentences(24, shared_dev=None)
    assert len(texts) == 24 and "committed" in origin
    sent_row = bench_cpu.bench_sentences(enc, tok, texts, batch=8, repeats=0)
    for row in (shape_row, sent_row):
        assert set(row["per_s"]) == set(bench_cpu.PATHS)
        assert _positive(row["per_s"]) and _positive(row["gflops"]) and _positive(row["seconds"])
        assert row["ratio_vs_transformers"]["transformers"] == 1.0
        assert all(0.0 <= v <= 1.0 for v in row["agreement_vs_padded"].values())
        assert 0.0 <= row["int8_agreement_vs_ort_fp32"] <= 1.0
        assert row["max_abs_diff_vs_padded"]["unpadded"] < 1e-4  # same fp32 weights, unpadded path
        assert row["best_fp32"] in bench_cpu.FP32_PATHS
        bench_cpu.print_row(row, "CPU bf16 native: test")
    assert 0.0 < sent_row["padding_efficiency"] <= 1.0 and sent_row["units"] == 24
    printed = capsys.readouterr().out
    assert all(p in printed for p in bench_cpu.PATHS) and "CPU bf16 native: test" in printed

    rows = bench_cpu.targets({"offline": [shape_row, sent_row], "bf16_note": "n"})
    assert [r["target"].split(" offline")[0] for r in rows] == ["bf16 / fp32", "ORT int8 / ORT fp32"]
    bf16, int8 = rows
    assert bf16["measured"] > 0 and bf16["verdict"] == ("PASS" if bf16["measured"] >= 1.8 else "MISS")
    agreed = sent_row["int8_agreement_vs_ort_fp32"] >= 0.99  # the gate is judged on the sentence workload
    assert int8["measured"] > 0 and int8["verdict"] == ("PASS" if int8["measured"] >= 2.0 and agreed else "MISS")


def test_targets_from_server_and_translation_ratios():
    rows = bench_cpu.targets({
        "server": {"ratios": {"new_over_today": 3.2, "fp32_new_over_today": 1.2, "server_over_offline_ideal": 0.95}},
        "translation": {"ratios": {"throughput_iteration_over_request/n_best=1": 1.6,
                                   "throughput_iteration_over_request/n_best=5": 1.4}},
    })
    assert [r["verdict"] for r in rows] == ["PASS", "MISS", "PASS", "PASS", "MISS"]
    rows = bench_cpu.targets({"server": {"ratios": {"new_over_today": 2.7, "instances_over_today": 3.1,
                                                    "instances_over_offline_ideal": 0.6}}})
    assert [(r["target"].strip().split(" /")[0], r["verdict"]) for r in rows] == [
        ("server new defaults", "MISS"), ("new defaults with instances > 1", "PASS"),
        ("new defaults with instances > 1", "MISS")]


def test_matmul_peaks_are_positive():
    assert bench_cpu.matmul_peak(torch.float32, n=128, seconds=0.05) > 0
    assert bench_cpu.matmul_peak(torch.bfloat16, n=128, seconds=0.05) > 0
