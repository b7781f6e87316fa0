"""Attention over the paged KV cache, in plain torch ops (any device).

One engine step runs a flat batch of ``T`` tokens from several sequences. The
engine describes where they go with :class:`AttentionMetadata`: for every token the
cache slot its K/V are written to, and per sequence which slice of the step's
tokens it owns and which cache blocks hold its context.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class SeqSlice:
    """One sequence's part of a step."""

    q_start: int  # first of its tokens in the step's flat batch
    q_len: int  # tokens computed this step
    ctx_len: int  # context length after this step (cached + new)
    block_table: torch.Tensor  # int64 [num_blocks] on the dense device
    blocks: Optional[list[int]] = None  # the same block ids on the host


@dataclasses.dataclass
class AttentionMetadata:
    """Where a step's tokens read and write K/V.

    ``decode`` is set when every sequence computes exactly one token: then the
    batched tensors ``block_tables`` ([B, max_blocks], padded with block 0),
    ``ctx_lens`` and ``mask`` ([B, 1, 1, max_blocks*block_size], True = attend) let
    one batched attention call serve the whole step.
    """

    slot_mapping: torch.Tensor  # int64 [T]
    seqs: list[SeqSlice]
    block_size: int
    decode: bool = False
    block_tables: Optional[torch.Tensor] = None
    ctx_lens: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    #: Set by a session that replays decode graphs: ``block_tables`` (int32
    #: ``[B, max_blocks]``) and ``ctx_lens`` (int32 ``[B]``) are static device buffers
    #: and attention runs :func:`freetoken.models.decode_attention.paged_decode_attention`
    #: with this implementation ("triton" or "torch"); no host-side shape depends on them.
    static_decode: Optional[str] = None
    #: The step's inputs on the host (token ids, positions, cache slots), for sessions that
    #: stage them into their own buffers.
    host_ids: Optional[list[int]] = None
    host_positions: Optional[list[int]] = None
    host_slots: Optional[list[int]] = None
    #: Models with recurrent layers: each sequence's recurrent-state slot
    #: (:class:`freetoken.engine.recurrent_state.RecurrentStatePool`), in ``seqs`` order.
    state_slots: Optional[list[int]] = None
    #: Set by a session whose backend computes attention over host tensors itself (the CPU
    #: backend: ``freetoken_cpu_moe.attention.StepAttention``): called as
    #: ``kernel(q, k_cache, v_cache, scale, window, sinks)`` for every attention layer of the
    #: step; it returns ``[T, heads * head_dim]``, or None for tensors it does not take (the
    #: torch ops below then run).
    kernel: Optional[Callable[..., Optional[torch.Tensor]]] = None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``k``/``v`` ([T, kv_heads, head_dim] and [T, kv_heads, v_head_dim]) into their
    cache slots."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, v_cache.shape[3]).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of the step's queries ``q`` ([T, heads, head_dim]) over each
    sequence's cached context (which already holds this step's K/V; a cache of another
    dtype than ``q``'s is read in ``q``'s).

    ``window``: sliding-window attention, the query at position ``p`` sees the keys at
    positions ``p - window < j <= p``. ``sinks`` (float ``[heads]``): one extra logit per
    head in the softmax's denominator whose value row is zero (attention sinks). Both
    None: plain causal attention.

    Returns ``[T, heads * head_dim]``.
    """
    if meta.kernel is not None:
        out = meta.kernel(q, k_cache, v_cache, scale, window, sinks)
        if out is not None:
            return out
    if window is not None or sinks is not None:
        return _windowed_attention(q, k_cache, v_cache, meta, scale, window, sinks)
    T, H, D = q.shape
    nb, bs, kvh, _ = k_cache.shape
    gqa = H != kvh
    if meta.static_decode is not None:
        from freetoken.models.decode_attention import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.ctx_lens, scale,
                                      impl=meta.static_decode)
    if meta.decode:
        # One query per sequence: plain matmuls over the gathered blocks (cheaper
        # than SDPA's dispatch for a single query); GQA as [kv_heads, group] views.
        B = len(meta.seqs)
        g = H // kvh
        if B == 1:
            s = meta.seqs[0]
            k = k_cache.index_select(0, s.block_table).to(q.dtype).view(-1, kvh, D)[: s.ctx_len].transpose(0, 1)
            v = v_cache.index_select(0, s.block_table).to(q.dtype).view(-1, kvh, D)[: s.ctx_len].transpose(0, 1)
            scores = torch.matmul(q.view(kvh, g, D), k.transpose(1, 2)) * scale  # [kvh, g, L]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(probs, v).reshape(1, H * D)
        assert meta.block_tables is not None and meta.mask is not None
        nbk = meta.block_tables.shape[1]
        flat = meta.block_tables.reshape(-1)
        k = k_cache.index_select(0, flat).to(q.dtype).view(B, nbk * bs, kvh, D).transpose(1, 2)  # [B, kvh, L, D]
        v = v_cache.index_select(0, flat).to(q.dtype).view(B, nbk * bs, kvh, D).transpose(1, 2)
        # the g query heads sharing a kv head act as g queries of that head: no K/V repeat
        o = F.scaled_dot_product_attention(q.view(B, kvh, g, D), k, v, attn_mask=meta.mask, scale=scale)
        return o.reshape(B, H * D)

    out = q.new_empty(T, H * D)
    for s in meta.seqs:
        qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        k = k_cache[s.block_table].to(q.dtype).reshape(-1, kvh, D)[: s.ctx_len].transpose(0, 1).unsqueeze(0)
        v = v_cache[s.block_table].to(q.dtype).reshape(-1, kvh, D)[: s.ctx_len].transpose(0, 1).unsqueeze(0)
        if s.q_len == s.ctx_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        elif s.q_len == 1:
            o = F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=gqa)
        else:  # a later chunk of a prompt: causal, aligned at the last key (no [q_len, ctx_len] mask or scores
            # where a fused kernel takes it: the flash and memory-efficient kernels read the alignment)
            from torch.nn.attention.bias import causal_lower_right  # (imports triton: not at module load)

            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=causal_lower_right(s.q_len, s.ctx_len),
                                               scale=scale, enable_gqa=gqa)
        out[s.q_start : s.q_start + s.q_len] = o[0].transpose(0, 1).reshape(s.q_len, H * D)
    return out


#: queries per piece of the sliding-window/sink path (bounds its [heads, queries, keys] scores)
QUERY_CHUNK = 256


def _windowed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, window: Optional[int], sinks: Optional[torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """Attention with a sliding window and/or sinks, softmax in float32. Each sequence
    gathers only the cache blocks its window reaches; queries go in pieces of
    :data:`QUERY_CHUNK` rows, each over the keys its own window reaches."""
    T, H, D = q.shape
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1 token, got {window}")
    if meta.static_decode is not None:
        from freetoken.models.decode_attention import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.ctx_lens, scale,
                                      impl=meta.static_decode, window=window, sinks=sinks)  # fmt: skip
    nb, bs, kvh, _ = k_cache.shape
    g = H // kvh
    sink = None if sinks is None else sinks.float().view(kvh, g, 1)
    out = q.new_empty(T, H * D)
    for s in meta.seqs:
        first = s.ctx_len - s.q_len  # position of the sequence's first query this step
        for c0 in range(0, s.q_len, QUERY_CHUNK):
            n = min(QUERY_CHUNK, s.q_len - c0)
            p0 = first + c0  # positions p0 .. p0 + n - 1
            lo = 0 if window is None else max(0, p0 - window + 1)
            hi = p0 + n
            b0, b1 = lo // bs, -(-hi // bs)
            blocks = s.block_table[b0:b1]
            k = k_cache.index_select(0, blocks).view(-1, kvh, D)[lo - b0 * bs : hi - b0 * bs]
            v = v_cache.index_select(0, blocks).view(-1, kvh, D)[lo - b0 * bs : hi - b0 * bs]
            qs = q[s.q_start + c0 : s.q_start + c0 + n].float().view(n, kvh, g, D).permute(1, 2, 0, 3)
            scores = torch.matmul(qs.reshape(kvh, g * n, D), k.float().permute(1, 2, 0)).view(kvh, g, n, -1)
            scores = scores * scale
            pos_q = torch.arange(p0, hi, device=q.device).view(n, 1)
            pos_k = torch.arange(lo, hi, device=q.device).view(1, -1)
            allowed = pos_k <= pos_q
            if window is not None:
                allowed &= pos_k > pos_q - window
            scores = scores.masked_fill(~allowed, float("-inf"))
            m = scores.amax(-1)  # [kvh, g, n], finite: a query always sees itself
            if sink is not None:
                m = torch.maximum(m, sink)
            p = torch.exp(scores - m.unsqueeze(-1))
            den = p.sum(-1)
            if sink is not None:
                den = den + torch.exp(sink - m)
            o = torch.matmul(p.reshape(kvh, g * n, -1), v.float().transpose(0, 1)).view(kvh, g, n, D)
            o = o / den.unsqueeze(-1)
            out[s.q_start + c0 : s.q_start + c0 + n] = o.permute(2, 0, 1, 3).reshape(n, H * D).to(q.dtype)
    return out
