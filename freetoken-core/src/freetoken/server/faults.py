"""Opt-in fault injection, so tests can prove that an internal error in one request
fails only that request (500 or an error event, traceback logged), that a step running
out of memory fails only its largest request (503 naming memory), and that the server
keeps serving. Off unless the server was started with FREETOKEN_SERVER_FAULTS=1."""

from __future__ import annotations

import os
from typing import Any, Optional

from starlette.requests import Request

ENV_VAR = "FREETOKEN_SERVER_FAULTS"
HEADER = "x-freetoken-fault"


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "") == "1"


class InjectedFault(RuntimeError):
    """The internal error a test asked for."""


def step_fault(request: Request, holder: Any) -> Optional[str]:
    """The engine step fault the request's fault header names ("oom-prefill", "oom-decode":
    :mod:`freetoken.engine.step_faults`), when enabled; else None."""
    from freetoken.engine.step_faults import FAULTS

    stage = request.headers.get(HEADER)
    return stage if holder.settings.enable_fault_injection and stage in FAULTS else None


def maybe_fail(request: Request, holder: Any, stage: str) -> None:
    """Raise InjectedFault when enabled and the request's fault header names ``stage``
    ("before": before generation starts; "stream": after the first streamed chunk)."""
    if holder.settings.enable_fault_injection and request.headers.get(HEADER) == stage:
        raise InjectedFault(f"fault injected at stage {stage!r} (test hook)")
