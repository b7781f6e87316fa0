"""``freetoken bench decode --tiles KIND:FIELDS``: other tiles for the Triton kernels, for
one benchmark run (whole-model A/B runs of the tiles ``tests/gpu/tune_cold.py`` finds).

The engine's kernels read their default tiles from module constants when they launch;
this replaces fields of those constants in the benchmark's process before the engine is
built. ``KIND`` names the constants and ``FIELDS`` is ``name=value,...`` over the fields of
their dataclass (integers, 0/1 for switches), checked by its ``validate``:

* ``experts``: the per-route packed expert kernels' ``PackedConfig``
  (``moe_packed.DEFAULT_CONFIG`` and ``NVIDIA_CONFIG``);
* ``dense``: the packed dense GEMV's ``PackedLinearConfig``
  (``kernels.packed_linear.DEFAULT_CONFIG`` and ``NVIDIA_CONFIG``);
* ``dense-wide``: its tiles for matrices of ``WIDE_ROWS`` rows and more, the output head
  (``WIDE_CONFIG`` and ``NVIDIA_WIDE_CONFIG``);
* ``grouped``: the grouped prompt kernels' ``GroupedConfig`` (``moe_grouped.DEFAULT_CONFIG``);
* ``attention``: the paged decode attention's ``KernelConfig``
  (``kernels.decode_attention.DEFAULT_CONFIG`` and its tiles by batch,
  ``ONE_SEQUENCE_CONFIG`` and ``BATCH_CONFIG``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from typing import Any, Iterable

#: KIND -> (module, the constants it changes)
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "experts": ("freetoken.kernels.moe_packed", ("DEFAULT_CONFIG", "NVIDIA_CONFIG")),
    "dense": ("freetoken.kernels.packed_linear", ("DEFAULT_CONFIG", "NVIDIA_CONFIG")),
    "dense-wide": ("freetoken.kernels.packed_linear", ("WIDE_CONFIG", "NVIDIA_WIDE_CONFIG")),
    "grouped": ("freetoken.kernels.moe_grouped", ("DEFAULT_CONFIG",)),
    "attention": ("freetoken.kernels.decode_attention", ("DEFAULT_CONFIG", "ONE_SEQUENCE_CONFIG", "BATCH_CONFIG")),
}

FORMS = f"expected KIND:name=value,... with KIND one of {', '.join(KINDS)}, like experts:block_n=4,int8_dot=0"


def tiles_arg(text: str) -> tuple[str, dict[str, int]]:
    """``--tiles`` as (kind, {field: integer}); the field names are checked when applied."""
    kind, sep, spec = str(text).strip().partition(":")
    if not sep or kind not in KINDS or not spec.strip():
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: {FORMS}")
    fields: dict[str, int] = {}
    for item in spec.split(","):
        name, eq, value = (p.strip() for p in item.partition("="))
        if not name or not eq or not value.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {item.strip()!r} is not name=integer; {FORMS}")
        fields[name] = int(value)
    return kind, fields


def with_fields(config: Any, fields: dict[str, int], what: str) -> Any:
    """``config`` (a frozen tile dataclass with ``validate``) with ``fields`` replaced (bool
    fields from 0/1); ValueError naming ``what`` and the dataclass's fields otherwise."""
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{what}: no field {', '.join(unknown)} in {type(config).__name__} "
                         f"(fields: {', '.join(sorted(known))})")
    changes = {k: bool(v) if isinstance(getattr(config, k), bool) else v for k, v in fields.items()}
    out = dataclasses.replace(config, **changes)
    try:
        out.validate()
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return out


def apply_tiles(specs: Iterable[tuple[str, dict[str, int]]]) -> dict[str, dict[str, Any]]:
    """Replace the fields of each ``(kind, fields)`` in its constants (later specs of the same
    kind add to earlier ones); returns ``{"KIND": {"CONSTANT": its fields as now}}``. Imports
    triton (through the kernel modules)."""
    applied: dict[str, dict[str, Any]] = {}
    for kind, fields in specs:
        module_name, names = KINDS[kind]
        module = importlib.import_module(module_name)
        for name in names:
            new = with_fields(getattr(module, name), fields, f"--tiles {kind}")
            setattr(module, name, new)
            applied.setdefault(kind, {})[name] = dataclasses.asdict(new)
    return applied
