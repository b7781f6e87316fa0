"""The expert cache, long-prompt streaming, page-locked banks and the MoE statistics on the
GPU machine, against the all-CPU placement of the same engine (every routed expert computed
by the CPU kernels through the hand-off) on the same GGUF file: the demo model's Q8_0 file,
so the cache's pool holds the file's Q8_0 blocks and the packed GPU kernels read them.

Bounds: BF16 activations, GPU arithmetic (int8 dots per 32 activations) against the CPU
kernels' own 8-bit activation rounding. Measured on the H200, already within the first 25
steps: every expert on the GPU against the all-CPU placement (then with a quarter of its
routes fetched to the GPU) up to 6.0e-2 of the logits' scale (tests/gpu/churn_spread.py),
prompts whose experts the GPU computed (streamed) against the all-CPU placement 5.2e-2. A
placement that mixes the two is held to 1e-1, up to the first differing greedy token, which
may differ from the reference's only where the reference's top-2 margin is within 2e-1
(random weights give flat logits); the comparison runs up to that point.
"""

from __future__ import annotations

import numpy as np
import pytest

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.models.demo import ensure_demo_model
from freetoken.models.moe_layer import MoELayer
from greedy_runs import check_logits, run_greedy

pytestmark = pytest.mark.gpu

#: eight requests decoded together: each compares up to its first differing greedy token, which
#: random weights' flat logits put anywhere from the first steps on; eight give the comparisons
#: a margin over their minimum of 100 positions that four did not always have
PROMPTS = [[(11 * i + 5 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((7, 45, 19, 3, 28, 11, 52, 5))]
#: one demo expert in Q8_0: 3 matrices of 256 x 256 values, 34 bytes per 32
EXPERT_BYTES = 3 * 256 * 256 * 34 // 32
TOL = 1e-1


def _engine(backend, **kw):
    return LLMEngine(EngineConfig(model=ensure_demo_model().gguf_path, max_model_len=256, kv_cache_tokens=4096,
                                  max_running_requests=len(PROMPTS), cuda_graph_max_bs=len(PROMPTS), **kw), backend=backend)


def _greedy_and_report(eng):
    """200 greedy steps of every prompt, and the session's report; the engine closed."""
    try:
        return run_greedy(eng, PROMPTS, 200), eng.session.report()
    finally:
        eng.close()


@pytest.fixture(scope="module")
def reference(backend):
    """The same GPU engine and dtype with every expert computed by the CPU workers (the
    all-CPU placement: no cache, nothing streamed); it is itself checked against the CPU
    backend by test_gpu_engine."""
    eng = _engine(backend, dtype="bfloat16", moe_cpu_layers="all", moe_stream_prefill="off", moe_locked_fetch=0)
    out = run_greedy(eng, PROMPTS, 200)
    eng.close()
    return out


def test_cache_churn_in_graphs_matches_cpu(backend, reference, monkeypatch):
    """200 decode steps per request, every layer's experts in host memory, a cache of 12 of
    the 16 experts with 2 fetches per layer and step, the fetch policy made restless (heat
    halving every step, no hysteresis: the last step's routes replace the coldest slots, as
    least recently used would): the slots change under the graphs."""
    from freetoken.moe.experts import expert_cache

    monkeypatch.setattr(expert_cache, "HEAT_HALF_LIFE", 1)
    monkeypatch.setattr(expert_cache, "FETCH_Z", 0.0)
    monkeypatch.setattr(expert_cache, "FETCH_MARGIN", 0.0)
    eng = _engine(backend, dtype="bfloat16", moe_cpu_layers="all", moe_cache_size=float(12 * EXPERT_BYTES),
                  moe_hybrid_max_fetch=2, moe_collect_stats=True, moe_stream_prefill="off", moe_locked_fetch=0)
    got, rep = _greedy_and_report(eng)
    assert rep["graphs"] is True
    assert rep["expert_cache"]["slots"] == 12 and rep["expert_cache"]["pools"][0]["formats"][0] == "packed"
    stats = rep["moe_stats"]
    assert rep["expert_cache"]["fetched_experts"] > 100, rep["expert_cache"]
    assert 0 < stats["gpu_routes"] < stats["routes"], stats
    assert check_logits(got, reference, TOL) > 100


def test_auto_cache_of_a_planned_placement_in_graphs(backend, reference, monkeypatch):
    """``--moe-cache-size auto``: a limit that holds two of the demo model's four
    expert layers and half a layer more places two, and the half layer (the KV cache given)
    becomes the expert cache; its routes run on the GPU inside the decode graphs, the outputs
    the all-CPU placement's. What lies outside torch's allocator is taken as nothing and the
    dense form and prompt chunk are fixed, so that the limit's arithmetic is exact."""
    from freetoken.moe.session.gpu_memory_plan import GpuMemoryPlanner

    monkeypatch.setattr(GpuMemoryPlanner, "_outside_allocator", lambda self, mem: 0)
    kw = dict(dtype="bfloat16", moe_stream_prefill="off", moe_locked_fetch=0, moe_collect_stats=True,
              gpu_dense="dequantized", gpu_embedding="device", prefill_chunk=256)
    probe = _engine(backend, gpu_memory_limit=16 << 30, moe_cache_size=0.0, **kw)
    sizes, kv = probe.session.report()["memory_plan"], probe.kv.bytes
    probe.close()
    assert sizes["cpu_layers"] == "none" and sizes["expert_layer_bytes"] == 16 * EXPERT_BYTES
    limit = sizes["reserve"] + sizes["dense"] + kv + 5 * sizes["expert_layer_bytes"] // 2
    eng = _engine(backend, gpu_memory_limit=limit, moe_cache_size="auto", **kw)
    got, rep = _greedy_and_report(eng)
    plan = rep["memory_plan"]
    assert (plan["gpu_layers"], plan["cpu_layers"], plan["cache_auto"]) == (2, "0-1", True)
    spare = limit - plan["reserve"] - plan["dense"] - plan["expert_bytes"] - kv
    assert plan["cache"] == spare // 2**20 * 2**20 > 0
    assert rep["graphs"] is True and rep["expert_cache"]["slots"] == plan["cache"] // EXPERT_BYTES
    for layer in ("0", "1"):
        per = rep["moe_stats"]["per_layer"][layer]
        assert 0 < per["gpu_routes"] < per["routes"], per
    assert check_logits(got, reference, TOL) > 100


def test_stats_equal_router_counts(backend):
    """Eager (the router's outputs are observable in Python): the statistics equal counts
    taken from the router's own outputs of the decode steps."""
    eng = _engine(backend, dtype="bfloat16", moe_cpu_layers="0-1", moe_cache_size=float(6 * EXPERT_BYTES),
                  moe_hybrid_max_fetch=1, moe_collect_stats=True, enforce_eager=True, moe_locked_fetch=0)
    steps: list[bool] = []
    routes: dict[int, list[np.ndarray]] = {}
    forward = eng.session.forward

    def traced(input_ids, positions, meta):
        steps.append(bool(meta.decode))
        return forward(input_ids, positions, meta)

    route = MoELayer.route

    def routed(self, x):
        ids, w = route(self, x)
        routes.setdefault(self.layer, []).append(ids.cpu().numpy().copy())
        return ids, w

    eng.session.forward = traced
    MoELayer.route = routed
    try:
        run_greedy(eng, PROMPTS, 30)
        stats = eng.session.report()["moe_stats"]
    finally:
        MoELayer.route = route
        eng.close()
    decode = [i for i, d in enumerate(steps) if d][:-1]  # the last step's routes are read at the next step
    assert stats["steps"] == len(decode) > 0
    for layer, calls in routes.items():
        chosen = [calls[i] for i in decode]
        per = stats["per_layer"][str(layer)]
        assert per["routes"] == sum(int((c >= 0).sum()) for c in chosen)
        assert per["active_experts"] == pytest.approx(np.mean([len(np.unique(c)) for c in chosen]))
        if layer >= 2:  # resident layers: every route on the GPU
            assert per["gpu_routes"] == per["routes"]
        else:
            assert per["gpu_routes"] + per["cpu_routes"] == per["routes"]


@pytest.mark.parametrize("cache", [0, 12])
@pytest.mark.parametrize("lock", ["on", "off"])
def test_streamed_prefill_matches_cpu(backend, reference, lock, cache):
    """Every prefill chunk computes the CPU layers' experts on the GPU from streamed bytes
    (page-locked or pageable banks), window by window through a buffer of a quarter of the
    layer's experts (the default 4 windows); decode steps hand off to the CPU as usual. With an
    expert cache (12 of 16 experts, 1 fetch per layer and step) the chunks' routes to
    cached experts run on the cache's slots and only the others are copied."""
    extra = {"moe_cache_size": float(cache * EXPERT_BYTES), "moe_hybrid_max_fetch": 1} if cache else {}
    eng = _engine(backend, dtype="bfloat16", moe_cpu_layers="all", moe_stream_prefill="on", moe_lock_host=lock,
                  **extra)
    got, rep = _greedy_and_report(eng)
    stream = rep["prefill_stream"]
    assert stream["streamed_layers"] >= 4 and stream["streamed_bytes"] > 0
    assert stream["buffer_bytes"] == 16 // 4 * EXPERT_BYTES  # the demo's 16 experts in 4 windows
    assert (rep.get("host_locked_bytes", 0) > 0) == (lock == "on")
    # page-locked (mapped) banks: the gather kernels copy the routed experts, no read-back
    assert stream["routed_copies"] == ("gather kernels" if lock == "on" else "copy engine")
    assert check_logits(got, reference, TOL) > 100


@pytest.mark.parametrize("mode", ["given", "auto"])
@pytest.mark.parametrize("cache_experts", [0, 12])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_locked_fetch_matches_cpu(backend, reference, cache_experts, eager, mode):
    """Half of each step's missed routes (at most 2 per layer) copied by the GPU from the
    page-locked, mapped host banks into device slots and computed there, beside the cache
    when there is one; ``auto``: no locked-fetch option given (the default: the start times
    a CPU layer's step with 0, 1 and 2 fetched routes and fetches the count the rule picks,
    a share of the top-k; none turns it off)."""
    given = {} if mode == "auto" else {"moe_locked_fetch": 0.5}
    eng = _engine(backend, dtype="bfloat16", moe_cpu_layers="all", moe_locked_max_fetch=2,
                  moe_cache_size=float(cache_experts * EXPERT_BYTES), moe_hybrid_max_fetch=1 if cache_experts else 0,
                  moe_collect_stats=True, moe_stream_prefill="off", enforce_eager=eager, **given)
    got, rep = _greedy_and_report(eng)
    assert rep["graphs"] is (not eager) and rep["host_locked_bytes"] > 0
    fetch = rep["locked_fetch"]
    assert check_logits(got, reference, TOL) > 100
    if mode == "auto":
        profile = fetch["profile"]
        step = {int(n): t for n, t in profile["step_us"].items()}
        assert sorted(step) == [0, 1, 2], profile
        assert profile["routes"] == min(n for n in step if step[n] <= 1.05 * min(step.values())), profile
        print("locked fetch auto:", profile)
        if profile["routes"] == 0:
            assert fetch["fraction"] == 0 and fetch["setting"].startswith("auto: off (measured"), fetch
            return
        assert (fetch["setting"], fetch["fraction"]) == ("auto: measured", profile["routes"] / 4), fetch
    else:
        assert (fetch["setting"], fetch["fraction"]) == ("given", 0.5)
    assert fetch["routes"] > 100
    assert fetch["staging_bytes"] == 2 * EXPERT_BYTES
    stats = rep["moe_stats"]
    assert 0 < stats["gpu_routes"] < stats["routes"]
