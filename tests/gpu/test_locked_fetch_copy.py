"""Locked fetch by copy (``--moe-locked-fetch-mode copy``) inside an engine: each step's
locked routes' experts gathered from the page-locked, mapped host banks into device slots
and computed there by the packed kernels, beside the CPU workers. Without a GPU: the
fakegpu plugin (host memory is its device memory) with the kernels in Triton's interpreter,
against the same engine with every route on the CPU workers. On the H200 the same mode runs
in tests/gpu/test_gpu_expert_traffic.py."""

from __future__ import annotations

import pytest

from fakegpu_mapped import EXPERT_BYTES, INTERPRET, mapped_banks_in_the_interpreter, run_demo
from greedy_runs import check_logits

PROMPTS = [[(11 * j) % 300 + 3 for j in range(5)]]
#: the GPU kernels' float32 products against the CPU kernels' 8-bit activations
TOL = 5e-2


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's run on the fakegpu plugin (the GPU runs the cuda one)")
@pytest.mark.parametrize("cache_experts", [0, 6], ids=["no-cache", "cache"])
def test_fakegpu_locked_fetch_copy_matches_the_cpu_workers(cache_experts, monkeypatch):
    """Half of each step's missed routes, at most 2 per layer, copied into the slots and
    computed there: without a cache the first routes of the step (constant masks), beside a
    cache of 6 of the 16 experts the first missed ones (slots ranked on the device)."""
    reference, _, _ = run_demo(PROMPTS, 5, moe_stream_prefill="off")
    mapped_banks_in_the_interpreter(monkeypatch)
    got, rep, _ = run_demo(PROMPTS, 5, moe_stream_prefill="off", moe_locked_fetch=0.5, moe_locked_max_fetch=2,
                           moe_locked_fetch_mode="copy", moe_cache_size=float(cache_experts * EXPERT_BYTES),
                           moe_collect_stats=True)  # fmt: skip
    fetch = rep["locked_fetch"]
    assert fetch["mode"] == "copy" and fetch["staging_bytes"] == 2 * EXPERT_BYTES, fetch
    assert fetch["routes"] > 0 and rep["host_locked_bytes"] > 0, rep
    assert 0 < rep["moe_stats"]["gpu_routes"] < rep["moe_stats"]["routes"], rep["moe_stats"]
    assert check_logits(got, reference, TOL) >= 5
