"""The global expert cache: GPU slots for experts of the CPU layers, from any layer.

Layers whose experts stay in host memory (the CPU layers) share a budget of device slots.
A route to a cached expert runs on the GPU, the others on the CPU workers, in the same
step (the hybrid executor splits them by the ``resident`` row of the layer). Slots hold
one expert each, in a pool per storage class: the checkpoint's block formats of (gate,
up, down) when the packed kernels read them (a Q4_K_M file has layers with Q4_K and with
Q6_K down projections: two pools), else the activation dtype; the budget is split between
pools in proportion to their layers' bytes.

Device tables, read by the kernels at every replay (never captured as constants): per
layer ``slot [E]`` (int32, -1 = not cached) and ``resident [E]`` (bool). Changing them
between steps keeps the decode graphs valid.

After each decode step (:meth:`ExpertCache.after_step`, on the engine thread, once the
step's routes are read back from the :class:`~freetoken.moe.handoff.moe_stats.RouteLog`):

1. every route adds one to its expert's *heat*, a route count that decays by half every
   :data:`HEAT_HALF_LIFE` steps (prompt routes, counted on the device while a prompt runs,
   are added with the weight :data:`PROMPT_WEIGHT` through :meth:`ExpertCache.observe`);
2. copies finished since the last step are committed: table entries written on the
   compute stream, so the next step uses them;
3. with ``max_fetch`` > 0, each layer's hottest experts that are not cached (at most
   ``max_fetch`` per layer) are matched, hottest first, with the pool's coldest cached
   experts (empty slots first); a pair is swapped only when the newcomer's heat exceeds the
   victim's by :data:`FETCH_Z` standard deviations of the difference of two route counts
   (Poisson: ``sqrt(h_new + h_victim)``) plus :data:`FETCH_MARGIN` routes, so experts of
   equal popularity do not chase each other through the slots on count noise (uniform
   routing settles instead of copying every step). The victims' table entries are cleared
   on the compute stream first, then the :class:`CopyQueue` copies the new bytes into the
   slots after that point, on its side stream. The current and next steps never wait for a
   copy; a slot is in no table while it is being written.

The cache starts filled: each layer gets an equal share of its pool, lowest expert ids
first (random-weight models route uniformly; real ones are then corrected by fetching).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, ClassVar, Optional

import numpy as np
import torch

from freetoken.backends.contract import on_gpu
from freetoken.moe.experts.copy_queue import CopyQueue, CopyTicket
from freetoken.moe.experts.gpu_packed_experts import PACKED_FORMATS, DequantScratch, fp8_rows_bytes, fp8_rows_fit
from freetoken.moe.experts.route_slots import route_slots
from freetoken.moe.experts.routed import GpuRoutedExperts

log = logging.getLogger(__name__)

#: decode steps after which an expert's heat (its decayed route count) has halved
HEAT_HALF_LIFE = 256
#: the report's window of recent decode steps (fetches in it: does the cache still copy?)
RECENT_STEPS = 256
#: a prompt route's share of heat against a decode route's (prompts hint at popularity;
#: the decode steps are what the cache serves)
PROMPT_WEIGHT = 0.25
#: an uncached expert of heat h replaces a cached one of heat v when
#: h - v >= FETCH_Z * sqrt(h + v) + FETCH_MARGIN: the difference is beyond the noise of two
#: route counts (hysteresis: experts of near-equal popularity stay where they are)
FETCH_Z = 3.0
FETCH_MARGIN = 2.0


@dataclasses.dataclass
class _Fetch:
    ticket: CopyTicket
    pool: "_Pool"
    slot: int
    row: int  # the layer's row in the tables
    expert: int


class _Pool:
    """``slots`` experts of one storage class on the device, and their LRU bookkeeping."""

    def __init__(self, key: tuple[Any, ...], rows: list[int], sample: Any, slots: int, device: torch.device,
                 act_dtype: torch.dtype, packed: bool) -> None:  # fmt: skip
        self.key, self.rows, self.slots, self.packed = key, rows, slots, packed
        self.row_index = np.asarray(rows, dtype=np.int64)
        self.tensors: list[torch.Tensor] = []
        self.shapes: list[tuple[int, ...]] = []
        for t in (sample.gate, sample.up, sample.down):
            if packed:
                # the file's bytes per expert; FP8 in its device rows (scales inside)
                per_expert = fp8_rows_bytes(math.prod(t.shape[1:])) if key[0] == "fp8" else t.nbytes // t.shape[0]
                self.tensors.append(torch.empty(slots, per_expert, dtype=torch.uint8, device=device))
            else:
                self.tensors.append(torch.empty(slots, *t.shape[1:], dtype=act_dtype, device=device))
            self.shapes.append(tuple(int(s) for s in t.shape[1:]))
        self.bytes_per_expert = sum(x[0].numel() * x.element_size() for x in self.tensors)
        self.owner = np.full((slots, 2), -1, dtype=np.int64)  # (row, expert) or -1 (free or being filled)
        self.filling = np.zeros(slots, dtype=bool)
        self.experts: Any = None  # the kernels' object over the pool

    @property
    def nbytes(self) -> int:
        return self.slots * self.bytes_per_expert

    def victims(self, heat: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``n`` slots not being filled, coldest first (an empty slot counts as -inf;
        ties: the lower slot), and their heat."""
        free = np.flatnonzero(~self.filling)
        if free.size == 0 or n <= 0:
            return free[:0], np.zeros(0)
        owner = self.owner[free]
        h = np.where(owner[:, 0] >= 0, heat[owner[:, 0], np.maximum(owner[:, 1], 0)], -np.inf)
        if n < free.size:  # the n coldest in O(slots), then only those sorted
            pick = np.argpartition(h, n - 1)[:n]
            pick = pick[np.lexsort((free[pick], h[pick]))]
        else:
            pick = np.lexsort((free, h))
        return free[pick], h[pick]


