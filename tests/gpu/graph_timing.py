"""GPU time of a call, replayed from a CUDA graph (launch overhead out of the measurement)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def graph_sequence_time_us(calls: Sequence[Callable[[], object]], replays: int = 20) -> float:
    """Microseconds per call of ``calls``: each once eagerly (compiles), then a graph of the
    whole sequence captured and replayed ``replays`` times between CUDA events."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(calls))


def graph_time_us(fn: Callable[[], object], iters: int = 200) -> float:
    """Microseconds per ``fn()``: a graph of 10 calls replayed ``iters`` times. The same
    inputs every call: weights that fit the L2 are timed from there."""
    return graph_sequence_time_us([fn] * 10, iters)
