"""``qllm serve``: the command line of the HTTP server.

``qllm.cli`` adds it as a subcommand through ``add_serve_command``; ``python -m
qllm.cli.serve`` runs it alone. fastapi and uvicorn are imported only when serving.
"""

from __future__ import annotations

import argparse
import logging
import sys

from qllm.cli.options import (HelpFormatter, add_engine_options, add_model_option,
                              engine_options, run_command)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_option(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    parser.add_argument("--served-model-name",
                        help="the model name of the API (default: the directory's name)")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests get to finish on SIGINT/SIGTERM "
                             "before they are aborted")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="server and engine log level")
    add_engine_options(parser)


def add_serve_command(subparsers) -> None:
    """Add ``serve`` to the ``qllm`` command's subparsers."""
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible "
                                                 "HTTP API", formatter_class=HelpFormatter)
    _add_arguments(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, then serve it until SIGINT/SIGTERM."""
    try:
        from qllm.server.api_server import create_server
    except ImportError as exc:
        print(f"qllm serve: {exc.name} is missing: install the server's extra from the qllm "
              f"source tree, pip install -e \".[serve]\"", file=sys.stderr)
        return 1
    from qllm.config import EngineConfig
    from qllm.engine.llm_engine import LLMEngine
    from qllm.model.default_model import default_model_dir

    model = args.model
    if model is None:
        model = default_model_dir()
        print(f"qllm: no --model given; serving the built-in default model at {model}. "
              f"Its weights are RANDOM, so its text is gibberish.", file=sys.stderr)
    engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_options(args)))
    server = create_server(engine, args.host, args.port, args.served_model_name,
                           args.shutdown_timeout, args.log_level)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down for
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qllm.cli.serve", description=__doc__,
                                     formatter_class=HelpFormatter)
    _add_arguments(parser)
    parser.set_defaults(func=run_serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
