"""``relserve serve`` / ``relserve export`` / ``relserve call`` — the command line.

    relserve serve [--config FILE] [--host HOST] [--port 50051] [--metrics-port 8002]
                   [--model NAME=DIR[,key=value...]]... [--drain-timeout SECONDS] [--log-level LEVEL]
                   [--model-dir DIR [--model-name NAME] [--model-options key=value,...]...]   (KServe: /mnt/models)
                   [--compute-scheduling partition|fair|shared] [--gil-switch-interval-us US]
                   [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] [--auth-token-file FILE]
                   [--no-reflection] [--metrics-host HOST] [--health-port PORT [--health-host HOST]]
                   [--http-port PORT [--http-host HOST]]
                   [--model-repository DIR]... [--model-control-mode none|poll|explicit] [--repository-poll-secs S]
                   [--load-model NAME]... [--memory-limit-mb MIB] [--admin-token-file FILE]
                   [--max-connection-age S] [--max-connection-age-grace S] [--keepalive-time S]
                   [--keepalive-timeout S] [--keepalive-min-ping-interval S] [--[no-]keepalive-permit-without-calls]
    relserve export CHECKPOINT_DIR OUT_DIR [--opset 18] [--no-parity]   (see relserve.models.onnx.cli)
    relserve call classify|answer|translate|models|health [--address HOST:PORT] ...   (see relserve.client.cli)
    relserve dtype-decisions [--config FILE] [--model NAME=DIR[,key=value...]]...   (default: the built-in models)
    relserve --version

A mistyped ``serve`` flag is reported with ``serve``'s usage (its flags), not the top-level one.

Exit codes: 0 after a drain (SIGTERM/SIGINT; calls still running at drain_timeout end UNAVAILABLE), 1 when a
model fails to load, the port cannot be bound, the drain hangs past drain_timeout + 0.45 s or a second
signal arrives during it, 2 for a configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
from typing import Sequence

from . import tracing
from .config import ConfigError, ServerConfig, add_config_flags, config_from_args

log = logging.getLogger("relserve")

EXIT_MARGIN_S = 0.45   # after drain_timeout the deadline thread ends the process (promise: within + 0.5 s)
EXIT_LINGER_S = 1.0    # after a drain that finished early: time for the last replies (a Watch stream's NOT_SERVING
                      # and its end) to leave grpc's buffers; 0.1 s and 0.3 s lost them on a 2-core machine whose
                      # cores were busy with other processes (grpc's I/O threads were not scheduled in time)


class _SubcommandParser(argparse.ArgumentParser):
    """A sub-command's parser that refuses arguments it does not know itself: argparse hands them back to the
    top-level parser, whose error shows the top-level usage instead of the sub-command's flags."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    """The ``relserve`` command line: ``serve`` (its flags: :func:`relserve.service.config.add_config_flags`),
    ``--version``, and the sub-commands that parse their own flags."""
    from relserve.client.cli import package_version  # the client's CLI prints the same version

    parser = argparse.ArgumentParser(prog="relserve", description="gRPC inference server for DeBERTa-style encoders")
    parser.add_argument("--version", action="version", version=f"relserve {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    serve = sub.add_parser("serve", help="serve models over gRPC (relserve.v1.Inference)")
    add_config_flags(serve)
    sub.add_parser("export", add_help=False, help="export a checkpoint to ONNX (custom relative-position ops) "
                                                  "with a parity report against torch (see export --help)")
    sub.add_parser("loadtest", add_help=False,
                   help="load-test a running server (same as python -m relserve.loadtest; see loadtest --help)")
    sub.add_parser("call", add_help=False,
                   help="one call to a running server (classify, answer, translate, models, health), the reply "
                        "printed as JSON (same as python -m relserve.client; see call --help)")
    for name, what in _TRAINERS.items():
        sub.add_parser(name, add_help=False, help=f"train {what} (see {name} --help)")
    sub.add_parser("dtype-decisions", add_help=False,
                   help="run dtype: auto's agreement gate for each model here and write its decision beside the "
                        "checkpoint (dtype_decision.json), so a server on a machine of the same class skips the gate "
                        "(see dtype-decisions --help)")
    return parser


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

    Raises:
        ConfigError: a model's configuration cannot be served (found while loading; ``main`` exits 2).
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
        if isinstance(exc, ConfigError):  # e.g. an ONNX cache directory it cannot write: main() exits 2
            raise exc
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


def dtype_decisions(argv: Sequence[str]) -> int:
    """``relserve dtype-decisions``: for each torch model with ``dtype: auto`` (default: the built-in models), load
    it as the server would, run the agreement gate afresh (an empty cache, shipped decisions ignored) and add its
    decision for this machine class to ``<checkpoint>/dtype_decision.json``
    (:mod:`relserve.service.backends.gate_cache`). Exit codes: 0 written (or nothing to decide here), 1 a model
    failed to load, 2 a configuration error."""
    from .backends import gate_cache
    from .config import load_config

    ap = _SubcommandParser(prog="relserve dtype-decisions", description=dtype_decisions.__doc__.split("(:mod")[0])
    ap.add_argument("--config", metavar="FILE", help="server config whose models are decided")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR[,key=value...]",
                    help="a model (repeatable); its keys must be those it is served with: they are part of the key")
    args = ap.parse_args(list(argv))
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        models = load_config(args.config, model_specs=args.model).models
    except ConfigError as exc:
        print(f"relserve dtype-decisions: configuration error: {exc}", file=sys.stderr)
        return 2
    gate_cache.read_shipped = False  # decide afresh, whatever is shipped already
    try:
        return _decide_and_ship(models)
    finally:
        gate_cache.read_shipped = True


def _decide_and_ship(models: Sequence) -> int:
    """``relserve dtype-decisions``' loop over ``models`` (its exit code)."""
    import dataclasses
    import json
    import tempfile
    from pathlib import Path

    from .backends import gate_cache
    from .config import DEFAULTS_DIR
    from .registry import build_runner

    for model in models:
        if model.dtype != "auto":
            print(f"{model.name}: dtype {model.dtype} configured, no gate")
            continue
        with tempfile.TemporaryDirectory(prefix="relserve-dtype-") as tmp:
            cfg = dataclasses.replace(model, onnx_cache_dir=Path(tmp), load_cache=True, worker_process=False,
                                      instances=1, warmup=True, cost_batching=False)
            runner = build_runner(cfg)
            if runner.backend.name != "torch":
                print(f"{model.name}: backend {runner.backend.name}, no dtype: auto gate")
                continue
            try:
                runner.load()
            except Exception as exc:  # noqa: BLE001 - reported; the models after it are not decided
                print(f"relserve dtype-decisions: model {model.name!r} failed to load: {exc}", file=sys.stderr)
                return 1
            finally:
                runner.backend.close()
            entries = [p for p in gate_cache.cache_dir(cfg).glob("*.json") if not p.name.endswith(".probes.json")]
            if not entries:
                print(f"{model.name}: {runner.meta.dtype} without a gate here ({runner.meta.dtype_reason})")
                continue
            kept = json.loads(entries[0].read_text())
            # the reason names the gate text's path: relative to the checkout, so a shipped file reads the same anywhere
            reason = kept["reason"].replace(f"{DEFAULTS_DIR.parent}/", "")
            target = gate_cache.ship(model.path, gate_cache.make_entry(kept["key"], kept["dtype"], reason))
            print(f"{model.name}: {runner.meta.dtype} ({runner.meta.dtype_reason}) -> {target}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["dtype-decisions"]:
        return dtype_decisions(argv[1:])
    if argv[:1] == ["loadtest"]:
        from relserve.loadtest.cli import main as loadtest_main  # its own flags, parsed there

        return loadtest_main(argv[1:])
    if argv[:1] == ["call"]:
        from relserve.client.cli import main as call_main  # its own flags; grpc and protobuf only

        return call_main(argv[1:], prog="relserve call")
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
        tracing.configure(config.otlp_endpoint, os.environ)  # imports OpenTelemetry only with an endpoint
    except ConfigError as exc:
        print(f"relserve: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format=tracing.LOG_FORMAT,  # the message, then the call's trace and request ids when in a call
    )
    tracing.install_log_context(logging.getLogger().handlers)
    try:
        return asyncio.run(serve(config))
    except ConfigError as exc:
        print(f"relserve: configuration error: {exc}", file=sys.stderr)
        return 2
    finally:
        tracing.shutdown()  # the spans still buffered leave before the process does


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
