"""Locked fetch inside an engine: each step's
locked routes' experts gathered from the page-locked, mapped host banks into device slots
and computed there by the packed kernels, beside the CPU workers. Without a GPU: the
fakegpu plugin (host memory is its device memory) with the kernels in Triton's interpreter,
against the same engine with every route on the CPU workers. On the H200 the same runs in
tests/gpu/test_gpu_expert_traffic.py."""

from __future__ import annotations

import pytest

from fakegpu_mapped import (EXPERT_BYTES, INTERPRET, mapped_banks_in_the_interpreter, run_demo,
                            wide_tiles_in_the_interpreter)
from greedy_runs import check_logits

PROMPTS = [[(11 * j) % 300 + 3 for j in range(5)]]
#: the GPU kernels' float32 products against the CPU kernels' 8-bit activations
TOL = 5e-2


@pytest.fixture(scope="module")
def reference():
    """The engine with every missed route on the CPU workers (shared by the tests here)."""
    return run_demo(PROMPTS, 5, moe_stream_prefill="off", moe_locked_fetch=0)[0]


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's run on the fakegpu plugin (the GPU runs the cuda one)")
@pytest.mark.parametrize("cache_experts", [0, 6], ids=["no-cache", "cache"])
def test_fakegpu_locked_fetch_copy_matches_the_cpu_workers(cache_experts, reference, monkeypatch):
    """Half of each step's missed routes, at most 2 per layer, copied into the slots and
    computed there: without a cache the first routes of the step (constant masks), beside a
    cache of 6 of the 16 experts the first missed ones (slots ranked on the device)."""
    mapped_banks_in_the_interpreter(monkeypatch)
    got, rep, _ = run_demo(PROMPTS, 5, moe_stream_prefill="off", moe_locked_fetch=0.5, moe_locked_max_fetch=2,
                           moe_cache_size=float(cache_experts * EXPERT_BYTES),
                           moe_collect_stats=True)  # fmt: skip
    fetch = rep["locked_fetch"]
    assert fetch["staging_bytes"] == 2 * EXPERT_BYTES, fetch
    assert fetch["routes"] > 0 and rep["host_locked_bytes"] > 0, rep
    assert 0 < rep["moe_stats"]["gpu_routes"] < rep["moe_stats"]["routes"], rep["moe_stats"]
    assert check_logits(got, reference, TOL) >= 5


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's run on the fakegpu plugin (the GPU runs the cuda one)")
def test_fakegpu_locked_fetch_auto(reference, monkeypatch):
    """No locked-fetch option given (``auto``), the plugin standing in for an NVIDIA device
    (the plan's device check answered as for CUDA): where the host banks cannot be mapped the
    engine runs with every missed route on the CPU and says why; where they can, the start
    times a CPU layer's step with 0, 1 and 2 fetched routes and takes the count the rule
    picks from those timings (here the interpreter's fetch is slow: none); a count of 2
    forced into the rule fetches half of the demo's 4 routes by copy."""
    from freetoken.cli.doctor import _traffic_lines
    from freetoken.kernels import availability
    from freetoken.moe.experts import locked_fetch
    from freetoken.moe.session import gpu_memory_plan

    planned = locked_fetch.planned_fraction
    monkeypatch.setattr(gpu_memory_plan, "planned_fraction", lambda f, device, ok, share: planned(f, "cuda", ok, 0.25))
    monkeypatch.setattr(availability, "default_impl", lambda device: ("triton", "the interpreter"))
    wide_tiles_in_the_interpreter(monkeypatch)
    got, rep, _ = run_demo(PROMPTS, 5, moe_stream_prefill="off")  # the plugin registers no banks
    fetch = rep["locked_fetch"]
    assert fetch["fraction"] == 0 and fetch["setting"].startswith("auto: off (the host banks could not be"), fetch
    assert "profile" not in fetch and any("locked fetch auto: off" in note for note in rep["moe_notes"]), rep
    assert check_logits(got, reference, 1e-6) >= 5  # every route on the CPU workers, as the reference
    mapped_banks_in_the_interpreter(monkeypatch)
    got, rep, _ = run_demo(PROMPTS, 5, moe_stream_prefill="off", moe_collect_stats=True)
    fetch = rep["locked_fetch"]
    profile = fetch["profile"]
    step = {int(n): t for n, t in profile["step_us"].items()}
    assert sorted(step) == [0, 1, 2], profile
    for n in step:
        assert step[n] == max(profile["cpu_us"][str(n)], profile["gpu_us"][str(n)]) > 0 or n == 0, profile
    # the fewest routes within 5% of the fastest
    assert profile["routes"] == min(n for n in step if step[n] <= 1.05 * min(step.values())), profile
    if profile["routes"]:
        assert (fetch["setting"], fetch["fraction"]) == ("auto: measured", profile["routes"] / 4), fetch
    else:
        assert fetch["fraction"] == 0 and fetch["setting"].startswith("auto: off (measured"), fetch
    assert check_logits(got, reference, TOL) >= 5
    monkeypatch.setattr(locked_fetch, "choose_fetch_routes", lambda step_us: 2)
    got, rep, _ = run_demo(PROMPTS, 5, moe_stream_prefill="off", moe_collect_stats=True)
    fetch = rep["locked_fetch"]
    assert (fetch["setting"], fetch["fraction"], fetch["profile"]["routes"]) == ("auto: measured", 0.5, 2), fetch
    lines = _traffic_lines(rep)  # what `freetoken doctor --model` prints of this report
    assert "  locked fetch (auto: measured): 0.5 of missed routes, at most 2 per layer" in lines, lines
    steps = ", ".join(f"{n}: {t}" for n, t in fetch["profile"]["step_us"].items())
    assert f"    measured at start, a CPU layer's batch-1 step in us by fetched routes: {steps}" in lines, lines
    assert fetch["staging_bytes"] == 2 * EXPERT_BYTES and fetch["routes"] > 0, fetch
    assert 0 < rep["moe_stats"]["gpu_routes"] < rep["moe_stats"]["routes"], rep["moe_stats"]
    assert check_logits(got, reference, TOL) >= 5
