"""docs/engine.md cannot drift from the code: its options table lists exactly the flags of
`freetoken serve`'s parser (with their defaults), and its environment table exactly the
FREETOKEN_* variables the installed packages' sources name."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from freetoken.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "engine.md"
#: the packages a user installs (their build scripts, setup.py, are outside src/)
SOURCES = [ROOT / name / "src" for name in ("freetoken-core", "freetoken-cpu-moe", "freetoken-cuda", "freetoken-rocm")]


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _rows(title: str, first_cell: str) -> dict[str, list[str]]:
    """The table rows of a section whose first cell matches ``first_cell`` (a regex), by that
    cell's name; duplicates fail."""
    rows: dict[str, list[str]] = {}
    for line in _section(title).splitlines():
        m = re.match(rf"^\| `({first_cell})` \|(.*)\|\s*$", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} listed twice in docs/engine.md"
            rows[m.group(1)] = [c.strip() for c in m.group(2).split(" | ")]
    return rows


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _serve_flags() -> dict[str, argparse.Action]:
    flags = {}
    for action in _serve_parser()._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and not isinstance(action, argparse._HelpAction):
            flags[longs[0]] = action
    return flags


def test_options_table_lists_exactly_the_serve_flags():
    rows = _rows("Engine and server options", r"--[a-z0-9-]+")
    flags = _serve_flags()
    assert sorted(set(flags) - set(rows)) == [], "flags of `freetoken serve` missing from docs/engine.md"
    assert sorted(set(rows) - set(flags)) == [], "docs/engine.md lists flags `freetoken serve` does not have"
    for flag, cells in rows.items():
        assert len(cells) == 2 and all(cells), f"{flag}: expected 'default | when to change it', got {cells}"


def _shown(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@pytest.mark.parametrize("flag", sorted(_serve_flags()))
def test_options_table_shows_the_parser_default(flag):
    """A default the parser holds as a plain value (a number, a mode) is in the default
    cell; defaults decided later (None: the backend's, the environment's) are described."""
    action = _serve_flags()[flag]
    default = action.default
    if flag == "--api-key" or default is None or isinstance(default, (bool, list)):
        return
    cell = _rows("Engine and server options", r"--[a-z0-9-]+")[flag][0]
    assert _shown(default) in cell, f"{flag}: default {default!r} not in {cell!r}"


def _env_names_in_sources() -> set[str]:
    names: set[str] = set()
    for src in SOURCES:
        for path in src.rglob("*.py"):
            names.update(re.findall(r"""["'](FREETOKEN_[A-Z0-9_]+)["']""", path.read_text()))
    return names


def test_environment_table_lists_exactly_the_variables_the_packages_read():
    documented = set(_rows("Environment variables", r"FREETOKEN_[A-Z0-9_]+"))
    used = _env_names_in_sources()
    assert used, "no FREETOKEN_* names found in the sources"
    assert sorted(used - documented) == [], "variables the packages read, missing from docs/engine.md"
    assert sorted(documented - used) == [], "docs/engine.md documents variables no package reads"


@pytest.mark.parametrize("removed", ["--gpu-dependent-launch", "--moe-locked-fetch-mode", "FREETOKEN_CPU_PIN_CALLER",
                                     "FREETOKEN_CPU_NATIVE_DECODE", "FREETOKEN_CPU_GREEDY_HEAD",
                                     "FREETOKEN_PACKED_EXPERTS", "FREETOKEN_PACKED_DENSE",
                                     "FREETOKEN_PACKED_DENSE_WIDE", "FREETOKEN_GROUPED_EXPERTS"])
def test_removed_knobs_are_gone(removed):
    assert removed not in _serve_flags() and removed not in _env_names_in_sources()
