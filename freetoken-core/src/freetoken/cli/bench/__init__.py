"""``freetoken bench``: benchmark scripts, one module per benchmark.

Each benchmark module exposes ``add_parser(subparsers)`` like the top-level
sub-commands do.
"""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES = (
    "freetoken.cli.bench.cpu_moe",
    "freetoken.cli.bench.make_model",
    "freetoken.cli.bench.decode",
    "freetoken.cli.bench.moe_layer",
    "freetoken.cli.bench.serve",
    "freetoken.cli.bench.clients",
    "freetoken.cli.bench.schema_decode",
)


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (results go in docs/benchmarks.md)")
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.add_parser(sub)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
