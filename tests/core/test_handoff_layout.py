"""The shared C header and its Python mirror describe the same bytes.

A C program generated from the mirror's fields is compiled against
``freetoken.get_include()`` and prints every struct's size and alignment, every
field's offset and size and every ``FT_*`` constant; each must equal the ctypes
mirror in :mod:`freetoken.handoff`. Structs or constants present on only one side
fail too. The header is also compiled as C++17 so its static_asserts run.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import freetoken
from freetoken import handoff

HEADER = Path(freetoken.get_include()) / "freetoken" / "handoff.h"
CC = shutil.which(os.environ.get("CC", "cc"))
CXX = shutil.which(os.environ.get("CXX", "c++"))

#: Constant families mirrored as Python enums: C prefix -> enum.
ENUM_FAMILIES = {"FT_FMT_": handoff.Fmt, "FT_ACT_": handoff.Act, "FT_ERR_": handoff.Err}


def _python_constants() -> dict[str, int]:
    """Every FT_* constant as the Python mirror defines it."""
    out = {f"{prefix}{member.name}": int(member) for prefix, enum in ENUM_FAMILIES.items() for member in enum}
    out["FT_HANDOFF_ABI_VERSION"] = handoff.ABI_VERSION
    out["FT_TASK_ACCUMULATE"] = handoff.TASK_ACCUMULATE
    out["FT_FLAG_SLOT_SIZE"] = ctypes.sizeof(handoff.FlagSlot)
    for field in ("ready", "done", "err", "seq", "gpu_ready_ns", "gpu_done_seen_ns", "gpu_y_read_ns",
                  "gpu_publish_start_ns"):
        out[f"FT_FLAG_{field.upper()}_OFFSET"] = getattr(handoff.FlagSlot, field).offset
    return out


def _header_constants(text: str) -> list[str]:
    return re.findall(r"^\s*#define\s+(FT_\w+)\s+\S", text, re.M)


def _program(text: str) -> str:
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "freetoken/handoff.h"', "int main(void) {"]
    for c_name, mirror in handoff.MIRRORS.items():
        lines.append(f'  printf("struct {c_name} %zu %zu\\n", sizeof({c_name}), _Alignof({c_name}));')
        for field, _ in mirror._fields_:
            lines.append(
                f'  printf("field {c_name}.{field} %zu %zu\\n", offsetof({c_name}, {field}), '
                f"sizeof((({c_name} *)0)->{field}));"
            )
    for name in _header_constants(text):
        lines.append(f'  printf("const {name} %llu\\n", (unsigned long long)({name}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict[str, tuple[int, ...]]:
    if CC is None:
        pytest.skip("no C compiler (set CC)")
    text = HEADER.read_text()
    work = tmp_path_factory.mktemp("layout")
    src, exe = work / "layout.c", work / "layout"
    src.write_text(_program(text))
    built = subprocess.run([CC, "-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I", freetoken.get_include(),
                            str(src), "-o", str(exe)], capture_output=True, text=True)
    assert built.returncode == 0, f"handoff.h does not compile against its mirror:\n{built.stderr}"
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    layout: dict[str, tuple[int, ...]] = {}
    for line in out.splitlines():
        kind, name, *values = line.split()
        layout[f"{kind} {name}"] = tuple(int(v) for v in values)
    return layout


def test_every_header_struct_has_a_mirror():
    structs = set(re.findall(r"typedef\s+struct\s+(\w+)", HEADER.read_text()))
    assert structs == set(handoff.MIRRORS)


@pytest.mark.parametrize("c_name", sorted(handoff.MIRRORS))
def test_struct_layout_matches_mirror(c_layout, c_name):
    mirror = handoff.MIRRORS[c_name]
    assert c_layout[f"struct {c_name}"] == (ctypes.sizeof(mirror), ctypes.alignment(mirror))
    assert ctypes.sizeof(mirror) == handoff.LAYOUT_SIZES[c_name]
    for field, _ in mirror._fields_:
        descriptor = getattr(mirror, field)
        assert c_layout[f"field {c_name}.{field}"] == (descriptor.offset, descriptor.size), f"{c_name}.{field}"


def test_constants_match_and_are_all_mirrored(c_layout):
    in_c = {key.split()[1]: value[0] for key, value in c_layout.items() if key.startswith("const ")}
    in_c.pop("FREETOKEN_HANDOFF_H", None)
    expected = _python_constants()
    assert sorted(set(in_c) - set(expected)) == [], "header constants without a Python mirror"
    assert sorted(set(expected) - set(in_c)) == [], "Python constants missing from the header"
    assert in_c == expected


def test_header_compiles_as_cxx17_with_its_static_asserts(tmp_path):
    if CXX is None:
        pytest.skip("no C++ compiler (set CXX)")
    src = tmp_path / "check.cpp"
    src.write_text('#include "freetoken/handoff.h"\nint main() { return sizeof(ft_task_desc) == 128 ? 0 : 1; }\n')
    built = subprocess.run([CXX, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
                            "-I", freetoken.get_include(), str(src)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
