"""Opt-in fault injection, so tests can prove that an internal error in one request
fails only that request (500 or an error event, traceback logged) and the server
keeps serving. Off unless the server was started with FREETOKEN_SERVER_FAULTS=1."""

from __future__ import annotations

import os
from typing import Any

from starlette.requests import Request

ENV_VAR = "FREETOKEN_SERVER_FAULTS"
HEADER = "x-freetoken-fault"


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "") == "1"


class InjectedFault(RuntimeError):
    """The internal error a test asked for."""


def maybe_fail(request: Request, holder: Any, stage: str) -> None:
    """Raise InjectedFault when enabled and the request's fault header names ``stage``
    ("before": before generation starts; "stream": after the first streamed chunk)."""
    if holder.settings.enable_fault_injection and request.headers.get(HEADER) == stage:
        raise InjectedFault(f"fault injected at stage {stage!r} (test hook)")
