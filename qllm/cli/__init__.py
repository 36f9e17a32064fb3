"""The ``qllm`` command line: ``qllm generate`` and ``qllm serve``."""

from __future__ import annotations

import argparse
import logging

from qllm import __version__
from qllm.cli.generate import add_generate_command
from qllm.cli.options import HelpFormatter, run_command


def _add_serve(subparsers) -> None:
    try:
        from qllm.cli.serve import add_serve_command
    except ImportError:
        return  # the server is an optional extra: `pip install -e ".[serve]"`
    add_serve_command(subparsers)


def main(argv: list[str] | None = None) -> int:
    """The ``qllm`` command (also ``python -m qllm``)."""
    parser = argparse.ArgumentParser(prog="qllm", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"qllm {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_command(subparsers)
    _add_serve(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_command(args)
