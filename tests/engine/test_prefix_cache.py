"""Prefix caching (freetoken.engine.prefix_cache): the reference-counted, LRU-evicting
block allocator on its own, and the engine with it on against the engine with it off."""

from __future__ import annotations

import random
import types

import pytest
import torch

from freetoken import SamplingParams
from freetoken.engine.kv_cache import KVCache, OutOfBlocks
from freetoken.engine.prefix_cache import PrefixCache
from freetoken.engine.request import Request
from helpers import LogitsRecorder, assert_close, engine_for, make_hf

BS = 4  # block size of the allocator tests


def _cache(num_blocks: int, enabled: bool = True) -> PrefixCache:
    cfg = types.SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=2)
    return PrefixCache(KVCache(cfg, num_blocks * BS, BS, torch.float32, torch.device("cpu")), enabled)


def _req(ids: list[int], name: str = "r") -> Request:
    return Request(name, ids, SamplingParams(max_tokens=1), None, [], 10_000, None)  # type: ignore[arg-type]


def _computed(cache: PrefixCache, req: Request) -> None:
    """Give the request blocks for all its tokens, as if they had been computed."""
    req.blocks = cache.allocate(cache.kv.blocks_for(req.num_tokens))
    req.num_computed = req.num_tokens
    cache.register(req)


def _check_counts(cache: PrefixCache, live: list[Request]) -> None:
    """Every block is free, cached-unreferenced or referenced by exactly its holders."""
    held: dict[int, int] = {}
    for r in live:
        for b in r.blocks:
            held[b] = held.get(b, 0) + 1
    assert held == cache.refs
    free = set(cache.kv._free)
    assert len(free) == cache.kv.free_blocks
    assert not free & set(cache.lru) and not free & set(held) and not set(cache.lru) & set(held)
    assert len(free) + len(cache.lru) + len(held) == cache.kv.num_blocks
    assert set(cache.lru) <= set(cache.key_of) and len(cache.key_of) == len(cache.by_key)


def test_shared_blocks_are_reference_counted():
    cache = _cache(8)
    a = _req(list(range(10)), "a")  # blocks: [0-3] [4-7] [8-9 partial]
    _computed(cache, a)
    assert len(cache.by_key) == 2  # the partial block is never registered
    b = _req(list(range(8)) + [50, 51, 52], "b")
    hit = cache.match(b)
    assert hit == a.blocks[:2]
    cache.attach(hit)
    b.blocks = hit + cache.allocate(1)
    assert cache.refs[a.blocks[0]] == 2 and cache.refs[a.blocks[2]] == 1
    _check_counts(cache, [a, b])
    cache.release(a.reset_blocks())  # shared blocks stay held by b; a's partial block is freed
    assert cache.refs[hit[0]] == 1 and cache.refs[hit[1]] == 1 and not cache.lru
    _check_counts(cache, [b])
    cache.release(b.reset_blocks())  # registered blocks stay cached, b's private block is freed
    assert list(cache.lru) == [hit[1], hit[0]]  # the tail is evicted before the head
    _check_counts(cache, [])
    assert cache.kv.free_blocks == 6


def test_whole_prompt_cached_still_computes_its_last_token():
    cache = _cache(8)
    a = _req(list(range(12)), "a")
    _computed(cache, a)
    assert len(cache.match(_req(list(range(12))))) == 2  # 11 tokens: two full blocks, the third is computed
    assert len(cache.match(_req(list(range(13))))) == 3
    assert cache.match(_req([99] + list(range(1, 12)))) == []  # a different first block: nothing
    # a block's key includes its whole prefix: an equal second block after another first one is no hit
    assert cache.match(_req([7, 7, 7, 7] + list(range(4, 12)))) == []


def test_lru_eviction_forgets_keys_and_prefers_free_blocks():
    cache = _cache(4)
    a, b = _req(list(range(8)), "a"), _req(list(range(100, 108)), "b")
    _computed(cache, a)
    _computed(cache, b)
    cache.release(a.reset_blocks())
    cache.release(b.reset_blocks())
    assert cache.kv.free_blocks == 0 and cache.num_available == 4 and cache.num_cached_free == 4
    # a's blocks were released first: evicted first, tail before head
    a_tail = cache.by_key[cache.keys(a, 2)[1]]
    got = cache.allocate(1)
    assert got == [a_tail] and cache.evictions == 1
    assert len(cache.match(_req(list(range(9))))) == 1  # a's first block is still there
    # using a cached block makes it recently used: the next eviction takes a's head, then b's
    hit = cache.match(_req(list(range(100, 109))))
    cache.attach(hit)
    cache.release(hit)
    c = _req(list(range(200, 208)), "c")
    c.blocks = got + cache.allocate(1)
    assert cache.match(_req(list(range(9)))) == []
    with pytest.raises(OutOfBlocks):
        cache.allocate(3)
    _check_counts(cache, [c])
    cache.release(c.reset_blocks())
    _check_counts(cache, [])


