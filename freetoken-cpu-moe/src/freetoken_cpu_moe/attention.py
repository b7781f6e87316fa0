"""Causal attention over the paged KV cache on the worker pool (the CPU backend's attention).

:func:`paged_attention` is the functional form (numpy arrays or torch CPU tensors);
:class:`CpuAttention` is what :class:`freetoken_cpu_moe.backend.CpuModelSession` installs on
each step's :class:`freetoken.models.attention.AttentionMetadata` (``meta.kernel``): it turns
the step's sequences into the kernel's int32 tables once per step, and every attention layer
of the step then makes one native call.

Layout: K and V caches ``[num_blocks, block_size, kv_heads, head_dim]`` (float32, bfloat16
or float16), queries ``[T, heads, head_dim]`` (unit stride within a head). The sequence ``s``
owns the step's tokens ``q_start[s] .. q_start[s] + q_len[s]``; its context after the step
(which already holds the step's K/V) is ``ctx_len[s]`` positions, position ``p`` in cache
block ``block_table[s, p // block_size]``. Query ``i`` of a sequence sits at position
``ctx_len - q_len + i`` and sees the positions up to its own (``window``: only the last
``window`` of them); ``sinks`` (float ``[heads]``) add one logit per head to the softmax's
denominator. GQA: query head ``h`` reads kv head ``h // (heads // kv_heads)``.

The work is split over (sequence, kv head, block of queries) and, when that gives fewer
items than ~4 per worker (decode), over pieces of each context whose softmax states are
merged afterwards (one wake-up of the pool, one barrier). Softmax in float32 (online, in
chunks of 32 keys), output rounded once to its dtype.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import numpy as np
import torch

from freetoken.handoff import Fmt
from freetoken_cpu_moe import _core
from freetoken_cpu_moe.arrays import act_fmt_of, address_of, is_torch
from freetoken_cpu_moe.pool import Pool, default_pool

log = logging.getLogger(__name__)

#: which steps the CPU backend's attention runs natively: ``native`` (decode and prompt
#: steps), ``decode`` (decode steps; prompt steps through torch), ``torch`` (never)
ATTENTION_ENV = "FREETOKEN_CPU_ATTENTION"
ATTENTION_MODES = ("native", "decode", "torch")
#: the tier whose kernel is the portable loop (every other tier has a register-blocked kernel for
#: head_dim 64/128/256: 16-lane on avx512/amx, 8-lane on avx2); the portable loop is slower than
#: torch's matmuls (one thread, 544 positions, 32/4 heads of 128: 1.96 ms against 0.19 ms), so
#: on it the default is torch
TORCH_TIERS = ("scalar",)

_TORCH_FMT = {torch.float32: int(Fmt.F32), torch.bfloat16: int(Fmt.BF16), torch.float16: int(Fmt.F16)}


def attention_mode() -> str:
    """``$FREETOKEN_CPU_ATTENTION``; by default ``torch`` on the :data:`TORCH_TIERS`, else ``native``."""
    mode = os.environ.get(ATTENTION_ENV, "").strip().lower()
    if not mode:
        return "torch" if str(_core.active_isa()) in TORCH_TIERS else "native"
    if mode not in ATTENTION_MODES:
        raise ValueError(f"{ATTENTION_ENV}={mode!r}: expected one of {', '.join(ATTENTION_MODES)}")
    return mode


def _i32(a: Any, what: str) -> np.ndarray:
    arr = a.detach().cpu().numpy() if is_torch(a) else np.asarray(a)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"paged_attention: {what} must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int32)


def paged_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    q_start: Any,
    q_len: Any,
    ctx_len: Any,
    block_table: Any,
    scale: float,
    *,
    window: Optional[int] = None,
    sinks: Any = None,
    out: Any = None,
    pool: Optional[Pool] = None,
    isa: Optional[str] = None,
) -> Any:
    """Attention of ``q`` ``[T, heads, head_dim]`` over the paged cache (see the module doc).

    ``q_start``, ``q_len``, ``ctx_len``: ``[S]`` integers; ``block_table``: ``[S, max_blocks]``.
    Returns ``[T, heads * head_dim]`` of q's kind and dtype (or writes ``out``); rows of
    tokens no sequence owns are zero.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if getattr(t, "ndim", 0) != (3 if name == "q" else 4):
            raise ValueError(f"paged_attention: {name} has shape {tuple(getattr(t, 'shape', ()))}, expected "
                             + ("[T, heads, head_dim]" if name == "q" else "[blocks, block_size, kv_heads, head_dim]"))
    T, H, D = (int(s) for s in q.shape)
    nb, bs, kvh, d2 = (int(s) for s in k_cache.shape)
    if tuple(v_cache.shape) != tuple(k_cache.shape) or d2 != D:
        raise ValueError(f"paged_attention: k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} and "
                         f"q {tuple(q.shape)} disagree")
    if str(k_cache.dtype) != str(v_cache.dtype):
        raise ValueError("paged_attention: k_cache and v_cache must have the same dtype")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        ok = t.is_contiguous() if is_torch(t) else t.flags.c_contiguous
        if not ok:
            raise ValueError(f"paged_attention: {name} must be contiguous")
    if is_torch(q):
        q_tok, q_head, unit = q.stride()
    else:
        q_tok, q_head, unit = (s // q.itemsize for s in q.strides)
    if unit != 1:
        raise ValueError("paged_attention: q needs unit stride within a head")
    starts, lens, ctxs = _i32(q_start, "q_start"), _i32(q_len, "q_len"), _i32(ctx_len, "ctx_len")
    table = _i32(block_table, "block_table")
    S = int(starts.shape[0])
    if lens.shape != (S,) or ctxs.shape != (S,) or table.ndim != 2 or table.shape[0] != S:
        raise ValueError(f"paged_attention: q_start {starts.shape}, q_len {lens.shape}, ctx_len {ctxs.shape} and "
                         f"block_table {table.shape} must describe the same {S} sequences")
    q_fmt = act_fmt_of(q, "paged_attention: q")
    kv_fmt = act_fmt_of(k_cache, "paged_attention: k_cache")
    if out is None:
        out = torch.empty((T, H * D), dtype=q.dtype) if is_torch(q) else np.empty((T, H * D), dtype=q.dtype)
    elif tuple(out.shape) != (T, H * D):
        raise ValueError(f"paged_attention: out has shape {tuple(out.shape)}, expected {(T, H * D)}")
    sink_arr = None
    if sinks is not None:
        sink_arr = np.ascontiguousarray(sinks.detach().float().numpy() if is_torch(sinks) else sinks, dtype=np.float32)
        if sink_arr.shape != (H,):
            raise ValueError(f"paged_attention: sinks has shape {sink_arr.shape}, expected ({H},)")
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: window must be >= 1 token, got {window}")
    _core.paged_attention(
        address_of(q), q_fmt, int(q_tok), int(q_head), address_of(k_cache), address_of(v_cache), kv_fmt, nb, bs,
        kvh, D, H, S, address_of(starts), address_of(lens), address_of(ctxs), address_of(table),
        int(table.shape[1]), T, address_of(out), act_fmt_of(out, "paged_attention: out"), float(scale),
        int(window or 0), 0 if sink_arr is None else address_of(sink_arr), (pool or default_pool())._core, isa or "",
    )
    return out


class StepAttention:
    """One step's tables (int32) and the call every attention layer of the step makes."""

    __slots__ = ("num_tokens", "tables", "_addr", "_pool", "_sinks")

    def __init__(self, meta: Any, num_tokens: int, pool: Pool, sink_cache: dict[int, tuple[Any, np.ndarray]]) -> None:
        seqs = meta.seqs
        S = len(seqs)
        starts = np.fromiter((s.q_start for s in seqs), dtype=np.int32, count=S)
        lens = np.fromiter((s.q_len for s in seqs), dtype=np.int32, count=S)
        ctxs = np.fromiter((s.ctx_len for s in seqs), dtype=np.int32, count=S)
        rows = [s.blocks if s.blocks is not None else s.block_table.tolist() for s in seqs]
        width = max(1, max((len(r) for r in rows), default=1))
        table = np.zeros((S, width), dtype=np.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = r
        self.num_tokens = num_tokens
        self.tables = (starts, lens, ctxs, table)  # kept alive for the native calls
        self._addr = (S, starts.ctypes.data, lens.ctypes.data, ctxs.ctypes.data, table.ctypes.data, width)
        self._pool = pool._core
        self._sinks = sink_cache

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:  # fmt: skip
        """``[T, heads * head_dim]``, or None when these tensors are not the kernel's kind (the
        caller then computes the torch way)."""
        q_fmt = _TORCH_FMT.get(q.dtype)
        kv_fmt = _TORCH_FMT.get(k_cache.dtype)
        if (q_fmt is None or kv_fmt is None or q.device.type != "cpu" or q.dim() != 3 or q.stride(2) != 1
                or q.shape[0] != self.num_tokens or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or v_cache.dtype != k_cache.dtype):
            return None
        T, H, D = q.shape
        nb, bs, kvh, _ = k_cache.shape
        sink_addr = 0
        if sinks is not None:
            key = id(sinks)
            hit = self._sinks.get(key)
            if hit is None or hit[0] is not sinks:
                hit = (sinks, np.ascontiguousarray(sinks.detach().float().numpy(), dtype=np.float32))
                self._sinks[key] = hit
            sink_addr = hit[1].ctypes.data
        out = torch.empty((T, H * D), dtype=q.dtype)
        S, a_start, a_len, a_ctx, a_table, width = self._addr
        _core.paged_attention(
            q.data_ptr(), q_fmt, q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), kv_fmt, nb, bs,
            kvh, D, H, S, a_start, a_len, a_ctx, a_table, width, T, out.data_ptr(), q_fmt, float(scale),
            int(window or 0), sink_addr, self._pool, "",
        )
        return out


class CpuAttention:
    """Builds each step's :class:`StepAttention` (``mode``: see :data:`ATTENTION_ENV`)."""

    def __init__(self, pool: Pool, mode: Optional[str] = None) -> None:
        self.pool = pool
        self.mode = mode or attention_mode()
        self._sinks: dict[int, tuple[Any, np.ndarray]] = {}  # float32 copies of the layers' sink logits

    def for_step(self, meta: Any, num_tokens: int) -> Optional[StepAttention]:
        """The step's attention, or None where this mode leaves the step to torch."""
        if self.mode == "torch" or (self.mode == "decode" and not meta.decode):
            return None
        return StepAttention(meta, num_tokens, self.pool, self._sinks)
