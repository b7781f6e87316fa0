"""Routed prompt streaming in windows (``--moe-stream-windows``): a layer's routed experts
gathered from the page-locked, mapped host banks into a buffer of a window of experts and
computed window by window, the windows' outputs summed. Without a GPU: the fakegpu plugin
(host memory is its device memory) with the gather and grouped kernels in Triton's
interpreter, against the same engine with every prompt route on the CPU workers. On the H200
the gather path runs in tests/gpu/test_gpu_expert_traffic.py."""

from __future__ import annotations

import numpy as np
import pytest

from fakegpu_mapped import EXPERT_BYTES, INTERPRET, mapped_banks_in_the_interpreter, run_demo
from greedy_runs import check_logits

#: two prompts of 8 tokens: 64 routes per layer, which reach every window's experts in every
#: layer and leave some of the 16 experts unrouted (12 to 15 used per layer)
PROMPTS = [[(11 * j + 5 * i) % 300 + 3 for j in range(8)] for i in range(2)]
#: the GPU kernels' float32 products against the CPU kernels' 8-bit activations
TOL = 5e-2


@pytest.fixture(scope="module")
def reference():
    """The engine with every prompt route on the CPU workers (shared by both window counts)."""
    return run_demo(PROMPTS, 4, moe_stream_prefill="off")[0]


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's run on the fakegpu plugin (the GPU runs the cuda one)")
@pytest.mark.parametrize("windows", [1, 3])
def test_windowed_gather_streaming_matches_the_cpu_workers(windows, reference, monkeypatch):
    """Every prompt step streams (``--moe-stream-prefill on``) through the gather kernels in
    ``windows`` windows (3: windows of 6, 6 and 4 experts, each of them routed to in every
    layer); the buffer is one window's bytes, the copied bytes are those of the experts the
    router picked (counted from its outputs; fewer than all of them), and the tokens and
    logits match the engine whose prompt routes all run on the CPU workers."""
    from freetoken.models.moe_layer import MoELayer

    mapped_banks_in_the_interpreter(monkeypatch)
    routes: dict[int, list[np.ndarray]] = {}  # the router's own outputs of every prompt step, per layer
    route = MoELayer.route

    def recording(self, x):
        ids, w = route(self, x)
        if ids.shape[0] > 2:  # (decode steps have at most 2 tokens)
            routes.setdefault(self.layer, []).append(ids.cpu().numpy().copy())
        return ids, w

    monkeypatch.setattr(MoELayer, "route", recording)
    got, rep, traffic = run_demo(PROMPTS, 4, moe_stream_prefill="on", moe_stream_windows=windows)
    streamer = traffic.streamer
    assert streamer.gathers, "the gather path was not taken"
    window = -(-16 // windows)
    assert streamer.window == window and streamer.nbytes == window * EXPERT_BYTES
    assert rep["memory_plan"]["scratch"] == window * EXPERT_BYTES, rep["memory_plan"]
    stream = rep["prefill_stream"]
    picked = [np.unique(ids[ids >= 0]) for calls in routes.values() for ids in calls]
    for experts in picked:  # every window computes routes in every streamed layer
        assert all(((experts >= a) & (experts < a + window)).any() for a in range(0, 16, window)), experts
    used = sum(len(experts) for experts in picked)
    assert stream["streamed_layers"] == len(picked) > 0
    assert 0 < stream["streamed_bytes"] == used * EXPERT_BYTES < 16 * len(picked) * EXPERT_BYTES
    assert check_logits(got, reference, TOL) >= 4