def test_free_blocks_are_used_before_cached_ones():
    cache = _cache(4)
    a = _req(list(range(8)), "a")
    _computed(cache, a)
    cache.release(a.reset_blocks())
    cache.allocate(2)
    assert cache.evictions == 0 and len(cache.match(_req(list(range(9))))) == 2


def test_duplicate_block_stays_private():
    cache = _cache(8)
    a, b = _req(list(range(8)), "a"), _req(list(range(8)), "b")
    _computed(cache, a)
    _computed(cache, b)  # computed alongside a: same keys, other blocks
    assert set(cache.by_key.values()) == set(a.blocks)
    cache.release(b.reset_blocks())
    assert cache.kv.free_blocks == 6 and not cache.lru


def test_disabled_cache_only_counts_references():
    cache = _cache(4, enabled=False)
    a = _req(list(range(8)), "a")
    _computed(cache, a)
    assert not cache.by_key and cache.match(_req(list(range(9)))) == []
    cache.release(a.reset_blocks())
    assert cache.kv.free_blocks == 4 and not cache.lru


# ------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf-prefix"))
    seed = random.randrange(1 << 30)
    make_hf(path, seed)
    return path, seed


def _run(eng, plan, steps_between: int = 2):
    """Add the requests of ``plan`` (lists of (request id, prompt, max_tokens)) wave by
    wave, ``steps_between`` steps apart, then run to the end; returns the token ids."""
    reqs = {}
    for wave in plan:
        for rid, ids, n in wave:
            reqs[rid] = eng.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                                        request_id=rid)
        for _ in range(steps_between):
            eng.step()
    while eng.has_work():
        eng.step()
    return {rid: list(r.output_ids) for rid, r in reqs.items()}


def _same_outputs(path, plan, **kw):
    outs, rows, engines = [], [], []
    for enabled in (True, False):
        eng = engine_for(path, enable_prefix_cache=enabled, **kw)
        with LogitsRecorder(eng) as rec:
            outs.append(_run(eng, plan))
        rows.append(rec.rows)
        engines.append(eng)
    assert outs[0] == outs[1]
    for rid, cached_rows in rows[0].items():
        assert len(cached_rows) == len(rows[1][rid])
        for i, (x, y) in enumerate(zip(cached_rows, rows[1][rid])):
            assert_close(x, y, f"{rid} token {i}")
    return engines


def test_second_turn_computes_only_new_tokens(checkpoint):
    path, seed = checkpoint
    rng = random.Random(seed)
    turn1 = [rng.randrange(160) for _ in range(37)]
    new = [rng.randrange(160) for _ in range(9)]
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)
    rows, computed = [], []
    for enabled in (True, False):
        eng = engine_for(path, enable_prefix_cache=enabled)
        with LogitsRecorder(eng) as rec:
            r1 = eng.add_request(turn1, params, request_id="t1")
            while eng.has_work():
                eng.step()
            turn2 = turn1 + list(r1.output_ids) + new  # the conversation so far plus the new turn
            before = eng.stats().prompt_tokens_computed
            r2 = eng.add_request(turn2, params, request_id="t2")
            while eng.has_work():
                eng.step()
        rows.append(rec.rows)
        computed.append(eng.stats().prompt_tokens_computed - before)
        if enabled:
            # turn 1 computed its prompt and 10 of its 11 tokens (47): two full blocks of 16
            assert (r1.cached_tokens, r2.cached_tokens) == (0, 32)
            stats = eng.stats()
            assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == (32, len(turn1) + len(turn2))
    assert computed == [len(turn2) - 32, len(turn2)]
    for rid in ("t1", "t2"):
        for i, (x, y) in enumerate(zip(rows[0][rid], rows[1][rid], strict=True)):
            assert_close(x, y, f"{rid} token {i}")


