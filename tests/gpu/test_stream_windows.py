"""Routed prompt streaming in windows (``--moe-stream-windows``): a layer's routed experts
gathered from the page-locked, mapped host banks into a buffer of a window of experts and
computed window by window, the windows' outputs summed. Without a GPU: the fakegpu plugin
(host memory is its device memory) with the gather and grouped kernels in Triton's
interpreter, against the same engine with every prompt route on the CPU workers. On the H200
the gather path runs in tests/gpu/test_gpu_expert_traffic.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.backends import registry
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.models.demo import ensure_demo_model
from greedy_runs import check_logits, run_greedy

INTERPRET = not torch.cuda.is_available()
#: prompts long enough to route to most of the demo's 16 experts per layer
PROMPTS = [[(11 * j + 5 * i) % 300 + 3 for j in range(24)] for i in range(2)]
#: one demo expert in Q8_0: 3 matrices of 256 x 256 values, 34 bytes per 32
EXPERT_BYTES = 3 * 256 * 256 * 34 // 32
#: the GPU kernels' float32 products against the CPU kernels' 8-bit activations
TOL = 5e-2


def _run(**kw):
    registry.reset()
    eng = LLMEngine(EngineConfig(model=ensure_demo_model().gguf_path, backend="fakegpu", dtype="float32",
                                 max_model_len=64, kv_cache_tokens=512, max_running_requests=2,
                                 moe_cpu_layers="all", **kw))
    try:
        got = run_greedy(eng, PROMPTS, 4)
        return got, eng.session.report(), eng.session.traffic.streamer
    finally:
        eng.close()
        registry.reset()


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's run on the fakegpu plugin (the GPU runs the cuda one)")
@pytest.mark.parametrize("windows", [1, 3])
def test_windowed_gather_streaming_matches_the_cpu_workers(windows, monkeypatch):
    """Every prompt step streams (``--moe-stream-prefill on``) through the gather kernels in
    ``windows`` windows (3: windows of 6, 6 and 4 experts); the buffer
    is one window's bytes, the copied bytes are those of the experts the router picked
    (counted from its outputs), and the tokens and logits match the engine whose prompt
    routes all run on the CPU workers. The session registers host banks for CUDA/HIP devices
    only; here the fakegpu plugin's registration (mapped: the same address) is asked for
    directly."""
    from test_packed_experts import WIDE

    from freetoken.moe import gpu_experts, triton_moe_packed
    from freetoken.moe.expert_traffic import ExpertTraffic
    from freetoken.moe.host_pinning import register_banks
    from freetoken.moe.layer import MoELayer

    reference, _, _ = _run(moe_stream_prefill="off")

    def register(self, staging, wanted, mapped):
        if wanted:
            self.registration = register_banks(staging, self.cpu_layers.values(), mapped=mapped)

    monkeypatch.setattr(ExpertTraffic, "_register", register)
    monkeypatch.setattr(gpu_experts, "default_impl", lambda device: ("triton", "the interpreter"))
    monkeypatch.setattr(triton_moe_packed, "default_config", lambda device: WIDE)  # few programs to interpret
    routes: dict[int, list[np.ndarray]] = {}  # the router's own outputs of every prompt step, per layer
    route = MoELayer.route

    def recording(self, x):
        ids, w = route(self, x)
        if ids.shape[0] > 2:  # (decode steps have at most 2 tokens)
            routes.setdefault(self.layer, []).append(ids.cpu().numpy().copy())
        return ids, w

    monkeypatch.setattr(MoELayer, "route", recording)
    got, rep, streamer = _run(moe_stream_prefill="on", moe_stream_windows=windows)
    assert streamer.gathers, "the gather path was not taken"
    window = -(-16 // windows)
    assert streamer.window == window and streamer.nbytes == window * EXPERT_BYTES
    assert rep["memory_plan"]["scratch"] == window * EXPERT_BYTES, rep["memory_plan"]
    stream = rep["prefill_stream"]
    used = sum(len(np.unique(ids[ids >= 0])) for calls in routes.values() for ids in calls)
    assert stream["streamed_layers"] == sum(len(calls) for calls in routes.values()) > 0
    assert 0 < stream["streamed_bytes"] == used * EXPERT_BYTES
    assert check_logits(got, reference, TOL) >= 4
