"""The expert cache, long-prompt streaming and the MoE statistics through the generic GPU
session on the fakegpu plugin (host "device", simulated stream): greedy outputs equal the
cpu backend's; the statistics equal counts taken from the router's own outputs; nothing
of it exists when it is off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.backends import registry
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.sampling_params import SamplingParams
from freetoken.models.moe_layer import MoELayer

PROMPTS = [[3, 17, 99, 4, 250, 31, 8, 40, 41, 42, 43, 44], [5, 6, 7], [77] * 12]
#: the demo model's expert at float32: 3 x 256 x 256 x 4 bytes
EXPERT_BYTES = 3 * 256 * 256 * 4


@pytest.fixture(autouse=True)
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


def _run(backend: str, record_routes: bool = False, **kw):
    registry.reset()
    eng = LLMEngine(EngineConfig(backend=backend, dtype="float32", max_model_len=128, kv_cache_tokens=1024,
                                 max_running_requests=4, **kw))
    steps: list[tuple[bool, int]] = []  # (decode, tokens) per forward
    routes: dict[int, list[np.ndarray]] = {}
    if record_routes:
        forward = eng.session.forward

        def traced(input_ids, positions, meta):
            steps.append((bool(meta.decode), int(input_ids.shape[0])))
            return forward(input_ids, positions, meta)

        eng.session.forward = traced
        route = MoELayer.route

        def routed(self, x):
            ids, w = route(self, x)
            routes.setdefault(self.layer, []).append(ids.cpu().numpy().copy())
            return ids, w

        MoELayer.route = routed
    try:
        reqs = [eng.add_request(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
        while eng.has_work():
            eng.step()
        info = eng.session.report()
        traffic = eng.session.traffic if backend == "fakegpu" else None
    finally:
        if record_routes:
            MoELayer.route = route
        eng.close()
    return [r.output_ids for r in reqs], info, steps, routes, traffic


def test_cache_with_fetches_equals_cpu_backend_and_stats_count_the_router(monkeypatch):
    from freetoken.moe.experts import expert_cache

    # a restless fetch policy (heat halving each step, no hysteresis): slots change every step
    for name, value in (("HEAT_HALF_LIFE", 1), ("FETCH_Z", 0.0), ("FETCH_MARGIN", 0.0)):
        monkeypatch.setattr(expert_cache, name, value)
    want, _, _, _, _ = _run("cpu")
    got, info, steps, routes, _ = _run(
        "fakegpu", record_routes=True, moe_cpu_layers="all", moe_cache_size=float(20 * EXPERT_BYTES),
        moe_hybrid_max_fetch=2, moe_collect_stats=True, moe_stream_prefill="off")
    assert got == want
    cache = info["expert_cache"]
    assert cache["slots"] == 20 and cache["cached_experts"] <= 20
    assert cache["fetched_experts"] > 0 and cache["fetched_bytes"] == cache["fetched_experts"] * EXPERT_BYTES
    stats = info["moe_stats"]
    # the router's outputs of the decode steps (all but the last are read back: the last
    # step's routes are taken at the next step, which never comes)
    decode_calls = [i for i, (decode, _) in enumerate(steps) if decode][:-1]
    assert stats["steps"] == len(decode_calls) > 0
    for layer, calls in routes.items():
        chosen = [calls[i] for i in decode_calls]
        per = stats["per_layer"][str(layer)]
        assert per["routes"] == sum(int((c >= 0).sum()) for c in chosen)
        assert per["gpu_routes"] + per["cpu_routes"] == per["routes"]
        assert per["active_experts"] == pytest.approx(np.mean([len(np.unique(c)) for c in chosen]))
    assert 0 < stats["gpu_routes"] < stats["routes"]  # some routes hit the cache, some did not
    assert stats["miss_rate"] == pytest.approx(stats["cpu_routes"] / stats["routes"])


def test_streamed_prefill_equals_cpu_backend():
    want, _, _, _, _ = _run("cpu")
    got, info, _, _, _ = _run("fakegpu", moe_cpu_layers="all", moe_stream_prefill="on")
    assert got == want
    stream = info["prefill_stream"]
    assert stream["mode"] == "on" and stream["streamed_layers"] > 0
    assert stream["profile"]["pcie_gb_s"] > 0 and stream["profile"]["source"] == "measured"


@pytest.mark.parametrize("experts", ["routed", "all"])
def test_streamed_experts_routed_or_all(experts):
    """``routed`` copies exactly the experts each streamed chunk routes to (counted from the
    router's own outputs), ``all`` whole layers; both give the cpu backend's tokens."""
    want, _, _, _, _ = _run("cpu")
    got, info, steps, routes, _ = _run("fakegpu", record_routes=True, moe_cpu_layers="all", moe_stream_prefill="on",
                                       moe_stream_experts=experts)
    assert got == want
    stream = info["prefill_stream"]
    assert stream["experts"] == experts
    prefill_calls = [i for i, (decode, _) in enumerate(steps) if not decode]
    assert prefill_calls and stream["streamed_layers"] == len(prefill_calls) * len(routes)
    num_experts = 16  # the demo model
    if experts == "routed":
        used = sum(len(np.unique(calls[i][calls[i] >= 0])) for calls in routes.values() for i in prefill_calls)
        assert 0 < used < num_experts * stream["streamed_layers"]
        assert stream["streamed_bytes"] == used * EXPERT_BYTES
    else:
        assert stream["streamed_bytes"] == stream["streamed_layers"] * num_experts * EXPERT_BYTES


def test_threshold_given_and_measured():
    _, info, _, _, _ = _run("fakegpu", moe_cpu_layers="all", moe_stream_min_tokens=1000)
    assert info["prefill_stream"]["min_tokens"] == 1000 and info["prefill_stream"]["streamed_layers"] == 0
    _, info, _, _, _ = _run("fakegpu", moe_cpu_layers="all")
    profile = info["prefill_stream"]["profile"]
    assert profile["cpu_us_per_token"] > 0 and profile["min_tokens"] >= 2


def test_everything_off_records_nothing():
    _, info, _, _, traffic = _run("fakegpu", moe_cpu_layers="all", moe_stream_prefill="off")
    assert traffic.route_log is None and traffic.stats is None and traffic.cache is None
    assert traffic.streamer is None and traffic.copies is None
    assert not {"expert_cache", "moe_stats", "prefill_stream"} & set(info)


def test_streamed_experts_are_routed_or_all():
    """Streaming copies the routed experts (one buffer of a window) or whole layers (two
    buffers); any other way is refused by the streamer and by EngineConfig, naming the two."""
    from freetoken.moe.experts.prefill_stream import PrefillStreamer, buffer_count

    assert [buffer_count(m) for m in ("routed", "all")] == [1, 2]
    with pytest.raises(ValueError, match="expected 'routed' or 'all'"):
        PrefillStreamer({}, "cpu", torch.float32, "silu", True, None, None, experts="mapped")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="moe_stream_experts must be one of routed, all"):
        EngineConfig(moe_stream_experts="mapped")


def test_prompt_routes_reach_the_cache_heat(monkeypatch):
    """The cached layers' routes of the prompt steps, counted on the device, reach the cache
    once (at the first decode step's bookkeeping) and equal counts of the router's outputs."""
    from freetoken.moe.experts.expert_cache import ExpertCache

    seen: list[np.ndarray] = []
    observe = ExpertCache.observe

    def recording(self, counts, *args, **kw):
        seen.append(np.array(counts, copy=True))
        return observe(self, counts, *args, **kw)

    monkeypatch.setattr(ExpertCache, "observe", recording)
    _, _, steps, routes, traffic = _run(
        "fakegpu", record_routes=True, moe_cpu_layers="all", moe_cache_size=float(20 * EXPERT_BYTES),
        moe_hybrid_max_fetch=1, moe_stream_prefill="off")
    cache = traffic.cache
    prompt_calls = [i for i, (decode, _) in enumerate(steps) if not decode]
    assert prompt_calls and len(seen) >= 1
    want = np.zeros_like(seen[0])
    for layer, calls in routes.items():
        for i in prompt_calls:
            ids = calls[i].reshape(-1)
            want[cache.rows[layer]] += np.bincount(ids[ids >= 0], minlength=want.shape[1])
    # every prompt is scheduled before the first decode step here: one observation holds them all
    top_k = next(iter(routes.values()))[0].shape[1]
    assert sum(seen).tolist() == want.tolist() and want.sum() == sum(len(p) for p in PROMPTS) * top_k * len(routes)


def test_streamed_prefill_with_a_cache_copies_only_uncached_experts():
    """Streamed prompt chunks of layers with cached experts: the routes to cached experts
    run on the cache's slots and only the other routed experts are copied (counted from
    the router's own outputs and the cache's residency, which no fetch changes here); the
    tokens equal the cpu backend's."""
    want, _, _, _, _ = _run("cpu")
    got, info, steps, routes, traffic = _run(
        "fakegpu", record_routes=True, moe_cpu_layers="all", moe_stream_prefill="on",
        moe_cache_size=float(20 * EXPERT_BYTES), moe_hybrid_max_fetch=0)
    assert got == want
    cache = traffic.cache
    stream = info["prefill_stream"]
    prefill_calls = [i for i, (decode, _) in enumerate(steps) if not decode]
    assert prefill_calls and stream["streamed_layers"] == len(prefill_calls) * len(routes)
    copied = held = 0
    for layer, calls in routes.items():
        cached = set(np.flatnonzero(cache.host_slot[cache.rows[layer]] >= 0).tolist())
        for i in prefill_calls:
            used = set(np.unique(calls[i][calls[i] >= 0]).tolist())
            copied += len(used - cached)
            held += len(used & cached)
    assert held > 0 and copied > 0
    assert stream["streamed_bytes"] == copied * EXPERT_BYTES


def _limited(limit: int, **kw):
    """Greedy tokens, the report and the KV cache's bytes of a fakegpu engine under ``limit``
    (the expert cache's size ``auto`` unless ``kw`` gives one)."""
    registry.reset()
    kw.setdefault("moe_cache_size", "auto")
    eng = LLMEngine(EngineConfig(backend="fakegpu", dtype="float32", max_model_len=128, max_running_requests=4,
                                 gpu_memory_limit=limit, moe_stream_prefill="off", moe_collect_stats=True, **kw))
    try:
        reqs = [eng.add_request(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
        while eng.has_work():
            eng.step()
        return [r.output_ids for r in reqs], eng.session.report(), eng.kv.bytes
    finally:
        eng.close()


def test_auto_cache_takes_what_the_kv_cache_leaves_of_a_planned_placement():
    """``--moe-cache-size auto``: a limit that holds two of the demo model's four
    expert layers and half a layer more places two, and the half layer, less the KV cache the
    engine allocates (every running request at the full context), becomes the expert cache;
    its routes run on the device and the tokens stay the cpu backend's. No cache with a size
    of 0, with a placement given, or where the KV cache takes the rest."""
    from freetoken.moe.session.gpu_memory_plan import WORKSPACE_BYTES

    want, _, _, _, _ = _run("cpu")
    registry.reset()
    probe = LLMEngine(EngineConfig(backend="fakegpu", dtype="float32", max_model_len=128, max_running_requests=4))
    sizes = probe.session.report()["memory_plan"]  # no budget: every layer's experts on the host
    per_token = probe.kv.bytes // probe.kv.total_tokens
    probe.close()
    layer = sizes["expert_layer_bytes"]
    assert layer == 16 * EXPERT_BYTES
    # the plan's fixed part (fakegpu has nothing outside the allocator) and 2.5 layers
    fixed = WORKSPACE_BYTES + sizes["activations"] + sizes["dense"] + sizes["scratch"] + 128 * per_token
    limit = fixed + 5 * layer // 2

    got, info, kv_bytes = _limited(limit)
    plan = info["memory_plan"]
    assert (plan["gpu_layers"], plan["cpu_layers"], plan["cache_auto"]) == (2, "0-1", True)
    assert kv_bytes == 4 * 128 * per_token  # every running request at the full context
    spare = limit - plan["reserve"] - plan["dense"] - plan["expert_bytes"] - plan["scratch"] - kv_bytes
    assert plan["cache"] == spare // 2**20 * 2**20 and plan["kv_budget"] == kv_bytes
    assert plan["cache"] + plan["kv_budget"] + plan["reserve"] + plan["dense"] + plan["expert_bytes"] \
        + plan["scratch"] <= limit
    cache = info["expert_cache"]
    assert cache["slots"] == plan["cache"] // EXPERT_BYTES > 2  # more than one expert per CPU layer
    cpu_layers = [info["moe_stats"]["per_layer"][str(i)] for i in (0, 1)]
    assert all(0 < s["gpu_routes"] < s["routes"] for s in cpu_layers)  # some routes hit the cache
    assert got == want

    got, info, _ = _limited(limit, moe_cache_size=0.0)
    assert "expert_cache" not in info and info["memory_plan"]["gpu_layers"] == 2
    assert all(info["moe_stats"]["per_layer"][str(i)]["gpu_routes"] == 0 for i in (0, 1)) and got == want
    _, info, _ = _limited(limit, moe_cpu_layers="0-1")
    assert "expert_cache" not in info and not info["memory_plan"]["cache_auto"]
    # a KV cache given that takes the spare but less than an expert per CPU layer
    tokens = (spare + kv_bytes - EXPERT_BYTES) // per_token // 16 * 16
    _, info, kv_bytes = _limited(limit, kv_cache_tokens=tokens)
    assert kv_bytes == tokens * per_token and "expert_cache" not in info and info["memory_plan"]["cache"] == 0
