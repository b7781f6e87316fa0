"""The hand-off stage split of a coordinator trace (no GPU: a synthetic trace)."""

from __future__ import annotations

import pytest

pytest.importorskip("freetoken_cpu_moe")

from freetoken.moe.session import stage_trace  # noqa: E402


def test_split_trace_parts_add_up_to_the_gap():
    """A synthetic trace of two steps of three layers, host clock = GPU clock + 1000 ns:
    the KernelIO parts of each in-step gap add up to it exactly, whatever the offset."""
    from freetoken_cpu_moe.coordinator import ServeRecord

    offset = 1000
    recs, t = [], 10_000
    seen: dict = {}
    y_read: dict = {}
    for step in range(2):
        for layer in range(3):
            g_start = t - offset - 900  # publish entry (GPU clock)
            g_ready = g_start + 400
            late = 30_000 if layer == 0 else 0  # each step's first ready is seen 30 us late (a sleeping poll thread)
            claim = g_ready + offset + 700 + late
            done = claim + 50_000
            prev_seen = seen.get(layer, 0)
            prev_y = y_read.get(layer, 0)
            recs.append(ServeRecord(100 + layer, claim, done - 10, done, g_start, g_ready, prev_seen, prev_y))
            seen[layer] = done - offset + 1200  # GPU saw done 1.2 us later
            y_read[layer] = seen[layer] + 2000
            t = y_read[layer] + offset + 1000 + 900  # boundary 1 us, then the next publish
        t += 5000  # a step boundary
    t += 30_200  # step 2's first layer, claimed as late as step 1's and served in 60 us
    recs.append(ServeRecord(100, t, t + 60_000, t + 60_000, 0, 0, 0, 0))
    out = stage_trace.split_trace(recs, {100: 0, 101: 1, 102: 2}, step_us=330.0, key="k")
    assert out["k_serve"] == pytest.approx(50.0)
    assert out["k_traced_latency"] == pytest.approx(110.0)
    assert out["k_overhead_vs_serve"] == pytest.approx(110.0 - (6 * 50.0 + 60.0) / 7)  # the mean serve
    # in-step gap: 1.2 (done seen) + 2.0 (y read) + 1.0 (boundary) + 0.4 (publish) + 0.7 (ready seen)
    assert out["k_gpu_gap"] == pytest.approx(5.3)
    assert out["k_combine_read"] == pytest.approx(2.0)
    assert out["k_kernel_boundary"] == pytest.approx(1.0)
    assert out["k_publish_body"] == pytest.approx(0.4)
    assert out["k_signal_latency"] == pytest.approx(1.9)
    # the boundary: 5 us more of GPU work and the 30 us late claim; its signal latency is
    # 1.2 (done seen) + 0.7 + 30 (ready seen), from the stamps of the layer served next step
    assert out["k_step_gap"] == pytest.approx(40.3)
    assert out["k_step_signal_latency"] == pytest.approx(31.9)
    assert out["k_first_serve"] == pytest.approx(55.0)  # median of 50 (step 1) and 60 (step 2)
    # every in-step stage equal to its median: nothing above it; the one 60 us serve: 10 us above
    assert out["k_gpu_gap_above_median_ms"] == 0.0
    assert out["k_serve_above_median_ms"] == pytest.approx(0.01)
    assert out["k_serve_max"] == pytest.approx(60.0)


def test_split_trace_sums_the_time_above_the_median():
    """Four steps of two layers with one stalled CPU task (+4 ms) and one slow step boundary
    (+2 ms): each shows in its own kind's time above the median, nowhere else."""
    from freetoken_cpu_moe.coordinator import ServeRecord

    recs, t = [], 0
    for step in range(4):
        for layer in range(2):
            serve = 50_000 + (4_000_000 if (step, layer) == (1, 0) else 0)
            recs.append(ServeRecord(100 + layer, t, t + serve - 10, t + serve, 0, 0, 0, 0))
            t += serve + 5_000  # the GPU side between two layers: 5 us
        t += 100_000 + (2_000_000 if step == 1 else 0) - 5_000  # the step boundary: 100 us (one 2.1 ms)
    out = stage_trace.split_trace(recs, {100: 0, 101: 1}, step_us=1000.0, key="k")
    assert out["k_serve"] == pytest.approx(50.0) and out["k_serve_max"] == pytest.approx(4050.0)
    assert out["k_serve_above_median_ms"] == pytest.approx(4.0)
    assert out["k_gpu_gap"] == pytest.approx(5.0) and out["k_gpu_gap_above_median_ms"] == pytest.approx(0.0)
    assert out["k_step_gap"] == pytest.approx(100.0) and out["k_step_gap_max"] == pytest.approx(2100.0)
    assert out["k_step_gap_above_median_ms"] == pytest.approx(2.0)
    assert out["k_first_serve"] == pytest.approx(50.0)  # steps 1-3: 4050, 50, 50
    assert "k_step_signal_latency" not in out  # no GPU stamps
