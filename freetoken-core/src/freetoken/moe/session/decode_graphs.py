"""Decode graphs: one captured decode step per batch-size bucket, replayed with new inputs.

A decode step (every sequence computes one token) runs the same kernels whatever the
tokens, positions and contexts, so it is captured once per bucket of batch sizes and
replayed: the step's inputs are copied into static device buffers the graph reads
(token ids, positions, cache slots, block tables, context lengths) and the graph writes
the final hidden states into a static output. A batch of B sequences replays the
smallest bucket >= B; rows B..bucket-1 repeat row 0 (same token, position and context,
so the same experts are routed and no extra expert weights are read) and write their
K/V into a scratch cache slot that no sequence owns.

Prefill steps, mixed steps and batches above the largest bucket run eagerly. Everything
a graph uses (hand-off tasks, the scratch block, compiled kernel variants) must exist
before it is captured; the runner keeps the graphs, and the graphs keep what they use,
until :meth:`DecodeGraphRunner.close`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from freetoken.backends.contract import GraphCapture, on_gpu
from freetoken.models.attention import AttentionMetadata, SeqSlice

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int, explicit: Optional[list[int]] = None) -> list[int]:
    """Batch-size buckets: ``explicit`` (sorted, deduplicated), else 1, 2, 4, 8 and then
    multiples of 8 up to ``max_batch``."""
    if explicit:
        return sorted({int(b) for b in explicit})
    out = [b for b in (1, 2, 4, 8) if b <= max_batch]
    out += list(range(16, max_batch + 1, 8))
    if max_batch not in out:
        out.append(max_batch)
    return sorted(set(out))


class DecodeGraphRunner:
    """Captures ``forward(ids, positions, meta) -> hidden`` per bucket and replays it."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        capture: GraphCapture,
        buckets: list[int],
        device: torch.device,
        block_size: int,
        max_blocks: int,
        scratch_block: int,
        attention_impl: str,
        before_capture: Optional[Callable[[int], None]] = None,
    ) -> None:
        self.forward_fn = forward
        self.capture_api = capture
        self.buckets = sorted(buckets)
        self.device = device
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.attention_impl = attention_impl
        self.before_capture = before_capture
        n = self.buckets[-1]
        # every input of a step in one device buffer, staged from one pinned host buffer of
        # the same layout and copied in one go: [ids | positions | slots] as int64 (3 n),
        # then [block table row | context length] as int32 (n rows of max_blocks + 1)
        words = 3 * n * 2 + n * (max_blocks + 1)  # in int32 words
        pin = on_gpu(device)
        # two staging buffers used in turn: a step launched before the previous one's tokens
        # are read back (the engine's decode-ahead) must not overwrite inputs whose copy may
        # still be queued behind the previous step
        self._hosts = [torch.zeros(words, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._dev = torch.zeros(words, dtype=torch.int32, device=device)
        dev64 = self._dev[: 6 * n].view(torch.int64).view(3, n)
        dev_tables = self._dev[6 * n :].view(n, max_blocks + 1)
        self.ids, self.positions, self.slots = dev64[0], dev64[1], dev64[2]
        self.block_tables = dev_tables[:, :max_blocks]
        self.ctx_lens = dev_tables[:, max_blocks]
        # the staging buffers written through numpy views (an element write costs ~0.1 us
        # there against ~3 us through torch indexing: 9 against 166 us for a step of 8)
        self._views = []
        for host_buffer in self._hosts:
            host = host_buffer.numpy()
            self._views.append((host[: 6 * n].view(np.int64).reshape(3, n), host[6 * n :].reshape(n, max_blocks + 1)))
        self._turn = 0
        self.slots.fill_(self.scratch_slot)
        self.block_tables.fill_(scratch_block)
        self.ctx_lens.fill_(1)
        for host_buffer in self._hosts:
            host_buffer.copy_(self._dev.cpu())
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch: int) -> Optional[int]:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def _meta(self, b: int) -> AttentionMetadata:
        dummy = [SeqSlice(i, 1, 1, self.block_tables[i]) for i in range(b)]
        return AttentionMetadata(self.slots[:b], dummy, self.block_size, decode=True,
                                 block_tables=self.block_tables[:b], ctx_lens=self.ctx_lens[:b],
                                 static_decode=self.attention_impl)

    def capture_all(self) -> None:
        """Capture every bucket (largest first), after two eager warm-up runs each."""
        t0 = time.monotonic()
        for b in sorted(self.buckets, reverse=True):
            if self.before_capture is not None:
                self.before_capture(b)
            meta = self._meta(b)

            def step(b: int = b, meta: AttentionMetadata = meta) -> torch.Tensor:
                return self.forward_fn(self.ids[:b], self.positions[:b], meta)

            for _ in range(2):  # compiles kernel variants, creates lazily allocated state
                step()
            if on_gpu(self.device):
                torch.cuda.synchronize(self.device)
            out: dict[str, torch.Tensor] = {}

            def captured(step: Callable[[], torch.Tensor] = step, out: dict[str, torch.Tensor] = out) -> torch.Tensor:
                out["hidden"] = step()
                return out["hidden"]

            self.graphs[b] = self.capture_api.capture(captured)
            self.outputs[b] = out  # "hidden": the graph's static output (set when the work is recorded)
        self.capture_seconds = time.monotonic() - t0
        log.info("captured decode graphs for batch sizes %s in %.1f s", self.buckets, self.capture_seconds)

    def run(self, meta: AttentionMetadata, input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Replay the bucket for this decode step; returns ``[B, hidden]`` (valid until the
        next replay). The token ids come from ``meta.host_ids``, or when there are none from
        ``input_ids`` on the device (copied there, in stream order)."""
        seqs = meta.seqs
        B = len(seqs)
        b = self.bucket_for(B)
        host_ids = meta.host_ids
        if b is None or (host_ids is None and input_ids is None) or meta.host_positions is None \
                or meta.host_slots is None:
            raise ValueError(f"no decode graph for this step (batch {B}, buckets {self.buckets})")
        vec, tables = self._views[self._turn]
        host = self._hosts[self._turn]
        self._turn ^= 1
        pos, slots = meta.host_positions, meta.host_slots
        for i in range(b):
            j = i if i < B else 0
            s = seqs[j]
            blocks = s.blocks if s.blocks is not None else s.block_table.tolist()
            if len(blocks) > self.max_blocks:
                raise ValueError(f"sequence of {s.ctx_len} tokens exceeds the graph's {self.max_blocks} blocks")
            vec[0, i] = host_ids[j] if host_ids is not None else 0
            vec[1, i] = pos[j]
            vec[2, i] = slots[j] if i < B else self.scratch_slot
            tables[i, : len(blocks)] = blocks
            tables[i, self.max_blocks] = s.ctx_len
        used = 6 * self.buckets[-1] + b * (self.max_blocks + 1)  # the int64 inputs and b table rows
        self._dev[:used].copy_(host[:used], non_blocking=True)
        if host_ids is None:
            self.ids[:B].copy_(input_ids[:B], non_blocking=True)  # type: ignore[index]
        self.graphs[b].replay()
        self.replays += 1
        return self.outputs[b]["hidden"][:B]

    def close(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
