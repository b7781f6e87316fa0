"""Opt-in fault injection for engine steps, so tests can prove that a step which runs out
of memory fails one request and the engine goes on serving the others.

A request carries a fault only when the caller asked for one (``LLMEngine.add_request(...,
fault=...)``; the server passes its ``x-freetoken-fault`` header through when started with
``FREETOKEN_SERVER_FAULTS=1``). The fault fires once, in the first step of the kind it
names, as a real allocation on the backend's device that cannot be satisfied, so the
allocator's own error travels the engine's recovery path:

* ``oom-prefill``: a step that computes prompt tokens of the request;
* ``oom-decode``: a step that decodes for the request after it has produced two tokens
  (a stream has started by then).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

FAULTS = ("oom-prefill", "oom-decode")

#: bytes no device or host has: the allocation fails at once, before touching memory
IMPOSSIBLE_BYTES = 1 << 50


def check(fault: str) -> str:
    if fault not in FAULTS:
        raise ValueError(f"unknown step fault {fault!r}; expected one of {', '.join(FAULTS)}")
    return fault


def _fires(fault: str, request: Any) -> bool:
    if fault == "oom-prefill":
        return request.num_computed < len(request.prompt_ids)
    return len(request.output_ids) >= 2


def inject(batch: Sequence[Any], device: Any) -> None:
    """Fail the step of ``batch`` (scheduled requests) if one of its requests carries a fault
    that fires now: the fault is spent, then an allocation of :data:`IMPOSSIBLE_BYTES` on
    ``device`` raises the allocator's out-of-memory error."""
    for s in batch:
        req = s.request
        if req.fault is not None and _fires(req.fault, req):
            req.fault = None
            torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8, device=device)
