"""The ``relserve`` command line dispatches to the training CLIs with their own flags."""

from __future__ import annotations

import pytest

from relserve.service.main import main


@pytest.mark.parametrize("command,flag", [
    ("train-translation", "--encoder"), ("train-classifier", "--tokenizer"), ("train-qa", "--max-minutes"),
])
def test_training_subcommands_parse_their_own_flags(command, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert flag in capsys.readouterr().out
