"""Continuous batching with chunked prefill over the paged KV cache.

Each step: every running request that is decoding computes one token; prompts
(of new or partly prefilled requests) share a budget of ``prefill_chunk`` tokens,
so a long prompt is spread over several steps instead of stalling the decodes.
Requests join (from the waiting queue) and leave (finished/aborted) between steps.
When the cache runs out of blocks, the most recently admitted request is preempted:
its blocks are released and it is recomputed later from its tokens.

Blocks come from the :class:`~freetoken.engine.prefix_cache.PrefixCache`. At admission a
request attaches the longest cached prefix of its tokens and computes only the rest;
after each step the full blocks it has computed are registered for later requests.
Releasing a request's blocks (finish, abort, preemption) drops its references: a block
another request still uses is never freed.

Models with linear-attention layers also give each running request a recurrent-state slot
(:class:`~freetoken.engine.recurrent_state.RecurrentStatePool`): taken, zeroed, when the
request is admitted and released with its blocks.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Optional

from freetoken.engine.prefix_cache import PrefixCache
from freetoken.engine.recurrent_state import RecurrentStatePool
from freetoken.engine.request import Request, Status

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Scheduled:
    request: Request
    num_tokens: int  # tokens computed this step
    sample: bool  # the chunk reaches the end: sample the next token


class Scheduler:
    def __init__(self, cache: PrefixCache, max_running: int, prefill_chunk: int,
                 states: Optional[RecurrentStatePool] = None) -> None:  # fmt: skip
        self.cache = cache
        self.states = states
        self.block_size = cache.block_size
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens of first admissions (looked up in the prefix cache)
        self.prefix_hits = 0  # of those, tokens found cached

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Optional[Request]:
        for r in self.running:
            if r.request_id == request_id:
                return r
        for r in self.waiting:
            if r.request_id == request_id:
                return r
        return None

    def remove(self, req: Request) -> None:
        """Take a finished or aborted request out and release its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.release(req)

    def release(self, req: Request) -> None:
        """Drop a request's KV blocks and its recurrent-state slot."""
        self.cache.release(req.reset_blocks())
        if req.state_slot is not None and self.states is not None:
            self.states.free(req.state_slot)
        req.state_slot = None

    def computed(self, batch: list[Scheduled]) -> None:
        """After a step (``num_computed`` advanced): register the full blocks it completed."""
        for s in batch:
            self.cache.register(s.request)

    def reserve(self, req: Request, tokens: int) -> bool:
        """Blocks for ``tokens`` of a running request, outside :meth:`schedule` (a step the
        engine launches ahead); False, and nothing taken, when the cache has too few."""
        return self._grow(req, tokens)

    def _grow(self, req: Request, tokens: int) -> bool:
        need = (tokens + self.block_size - 1) // self.block_size - len(req.blocks)
        if need <= 0:
            return True
        if need > self.cache.num_available:
            return False
        req.blocks.extend(self.cache.allocate(need))
        return True

    def _admit(self, req: Request, budget: int) -> int:
        """Attach the request's cached prefix and allocate blocks for its next chunk;
        returns the chunk's tokens, 0 (nothing attached) if the blocks are not there."""
        if self.states is not None and req.state_slot is None:
            if self.states.free_slots == 0:
                return 0
            req.state_slot = self.states.allocate()
        if not req.blocks:
            hit = self.cache.match(req)
            self.cache.attach(hit)
            req.blocks = hit
            req.num_computed = len(hit) * self.block_size
            req.num_registered = len(hit)
        n = min(req.remaining, budget)
        if not self._grow(req, req.num_computed + n):
            self.release(req)
            return 0
        if req.cached_tokens is None:
            req.cached_tokens = req.num_computed
            self.prefix_queries += len(req.prompt_ids)
            self.prefix_hits += req.num_computed
        return n

    def preempt(self, victim: Request, why: str = "KV cache full") -> None:
        """Take a running request back to the front of the waiting queue, its blocks
        released: it is recomputed from its tokens when admitted again."""
        self.running.remove(victim)
        self.release(victim)
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        logger.info("%s: preempted %s (will be recomputed)", why, victim.request_id)

    def schedule(self) -> list[Scheduled]:
        out: list[Scheduled] = []
        # 1. decodes (one token each), oldest first; preempt the newest on shortage
        i = 0
        while i < len(self.running):
            r = self.running[i]
            if r.remaining == 1:
                while not self._grow(r, r.num_tokens):
                    victim = self.running[-1]
                    self.preempt(victim)
                    if victim is r:
                        break
                if r.status == Status.RUNNING:
                    out.append(Scheduled(r, 1, True))
            i += 1
        budget = self.prefill_chunk
        # 2. running requests still in their prompt
        for r in list(self.running):
            if budget <= 0:
                break
            if r.remaining > 1:
                n = min(r.remaining, budget)
                if not self._grow(r, r.num_computed + n):
                    continue
                out.append(Scheduled(r, n, r.num_computed + n == r.num_tokens))
                budget -= n
        # 3. admit waiting requests
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            r = self.waiting[0]
            n = self._admit(r, budget)
            if n == 0:
                break
            self.waiting.popleft()
            r.status = Status.RUNNING
            self.running.append(r)
            out.append(Scheduled(r, n, r.num_computed + n == r.num_tokens))
            budget -= n
        return out
