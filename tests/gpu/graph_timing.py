"""GPU time of a call, replayed from a CUDA graph (launch overhead out of the measurement)."""

from __future__ import annotations

from typing import Callable

import torch


def graph_time_us(fn: Callable[[], object], iters: int = 200) -> float:
    """Microseconds per ``fn()``: one eager call (compiles), a graph of 10 calls captured and
    replayed ``iters`` times between CUDA events."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (iters * 10)
