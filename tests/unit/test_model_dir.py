"""``--model-dir`` / ``--model-name`` / ``--model-options`` and their ``RELSERVE_MODEL_*`` variables
(service/config/model_dir.py, service/config/loader.py ``config_from_args``), through the real parser and loader."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from relserve.service import main as cli
from relserve.service.config import ConfigError


def _checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "deberta-v2"}))
    return path


def _config(argv: list[str], environ: dict[str, str] | None = None):
    return cli.config_from_args(cli.build_parser().parse_args(["serve", *argv]), environ or {})


def _models(cfg) -> list[tuple[str, Path]]:
    return [(m.name, m.path) for m in cfg.models]


def test_single_checkpoint_is_one_model_named_by_the_flag_or_env(tmp_path):
    ckpt = _checkpoint(tmp_path / "mnt")
    _checkpoint(ckpt / "checkpoint-500")  # training output inside: the top-level config.json wins
    assert _models(_config([f"--model-dir={ckpt}", "--model-name=sst2"])) == [("sst2", ckpt)]
    assert _models(_config(["--model_dir", str(ckpt), "--model_name", "sst2"])) == [("sst2", ckpt)]  # KServe style
    env = {"RELSERVE_MODEL_DIR": str(ckpt), "RELSERVE_MODEL_NAME": "from-env"}
    assert _models(_config([], env)) == [("from-env", ckpt)]
    assert _models(_config(["--model-name=flag"], env)) == [("flag", ckpt)]  # a flag beats its variable
    # the default models are not added once a model directory is given
    assert len(_config([], env).models) == 1


def test_one_subdirectory_per_model(tmp_path):
    root = tmp_path / "mnt"
    a, b = _checkpoint(root / "b-model"), _checkpoint(root / "a-model")
    (root / "lost+found").mkdir()
    (root / ".cache").mkdir()
    _checkpoint(root / ".hidden")
    (root / "README.md").write_text("x")
    # named after the directories, in name order; the InferenceService name KServe passes renames nothing
    assert _models(_config([f"--model-dir={root}", "--model-name=my-isvc"])) == [("a-model", b), ("b-model", a)]


def test_model_options_apply_to_every_model_env_first_then_flags_in_order(tmp_path):
    root = tmp_path / "mnt"
    _checkpoint(root / "x")
    _checkpoint(root / "y")
    cfg = _config([f"--model-dir={root}", "--model-options=device=cpu,max_batch_size=3",
                   "--model-options=max_batch_size=5"], {"RELSERVE_MODEL_OPTIONS": "max_queue_size=7,max_batch_size=1"})
    assert {(m.device, m.max_batch_size, m.max_queue_size) for m in cfg.models} == {("cpu", 5, 7)}


def test_a_model_dir_model_may_not_repeat_a_model_flag(tmp_path):
    ckpt = _checkpoint(tmp_path / "mnt")
    with pytest.raises(ConfigError, match="model name 'sst2' is also given by --model"):
        _config(["--model", f"sst2={ckpt}", f"--model-dir={ckpt}", "--model-name=sst2"])
    cfg = _config(["--model", f"other={ckpt}", f"--model-dir={ckpt}", "--model-name=sst2"])
    assert [m.name for m in cfg.models] == ["other", "sst2"]


@pytest.mark.parametrize("argv,environ,message", [
    (["--model-dir={ckpt}"], {}, r"is one checkpoint \(it has config.json\): give its model name with "
                                 r"--model-name \(or \$RELSERVE_MODEL_NAME\)"),
    (["--model-name=x"], {}, r"--model-name is given but no model directory: add --model-dir DIR"),
    ([], {"RELSERVE_MODEL_NAME": "x"}, r"\$RELSERVE_MODEL_NAME is given but no model directory"),
    (["--model-options=device=cpu"], {}, r"--model-options is given but no model directory"),
    (["--model-dir={tmp}/nope"], {}, r"--model-dir '.*/nope' is not a directory"),
    ([], {"RELSERVE_MODEL_DIR": "{tmp}/empty"},
     r"\$RELSERVE_MODEL_DIR '.*/empty' holds no checkpoint: neither config.json in it nor a sub-directory with one "
     r"\(found: \['junk'\]\)"),
    (["--model-dir={ckpt}", "--model-name=bad name"], {}, r"name must match"),
    (["--model-dir={ckpt}", "--model-name=m", "--model-options=max_batch_size=0"], {},
     r"model 'm'.*max_batch_size must be >= 1, got 0"),
    (["--model-dir={ckpt}", "--model-name=m", "--model-options=bogus=1"], {}, r"unknown key\(s\) \['bogus'\]"),
    (["--model-dir={ckpt}", "--model-name=m", "--model-options=device"], {}, r"option 'device' is not key=value"),
    (["--model-dir={ckpt}", "--model-name=m", "--model-options=path=/x"], {}, r"path comes from the model directory"),
])
def test_clear_errors(tmp_path, argv, environ, message):
    ckpt = _checkpoint(tmp_path / "ckpt")
    (tmp_path / "empty" / "junk").mkdir(parents=True)
    fill = {"ckpt": str(ckpt), "tmp": str(tmp_path)}
    with pytest.raises(ConfigError, match=message):
        _config([a.format(**fill) for a in argv], {k: v.format(**fill) for k, v in environ.items()})


@pytest.mark.parametrize("source,argv,environ", [
    ("--model-options", ["--model-options=device=cpu,bogus=1"], {}),
    ("$RELSERVE_MODEL_OPTIONS", [], {"RELSERVE_MODEL_OPTIONS": "bogus=1"}),
])
def test_unknown_option_lists_only_the_keys_an_option_may_set(tmp_path, source, argv, environ):
    ckpt = _checkpoint(tmp_path / "ckpt")
    with pytest.raises(ConfigError) as info:
        _config([f"--model-dir={ckpt}", "--model-name=m", *argv], environ)
    message = str(info.value)
    assert message.startswith(f"{source} ") and "unknown key(s) ['bogus']; allowed: [" in message
    allowed = ast.literal_eval(message.split("allowed: ", 1)[1])  # the list the message prints
    assert "device" in allowed and "doc_stride" in allowed and "max_batch_size" in allowed
    assert "name" not in allowed and "path" not in allowed  # refused by this flag: not offered


def test_main_reports_a_model_dir_error_as_a_configuration_error(tmp_path, capsys):
    assert cli.main(["serve", f"--model-dir={tmp_path}"]) == 2
    assert "configuration error" in capsys.readouterr().err
