"""Counters of kernels whose last program finishes the work: each program takes a count with
an atomic add after its stores, the one that takes it to the number of programs completes
the result (a top-k over every program's logits, a merge of every partition) and sets the
count back to zero for the next launch (:mod:`freetoken.kernels.dense_ops`'s fused
routing, :mod:`freetoken.kernels.decode_attention`'s merging partial programs).

The counters are int32 zeros on the device, made once per kernel and device and grown when a
launch needs more; every buffer made is kept, since a captured graph holds its address. The
launches that share a buffer run on one stream at a time, as an engine's steps do."""

from __future__ import annotations

from typing import Any

import torch

#: (kernel, device) -> the buffers made, the last the largest
_MADE: dict[tuple[str, str], list[torch.Tensor]] = {}


def zeroed_counters(kernel: str, device: Any, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 counters on ``device`` for ``kernel``'s launches: the largest
    buffer made so far, or a new one of ``max(4096, n)`` (made before any graph capture in
    practice: the first decode step runs eagerly)."""
    made = _MADE.setdefault((kernel, str(torch.device(device))), [])
    if not made or made[-1].numel() < n:
        made.append(torch.zeros(max(4096, n), dtype=torch.int32, device=device))
    return made[-1]
