"""The global expert cache's policy on the host "device" (CPU tensors, synchronous copies):
slot tables on the device equal the host's bookkeeping, every cached slot holds the bytes
of the expert its table entry names, the replacement follows the heat policy (decayed route
counts, hottest uncached against coldest cached with hysteresis) written out independently,
it settles on the most routed experts of a skewed distribution and stops copying under
uniform routing, at most ``max_fetch`` experts per layer and step are fetched, an expert is
in no table while its slot is being written, and the GPU side of a cached layer computes what an independent
float64 reference computes for the routes it serves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.handoff import Fmt
from freetoken.loading.tensors import RawTensor
from freetoken.moe.experts import expert_cache
from freetoken.moe.experts.copy_queue import CopyQueue
from freetoken.moe.experts.expert_cache import ExpertCache
from freetoken.models.moe_layer import ExpertWeights
from freetoken.moe.handoff.moe_stats import MoEStats, distinct_per_row

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


def test_fetch_replaces_the_coldest_and_is_bounded(copies):
    cache, weights = make(copies, layers=2, slots=4, max_fetch=1)  # rows hold experts {0,1} and {0,1}
    # step 1 (15 tokens): row 0 routes expert 0 (hit) and misses 5 fifteen times and 6 once;
    # row 1 routes expert 1 (hit)
    ids = np.array([[[0, 5]] * 14 + [[6, 5]], [[1, -1]] * 15], dtype=np.int32)
    hit = cache.after_step(ids)
    assert hit[0, :, 0].tolist() == [True] * 14 + [False] and not hit[0, :, 1].any()
    assert hit[1, :, 0].all() and not hit[1, :, 1].any()
    # max_fetch=1: the hottest miss of row 0 (expert 5, heat 15 against 0: beyond 3 sqrt(15) + 2)
    assert cache.fetched_experts == 1
    f = cache.pending[0]
    assert (f.row, f.expert) == (0, 5)
    # the victim was a coldest slot (heat 0: row 0 expert 1 in slot 1, row 1 expert 0 in
    # slot 2; ties: the lower slot); it left the tables before its slot was written
    assert f.slot == 1 and cache.host_slot[0, 1] == -1 and cache.host_slot[1, 0] == 2
    assert cache.host_slot[0, 5] == -1 and not cache.resident[0, 5]
    settle(cache, copies)
    assert cache.host_slot[0, 5] == 1 and bool(cache.resident[0, 5])
    check_consistent(cache, weights)
    # step 2: expert 5 of row 0 now hits; expert 6 (heat ~1) is not hot enough to replace
    # anything, not even an expert never routed (the difference is within the noise)
    hit = cache.after_step(np.array([[[5, 0]], [[1, 1]]], dtype=np.int32))
    assert hit.all()
    assert cache.fetched_experts == 1


def test_churn_keeps_tables_consistent(copies, monkeypatch):
    from freetoken.moe.experts import expert_cache as ec

    monkeypatch.setattr(ec, "FETCH_Z", 0.0)  # restless: uniform routes keep replacing slots
    monkeypatch.setattr(ec, "FETCH_MARGIN", 0.0)
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


class HeatModel:
    """The replacement policy written out one route at a time: every route adds one to its
    expert's count for the step, the heat is multiplied by 2^(-1/half-life) each step before
    the counts are added; each row proposes its ``max_fetch`` hottest experts that are not
    cached and not being written (heat > 0); the proposals, hottest first (ties: row, then
    id), take the coldest slots not being written (an empty slot first; ties: the lower
    slot) as long as the proposal's heat h and the victim's v have h - v >= z sqrt(h + v) +
    margin; a fetched slot joins the tables when its copy ends."""

    def __init__(self, cache, ec):
        pool = cache.pools[0]
        self.ec = ec
        self.rows, self.E = cache.heat.shape
        self.max_fetch = cache.max_fetch
        self.owner = {s: tuple(int(v) for v in pool.owner[s]) for s in range(pool.slots)}
        self.heat = {(r, e): 0.0 for r in range(self.rows) for e in range(self.E)}
        self.filling: dict[int, tuple[int, int]] = {}

    def where(self, row, expert):
        return next((s for s, o in self.owner.items() if o == (row, expert)), None)

    def land(self):  # the copies ended: fetched slots join the tables
        for s, (row, expert) in self.filling.items():
            self.owner[s] = (row, expert)
        self.filling = {}

    def step(self, ids):
        hit = np.zeros(ids.shape, dtype=bool)
        counts = {}
        for idx in np.ndindex(ids.shape):
            e = int(ids[idx])
            if e >= 0:
                hit[idx] = self.where(idx[0], e) is not None
                counts[(idx[0], e)] = counts.get((idx[0], e), 0) + 1
        decay = 0.5 ** (1.0 / self.ec.HEAT_HALF_LIFE)
        for key in self.heat:
            self.heat[key] = self.heat[key] * decay + counts.get(key, 0)
        busy = set(self.filling.values())
        proposals = []
        for row in range(self.rows):
            free = [(self.heat[(row, e)], e) for e in range(self.E)
                    if self.where(row, e) is None and (row, e) not in busy and self.heat[(row, e)] > 0]
            free.sort(key=lambda c: (-c[0], c[1]))
            proposals += [(h, row, e) for h, e in free[: self.max_fetch]]
        proposals.sort(key=lambda c: (-c[0], c[1], c[2]))

        def cold(s):
            o = self.owner[s]
            return self.heat[o] if o[0] >= 0 else float("-inf")

        victims = sorted((s for s in self.owner if s not in self.filling), key=lambda s: (cold(s), s))
        for (h, row, e), s in zip(proposals, victims):
            v = cold(s)
            if v > float("-inf") and h - v < self.ec.FETCH_Z * (h + v) ** 0.5 + self.ec.FETCH_MARGIN:
                break
            self.owner[s] = (-1, -1)
            self.filling[s] = (row, e)
        return hit


@pytest.mark.parametrize("max_fetch,slots,tokens", [(1, 5, 1), (2, 7, 2), (3, 9, 3)])
def test_fetches_follow_the_heat_policy_written_out(copies, max_fetch, slots, tokens):
    from freetoken.moe.experts import expert_cache as ec

    cache, weights = make(copies, layers=3, slots=slots, max_fetch=max_fetch)
    model = HeatModel(cache, ec)
    rng = np.random.default_rng(slots)
    p = rng.dirichlet(np.full(E, 0.5), size=3)  # a skewed distribution per row: fetches happen
    fetched = 0
    for step in range(60):
        ids = np.stack([rng.choice(E, size=(tokens, K), p=p[r]) for r in range(3)]).astype(np.int32)
        ids[rng.random(ids.shape) < 0.1] = -1
        want = model.step(ids)
        assert (cache.after_step(ids) == want).all()
        if step % 4 != 3:  # copies land between most steps; sometimes a step passes with them in flight
            settle(cache, copies)
            model.land()
        table = {(r, e): int(cache.host_slot[r, e]) for r in range(3) for e in range(E) if cache.host_slot[r, e] >= 0}
        assert table == {o: s for s, o in model.owner.items() if o[0] >= 0}
        assert sorted(f.slot for f in cache.pending) == sorted(model.filling)
        fetched = cache.fetched_experts
    assert fetched > 0
    settle(cache, copies)
    check_consistent(cache, weights)


def test_settles_on_the_most_routed_experts_and_stops_under_uniform_routing(copies):
    """A skewed stationary distribution: the cache ends up holding (nearly) the experts a
    frequency oracle would pick and the hit rate rises well above the initial fill's; uniform
    routing: after the heat has built up, (almost) nothing is copied any more."""
    rows, slots, steps = 3, 12, 1500
    cache, weights = make(copies, layers=rows, slots=slots, max_fetch=1)
    rng = np.random.default_rng(7)
    p = np.stack([rng.permutation(np.exp(-0.6 * np.arange(E))) for _ in range(rows)])
    p /= p.sum(axis=1, keepdims=True)
    static_hit = float(np.mean([p[r, cache.host_slot[r] >= 0].sum() for r in range(rows)]))  # the initial fill's
    hits, fetches = [], []
    for step in range(steps):
        ids = np.stack([rng.choice(E, size=(1, K), p=p[r]) for r in range(rows)]).astype(np.int32)
        before = cache.fetched_experts
        hits.append(cache.after_step(ids).mean())
        fetches.append(cache.fetched_experts - before)
        settle(cache, copies)
    d = cache.describe()  # the report's window: the fetches of the last RECENT_STEPS steps
    assert (d["decode_steps"], d["recent_steps"]) == (steps, expert_cache.RECENT_STEPS)
    assert d["fetched_experts_recent"] == sum(fetches[-expert_cache.RECENT_STEPS:])
    assert sum(fetches) > d["fetched_experts_recent"]  # the learning's fetches are outside it
    oracle = np.argsort(-p, axis=None)[:slots]  # the globally most routed (row, expert) pairs
    oracle_hit = p.reshape(-1)[oracle].sum() / rows
    held = {(r, e) for r in range(rows) for e in range(E) if cache.host_slot[r, e] >= 0}
    assert len(held & {(int(i) // E, int(i) % E) for i in oracle}) >= slots - 2
    late = float(np.mean(hits[-500:]))
    assert oracle_hit - static_hit > 0.2  # the initial fill leaves room to gain
    assert late > oracle_hit - 0.06, (static_hit, late, oracle_hit)
    check_consistent(cache, weights)

    cache, weights = make(copies, layers=rows, slots=slots, max_fetch=2)
    counts = []
    for step in range(steps):
        before = cache.fetched_experts
        cache.after_step(rng.integers(0, E, size=(rows, 1, K)).astype(np.int32))
        settle(cache, copies)
        counts.append(cache.fetched_experts - before)
    # the same heat with no hysteresis (FETCH_Z = FETCH_MARGIN = 0) copies ~0.3 experts per step here
    assert sum(counts[-500:]) <= 0.05 * 500, sum(counts[-500:])
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
