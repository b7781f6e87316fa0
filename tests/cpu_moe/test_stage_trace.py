"""The hand-off stage split of a coordinator trace (no GPU: a synthetic trace)."""

from __future__ import annotations

import pytest

pytest.importorskip("freetoken_cpu_moe")

from freetoken.moe import stage_trace  # noqa: E402


def test_split_trace_parts_add_up_to_the_gap():
    """A synthetic trace of two steps of three layers, host clock = GPU clock + 1000 ns:
    the KernelIO parts of each in-step gap add up to it exactly, whatever the offset."""
    from freetoken_cpu_moe.coordinator import ServeRecord

    offset = 1000
    recs, t = [], 10_000
    publish_start, ready, seen, y_read = {}, {}, {}, {}
    for step in range(2):
        for layer in range(3):
            g_start = t - offset - 900  # publish entry (GPU clock)
            g_ready = g_start + 400
            claim = g_ready + offset + 700
            done = claim + 50_000
            prev_seen = seen.get(layer, 0)
            prev_y = y_read.get(layer, 0)
            recs.append(ServeRecord(100 + layer, claim, done - 10, done, g_start, g_ready, prev_seen, prev_y))
            seen[layer] = done - offset + 1200  # GPU saw done 1.2 us later
            y_read[layer] = seen[layer] + 2000
            t = y_read[layer] + offset + 1000 + 900  # boundary 1 us, then the next publish
        t += 5000  # a step boundary
    out = stage_trace.split_trace(recs, {100: 0, 101: 1, 102: 2}, step_us=330.0, key="k")
    assert out["k_serve"] == pytest.approx(50.0)
    assert out["k_traced_latency"] == pytest.approx(110.0)
    assert out["k_overhead_vs_serve"] == pytest.approx(60.0)
    # in-step gap: 1.2 (done seen) + 2.0 (y read) + 1.0 (boundary) + 0.4 (publish) + 0.7 (ready seen)
    assert out["k_gpu_gap"] == pytest.approx(5.3)
    assert out["k_combine_read"] == pytest.approx(2.0)
    assert out["k_kernel_boundary"] == pytest.approx(1.0)
    assert out["k_publish_body"] == pytest.approx(0.4)
    assert out["k_signal_latency"] == pytest.approx(1.9)
    assert out["k_step_gap"] == pytest.approx(10.3)
