"""Test-only fault injection for the hand-off paths (off unless the variable is set).

``FREETOKEN_FAULT_INJECT`` holds comma-separated rules ``PATH[@graph]:KIND``:

* ``PATH``  -- ``kernel_io``, ``copy`` or ``host_callback`` (an :class:`~freetoken.backends.handoff_io.IOPath` value)
* ``@graph``-- only in work recorded under graph capture (eager runs stay correct)
* ``KIND``  -- ``stale``   publish without storing the new activations (the CPU computes
  on the previous ones); ``nofence`` raise ``ready`` before the stores, unfenced (a race,
  which may or may not show); ``error`` raise a runtime error in the path's publish.

Example: ``FREETOKEN_FAULT_INJECT=kernel_io@graph:stale`` makes BF16 KernelIO wrong
under graph replay only, so the startup qualification must turn decode graphs off.
Every backend consults :func:`fault_for` at publish time; nothing here is used in
normal operation.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

ENV_VAR = "FREETOKEN_FAULT_INJECT"
KINDS = ("stale", "nofence", "error")
PATHS = ("kernel_io", "copy", "host_callback")


@dataclasses.dataclass(frozen=True)
class FaultRule:
    path: str
    kind: str
    graph_only: bool


class InjectedFault(RuntimeError):
    """The runtime error raised by an ``error`` fault rule."""


def parse(spec: str) -> list[FaultRule]:
    rules = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, sep, kind = item.partition(":")
        path, _, scope = where.partition("@")
        if not sep or path not in PATHS or kind not in KINDS or scope not in ("", "graph"):
            raise ValueError(
                f"{ENV_VAR}: bad rule {item!r}; expected PATH[@graph]:KIND with PATH in {PATHS} and KIND in {KINDS}"
            )
        rules.append(FaultRule(path=path, kind=kind, graph_only=scope == "graph"))
    return rules


def active_rules() -> list[FaultRule]:
    return parse(os.environ.get(ENV_VAR, ""))


def fault_for(path: str, capturing: bool) -> Optional[str]:
    """The fault kind to inject into ``path`` now (None: behave correctly)."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return None
    for rule in parse(spec):
        if rule.path == path and (capturing or not rule.graph_only):
            return rule.kind
    return None
