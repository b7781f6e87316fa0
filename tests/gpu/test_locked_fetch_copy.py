"""Locked fetch by copy (``--moe-locked-fetch-mode copy``) inside an engine: each step's
locked routes' experts gathered from the page-locked, mapped host banks into device slots
and computed there by the packed kernels, beside the CPU workers. Without a GPU: the
fakegpu plugin (host memory is its device memory) with the kernels in Triton's interpreter,
against the same engine with every route on the CPU workers. On the H200 the same mode runs
in tests/gpu/test_gpu_expert_traffic.py."""

from __future__ import annotations

import pytest
import torch

from freetoken.backends import registry
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.models.demo import ensure_demo_model
from greedy_runs import check_logits, run_greedy

INTERPRET = not torch.cuda.is_available()
PROMPTS = [[(11 * j) % 300 + 3 for j in range(5)]]
#: one demo expert in Q8_0: 3 matrices of 256 x 256 values, 34 bytes per 32
EXPERT_BYTES = 3 * 256 * 256 * 34 // 32
#: the GPU kernels' float32 products against the CPU kernels' 8-bit activations
TOL = 5e-2


def _run(**kw):
    registry.reset()
    eng = LLMEngine(EngineConfig(model=ensure_demo_model().gguf_path, backend="fakegpu", dtype="float32",
                                 max_model_len=64, kv_cache_tokens=512, max_running_requests=1,
                                 moe_cpu_layers="all", moe_stream_prefill="off", **kw))
    try:
        got = run_greedy(eng, PROMPTS, 5)
        return got, eng.session.report()
    finally:
        eng.close()
        registry.reset()


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's run on the fakegpu plugin (the GPU runs the cuda one)")
@pytest.mark.parametrize("cache_experts", [0, 6], ids=["no-cache", "cache"])
def test_fakegpu_locked_fetch_copy_matches_the_cpu_workers(cache_experts, monkeypatch):
    """Half of each step's missed routes, at most 2 per layer, copied into the slots and
    computed there: without a cache the first routes of the step (constant masks), beside a
    cache of 6 of the 16 experts the first missed ones (slots ranked on the device). The
    session registers host banks for CUDA/HIP devices only; here the fakegpu plugin's
    registration (mapped: the same address) is asked for directly."""
    from test_packed_experts import WIDE

    from freetoken.moe import gpu_experts, triton_moe_packed
    from freetoken.moe.expert_traffic import ExpertTraffic
    from freetoken.moe.host_pinning import register_banks

    reference, _ = _run()

    def register(self, staging, wanted, mapped):
        if wanted:
            self.registration = register_banks(staging, self.cpu_layers.values(), mapped=mapped)

    monkeypatch.setattr(ExpertTraffic, "_register", register)
    monkeypatch.setattr(gpu_experts, "default_impl", lambda device: ("triton", "the interpreter"))
    monkeypatch.setattr(triton_moe_packed, "default_config", lambda device: WIDE)  # few programs to interpret
    got, rep = _run(moe_locked_fetch=0.5, moe_locked_max_fetch=2, moe_locked_fetch_mode="copy",
                    moe_cache_size=float(cache_experts * EXPERT_BYTES), moe_collect_stats=True)
    fetch = rep["locked_fetch"]
    assert fetch["mode"] == "copy" and fetch["staging_bytes"] == 2 * EXPERT_BYTES, fetch
    assert fetch["routes"] > 0 and rep["host_locked_bytes"] > 0, rep
    assert 0 < rep["moe_stats"]["gpu_routes"] < rep["moe_stats"]["routes"], rep["moe_stats"]
    assert check_logits(got, reference, TOL) >= 5
