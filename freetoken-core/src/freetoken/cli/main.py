"""The ``freetoken`` command: one sub-command per module.

Each sub-command module exposes ``add_parser(subparsers)``, which registers its
parser and sets ``func`` (called with the parsed namespace, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Optional, Sequence

from freetoken._version import __version__

#: Sub-command modules, in help order.
COMMAND_MODULES = (
    "freetoken.cli.generate",
    "freetoken.cli.serve",
    "freetoken.cli.doctor",
    "freetoken.cli.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freetoken",
        description="Run Mixture-of-Experts models on one GPU plus the host CPU.",
    )
    parser.add_argument("--version", action="version", version=f"freetoken {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # sub-command not built yet
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
