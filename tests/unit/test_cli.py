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


def test_security_flags_reach_the_config(tmp_path):
    from fixtures.tls import make_pki

    from relserve.service.main import build_parser, config_from_args

    pki = make_pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    tokens.write_text("t0ken\n")
    args = build_parser().parse_args([
        "serve", "--model", f"a={tmp_path}", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tls-client-ca", str(pki.ca_cert), "--auth-token-file", str(tokens), "--no-reflection",
        "--metrics-host", "127.0.0.1", "--health-port", "8081", "--health-host", "0.0.0.0",
    ])
    cfg = config_from_args(args)
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) == (pki.server_cert, pki.server_key, pki.ca_cert)
    assert cfg.auth_token_file == tokens and cfg.reflection is False
    assert (cfg.metrics_host, cfg.health_port, cfg.health_host) == ("127.0.0.1", 8081, "0.0.0.0")
    plain = config_from_args(build_parser().parse_args(["serve", "--model", f"a={tmp_path}"]))
    assert plain.reflection is True and plain.tls_cert is None and plain.health_port is None


def test_no_reflection_overrides_the_config_file(tmp_path):
    from relserve.service.main import build_parser, config_from_args

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"reflection: true\nmodels: [{{name: a, path: {tmp_path}}}]\n")
    base = ["serve", "--config", str(cfg_file)]
    assert config_from_args(build_parser().parse_args(base)).reflection is True
    assert config_from_args(build_parser().parse_args([*base, "--no-reflection"])).reflection is False


@pytest.mark.parametrize("flags, fragment", [
    (["--tls-cert", "{cert}"], "tls_cert is set but tls_key is not"),
    (["--tls-key", "{key}"], "tls_key is set but tls_cert is not"),
    (["--tls-client-ca", "{ca}"], "needs TLS: set tls_cert and tls_key too"),
    (["--tls-cert", "{cert}", "--tls-key", "{d}/missing.key"], "tls_key: cannot read"),
    (["--auth-token-file", "{d}/empty"], "holds no token"),
])
def test_bad_security_flags_exit_2(tmp_path, capsys, flags, fragment):
    from fixtures.tls import make_pki

    pki = make_pki(tmp_path / "pki")
    (tmp_path / "empty").write_text("\n# no tokens yet\n")
    paths = {"cert": pki.server_cert, "key": pki.server_key, "ca": pki.ca_cert, "d": tmp_path}
    assert main(["serve", "--model", f"a={tmp_path}", *(f.format(**paths) for f in flags)]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and fragment in err


def test_serve_help_lists_the_security_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--tls-cert", "--tls-key", "--tls-client-ca", "--auth-token-file", "--no-reflection",
                 "--metrics-host", "--health-port", "--health-host"):
        assert flag in out


def test_connection_flags_reach_the_config(tmp_path):
    from relserve.service.main import build_parser, config_from_args

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"max_connection_age: 120\nkeepalive_permit_without_calls: true\n"
                        f"models: [{{name: a, path: {tmp_path}}}]\n")
    args = build_parser().parse_args([
        "serve", "--config", str(cfg_file), "--max-connection-age", "1", "--max-connection-age-grace", "2",
        "--keepalive-time", "30", "--keepalive-timeout", "5", "--keepalive-min-ping-interval", "15",
        "--no-keepalive-permit-without-calls",
    ])
    cfg = config_from_args(args)
    assert (cfg.max_connection_age, cfg.max_connection_age_grace) == (1.0, 2.0)
    assert (cfg.keepalive_time, cfg.keepalive_timeout, cfg.keepalive_min_ping_interval) == (30.0, 5.0, 15.0)
    assert cfg.keepalive_permit_without_calls is False
    from_file = config_from_args(build_parser().parse_args(["serve", "--config", str(cfg_file)]))
    assert from_file.max_connection_age == 120.0 and from_file.keepalive_permit_without_calls is True


def test_bad_connection_flag_exits_2(tmp_path, capsys):
    assert main(["serve", "--model", f"a={tmp_path}", "--max-connection-age", "-3"]) == 2
    assert "max_connection_age must be between 0 and" in capsys.readouterr().err


def test_http_flags_reach_the_config(tmp_path):
    from relserve.service.main import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "--model", f"a={tmp_path}", "--http-port", "8080",
                                      "--http-host", "127.0.0.1"])
    cfg = config_from_args(args)
    assert (cfg.http_port, cfg.http_host) == (8080, "127.0.0.1")
    plain = config_from_args(build_parser().parse_args(["serve", "--model", f"a={tmp_path}"]))
    assert (plain.http_port, plain.http_host) == (None, None)


def test_unknown_model_option_lists_only_accepted_keys(tmp_path, capsys):
    # name and path are refused as --model options (NAME=DIR gives them), so the list must not offer them
    assert main(["serve", "--model", f"a={tmp_path},bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key(s) ['bogus']" in err and "max_batch_size" in err
    allowed = err.split("allowed:", 1)[1]
    assert "'name'" not in allowed and "'path'" not in allowed


def test_train_translation_help_names_the_train_extra(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train-translation", "--help"])
    assert exit_info.value.code == 0
    assert "relserve[train]" in capsys.readouterr().out
