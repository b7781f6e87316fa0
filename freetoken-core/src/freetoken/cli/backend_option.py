"""The ``--backend`` option shared by every sub-command that uses a backend.

``freetoken doctor`` registers it alone (:func:`add_backend_option`); the commands that
run a model get it with the other engine options (:mod:`freetoken.cli.engine_options`).
"""

from __future__ import annotations

import argparse

from freetoken.backends.selection import ENV_VAR


def backend_help() -> str:
    return (f"backend plugin to use (cpu, cuda, rocm or a third-party name); overrides {ENV_VAR}; "
            "default: chosen from the torch build and the visible GPUs")


def add_backend_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", metavar="NAME", default=None, help=backend_help())
