"""Where a hybrid decode step's time goes, from the CPU coordinator's hand-off trace.

The coordinator records every hand-off it serves (claim, run end, done on the host clock)
with the KernelIO kernels' GPU clock stamps (publish entry, ready, done seen, y read).
:func:`split_trace` turns a trace of consecutive layers into the stages of one layer:
the CPU task as served and the GPU side between two layers' CPU tasks, split exactly
where the stamps allow (the offset between the GPU and host clocks cancels in the sums).
"""

from __future__ import annotations

import statistics
from typing import Any


def split_trace(trace: list[Any], order: dict[int, int], step_us: float, key: str) -> dict[str, float]:
    """Stage medians (us) of a coordinator trace (``ServeRecord``s). ``order`` maps a task's
    descriptor address to its layer's position (consecutive integers in step order; other
    tasks are ignored), ``step_us`` is the mean step time of the traced block.

    ``{key}_serve``: claim -> done (the CPU task with the pool's wake-up);
    ``{key}_overhead_vs_serve``: the mean layer time minus the mean serve;
    ``{key}_gpu_gap``: done of layer l -> claim of layer l+1 in a step, split with the GPU
    stamps into ``combine_read`` (GPU saw done -> y read and added), ``kernel_boundary``
    (-> the next publish kernel's entry: the dense work of the next layer and the kernel
    launches), ``publish_body`` (route split, x/ids/w stores) and ``signal_latency``
    (ready reaching the CPU plus done reaching the GPU); ``{key}_step_gap``: the gap across
    a step boundary (the rest of the model, the output head, sampling, the host's step), with
    its ``step_signal_latency`` (the last layer's done reaching the GPU plus the next step's
    first ready reaching the CPU: a coordinator asleep across the boundary shows here) and
    ``first_serve``, the serve of each step's first CPU layer (its workers woken, if asleep).

    Where a few slow steps come from: ``{key}_{serve,gpu_gap,step_gap}_above_median_ms``,
    the time of each kind above its median summed over the trace (a stalled CPU task, a slow
    GPU side, a slow step boundary), and ``{key}_{...}_max`` the slowest one (us).
    """
    trace = [r for r in trace if r.desc in order]
    serve = [(r.done_ns - r.claim_ns) / 1e3 for r in trace]
    # the combine stamps of record i arrive with the next hand-off on the same slot
    after: dict[int, Any] = {}
    last_on_slot: dict[int, int] = {}
    for i, r in enumerate(trace):
        if r.desc in last_on_slot and r.gpu_prev_done_seen_ns:
            after[last_on_slot[r.desc]] = r
        last_on_slot[r.desc] = i
    parts: dict[str, list[float]] = {n: [] for n in ("gpu_gap", "step_gap", "combine_read", "kernel_boundary",
                                                      "publish_body", "signal_latency", "step_signal_latency",
                                                      "first_serve")}  # fmt: skip
    for i in range(1, len(trace)):
        prev, cur = trace[i - 1], trace[i]
        gap = (cur.claim_ns - prev.done_ns) / 1e3
        nxt = after.get(i - 1)
        boundary = order[cur.desc] != order[prev.desc] + 1  # cur is a step's first CPU layer
        parts["step_gap" if boundary else "gpu_gap"].append(gap)
        if boundary:
            parts["first_serve"].append((cur.done_ns - cur.claim_ns) / 1e3)
        if nxt is None or not cur.gpu_ready_ns:
            continue
        seen = nxt.gpu_prev_done_seen_ns
        parts["step_signal_latency" if boundary else "signal_latency"].append(
            ((cur.claim_ns - cur.gpu_ready_ns) + (seen - prev.done_ns)) / 1e3)
        if boundary:
            continue
        y_read = nxt.gpu_prev_y_read_ns
        parts["combine_read"].append((y_read - seen) / 1e3)
        parts["kernel_boundary"].append((cur.gpu_publish_start_ns - y_read) / 1e3)
        parts["publish_body"].append((cur.gpu_ready_ns - cur.gpu_publish_start_ns) / 1e3)
    layer_us = step_us / len(order)
    out: dict[str, float] = {f"{key}_traced_latency": layer_us}
    if serve:
        out[f"{key}_serve"] = statistics.median(serve)
        # the layer latency is a mean over the block, so the CPU work it holds is the mean serve
        out[f"{key}_overhead_vs_serve"] = layer_us - statistics.fmean(serve)
    out.update({f"{key}_{name}": statistics.median(v) for name, v in parts.items() if v})
    for name, v in (("serve", serve), ("gpu_gap", parts["gpu_gap"]), ("step_gap", parts["step_gap"])):
        if v:
            mid = statistics.median(v)
            out[f"{key}_{name}_above_median_ms"] = sum(max(0.0, x - mid) for x in v) / 1e3
            out[f"{key}_{name}_max"] = max(v)
    return out
