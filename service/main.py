"""``relserve serve`` / ``relserve export`` — the command line.

    relserve serve [--config FILE] [--host HOST] [--port 50051] [--metrics-port 8002]
                   [--model NAME=DIR[,key=value...]]... [--drain-timeout SECONDS] [--log-level LEVEL]
                   [--model-dir DIR [--model-name NAME] [--model-options key=value,...]...]   (KServe: /mnt/models)
                   [--compute-scheduling partition|fair|shared] [--gil-switch-interval-us US]
                   [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] [--auth-token-file FILE]
                   [--no-reflection] [--metrics-host HOST] [--health-port PORT [--health-host HOST]]
                   [--http-port PORT [--http-host HOST]]
                   [--max-connection-age S] [--max-connection-age-grace S] [--keepalive-time S]
                   [--keepalive-timeout S] [--keepalive-min-ping-interval S] [--[no-]keepalive-permit-without-calls]
    relserve export CHECKPOINT_DIR OUT_DIR [--opset 18] [--no-parity]   (see relserve.models.onnx.cli)

Exit codes: 0 after a drain (SIGTERM/SIGINT; calls still running at drain_timeout end UNAVAILABLE), 1 when a
model fails to load, the port cannot be bound, the drain hangs past drain_timeout + 0.45 s or a second
signal arrives during it, 2 for a configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import logging
import os
import signal
import sys
from typing import Mapping, Sequence

from . import model_dir
from .config import COMPUTE_SCHEDULING, ConfigError, ModelConfig, ServerConfig, load_config

log = logging.getLogger("relserve")

EXIT_MARGIN_S = 0.45   # after drain_timeout the deadline thread ends the process (promise: within + 0.5 s)
EXIT_LINGER_S = 1.0    # after a drain that finished early: time for the last replies (a Watch stream's NOT_SERVING
                      # and its end) to leave grpc's buffers; 0.1 s and 0.3 s lost them on a 2-core machine whose
                      # cores were busy with other processes (grpc's I/O threads were not scheduled in time)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relserve", description="gRPC inference server for DeBERTa-style encoders")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve models over gRPC (relserve.v1.Inference)")
    serve.add_argument("--config", metavar="FILE", help="YAML config file (flags below override it)")
    serve.add_argument("--host", help="address to bind (default 0.0.0.0)")
    serve.add_argument("--port", type=int, help="gRPC port (default 50051; 0 picks a free port)")
    serve.add_argument("--metrics-port", type=int,
                       help="Prometheus /metrics port (default 8002; 0 picks a free port; -1 disables)")
    serve.add_argument("--model", action="append", default=[], metavar="NAME=DIR[,key=value...]",
                       help="serve the checkpoint DIR as NAME, e.g. --model sst2=./ckpt,max_batch_size=8 "
                            "(repeatable; default: the built-in models in defaults/)")
    kserve = serve.add_argument_group(
        "model directory (KServe: the storage initializer's /mnt/models; each flag falls back to the environment "
        "variable named, see service/model_dir.py)")
    kserve.add_argument("--model-dir", "--model_dir", dest="model_dir", metavar="DIR",
                        help="a checkpoint (DIR/config.json: one model, named by --model-name) or one checkpoint "
                             f"sub-directory per model, named after it [${model_dir.ENV_DIR}]")
    kserve.add_argument("--model-name", "--model_name", dest="model_name", metavar="NAME",
                        help=f"name of a single-checkpoint --model-dir (KServe: {{{{.Name}}}}) [${model_dir.ENV_NAME}]")
    kserve.add_argument("--model-options", "--model_options", dest="model_options", metavar="KEY=VALUE,...",
                        action="append", default=[],
                        help="model config keys for every model of --model-dir, e.g. device=cuda,dtype=float16 "
                             f"(repeatable, later keys win; after those of ${model_dir.ENV_OPTIONS})")
    serve.add_argument("--drain-timeout", type=float, help="seconds to let in-flight requests finish on SIGTERM")
    serve.add_argument("--max-message-bytes", type=int,
                       help="max gRPC message size both ways (default 4194304)")
    conn = serve.add_argument_group("connection management (seconds; see the config keys of the same names)")
    conn.add_argument("--max-connection-age", type=float, metavar="S",
                      help="GOAWAY to each connection after S (default 300; 0: off): clients reconnect and "
                           "re-resolve DNS, so they reach replicas added later")
    conn.add_argument("--max-connection-age-grace", type=float, metavar="S",
                      help="in-flight calls' time after that GOAWAY before the connection closes (default 30)")
    conn.add_argument("--keepalive-time", type=float, metavar="S",
                      help="server keepalive ping interval (default 60; 0: no pings)")
    conn.add_argument("--keepalive-timeout", type=float, metavar="S",
                      help="drop a connection whose ping is unanswered this long (default 20)")
    conn.add_argument("--keepalive-min-ping-interval", type=float, metavar="S",
                      help="shortest client keepalive interval accepted (default 10; faster clients get "
                           "GOAWAY too_many_pings)")
    conn.add_argument("--keepalive-permit-without-calls", action=argparse.BooleanOptionalAction, default=None,
                      help="clients may ping connections without open calls (default: yes)")
    serve.add_argument("--log-level", help="DEBUG, INFO, WARNING, ... (default INFO)")
    serve.add_argument("--compute-scheduling", choices=COMPUTE_SCHEDULING,
                       help="how models share the cores: partition (default; models compute concurrently, each "
                            "call on cores // active models threads), fair (one model's backend call at a time, models in turn) "
                            "or shared (no coordination)")
    serve.add_argument("--gil-switch-interval-us", type=float, metavar="US",
                       help="sys.setswitchinterval while serving, in microseconds (default: Python's own, 5000): "
                            "how long a backend thread may wait to take the GIL back from the event loop; 10 "
                            "speeds encoder models under load and slows translation's decode loop")
    security = serve.add_argument_group("transport security and auth")
    security.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve gRPC over TLS "
                                                            "(needs --tls-key)")
    security.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert (unencrypted)")
    security.add_argument("--tls-client-ca", metavar="FILE",
                          help="PEM CA bundle: require client certificates signed by it (mTLS; needs TLS)")
    security.add_argument("--auth-token-file", metavar="FILE",
                          help="bearer tokens, one per line: calls without 'authorization: Bearer <token>' "
                               "are UNAUTHENTICATED (health checks stay open unless auth_health: true)")
    security.add_argument("--no-reflection", dest="reflection", action="store_const", const=False, default=None,
                          help="do not serve grpc.reflection (config key reflection: false)")
    security.add_argument("--metrics-host", metavar="HOST", help="address of the /metrics server (default: --host)")
    security.add_argument("--health-port", type=int, metavar="PORT",
                          help="also serve grpc.health.v1 alone, in plaintext, on PORT (for kubelet probes "
                               "when TLS or auth is on; 0 picks a free port)")
    security.add_argument("--health-host", metavar="HOST", help="address of --health-port (default: --host)")
    security.add_argument("--http-port", type=int, metavar="PORT",
                          help="also serve the HTTP/JSON API (KServe v2 REST, /v1/classify|answer|translate, "
                               "/metrics) on PORT, with the gRPC port's TLS and tokens (0 picks a free port)")
    security.add_argument("--http-host", metavar="HOST", help="address of --http-port (default: --host)")
    sub.add_parser("export", add_help=False, help="export a checkpoint to ONNX (custom relative-position ops) "
                                                  "with a parity report against torch (see export --help)")
    sub.add_parser("loadtest", add_help=False,
                   help="load-test a running server (same as python -m relserve.loadtest; see loadtest --help)")
    for name, what in _TRAINERS.items():
        sub.add_parser(name, add_help=False, help=f"train {what} (see {name} --help)")
    return parser


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """The one place command-line flags meet the config file (and the ``RELSERVE_MODEL_*`` variables of
    ``environ``, default ``os.environ``, where their flags are absent)."""
    overrides = {
        "host": args.host,
        "port": args.port,
        "metrics_port": args.metrics_port,
        "drain_timeout": args.drain_timeout,
        "log_level": args.log_level,
        "compute_scheduling": args.compute_scheduling,
        "gil_switch_interval_us": args.gil_switch_interval_us,
        "max_receive_message_length": args.max_message_bytes,
        "max_send_message_length": args.max_message_bytes,
        "max_connection_age": args.max_connection_age,
        "max_connection_age_grace": args.max_connection_age_grace,
        "keepalive_time": args.keepalive_time,
        "keepalive_timeout": args.keepalive_timeout,
        "keepalive_min_ping_interval": args.keepalive_min_ping_interval,
        "keepalive_permit_without_calls": args.keepalive_permit_without_calls,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
        "auth_token_file": args.auth_token_file,
        "reflection": args.reflection,
        "metrics_host": args.metrics_host,
        "health_port": args.health_port,
        "health_host": args.health_host,
        "http_port": args.http_port,
        "http_host": args.http_host,
    }
    return load_config(args.config, overrides=overrides, model_specs=args.model,
                       dir_models=_dir_models(args, os.environ if environ is None else environ))


def _dir_models(args: argparse.Namespace, environ: Mapping[str, str]) -> list:
    """``--model-dir`` and ``--model-name``, each falling back to its environment variable, and the model options
    of ``$RELSERVE_MODEL_OPTIONS`` then of each ``--model-options`` (a KServe InferenceService's args come after
    its runtime's, so it can add to or override the runtime's options), as ``load_config`` ``dir_models`` entries.

    Raises:
        ConfigError: a name or options without a directory, or what ``model_dir.dir_models`` refuses.
    """
    def pick(flag: str, value: str | None, env: str) -> tuple[str | None, str]:
        if value is not None:
            return value, flag
        if environ.get(env):
            return environ[env], f"${env}"
        return None, f"{flag} (or ${env})"

    directory, dir_source = pick("--model-dir", args.model_dir, model_dir.ENV_DIR)
    name, name_source = pick("--model-name", args.model_name, model_dir.ENV_NAME)
    env_options = environ.get(model_dir.ENV_OPTIONS)
    options = [(f"${model_dir.ENV_OPTIONS}", env_options)] if env_options else []
    options += [("--model-options", text) for text in args.model_options]
    if directory is None:
        for value, source in ((name, name_source), *((text, src) for src, text in options)):
            if value is not None:
                raise ConfigError(f"{source} is given but no model directory: add --model-dir DIR "
                                  f"(or set ${model_dir.ENV_DIR})")
        return []
    # what an option may set: every model config key but the two the directory gives (parse_options refuses
    # those by name); checked here so the unknown-key message lists only keys this flag accepts
    allowed = sorted({f.name for f in dataclasses.fields(ModelConfig)} - {"name", "path"})
    parsed = {}
    for source, text in options:
        items = model_dir.parse_options(text, source)
        unknown = sorted(set(items) - set(allowed))
        if unknown:
            raise ConfigError(f"{source} {text!r}: unknown key(s) {unknown}; allowed: {allowed}")
        parsed.update(items)
    return model_dir.dir_models(directory, name, parsed, dir_source=dir_source, name_source=name_source)


async def serve(config: ServerConfig, runners=None) -> int:
    """Run a server until SIGTERM/SIGINT, drain, then end the process.

    The drain is ``InferenceServer.drain`` (service/drain.py has the sequence): late calls get UNAVAILABLE,
    health NOT_SERVING, running calls get up to ``drain_timeout``, Watch streams end. Then the process
    exits at once (``drain.exit_now``, code 0) instead of stopping the gRPC server, whose stop would reset
    calls that arrived in its last millisecond (CANCELLED at the client); the exit closes the connections,
    so such calls end UNAVAILABLE. A deadline thread ends the process (code 1) ``EXIT_MARGIN_S`` after
    ``drain_timeout`` whatever hangs, and so does a second signal.

    Returns:
        1 when the port cannot be bound or a model fails to load (nothing was served); after a signal this
        function does not return.
    """
    from .drain import ExitDeadline, exit_now
    from .server import InferenceServer

    server = InferenceServer(config, runners)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            log.warning("second signal during the drain: exiting now")
            exit_now(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread / platform
            pass
    try:
        await server.start()
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    loading = asyncio.create_task(server.load_models())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        exc = loading.exception()
        log.error("model loading failed: %s: %s", type(exc).__name__, exc)
        stopping.cancel()
        await server.stop(0)
        return 1
    await stopping
    ExitDeadline(config.drain_timeout + EXIT_MARGIN_S, code=1).start()
    t0 = loop.time()
    log.info("signal received: health NOT_SERVING, draining (timeout %.1f s)", config.drain_timeout)
    finished = await server.drain(config.drain_timeout)  # also keeps a model still loading from going SERVING
    await server.close_runners()
    # Replies written just now may still sit in socket buffers, and closing a socket that has unread input
    # (a late call) resets the connection and drops them: give them a moment if the deadline allows.
    await asyncio.sleep(max(0.0, min(EXIT_LINGER_S, config.drain_timeout - (loop.time() - t0))))
    log.info("drained in %.2f s (%s); exiting", loop.time() - t0,
             "every request answered" if finished else "requests still running at the deadline ended UNAVAILABLE")
    exit_now(0)
    return 0  # pragma: no cover - exit_now does not return


# Subcommand -> what it trains; each is relserve.models.training.<name after "train-">.main(argv).
_TRAINERS = {
    "train-classifier": "the default sentiment classifier",
    "train-qa": "the default extractive QA model",
    "train-translation": "an RNNsearch translation model (BiGRU or DeBERTa-style encoder)",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["loadtest"]:
        from relserve.loadtest.cli import main as loadtest_main  # its own flags, parsed there

        return loadtest_main(argv[1:])
    if argv[:1] and argv[0] in _TRAINERS:  # training CLIs keep their own flags; imported only when asked for
        module = importlib.import_module(f"relserve.models.training.{argv[0].removeprefix('train-')}")
        return module.main(argv[1:])
    if argv[:1] == ["export"]:
        from relserve.service.backends import require_onnx

        try:
            require_onnx("relserve export")  # the onnx extra is optional; say which to install
        except ConfigError as exc:
            print(f"relserve: {exc}", file=sys.stderr)
            return 2
        from relserve.models.onnx.cli import main as export_main  # imports torch, onnx; its own flags

        return export_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"relserve: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return asyncio.run(serve(config))
    except ConfigError as exc:
        print(f"relserve: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