class ExpertCache:
    def __init__(
        self, layers: dict[int, Any], capacity: int, device: Any, act_dtype: torch.dtype, activation: str,
        packed_ok: bool, copies: CopyQueue, max_fetch: int = 0, scratch: Optional[DequantScratch] = None,
        native: Any = None,
    ) -> None:  # fmt: skip
        self.layers = dict(sorted(layers.items()))
        self.rows = {layer: i for i, layer in enumerate(self.layers)}
        self.by_row = list(self.layers.values())  # ExpertWeights in table-row order
        self.device = torch.device(device)
        self.act_dtype = act_dtype
        self.activation = activation
        self.copies = copies
        self.max_fetch = max_fetch
        self.scratch = scratch or DequantScratch()
        #: the backend's routed-expert kernels (a PackedGemv), offered to packed slots for decode
        self.native = native
        first = next(iter(self.layers.values()))
        self.num_experts = first.num_experts
        n = len(self.layers)
        self.slot = torch.full((n, self.num_experts), -1, dtype=torch.int32, device=self.device)
        self.resident = torch.zeros((n, self.num_experts), dtype=torch.bool, device=self.device)
        self.host_slot = np.full((n, self.num_experts), -1, dtype=np.int64)
        self.pool_of_row: list[_Pool] = []
        self.pools = self._make_pools(capacity, packed_ok)
        self.heat = np.zeros((n, self.num_experts))  # decayed route counts per (row, expert)
        self.decay = 0.5 ** (1.0 / HEAT_HALF_LIFE)
        self.fetching = np.zeros((n, self.num_experts), dtype=bool)
        self.pending: list[_Fetch] = []
        self.fetched_bytes = 0
        self.decode_steps = 0
        self._recent_fetches: collections.deque[int] = collections.deque(maxlen=RECENT_STEPS)
        self.fetched_experts = 0
        self._fill()

    # ---- layout ----------------------------------------------------------------------------
    def _make_pools(self, capacity: int, packed_ok: bool) -> list[_Pool]:
        groups: dict[tuple[Any, ...], list[int]] = {}
        for layer, e in self.layers.items():
            fmts = tuple(int(t.fmt) for t in (e.gate, e.up, e.down))
            if packed_ok and set(fmts) <= PACKED_FORMATS:
                key: tuple[Any, ...] = ("packed", *fmts)
            elif packed_ok and fp8_rows_fit(fmts, e.hidden, e.intermediate):
                key = ("fp8", *fmts)  # FP8 block-scaled: held in the packed kernels' rows, built at each fetch
            else:
                key = ("float",)
            groups.setdefault(key, []).append(self.rows[layer])
        elt = torch.empty((), dtype=self.act_dtype).element_size()

        def per_expert(key: tuple[Any, ...], row: int) -> int:
            e = self.by_row[row]
            if key[0] == "fp8":
                return fp8_rows_bytes(3 * e.hidden * e.intermediate)
            return e.bytes_per_expert if key[0] == "packed" else 3 * e.hidden * e.intermediate * elt

        total = sum(per_expert(k, r) * self.num_experts for k, rows in groups.items() for r in rows)
        pools: list[Optional[_Pool]] = [None] * len(self.layers)
        out = []
        for key, rows in groups.items():
            share = capacity * sum(per_expert(key, r) * self.num_experts for r in rows) / total
            slots = min(int(share // per_expert(key, rows[0])), len(rows) * self.num_experts)
            if slots <= 0:
                continue
            pool = _Pool(key, rows, self.by_row[rows[0]], slots, self.device, self.act_dtype, key[0] != "float")
            pool.experts = self._kernels(pool, self.by_row[rows[0]])
            for r in rows:
                pools[r] = pool
            out.append(pool)
        self.pool_of_row = pools  # type: ignore[assignment]
        return out

    def _kernels(self, pool: _Pool, sample: Any) -> Any:
        from freetoken.moe.experts.gpu_experts import GpuExperts

        if pool.packed:
            import dataclasses as dc

            from freetoken.kernels import moe_packed as tp
            from freetoken.moe.experts.gpu_packed_experts import PackedGpuExperts
            from freetoken.models.moe_layer import ExpertWeights

            views = tuple(t.view(-1) for t in pool.tensors)
            shaped = ExpertWeights(*(dc.replace(t, shape=(pool.slots, *t.shape[1:])) for t in
                                     (sample.gate, sample.up, sample.down)),
                                   num_experts=pool.slots, hidden=sample.hidden, intermediate=sample.intermediate)
            # GGUF blocks: decode batches run the per-route kernels, prompt-sized ones the
            # grouped kernels, which read each routed slot's blocks once; FP8 rows: every batch
            # the per-route kernels (slots are never dequantized wholesale)
            base = tp.default_config(self.device)
            config = base if pool.key[0] == "packed" else dc.replace(base, max_routes=1 << 30)
            return PackedGpuExperts.over_device_bytes(shaped, views, self.device, activation=self.activation,
                                                      config=config, large_batch="grouped", scratch=self.scratch,
                                                      native=self.native)
        return GpuExperts(*pool.tensors, activation=self.activation)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    @property
    def slots(self) -> int:
        return sum(p.slots for p in self.pools)

    # ---- the layer's GPU experts -------------------------------------------------------------
    def layer_experts(self, layer: int) -> Optional["CachedLayerExperts"]:
        row = self.rows[layer]
        pool = self.pool_of_row[row]
        return None if pool is None else CachedLayerExperts(self, row, pool)

    # ---- filling ------------------------------------------------------------------------------
    def _sources(self, pool: _Pool, row: int, expert: int) -> list[torch.Tensor]:
        e = self.by_row[row]
        out = []
        for t in (e.gate, e.up, e.down):
            one = t.raw_torch()[expert]
            if pool.packed:
                out.append(one.reshape(-1).view(torch.uint8) if one.dtype != torch.uint8 else one.reshape(-1))
            else:
                out.append(one)
        return out

    def _copy_job(self, pool: _Pool, slot: int, row: int, expert: int) -> Any:
        e = self.by_row[row]
        if pool.key[0] == "fp8":

            def rows_job() -> None:  # codes and scales copied, then laid out as the kernels' rows
                from freetoken.kernels.moe_packed import PackedStack

                for i, t in enumerate((e.gate, e.up, e.down)):
                    one = PackedStack.from_fp8(t.raw_torch()[expert:expert + 1], t.scale[expert:expert + 1],
                                               self.device)
                    pool.tensors[i][slot].copy_(one.data.reshape(-1))

            return rows_job
        if pool.packed:
            return [(pool.tensors[i][slot], src) for i, src in enumerate(self._sources(pool, row, expert))]

        def job() -> None:
            import dataclasses as dc

            from freetoken.loading.dequant import to_device_float

            for i, t in enumerate((e.gate, e.up, e.down)):
                one = dc.replace(t, shape=tuple(t.shape[1:]), data=t.raw_torch()[expert],
                                 scale=None if t.scale is None else t.scale[expert])
                pool.tensors[i][slot].copy_(to_device_float(one, self.device, self.act_dtype), non_blocking=True)

        return job

    def _fill(self) -> None:
        """Give each layer of a pool an equal share of its slots (lowest expert ids first)."""
        entries = []
        for pool in self.pools:
            per_row, extra = divmod(pool.slots, len(pool.rows))
            slot = 0
            for i, row in enumerate(pool.rows):
                for expert in range(min(self.num_experts, per_row + (1 if i < extra else 0))):
                    self.copies.submit(self._copy_job(pool, slot, row, expert), nbytes=pool.bytes_per_expert)
                    pool.owner[slot] = (row, expert)
                    self.host_slot[row, expert] = slot
                    entries.append((row, expert, slot))
                    slot += 1
        self.copies.submit([]).order_before()  # one thread, in order: every filling copy is before this
        self._write_tables(entries)

    def _write_tables(self, entries: list[tuple[int, int, int]]) -> None:
        """Write (row, expert, slot or -1) into the device tables on the current stream."""
        if not entries:
            return
        a = torch.tensor(entries, dtype=torch.int64)
        flat = a[:, 0] * self.num_experts + a[:, 1]
        if on_gpu(self.device):
            flat, slots = flat.pin_memory().to(self.device, non_blocking=True), a[:, 2].to(torch.int32).pin_memory().to(
                self.device, non_blocking=True)
        else:
            slots = a[:, 2].to(torch.int32)
        self.slot.view(-1).index_copy_(0, flat, slots)
        self.resident.view(-1).index_copy_(0, flat, slots >= 0)

    # ---- after a decode step ----------------------------------------------------------------
    def observe(self, counts: np.ndarray, weight: float = PROMPT_WEIGHT) -> None:
        """Add routes counted elsewhere (``counts [rows, E]``, a prompt's) to the heat."""
        self.heat += weight * np.asarray(counts, dtype=np.float64)

    def after_step(self, ids: np.ndarray) -> np.ndarray:
        """``ids [rows, T, K]``: the step's routes of the cached layers (in row order).
        Returns which of them ran on the GPU (bool, same shape); commits finished copies
        and starts new fetches."""
        rows, E = ids.shape[0], self.num_experts
        hit = (ids >= 0) & (self.host_slot[np.arange(rows).reshape(-1, *([1] * (ids.ndim - 1))),
                                           np.maximum(ids, 0)] >= 0)
        self._commit()
        self.decode_steps += 1
        before = self.fetched_experts
        if self.max_fetch:  # (the heat serves only the fetch decisions)
            routed = ids >= 0
            row_of = np.broadcast_to(np.arange(rows).reshape(-1, *([1] * (ids.ndim - 1))), ids.shape)[routed]
            self.heat *= self.decay
            self.heat += np.bincount(row_of * E + ids[routed], minlength=rows * E).reshape(rows, E)
            self._fetch()
        self._recent_fetches.append(self.fetched_experts - before)
        return hit

    def _commit(self) -> None:
        done, left = [], []
        finished: dict[int, bool] = {}  # a step's fetches share one ticket: asked once
        for f in self.pending:
            key = id(f.ticket)
            if key not in finished:
                finished[key] = f.ticket.done()
            (done if finished[key] else left).append(f)
        self.pending = left
        entries = []
        for f in done:
            f.pool.filling[f.slot] = False
            self.fetching[f.row, f.expert] = False
            f.pool.owner[f.slot] = (f.row, f.expert)
            self.host_slot[f.row, f.expert] = f.slot
            entries.append((f.row, f.expert, f.slot))
        self._write_tables(entries)

    def _candidates(self, rows: np.ndarray, heat: np.ndarray) -> list[tuple[float, int, int]]:
        """Per row of ``rows``, its hottest experts neither cached nor being fetched (at most
        ``max_fetch``, heat > 0) as (heat, row, expert), hottest first (ties: lower row, lower
        id); ``heat`` is those rows' heat with the others at -inf."""
        k = min(self.max_fetch, heat.shape[1])
        top = np.argpartition(-heat, k - 1, axis=1)[:, :k] if k < heat.shape[1] else \
            np.broadcast_to(np.arange(heat.shape[1]), heat.shape)
        h = np.take_along_axis(heat, top, axis=1)
        r, j = np.nonzero(h > 0)
        cands = [(float(h[a, b]), int(rows[a]), int(top[a, b])) for a, b in zip(r, j)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        return cands

    def _fetch(self) -> None:
        cached = self.host_slot >= 0
        evict: list[tuple[int, int, int]] = []
        jobs: list[tuple[_Pool, int, int, int]] = []
        for pool in self.pools:
            rows = pool.row_index
            heat = self.heat[rows]
            open_heat = np.where(cached[rows] | self.fetching[rows], -np.inf, heat)
            hottest = float(open_heat.max())
            if hottest <= 0:
                continue
            if not ((pool.owner[:, 0] < 0) & ~pool.filling).any():  # no empty slot: is any swap worth it?
                coldest = float(np.where(cached[rows], heat, np.inf).min())
                # the best pair decides: where the rule can hold at all, h - v - z sqrt(h + v)
                # grows with h and falls with v
                if hottest - coldest < FETCH_Z * math.sqrt(hottest + coldest) + FETCH_MARGIN:
                    continue
            cands = self._candidates(rows, open_heat)
            slots, cold = pool.victims(self.heat, len(cands))
            for (h, row, expert), slot, v in zip(cands, slots, cold):
                if v != -np.inf and h - v < FETCH_Z * math.sqrt(h + v) + FETCH_MARGIN:
                    break  # the rest are no hotter, the remaining victims no colder
                slot = int(slot)
                old_row, old_expert = (int(x) for x in pool.owner[slot])
                if old_row >= 0:
                    self.host_slot[old_row, old_expert] = -1
                    evict.append((old_row, old_expert, -1))
                pool.owner[slot] = (-1, -1)
                pool.filling[slot] = True
                self.fetching[row, expert] = True
                jobs.append((pool, slot, row, expert))
        if not jobs:
            return
        self._write_tables(evict)  # no kernel after this point reads the victims' slots
        # the step's fetches as one job of the copy thread and one ticket (one hand-over and
        # one end event instead of one per expert: up to layers x max_fetch a step)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        calls: list[Any] = []
        for pool, slot, row, expert in jobs:
            job = self._copy_job(pool, slot, row, expert)
            if callable(job):
                calls.append(job)
            else:
                pairs.extend(job)

        def all_fetches() -> None:
            for call in calls:
                call()
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

        nbytes = sum(pool.bytes_per_expert for pool, *_ in jobs)
        ticket = self.copies.submit(all_fetches if calls else pairs, after=self.copies.compute_event(), nbytes=nbytes)
        for pool, slot, row, expert in jobs:
            self.pending.append(_Fetch(ticket, pool, slot, row, expert))
        self.fetched_bytes += nbytes
        self.fetched_experts += len(jobs)

    def describe(self) -> dict[str, Any]:
        return {
            "bytes": self.nbytes, "slots": self.slots, "layers": len(self.layers), "max_fetch": self.max_fetch,
            "policy": {"heat_half_life_steps": HEAT_HALF_LIFE, "prompt_weight": PROMPT_WEIGHT,
                       "fetch_z": FETCH_Z, "fetch_margin": FETCH_MARGIN},
            "pools": [{"formats": list(p.key), "slots": p.slots, "layers": len(p.rows),
                       "bytes_per_expert": p.bytes_per_expert} for p in self.pools],
            "cached_experts": int((self.host_slot >= 0).sum()), "fetched_experts": self.fetched_experts,
            "decode_steps": self.decode_steps, "recent_steps": len(self._recent_fetches),
            "fetched_experts_recent": int(sum(self._recent_fetches)),
            "fetched_bytes": self.fetched_bytes, "fetches_in_flight": len(self.pending),
        }  # fmt: skip

    def close(self) -> None:
        for f in self.pending:
            try:
                f.ticket.order_before()
            except RuntimeError:
                pass
        self.pending.clear()
        self.fetching[:] = False


class CachedLayerExperts(GpuRoutedExperts):
    """One layer's GPU experts: its routes' expert ids mapped to cache slots, then the
    pool's kernels (``forward(x, gpu_ids, w, out=None)`` as GpuExperts).

    :meth:`forward_routes` takes the layer's whole routing instead: a route to an expert
    that is not cached maps to no slot, so the GPU side needs no split of its own (the
    hand-off splits by the same residency table)."""

    takes_whole_routing: ClassVar[bool] = True

    def __init__(self, cache: ExpertCache, row: int, pool: _Pool) -> None:
        self.cache, self.row, self.pool = cache, row, pool
        self.hidden = cache.by_row[row].hidden

    def forward(self, x: torch.Tensor, gpu_ids: torch.Tensor, w: torch.Tensor, out: Any = None) -> torch.Tensor:
        return self.forward_routes(x, gpu_ids, w, out)

    def forward_routes(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: Any = None) -> torch.Tensor:
        """The cached experts' share of ``ids [T, K]`` (every route; those to experts not
        cached, and ids -1, contribute nothing). Packed pools' kernels read the layer's slot
        table themselves (no mapping kernel before them)."""
        table = self.cache.slot[self.row]
        if self.pool.packed:
            return self.pool.experts.forward(x, ids, w, out, slot_table=table)
        return self.pool.experts.forward(x, route_slots(ids, table), w, out)

    def warmup(self, batch_sizes: Any, top_k: int, x_dtype: Any = None) -> None:
        table = self.cache.slot[self.row]
        if self.pool.packed:
            self.pool.experts.warmup(batch_sizes, top_k, x_dtype, slot_table=table)
        else:
            self.pool.experts.warmup(batch_sizes, top_k, x_dtype)
        for dtype in (torch.int32, torch.int64):  # routers give either: both slot kernels compiled
            route_slots(torch.zeros((1, top_k), dtype=dtype, device=table.device), table)
