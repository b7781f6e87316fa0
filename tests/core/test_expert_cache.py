"""The global expert cache's policy on the host "device" (CPU tensors, synchronous copies):
slot tables on the device equal the host's bookkeeping, every cached slot holds the bytes
of the expert its table entry names, the least recently used slots are the ones replaced,
at most ``max_fetch`` experts per layer and step are fetched, an expert is in no table while
its slot is being written, and the GPU side of a cached layer computes what an independent
float64 reference computes for the routes it serves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.handoff import Fmt
from freetoken.loading.tensors import RawTensor
from freetoken.moe.copy_queue import CopyQueue
from freetoken.moe.expert_cache import ExpertCache
from freetoken.moe.layer import ExpertWeights
from freetoken.moe.moe_stats import MoEStats, distinct_per_row

E, H, I, K = 8, 32, 16, 2


def layer(seed: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    raw = [RawTensor(n, s, int(Fmt.F32), torch.randn(*s, generator=g) * 0.2)
           for n, s in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I)))]
    return ExpertWeights(*raw, num_experts=E, hidden=H, intermediate=I)


@pytest.fixture
def copies():
    q = CopyQueue("cpu")
    yield q
    q.close()


def make(copies, layers=3, slots=6, max_fetch=1):
    weights = {10 + i: layer(i) for i in range(layers)}
    per_expert = 3 * H * I * 4
    cache = ExpertCache(weights, slots * per_expert, "cpu", torch.float32, "silu", packed_ok=False, copies=copies,
                        max_fetch=max_fetch)
    return cache, weights


def settle(cache, copies):
    copies.submit([]).order_before()
    cache._commit()


def check_consistent(cache, weights):
    """Device tables == host tables; each cached expert's slot holds its weights; no slot twice."""
    assert torch.equal(cache.slot.long(), torch.from_numpy(cache.host_slot))
    assert torch.equal(cache.resident, torch.from_numpy(cache.host_slot >= 0))
    pool = cache.pools[0]
    seen = set()
    for row, lw in enumerate(weights.values()):
        for e in range(E):
            s = int(cache.host_slot[row, e])
            if s < 0:
                continue
            assert s not in seen
            seen.add(s)
            assert tuple(pool.owner[s]) == (row, e)
            assert torch.equal(pool.tensors[0][s], lw.gate.data[e]) and torch.equal(pool.tensors[2][s], lw.down.data[e])


def test_initial_fill_shares_slots_and_holds_the_weights(copies):
    cache, weights = make(copies, layers=3, slots=7)
    assert cache.slots == 7 and len(cache.pools) == 1
    assert [(cache.host_slot[r] >= 0).sum() for r in range(3)] == [3, 2, 2]
    check_consistent(cache, weights)


def test_fetch_replaces_least_recently_used_and_is_bounded(copies):
    cache, weights = make(copies, layers=2, slots=4, max_fetch=1)  # rows hold experts {0,1} and {0,1}
    # step 1: row 0 uses expert 0 (hit) and misses 5 and 6; row 1 uses expert 1 (hit)
    ids = np.array([[[0, 5], [6, 5]], [[1, -1], [1, -1]]], dtype=np.int32)
    hit = cache.after_step(ids)
    assert hit.tolist() == [[[True, False], [False, False]], [[True, False], [True, False]]]
    assert cache.fetched_experts == 1  # max_fetch=1: the most routed miss of row 0 (expert 5)
    f = cache.pending[0]
    assert (f.row, f.expert) == (0, 5)
    # the victim was the least recently used slot: row 0 expert 1 or row 1 expert 0 (both unused
    # in step 1); it left the tables before its slot was written
    assert cache.host_slot[0, 5] == -1 and not cache.resident[0, 5]
    evicted = [(r, e) for r, e in ((0, 1), (1, 0)) if cache.host_slot[r, e] == -1]
    assert len(evicted) == 1
    settle(cache, copies)
    assert cache.host_slot[0, 5] >= 0 and bool(cache.resident[0, 5])
    check_consistent(cache, weights)
    # step 2: expert 5 of row 0 now hits
    hit = cache.after_step(np.array([[[5, 0]], [[1, 1]]], dtype=np.int32))
    assert hit.all()
    assert cache.fetched_experts == 1


def test_churn_keeps_tables_consistent(copies):
    cache, weights = make(copies, layers=3, slots=5, max_fetch=2)
    rng = np.random.default_rng(0)
    for step in range(60):
        ids = rng.integers(-1, E, size=(3, 2, K)).astype(np.int32)
        cached = cache.host_slot.copy()
        fetched = cache.fetched_experts
        hit = cache.after_step(ids)
        expect = np.zeros_like(hit)
        for r in range(3):
            for t in range(2):
                for k in range(K):
                    expect[r, t, k] = ids[r, t, k] >= 0 and cached[r, ids[r, t, k]] >= 0
        assert (hit == expect).all()
        per_row = np.bincount([f.row for f in cache.pending[-(cache.fetched_experts - fetched):]]
                              if cache.fetched_experts > fetched else [], minlength=3)
        assert (per_row <= 2).all()
        for f in cache.pending:  # a slot being written is in no table
            assert cache.host_slot[f.row, f.expert] == -1 and not bool(cache.resident[f.row, f.expert])
            assert tuple(f.pool.owner[f.slot]) == (-1, -1)
        if step % 3 == 0:
            settle(cache, copies)
            check_consistent(cache, weights)
    settle(cache, copies)
    check_consistent(cache, weights)
    assert cache.fetched_bytes == cache.fetched_experts * cache.pools[0].bytes_per_expert
    assert cache.fetched_experts > 0


