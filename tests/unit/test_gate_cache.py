"""The dtype gate's kept decisions (service/backends/gate_cache.py) and the pre-bind check of a model's files
(service/config/validation.py check_model_files), without a model: keys, sealed entries, what is refused and
ignored (a tampered, truncated, foreign-key or group-writable entry), shipped decisions, atomic writes."""

from __future__ import annotations

import json
import os
import struct

import pytest

pytest.importorskip("torch")

from relserve.service.backends import gate_cache  # noqa: E402
from relserve.service.config import ConfigError, ModelConfig  # noqa: E402
from relserve.service.config.validation import check_model_files  # noqa: E402


def _safetensors(path, header=b'{"__metadata__":{}}'):
    path.write_bytes(struct.pack("<Q", len(header)) + header)


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deberta-v2",
                                               "architectures": ["DebertaV2ForSequenceClassification"]}))
    _safetensors(d / "model.safetensors")
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.fixture
def config(ckpt, tmp_path):
    return ModelConfig(name="m", path=ckpt, onnx_cache_dir=tmp_path / "cache")


def _key(config, text=()):
    return gate_cache.gate_key(config, "classification", "cpu", text)


def test_key_follows_the_files_the_device_and_the_gate_keys(config, ckpt, tmp_path):
    key = _key(config)
    assert key["checkpoint_files"].keys() == {"config.json", "model.safetensors", "tokenizer.json"}
    assert key["device"] == "cpu" and key["model_keys"]["dtype_gate_agreement"] == 0.99 and key["torch"]
    (ckpt / "tokenizer.json").write_text('{"changed": 1}')
    assert gate_cache.key_digest(_key(config)) != gate_cache.key_digest(key)
    text = tmp_path / "gate.jsonl"
    text.write_text('{"text": "a"}\n')
    assert _key(config, [text])["gate_text"] == {"gate.jsonl": gate_cache._sha256_file(text)}
    import dataclasses
    other = dataclasses.replace(config, dtype_gate_agreement=0.9)
    assert gate_cache.key_digest(_key(other)) != gate_cache.key_digest(_key(config))


def test_store_then_lookup_and_every_refusal_is_ignored(config, caplog):
    key = _key(config)
    assert gate_cache.lookup(config, key) is None
    path = gate_cache.store(config, key, "bfloat16", "gate passed: agreement 1.0")
    assert path.parent == gate_cache.cache_dir(config) and oct(path.stat().st_mode & 0o777) == "0o644"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".entry.")]  # temp file renamed away
    kept = gate_cache.lookup(config, key)
    assert (kept.dtype, kept.reason, kept.where) == ("bfloat16", "gate passed: agreement 1.0", path)

    entry = json.loads(path.read_text())
    entry["dtype"] = "float32"  # tampered: the seal no longer fits
    path.write_text(json.dumps(entry))
    assert gate_cache.lookup(config, key) is None
    assert "entry_sha256 does not match" in caplog.text

    path.write_text(path.read_text()[:40])  # truncated
    assert gate_cache.lookup(config, key) is None

    other = dict(key, relserve="9.9")  # an entry sealed for another key under this key's name
    path.write_text(json.dumps(gate_cache.make_entry(other, "bfloat16", "r")))
    assert gate_cache.lookup(config, key) is None
    assert "another key (differs in relserve)" in caplog.text

    gate_cache.store(config, key, "float32", "gate failed")  # the next gate's decision replaces it
    assert gate_cache.lookup(config, key).dtype == "float32"
    os.chmod(path, 0o666)  # anyone could have written it: not trusted
    assert gate_cache.lookup(config, key) is None
    assert "writable by group and others" in caplog.text


def test_shipped_decision_is_used_when_its_key_fits(config, ckpt):
    key = _key(config)
    mine = gate_cache.make_entry(key, "float32", "failed the agreement gate on 256 items")
    foreign = gate_cache.make_entry(dict(key, cpu_flags=["amx_bf16"]), "bfloat16", "passed")
    gate_cache.ship(ckpt, foreign)
    assert gate_cache.lookup(config, key) is None  # another machine class only
    target = gate_cache.ship(ckpt, mine)
    assert len(json.loads(target.read_text())["entries"]) == 2
    kept = gate_cache.lookup(config, key)
    assert (kept.dtype, kept.where) == ("float32", ckpt / gate_cache.SHIPPED_NAME)
    gate_cache.ship(ckpt, gate_cache.make_entry(key, "bfloat16", "again"))  # same key: replaced, not added
    assert len(json.loads(target.read_text())["entries"]) == 2
    # a cache entry wins over the shipped file
    gate_cache.store(config, key, "float32", "cached")
    assert gate_cache.lookup(config, key).reason == "cached"


@pytest.mark.parametrize("damage, problem", [
    (lambda d: (d / "config.json").unlink(), r"config\.json' is missing"),
    (lambda d: (d / "config.json").write_text("{not json"), r"config\.json' is not valid JSON"),
    (lambda d: (d / "config.json").write_text("[1]"), r"is not a JSON object"),
    (lambda d: (d / "model.safetensors").unlink(), r"no weights in .* \(expected model\.safetensors or "),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 20), r"is not a safetensors file"),
    (lambda d: os.chmod(d / "model.safetensors", 0), r"cannot be read \(Permission denied\)"),
    (lambda d: (d / "tokenizer.json").unlink(), r"no tokenizer in"),
    (lambda d: (d / "config.json").write_text('{"architectures": ["DebertaV2ForMaskedLM"]}'),
     r"unsupported architectures \['DebertaV2ForMaskedLM'\] for model_type 'deberta-v2'"),
    (lambda d: (d / "config.json").write_text('{"model_type": "bert"}'), r"model_type 'bert' is not supported"),
])
def test_model_files_checked_before_any_bind(ckpt, config, damage, problem):
    check_model_files(config)
    damage(ckpt)
    if os.geteuid() == 0 and "Permission" in problem:
        pytest.skip("root reads a file of mode 0")
    with pytest.raises(ConfigError, match=rf"model 'm': .*{problem}") as err:
        check_model_files(config)
    assert str(ckpt) in str(err.value)


def test_translation_files_are_the_ones_its_config_names(ckpt, config):
    (ckpt / "config.json").write_text('{"model_type": "rnnsearch", "source_tokenizer": "src.spm"}')
    (ckpt / "src.spm").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"tokenizer file '.*target\.spm' is missing"):
        check_model_files(config)
    (ckpt / "target.spm").write_bytes(b"x")
    check_model_files(config)
