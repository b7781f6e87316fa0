"""Prefix caching: full KV blocks shared between requests whose token prefixes match.

Every full block of a sequence has a key: a hash of its tokens chained with the key of
the block before it, so two blocks with the same key hold the K/V of the same whole
prefix (at the same positions). Once a request has computed a full block, the block is
registered under its key; a later request whose prompt starts with the same blocks
attaches them (their reference counts go up) and computes only the rest.

Blocks are reference-counted. A block no request references goes back to the
:class:`~freetoken.engine.kv_cache.KVCache` free list, unless it is registered: then it
stays cached, unreferenced, in LRU order, and is evicted (its key forgotten) only when
an allocation finds the free list empty. Shared blocks are read-only: a request attaches
only full blocks and always computes at least its last token, so the first token it
writes goes into a block of its own. The last, partial block of a sequence is never
shared.

:class:`PrefixCache` is the allocator the scheduler uses; with ``enabled=False`` it
only counts references (nothing is registered or looked up). Blocks taken straight from
the ``KVCache`` (a session's scratch block) are never seen here.
"""

from __future__ import annotations

import array
import collections
import hashlib
from freetoken.engine.kv_cache import KVCache, OutOfBlocks
from freetoken.engine.request import Request

#: Key of the (absent) block before a sequence's first block.
ROOT_KEY = b""


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block: its tokens chained with its parent's key (128-bit BLAKE2b)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array.array("q", tokens).tobytes())
    return h.digest()


class PrefixCache:
    """Reference-counted KV blocks, registered by prefix key, with LRU eviction."""

    def __init__(self, kv: KVCache, enabled: bool = True) -> None:
        self.kv = kv
        self.enabled = enabled
        self.block_size = kv.block_size
        self.refs: dict[int, int] = {}  # block -> requests holding it (blocks handed out here)
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unreferenced; oldest first
        self.evictions = 0

    # ------------------------------------------------------------------ counts

    @property
    def num_cached_free(self) -> int:
        """Registered blocks no request references (reusable by eviction)."""
        return len(self.lru)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free plus evictable."""
        return self.kv.free_blocks + len(self.lru)

    @property
    def num_referenced(self) -> int:
        return len(self.refs)

    # -------------------------------------------------------------- allocation

    def allocate(self, n: int) -> list[int]:
        """``n`` private blocks (reference count 1): free ones first, then the least
        recently used cached ones, whose keys are forgotten."""
        if n > self.num_available:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_available} available")
        blocks = self.kv.allocate(min(n, self.kv.free_blocks))
        while len(blocks) < n:
            block, _ = self.lru.popitem(last=False)
            del self.by_key[self.key_of.pop(block)]
            self.evictions += 1
            blocks.append(block)  # holds finite K/V of its old prefix: no need to clear it
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block (a request's table, in order). A block left
        unreferenced stays cached if registered, else returns to the free list. The
        table's tail is queued for eviction before its head."""
        free: list[int] = []
        for b in reversed(blocks):
            left = self.refs[b] - 1
            if left > 0:
                self.refs[b] = left
                continue
            del self.refs[b]
            if b in self.key_of:
                self.lru[b] = None
            else:
                free.append(b)
        if free:
            self.kv.free(free[::-1])

    # ---------------------------------------------------------------- sharing

    def keys(self, req: Request, num_blocks: int) -> list[bytes]:
        """The keys of the request's first ``num_blocks`` full blocks (computed once per
        request and kept: its tokens only grow)."""
        keys = req.block_keys
        bs = self.block_size
        if len(keys) < num_blocks:
            ids = req.all_ids
            parent = keys[-1] if keys else ROOT_KEY
            for i in range(len(keys), num_blocks):
                parent = block_key(parent, ids[i * bs : (i + 1) * bs])
                keys.append(parent)
        return keys[:num_blocks]

    def match(self, req: Request) -> list[int]:
        """The cached blocks of the request's longest cached prefix, leaving at least its
        last token to compute (that step gives the logits)."""
        if not self.enabled:
            return []
        found: list[int] = []
        for key in self.keys(req, (req.num_tokens - 1) // self.block_size):
            block = self.by_key.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def attach(self, blocks: list[int]) -> None:
        """Take a reference to each cached block (from :meth:`match`)."""
        for b in blocks:
            if b in self.refs:
                self.refs[b] += 1
            else:
                del self.lru[b]
                self.refs[b] = 1

    def register(self, req: Request) -> None:
        """Register the request's full blocks whose K/V are now all computed. A block
        whose key is already registered to another block stays private."""
        if not self.enabled:
            return
        done = min(req.num_computed // self.block_size, len(req.blocks))
        if req.num_registered >= done:
            return
        keys = self.keys(req, done)
        for i in range(req.num_registered, done):
            key, block = keys[i], req.blocks[i]
            if key not in self.by_key and block not in self.key_of:
                self.by_key[key] = block
                self.key_of[block] = key
        req.num_registered = done