def test_cached_tokens_in_the_stream(checkpoint):
    path, seed = checkpoint
    rng = random.Random(seed + 1)
    eng = engine_for(path)
    prompt = [rng.randrange(160) for _ in range(40)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    deltas = []
    for rid in ("a", "b"):
        eng.add_request(prompt, params, request_id=rid)
        while eng.has_work():
            deltas += eng.step()
    assert [d.cached_tokens for d in deltas if d.request_id == "a"] == [0, 0]
    assert [d.cached_tokens for d in deltas if d.request_id == "b"] == [32, 32]


def test_mixed_batch_equals_no_prefix_cache(checkpoint):
    path, seed = checkpoint
    rng = random.Random(seed + 2)
    system = [rng.randrange(160) for _ in range(35)]

    def p(n):
        return [rng.randrange(160) for _ in range(n)]

    plan = [
        [("a", system + p(5), 6), ("b", p(20), 5)],
        [("c", system + p(12), 6), ("d", system[:16], 4), ("e", system, 5)],
        [("f", system + p(30), 3), ("g", system[:20] + p(3), 6)],
    ]
    engines = _same_outputs(path, plan, prefill_chunk=32)
    assert engines[0].stats().prefix_cache_hits > 0
    assert engines[0].stats().prompt_tokens_computed < engines[1].stats().prompt_tokens_computed


def test_preemption_equals_no_prefix_cache(checkpoint):
    """A KV cache too small for the batch forces preemption: the cached engine still
    gives the same logits, and preempted requests reattach their own cached blocks."""
    path, seed = checkpoint
    rng = random.Random(seed + 3)
    shared = [rng.randrange(160) for _ in range(24)]
    plan = [
        [(f"r{i}", shared + [rng.randrange(160) for _ in range(4 + 3 * i)], 18) for i in range(3)],
        [("late", shared + [1, 2, 3], 10)],
    ]
    cached, plain = _same_outputs(path, plan, kv_cache_tokens=112, max_model_len=96, prefill_chunk=64)
    assert cached.stats().num_preemptions > 0 and plain.stats().num_preemptions > 0
    assert cached.stats().prefix_cache_hits > 0
    assert cached.stats().kv_used_tokens == 0


def test_no_leaks_with_aborts_and_preemption(checkpoint):
    path, _ = checkpoint
    rng = random.Random(1)  # the workload (and so the preemptions) does not depend on the weights
    eng = engine_for(path, kv_cache_tokens=96, max_model_len=48, prefill_chunk=24, max_running_requests=6)
    cache = eng.prefix_cache
    prefixes = [[rng.randrange(160) for _ in range(20)] for _ in range(3)]
    live: list[str] = []
    for i in range(60):
        if rng.random() < 0.6:
            tail = [rng.randrange(160) for _ in range(rng.randrange(0, 12))]
            ids = rng.choice(prefixes)[: rng.randrange(1, 21)] + tail
            params = SamplingParams(max_tokens=rng.randrange(1, 16), temperature=0.0, ignore_eos=True)
            live.append(eng.add_request(ids, params).request_id)
        if live and rng.random() < 0.2:
            eng.abort(live.pop(rng.randrange(len(live))))
        eng.step()
        _check_counts(cache, [r for r in eng.requests.values() if r.blocks])
        live = [rid for rid in live if rid in eng.requests]
    while eng.has_work():
        eng.step()
        _check_counts(cache, [r for r in eng.requests.values() if r.blocks])
    assert eng.stats().num_preemptions > 0 and eng.stats().prefix_cache_hits > 0 and cache.evictions > 0
    assert not cache.refs and cache.kv.free_blocks + cache.num_cached_free == cache.kv.num_blocks
    stats = eng.stats()
    assert stats.kv_used_tokens == 0 and stats.kv_cached_tokens == cache.num_cached_free * cache.block_size
    # prompt_logits allocates through the cache too (evicting cached blocks when it must)
    assert eng.prompt_logits([rng.randrange(160) for _ in range(40)]).shape == (40, 160)
    _check_counts(cache, [])


def test_decode_graphs_read_shared_blocks():
    """Decode graphs (the fake GPU backend's capture, tests/qualify/fake_backend.py) over
    block tables that share cached blocks give the eager steps' logits without the cache;
    the runner's scratch block is never handed to a request."""
    import importlib.util
    from pathlib import Path

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine

    pytest.importorskip("freetoken_cpu_moe")
    spec = importlib.util.spec_from_file_location(
        "ft_prefix_fake_backend", Path(__file__).resolve().parents[1] / "qualify" / "fake_backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shared = [(5 * i + 2) % 200 for i in range(36)]
    plan = [[("a", shared + [1, 2], 5)], [("b", shared + [3], 6), ("c", shared[:20] + [4, 5], 6)]]
    outs, rows = [], []
    for enabled in (True, False):
        eng = LLMEngine(EngineConfig(dtype="float32", max_model_len=128, kv_cache_tokens=1024, max_running_requests=4,
                                     moe_cpu_layers="all", enforce_eager=not enabled, enable_prefix_cache=enabled),
                        backend=module.FakeGpuBackend())
        try:
            with LogitsRecorder(eng) as rec:
                outs.append(_run(eng, plan, steps_between=3))
            rows.append(rec.rows)
            if enabled:
                assert eng.session.runner.replays > 0 and eng.stats().prefix_cache_hits == 32 + 16
                scratch = eng.session.runner.scratch_block
                assert scratch not in eng.prefix_cache.lru and scratch not in eng.kv._free
        finally:
            eng.close()
    assert outs[0] == outs[1]
    for rid in outs[0]:
        for x, y in zip(rows[0][rid], rows[1][rid], strict=True):
            assert float((x - y).abs().max() / y.abs().max()) < 1e-5
