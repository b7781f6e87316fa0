"""Continuous batching with chunked prefill over the paged KV cache.

Each step: every running request that is decoding computes one token; prompts
(of new or partly prefilled requests) share a budget of ``prefill_chunk`` tokens,
so a long prompt is spread over several steps instead of stalling the decodes.
Requests join (from the waiting queue) and leave (finished/aborted) between steps.
When the cache runs out of blocks, the most recently admitted request is preempted:
its blocks are freed and it is recomputed later from its tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Optional

from freetoken.engine.kv_cache import KVCache
from freetoken.engine.request import Request, Status

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Scheduled:
    request: Request
    num_tokens: int  # tokens computed this step
    sample: bool  # the chunk reaches the end: sample the next token


class Scheduler:
    def __init__(self, kv: KVCache, max_running: int, prefill_chunk: int) -> None:
        self.kv = kv
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

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
        """Take a finished or aborted request out and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.reset_blocks())

    def _grow(self, req: Request, tokens: int) -> bool:
        need = self.kv.blocks_for(tokens) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.kv.free_blocks:
            return False
        req.blocks.extend(self.kv.allocate(need))
        return True

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim.reset_blocks())
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        logger.info("KV cache full: preempted %s (will be recomputed)", victim.request_id)

    def schedule(self) -> list[Scheduled]:
        out: list[Scheduled] = []
        # 1. decodes (one token each), oldest first; preempt the newest on shortage
        i = 0
        while i < len(self.running):
            r = self.running[i]
            if r.remaining == 1:
                while not self._grow(r, r.num_tokens):
                    victim = self.running[-1]
                    self._preempt(victim)
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
            n = min(r.remaining, budget)
            if not self._grow(r, r.num_computed + n):
                break
            self.waiting.popleft()
            r.status = Status.RUNNING
            self.running.append(r)
            out.append(Scheduled(r, n, r.num_computed + n == r.num_tokens))
            budget -= n
        return out
