"""``relserve serve`` / ``relserve export`` — the command line.

    relserve serve [--config FILE] [--host HOST] [--port 50051] [--metrics-port 8002]
                   [--model NAME=DIR[,key=value...]]... [--drain-timeout SECONDS] [--log-level LEVEL]
    relserve export CHECKPOINT_DIR OUT_DIR [--opset 18] [--no-parity]   (see relserve.models.onnx.cli)

Exit codes: 0 after a clean drain (SIGTERM/SIGINT), 1 when a model fails to load or the port cannot be
bound, 2 for a configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
from typing import Sequence

from .config import ConfigError, ServerConfig, load_config

log = logging.getLogger("relserve")


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
    serve.add_argument("--drain-timeout", type=float, help="seconds to let in-flight requests finish on SIGTERM")
    serve.add_argument("--max-message-bytes", type=int,
                       help="max gRPC message size both ways (default 4194304)")
    serve.add_argument("--log-level", help="DEBUG, INFO, WARNING, ... (default INFO)")
    sub.add_parser("export", add_help=False, help="export a checkpoint to ONNX (custom relative-position ops) "
                                                  "with a parity report against torch (see export --help)")
    sub.add_parser("loadtest", add_help=False,
                   help="load-test a running server (same as python -m relserve.loadtest; see loadtest --help)")
    for name, what in _TRAINERS.items():
        sub.add_parser(name, add_help=False, help=f"train {what} (see {name} --help)")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The one place command-line flags meet the config file."""
    overrides = {
        "host": args.host,
        "port": args.port,
        "metrics_port": args.metrics_port,
        "drain_timeout": args.drain_timeout,
        "log_level": args.log_level,
        "max_receive_message_length": args.max_message_bytes,
        "max_send_message_length": args.max_message_bytes,
    }
    return load_config(args.config, overrides=overrides, model_specs=args.model)


async def serve(config: ServerConfig, runners=None) -> int:
    """Run a server until SIGTERM/SIGINT, then drain. Returns the process exit code."""
    from .server import InferenceServer

    server = InferenceServer(config, runners)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
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
    log.info("signal received: health NOT_SERVING, draining (timeout %.1f s)", config.drain_timeout)
    if not loading.done():
        server.registry.draining = True  # type: ignore[union-attr]
    await server.stop(config.drain_timeout)
    if not loading.done():
        loading.cancel()
    return 0


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