class LruModel:
    """The cache's replacement policy written out one route and one row at a time: hits
    touch their slot; each row in turn fetches its most missed experts (ties: the lower id),
    at most ``max_fetch``, each into the least recently used slot not being written (ties:
    the lower slot), evicting its owner; a fetched slot joins the tables when its copy ends."""

    def __init__(self, cache):
        pool = cache.pools[0]
        self.max_fetch = cache.max_fetch
        self.owner = {s: tuple(int(v) for v in pool.owner[s]) for s in range(pool.slots)}
        self.used = {s: int(pool.last_used[s]) for s in range(pool.slots)}
        self.clock = cache.clock
        self.filling: dict[int, tuple[int, int]] = {}

    def where(self, row, expert):
        return next((s for s, o in self.owner.items() if o == (row, expert)), None)

    def land(self):  # the copies ended: fetched slots join the tables
        for s, (row, expert) in self.filling.items():
            self.owner[s], self.used[s] = (row, expert), self.clock
        self.filling = {}

    def step(self, ids):
        self.clock += 1
        hit = np.zeros(ids.shape, dtype=bool)
        missed = []
        for row in range(ids.shape[0]):
            counts = {}
            for e in ids[row].reshape(-1).tolist():
                if e < 0:
                    continue
                s = self.where(row, e)
                if s is None:
                    counts[e] = counts.get(e, 0) + 1
                else:
                    self.used[s] = self.clock
            missed.append(counts)
        for idx in np.ndindex(ids.shape):
            hit[idx] = ids[idx] >= 0 and self.where(idx[0], int(ids[idx])) is not None
        for row, counts in enumerate(missed):
            for e in sorted(counts, key=lambda x: (-counts[x], x))[: self.max_fetch]:
                free = [s for s in self.used if s not in self.filling]
                if not free:
                    break
                victim = min(free, key=lambda s: (self.used[s], s))
                self.owner[victim], self.used[victim] = (-1, -1), self.clock
                self.filling[victim] = (row, e)
        return hit


@pytest.mark.parametrize("max_fetch,slots,tokens", [(1, 5, 1), (2, 7, 2), (3, 9, 3)])
def test_fetches_follow_the_lru_policy_written_out(copies, max_fetch, slots, tokens):
    cache, weights = make(copies, layers=3, slots=slots, max_fetch=max_fetch)
    model = LruModel(cache)
    rng = np.random.default_rng(slots)
    for _ in range(40):
        ids = rng.integers(-1, E, size=(3, tokens, K)).astype(np.int32)
        want = model.step(ids)
        assert (cache.after_step(ids) == want).all()
        settle(cache, copies)
        model.land()
        table = {(r, e): int(cache.host_slot[r, e]) for r in range(3) for e in range(E) if cache.host_slot[r, e] >= 0}
        assert table == {o: s for s, o in model.owner.items() if o[0] >= 0}
    check_consistent(cache, weights)


def test_cached_layer_experts_compute_the_routes_they_serve(copies):
    cache, weights = make(copies, layers=2, slots=8, max_fetch=0)  # 4 experts per layer: 0..3
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, H, generator=g)
    ids = torch.randint(0, E, (5, K), generator=g).to(torch.int32)
    w = torch.rand(5, K, generator=g)
    lw = weights[11]
    gpu_ids = torch.where(cache.resident[1][ids.long()], ids, torch.full_like(ids, -1))
    out = torch.full((5, H), float("nan"))
    cache.layer_experts(11).forward(x, gpu_ids, w, out=out)
    ref = torch.zeros(5, H, dtype=torch.float64)
    for t in range(5):
        for k in range(K):
            e = int(gpu_ids[t, k])
            if e < 0:
                continue
            xd = x[t].double()
            gg = lw.gate.data[e].double() @ xd
            uu = lw.up.data[e].double() @ xd
            ref[t] += float(w[t, k]) * (lw.down.data[e].double() @ (torch.nn.functional.silu(gg) * uu))
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_stats_counts_from_routes():
    stats = MoEStats([3, 4])
    rng = np.random.default_rng(1)
    total = np.zeros(2, dtype=np.int64)
    gpu = np.zeros(2, dtype=np.int64)
    distinct = np.zeros(2)
    for _ in range(5):
        ids = rng.integers(-1, E, size=(2, 3, K)).astype(np.int32)
        on = rng.random(ids.shape) < 0.5
        stats.add_step(ids, on)
        total += (ids >= 0).sum(axis=(1, 2))
        gpu += ((ids >= 0) & on).sum(axis=(1, 2))
        distinct += [len(set(ids[i].ravel()) - {-1}) for i in range(2)]
    snap = stats.snapshot()
    assert [snap["per_layer"][k]["routes"] for k in ("3", "4")] == total.tolist()
    assert [snap["per_layer"][k]["gpu_routes"] for k in ("3", "4")] == gpu.tolist()
    assert snap["routes"] == snap["gpu_routes"] + snap["cpu_routes"]
    assert [snap["per_layer"][k]["active_experts"] for k in ("3", "4")] == pytest.approx((distinct / 5).tolist())
    assert distinct_per_row(np.array([[3, 3, -1, 1], [-1, -1, -1, -1]])).tolist() == [2, 0]
