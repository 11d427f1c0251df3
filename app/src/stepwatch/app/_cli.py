"""The ``stepwatch`` command.

Each component contributes its subcommands from a ``_commands`` module exposing
``register(subparsers)``. Those modules import only the standard library at import time, so
``stepwatch --help`` works with no extra installed; heavy imports happen in the handlers.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from stepwatch.core import __version__
from stepwatch.core._errors import StepwatchError

_COMMAND_MODULES = (
    "stepwatch.app._stack_commands",  # up, demo
    "stepwatch.app._bridge_command",  # bridge
    "stepwatch.app._ingest_command",  # ingest
    "stepwatch.app._detect_commands",  # detect, simulate, evaluate
    "stepwatch.app._report_command",  # report
    "stepwatch.app._top",  # top
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepwatch",
        description="Always-on performance diagnosis for distributed training.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="logging level (default INFO)",
    )
    parser.add_argument("--version", action="version", version=f"stepwatch {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue  # that component is not written yet / not installed
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args))
    except StepwatchError as exc:
        print(f"stepwatch {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
