"""The ``train`` extra is optional (``relserve[train]``: sacrebleu for train-translation's BLEU/chrF): with
sacrebleu hidden from a child process, ``relserve train-translation`` stops before doing anything, with a
message that names the extra, instead of failing at its first evaluation.

The child gets a ``sitecustomize`` that hides sacrebleu (tests/fixtures/hidden_modules.py: what an absent
package gives), as tests/deploy/test_optional_onnx.py does for ONNX Runtime; so this holds whether or not the
test venv has the extra installed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from relserve.models.training import require_train_extra

from fixtures.hidden_modules import hiding_env

@pytest.fixture()
def no_sacrebleu(tmp_path) -> dict:
    return hiding_env(tmp_path / "site", ("sacrebleu",))


def test_the_blocker_hides_sacrebleu(no_sacrebleu):
    out = subprocess.run([sys.executable, "-c", "import sacrebleu"], capture_output=True, text=True, timeout=60,
                         env=no_sacrebleu)
    assert out.returncode != 0 and "No module named 'sacrebleu'" in out.stderr, out.stderr


@pytest.mark.parametrize("mode", ["train", "eval-checkpoint"])
def test_train_translation_without_the_extra_names_it(no_sacrebleu, tmp_path, mode):
    args = (["--train", str(tmp_path / "train.jsonl"), "--dev", str(tmp_path / "dev.jsonl"), "--out",
             str(tmp_path / "out"), "--state-dir", str(tmp_path / "state")] if mode == "train"
            else ["--eval-checkpoint", str(tmp_path / "ckpt"), "--dev", str(tmp_path / "dev.jsonl")])
    out = subprocess.run([sys.executable, "-m", "relserve.service.main", "train-translation", *args],
                         capture_output=True, text=True, timeout=120, env=no_sacrebleu)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.strip() == ("relserve train-translation: sacrebleu not installed; training needs the train "
                                  "extra: pip install 'relserve[train]'  (from a checkout: pip install -c "
                                  "constraints.txt '.[train]')")
    assert not (tmp_path / "state").exists() and not (tmp_path / "out").exists()  # stopped before any work


def test_require_train_extra_passes_for_installed_packages():
    assert require_train_extra("relserve train-x", ["numpy", "tqdm"]) is None
    with pytest.raises(SystemExit, match=r"^relserve train-x: no_such_pkg_a, no_such_pkg_b not installed; .*"
                                         r"relserve\[train\]"):
        require_train_extra("relserve train-x", ["numpy", "no_such_pkg_a", "no_such_pkg_b"])


def test_train_extra_is_declared_and_pinned():
    """pyproject's train extra pins sacrebleu, and constraints.txt has the same pin (the Makefile installs use it)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    assert extra == ["sacrebleu==2.6.0"]
    assert "sacrebleu==2.6.0" in (root / "constraints.txt").read_text().split()
