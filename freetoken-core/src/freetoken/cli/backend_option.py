"""The ``--backend`` option shared by every sub-command that uses a backend."""

from __future__ import annotations

import argparse

from freetoken.backends.selection import ENV_VAR


def add_backend_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        metavar="NAME",
        default=None,
        help=f"backend plugin to use (cpu, cuda, rocm or a third-party name); overrides {ENV_VAR}; "
        "default: chosen from the torch build and the visible GPUs",
    )
