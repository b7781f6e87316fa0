"""Triton kernels of :func:`freetoken.models.decode_attention.paged_decode_attention`.

Split-K (flash-decoding) over the paged KV cache::

    partial  grid (B, Hkv*GB, P)  program (b, h*GB + j, p): partition p of sequence b's
                                  context, query group j (GP = G/GB heads) of kv head h
    reduce   grid (B, Hq)         program (b, hq): merges the active partitions of (b, hq)

A kv head's G = Hq/Hkv query heads are one group (GB = 1) unless their float32
accumulator would exceed :data:`ACC_TILE` elements (MLA's 128 heads of 512 values:
groups of 16, :func:`query_group`).

By default (``KernelConfig.reduce_in_partial``) one launch does both: the last of a
(b, group)'s P partial programs to store its partials (a per-(b, h) counter taken with an
atomic add after the stores) merges the G heads' partitions itself, as the reduce program
does, and sets the counter back to zero for the next launch.

The partition count ``P`` is fixed by shapes (batch, kv heads, ``max_blocks``), never by
values. The partition *length* is computed in the kernels from the sequence's context
length ``L`` (a device value): ``part = max(MIN_PART, ceil(ceil(L / P) / BLOCK_N) * BLOCK_N)``,
so a short context still spreads over several programs, every program reads at most
``ceil(max_blocks * block_size / P)`` tokens (rounded up to ``BLOCK_N``), and the
``ceil(L / part) <= P`` active partitions are the first ones. Both kernels derive the
same ``part`` from the same ``L``.

A partial program walks its tokens ``BLOCK_N`` at a time: each token's cache block comes
from the block table (any block size, blocks in any order), K and V rows are gathered
with masked loads (tokens at or past ``L`` are never read, so garbage there cannot leak),
``S = Q K^T`` is one ``tl.dot`` with the G query heads as its M dimension (padded to 16),
followed by an online softmax in base 2 and ``acc += P V`` (fp32 accumulation; P is cast
to the cache dtype for the MMA, as flash attention does). It stores the unnormalised
``acc`` and the running max ``m`` and sum ``l``. The reduce program combines them as
``sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p``; a row without context (``L = 0``,
a padded batch row) has no active partition and gets zeros.

With ``P == 1`` (``SPLIT`` off) the partial program normalises and writes the output
itself and no reduce is launched.

Head sizes: q/k heads of ``D`` and v heads of ``DV`` values (MLA: 192 and 128, or, with
the up-projections absorbed, 576 and 512; else equal), the sizes
:func:`freetoken.kernels.availability.head_dim_support` accepts. The tiles are
``BLOCK_D``/``BLOCK_DV`` wide, the next power of two of at least 16 (:func:`block_d`);
lanes past the head load zeros (they add nothing to ``Q K^T``) and are never stored. A
q/k head wider than :data:`SINGLE_TILE_HEAD` that is no power of two takes a second tile
of ``BLOCK_D2`` values past the first (:func:`split_d`: 576 = 512 + 64), its product
added to the scores. Where the values are the keys' first ``DV = BLOCK_D`` values in the
same cache (MLA's latents, :func:`shares_kv`), one load serves both. The caller's
``scale`` comes from the true head size.

A sliding window (``WINDOW > 0``) moves each program's first token up to ``L - WINDOW``;
a partition left without tokens stores ``m = -inf, l = 0, acc = 0``, which the reduce
weighs by zero. Sinks (``HAS_SINKS``) add ``2^(sink log2(e) - M)`` to the denominator
of each query head, ``M`` its final running max.

triton is optional: import this module lazily, only when the Triton implementation runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import triton
import triton.language as tl

from freetoken.backends import triton_target

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options of the partial kernel."""

    block_n: int = 64  # tokens per step of a partial program (a power of two >= 16)
    min_part_blocks: int = 2  # a partition spans at least this many steps (bounds the reduce's work)
    block_p: int = 16  # partitions merged per step of the reduce program
    num_warps: int = 4
    num_stages: int = 2
    #: the last partial program of each (sequence, kv head) merges the partitions (one launch)
    #: instead of a second launch of reduce programs
    reduce_in_partial: bool = True

    def validate(self) -> None:
        for name in ("block_n", "block_p"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two >= 16")
        if self.min_part_blocks < 1:
            raise ValueError(f"min_part_blocks={self.min_part_blocks}: must be >= 1")

    @property
    def min_part(self) -> int:
        return self.block_n * self.min_part_blocks


DEFAULT_CONFIG = KernelConfig()
#: the tiles of one sequence and of batches of :data:`BATCH_FROM` sequences and more, where
#: the device's shared memory holds their stages (:func:`config_for`). On an H100
#: (``tests/gpu/bench_decode_attention.py --sweep``): a third stage made one sequence's
#: step 2-3% faster; 128-token steps made a batch's ~5% faster at 8 sequences and 17% at
#: 32 sequences of 32k tokens (the copy bandwidth's pace); each slower in the other place.
ONE_SEQUENCE_CONFIG = KernelConfig(num_stages=3)
BATCH_CONFIG = KernelConfig(block_n=128)
BATCH_FROM = 8
#: float32 queries and caches (``--dtype float32``): steps of 32 tokens with 8 warps. Compiled
#: for sm_90, the 64- and 128-token steps of 4 warps kept 0.1-7.8 KB a thread in local memory
#: inside the token loop at every preset's head size (Qwen3.5's 256: 7.2 KB; MLA's 576/512:
#: 1.2 KB); these tiles keep none at any of them (tests/gpu/attention_sm90_spills.py)
FLOAT32_BLOCK_N, FLOAT32_WARPS = 32, 8
#: shared memory a program needs besides its K/V stages (queries, scores, the merge)
SHARED_MARGIN = 16 * 1024


@triton.jit
def _partition(ctx, P, BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr):
    """Tokens per partition of a context of ``ctx`` tokens split ``P`` ways."""
    part = tl.cdiv(tl.cdiv(ctx, P), BLOCK_N) * BLOCK_N
    return tl.maximum(part, MIN_PART)


@triton.jit(do_not_specialize=["P", "max_tokens", "scale_log2"])
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, acc_ptr, ml_ptr, count_ptr,
    scale_log2, P, max_tokens,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_btb, stride_ob,
    G: tl.constexpr, GP: tl.constexpr, GB: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr, BLOCK_GM: tl.constexpr, MERGE_P: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, LAST_REDUCES: tl.constexpr, SHARED_KV: tl.constexpr,
):  # fmt: skip
    _partial(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, acc_ptr, ml_ptr, count_ptr, out_ptr, scale_log2, P,
             max_tokens, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
             stride_btb, stride_ob, G, GP, GB, D, DV, BS, BLOCK_G, BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_N, MIN_PART,
             BLOCK_GM, MERGE_P, SPLIT, PRECISION, 0, False, LAST_REDUCES, SHARED_KV)  # fmt: skip


@triton.jit(do_not_specialize=["P", "max_tokens", "scale_log2"])
def _partial_window_sinks_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, acc_ptr, ml_ptr, count_ptr,
    scale_log2, P, max_tokens,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_btb, stride_ob,
    sink_ptr,
    G: tl.constexpr, GP: tl.constexpr, GB: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr, BLOCK_GM: tl.constexpr, MERGE_P: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    LAST_REDUCES: tl.constexpr, SHARED_KV: tl.constexpr,
):  # fmt: skip
    _partial(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, acc_ptr, ml_ptr, count_ptr, sink_ptr, scale_log2, P,
             max_tokens, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
             stride_btb, stride_ob, G, GP, GB, D, DV, BS, BLOCK_G, BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_N, MIN_PART,
             BLOCK_GM, MERGE_P, SPLIT, PRECISION, WINDOW, HAS_SINKS, LAST_REDUCES, SHARED_KV)  # fmt: skip


@triton.jit
def _partial(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, acc_ptr, ml_ptr, count_ptr, sink_ptr,
    scale_log2, P, max_tokens,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_btb, stride_ob,
    G: tl.constexpr, GP: tl.constexpr, GB: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr, BLOCK_GM: tl.constexpr, MERGE_P: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    LAST_REDUCES: tl.constexpr, SHARED_KV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)  # GB groups of GP query heads per kv head
    p = tl.program_id(2)
    h = group // GB  # the kv head
    head0 = h * G + (group % GB) * GP  # the group's first query head
    hq_count = tl.num_programs(1) * GP
    ctx = tl.load(ctx_ptr + b)
    ctx = tl.minimum(tl.maximum(ctx, 0), max_tokens)
    part = _partition(ctx, P, BLOCK_N, MIN_PART)
    lo = p * part
    hi = tl.minimum(lo + part, ctx)
    first = lo
    if WINDOW > 0:
        first = tl.maximum(lo, ctx - WINDOW)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < GP
    d_ok = offs_d < D  # any head size: the tiles are padded to a power of two (>= 16), lanes past D masked
    dv_ok = offs_dv < DV
    heads = head0 + offs_g  # the group's query heads (of kv head h)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    if BLOCK_D2 > 0:  # a wide head's values past BLOCK_D: a second tile (MLA's rope part)
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        d2_ok = offs_d2 < D
        q2 = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d2[None, :],
                     mask=g_ok[:, None] & d2_ok[None, :], other=0.0)  # fmt: skip

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_btb
    for start in range(first, hi, BLOCK_N):  # every step holds at least one token < hi
        t = start + offs_n
        t_ok = t < hi
        blk = tl.load(bt_row + t // BS, mask=t_ok, other=0).to(tl.int64)
        row = t % BS
        k_off = blk * stride_kb + row * stride_kt + h * stride_kh
        # [BLOCK_N, BLOCK_D]
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_G, BLOCK_N]
        if BLOCK_D2 > 0:
            k2 = tl.load(k_ptr + k_off[:, None] + offs_d2[None, :], mask=t_ok[:, None] & d2_ok[None, :], other=0.0)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=PRECISION)
        s = s * scale_log2
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the step has a valid token
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if SHARED_KV:  # the values are the keys' first DV = BLOCK_D values (MLA's latents): no second load
            v = k
        else:
            v_off = blk * stride_vb + row * stride_vt + h * stride_vh
            # [BLOCK_N, BLOCK_DV]
            v = tl.load(v_ptr + v_off[:, None] + offs_dv[None, :], mask=t_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = tl.dot(pr.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    if SPLIT:
        active = lo < hi
        part_row = (b * hq_count + heads) * P + p  # [BLOCK_G] rows of the [B, Hq, P] partials
        tl.store(acc_ptr + part_row[:, None] * DV + offs_dv[None, :], acc,
                 mask=active & g_ok[:, None] & dv_ok[None, :])  # fmt: skip
        tl.store(ml_ptr + part_row * 2, m_i, mask=active & g_ok)
        tl.store(ml_ptr + part_row * 2 + 1, l_i, mask=active & g_ok)
        if LAST_REDUCES:
            # every thread's partials stored before the count goes up (the atomic releases
            # them at GPU scope); the program that takes it to P merges the partitions
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + b * tl.num_programs(1) + group, 1, sem="acq_rel", scope="gpu")
            if done == P - 1:
                _merge_heads(acc_ptr, ml_ptr, sink_ptr, out_ptr, b, head0, hq_count, P, tl.cdiv(ctx, part),
                             stride_ob, GP, DV, BLOCK_DV, BLOCK_GM, MERGE_P, HAS_SINKS)  # fmt: skip
                tl.atomic_xchg(count_ptr + b * tl.num_programs(1) + group, 0, sem="relaxed", scope="gpu")
    else:  # the only partition: normalise here (no context: acc = 0, l = 0 -> zeros)
        _store_heads(out_ptr, sink_ptr, b, heads, stride_ob, offs_dv, g_ok, dv_ok, acc, l_i, m_i, DV, HAS_SINKS)


@triton.jit
def _store_heads(out_ptr, sink_ptr, b, heads, stride_ob, offs_d, g_ok, d_ok, acc, den, m,
                 D: tl.constexpr, HAS_SINKS: tl.constexpr):  # fmt: skip
    """``heads``' outputs ``acc / den`` (``D`` here: the v head size) into sequence ``b``'s
    row, each head's sink (with ``HAS_SINKS``) added to its denominator at its running max
    ``m``; a head without context (``den`` 0) gets zeros."""
    if HAS_SINKS:
        sk = tl.load(sink_ptr + heads, mask=g_ok, other=0.0) * 1.4426950408889634
        den += tl.where(m == float("-inf"), 0.0, tl.exp2(sk - m))
    o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * D + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])  # fmt: skip


@triton.jit
def _merge_heads(acc_ptr, ml_ptr, sink_ptr, out_ptr, b, head0, hq_count, P, n_active, stride_ob,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_GM: tl.constexpr,
                 MERGE_P: tl.constexpr, HAS_SINKS: tl.constexpr):  # fmt: skip
    """What the reduce programs of the G query heads from ``head0`` on compute, in the
    partial program that stored their last partitions (loads through L2: other programs
    wrote them). ``MERGE_P`` partitions of all G heads at a time (``[BLOCK_GM, MERGE_P,
    BLOCK_D]`` tiles), with a running max: one dependent round trip to L2 per ``MERGE_P``
    partitions."""
    offs_g = tl.arange(0, BLOCK_GM)
    offs_p = tl.arange(0, MERGE_P)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < G
    d_ok = offs_d < D
    heads = head0 + offs_g
    rows = (b * hq_count + heads) * P  # [BLOCK_GM]: each head's first partition
    m_run = tl.full([BLOCK_GM], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_GM], dtype=tl.float32)
    acc = tl.zeros([BLOCK_GM, BLOCK_D], dtype=tl.float32)
    for p0 in range(0, n_active, MERGE_P):
        pp = p0 + offs_p
        ok = g_ok[:, None] & (pp < n_active)[None, :]  # [BLOCK_GM, MERGE_P]
        r = rows[:, None] + pp[None, :]
        m = tl.load(ml_ptr + r * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(ml_ptr + r * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
        a = tl.load(acc_ptr + r[:, :, None] * D + offs_d[None, None, :], mask=ok[:, :, None] & d_ok[None, None, :],
                    other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m_run, tl.max(m, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing attended yet: weights stay 0
        alpha = tl.exp2(m_run - m_ref)
        w = tl.exp2(m - m_ref[:, None])
        den = den * alpha + tl.sum(w * l, axis=1)
        acc = acc * alpha[:, None] + tl.sum(a * w[:, :, None], axis=1)
        m_run = m_new
    _store_heads(out_ptr, sink_ptr, b, heads, stride_ob, offs_d, g_ok, d_ok, acc, den, m_run, D, HAS_SINKS)


@triton.jit(do_not_specialize=["P", "max_tokens"])
def _reduce_kernel(
    acc_ptr, ml_ptr, ctx_ptr, out_ptr,
    P, max_tokens, stride_ob,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr,
):  # fmt: skip
    _reduce(acc_ptr, ml_ptr, ctx_ptr, out_ptr, out_ptr, P, max_tokens, stride_ob, D, BLOCK_D, BLOCK_P, BLOCK_N,
            MIN_PART, False)  # fmt: skip


@triton.jit(do_not_specialize=["P", "max_tokens"])
def _reduce_sinks_kernel(
    acc_ptr, ml_ptr, ctx_ptr, out_ptr,
    P, max_tokens, stride_ob, sink_ptr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr,
):  # fmt: skip
    _reduce(acc_ptr, ml_ptr, ctx_ptr, out_ptr, sink_ptr, P, max_tokens, stride_ob, D, BLOCK_D, BLOCK_P, BLOCK_N,
            MIN_PART, True)  # fmt: skip


@triton.jit
def _reduce(
    acc_ptr, ml_ptr, ctx_ptr, out_ptr, sink_ptr,
    P, max_tokens, stride_ob,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    hq_count = tl.num_programs(1)
    ctx = tl.load(ctx_ptr + b)
    ctx = tl.minimum(tl.maximum(ctx, 0), max_tokens)
    part = _partition(ctx, P, BLOCK_N, MIN_PART)
    n_active = tl.cdiv(ctx, part)
    base = (b * hq_count + hq) * P
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    m_max = tl.max(tl.full([BLOCK_P], float("-inf"), dtype=tl.float32), axis=0)
    for p0 in range(0, n_active, BLOCK_P):
        pp = p0 + offs_p
        m = tl.load(ml_ptr + (base + pp) * 2, mask=pp < n_active, other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m, axis=0))
    den = tl.sum(tl.zeros([BLOCK_P], dtype=tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p0 in range(0, n_active, BLOCK_P):
        pp = p0 + offs_p
        ok = pp < n_active
        m = tl.load(ml_ptr + (base + pp) * 2, mask=ok, other=0.0)
        l = tl.load(ml_ptr + (base + pp) * 2 + 1, mask=ok, other=0.0)
        w = tl.where(ok, tl.exp2(m - m_max), 0.0)
        a = tl.load(acc_ptr + (base + pp)[:, None] * D + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(a * w[:, None], axis=0)
        den += tl.sum(w * l, axis=0)
    if HAS_SINKS:
        sk = tl.load(sink_ptr + hq) * 1.4426950408889634
        den += tl.where(m_max == float("-inf"), 0.0, tl.exp2(sk - m_max))
    o = acc / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + hq * D + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


#: elements of one ``[BLOCK_GM, MERGE_P, BLOCK_DV]`` tile of the merge in the partial kernel
MERGE_TILE = 8192


def merge_tile(g: int, dv: int) -> dict[str, int]:
    """The merge's tile (constants ``BLOCK_GM``, ``MERGE_P``) for ``g`` query heads per kv
    head and v heads of ``dv``: the heads padded to a power of two, as many partitions at a
    time (a power of two, 1-16) as :data:`MERGE_TILE` elements hold."""
    gm = triton.next_power_of_2(g)
    per_partition = gm * block_d(dv)
    return dict(BLOCK_GM=gm, MERGE_P=max(1, min(16, 1 << max(0, (MERGE_TILE // per_partition).bit_length() - 1))))


def block_d(d: int) -> int:
    """The tile width of a head of ``d`` values: the next power of two, at least 16 (``tl.dot``'s
    smallest K and N); lanes past ``d`` are masked."""
    return max(16, triton.next_power_of_2(d))


#: the widest q/k head one tile takes; a wider one (MLA's latent queries: 512 + 64 values)
#: is read as a power-of-two tile and a second tile of the rest (:func:`split_d`)
SINGLE_TILE_HEAD = 256
#: float32 accumulator elements (``[query heads, v head]``) one program holds at most: the
#: query heads of a kv head that do not fit go to several programs, ``GP`` heads each
ACC_TILE = 8192
#: tokens per step of a program whose tiles are wider than :data:`SINGLE_TILE_HEAD`: MLA's
#: latents (512 + 64 bf16 values) at 32 tokens a step in two pipelined stages take 55 KiB of
#: shared memory compiled for sm_90 (64 tokens in one stage: 114 KiB, more than consumer
#: GPUs give a block)
WIDE_BLOCK_N = 32


def split_d(d: int) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_D2)``: a q/k head of ``d`` values as one tile (``BLOCK_D2`` 0) up
    to :data:`SINGLE_TILE_HEAD` or when ``d`` is a power of two, else a power-of-two tile and
    a second one for the values past it (576: 512 and 64)."""
    if d <= SINGLE_TILE_HEAD or d & (d - 1) == 0:
        return block_d(d), 0
    first = 1 << (d.bit_length() - 1)
    return first, block_d(d - first)


def query_group(g: int, dv: int) -> int:
    """``GP``, the query heads one program takes of a kv head's ``g``: the most that divide
    ``g`` with an accumulator (heads padded to a power of two >= 16, times the v tile) of at
    most :data:`ACC_TILE` elements (all of them for the usual groups; 16 of MLA's 128)."""
    for gp in range(g, 0, -1):
        if g % gp == 0 and max(16, triton.next_power_of_2(gp)) * block_d(dv) <= ACC_TILE:
            return gp
    return 1


def program_groups(q_heads: int, kv_heads: int, dv: int) -> int:
    """Programs per sequence and partition: the kv heads times their query groups."""
    g = q_heads // kv_heads
    return kv_heads * (g // query_group(g, dv))


def tiles(config: KernelConfig, d: int, dv: int) -> tuple[int, int]:
    """``(BLOCK_N, MIN_PART)`` for heads of ``d``/``dv`` values: the config's, but at most
    :data:`WIDE_BLOCK_N` tokens a step where a tile is wider than :data:`SINGLE_TILE_HEAD`
    (bounded shared memory)."""
    b1, b2 = split_d(d)
    if b1 + b2 <= SINGLE_TILE_HEAD and block_d(dv) <= SINGLE_TILE_HEAD:
        return config.block_n, config.min_part
    n = min(config.block_n, WIDE_BLOCK_N)
    return n, n * config.min_part_blocks


def stage_bytes(config: KernelConfig, d: int, dv: int, elem_bytes: int, shared_kv: bool = False) -> int:
    """Shared memory of the partial kernel's pipelined K/V loads under ``config`` (its
    ``num_stages`` buffers of a step's keys and values) for heads of ``d``/``dv`` values."""
    block_n = tiles(config, d, dv)[0]
    first, second = split_d(d)
    return config.num_stages * block_n * (first + second + (0 if shared_kv else block_d(dv))) * elem_bytes


def config_for(batch: int, d: int, dv: int, elem_bytes: int, shared_limit: int, shared_kv: bool = False,
               ) -> KernelConfig:  # fmt: skip
    """The tiles for a batch of ``batch`` sequences: :data:`ONE_SEQUENCE_CONFIG` for one,
    :data:`BATCH_CONFIG` from :data:`BATCH_FROM`, where their stages and
    :data:`SHARED_MARGIN` fit ``shared_limit`` bytes a program may take (a consumer GPU's
    ~100 KiB holds neither at head size 128); :data:`DEFAULT_CONFIG` otherwise. Float32
    (``elem_bytes`` 4) takes :data:`FLOAT32_BLOCK_N` tokens a step with :data:`FLOAT32_WARPS`
    warps in each."""
    chosen = ONE_SEQUENCE_CONFIG if batch == 1 else BATCH_CONFIG if batch >= BATCH_FROM else DEFAULT_CONFIG
    if chosen is not DEFAULT_CONFIG and stage_bytes(chosen, d, dv, elem_bytes, shared_kv) + SHARED_MARGIN > shared_limit:
        chosen = DEFAULT_CONFIG
    if elem_bytes >= 4:  # (fewer tokens a step: the stages' shared memory shrinks, they still fit)
        return dataclasses.replace(chosen, block_n=FLOAT32_BLOCK_N, num_warps=FLOAT32_WARPS)
    return chosen


def shared_limit(device: Any) -> int:
    """The shared memory one program may take on ``device`` (Triton's figure for the GPU;
    0 without one: the interpreter takes :data:`DEFAULT_CONFIG`)."""
    if getattr(device, "type", "cpu") != "cuda":
        return 0
    return _shared_limit(device.index if device.index is not None else 0)


@functools.lru_cache(maxsize=None)
def _shared_limit(index: int) -> int:
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def shares_kv(k_cache: Any, v_cache: Any) -> bool:
    """Whether the values are the keys' first ``DV`` values, the whole first tile (MLA's
    cache: one latent per token serves as key and, cut, as value), so one load serves both."""
    d, dv = k_cache.shape[3], v_cache.shape[3]
    return (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride()[:3] == k_cache.stride()[:3]
            and dv <= d and dv == split_d(d)[0])  # fmt: skip


def _spec(value: Any) -> Any:
    """What of one launch argument selects a compiled variant: a tensor's dtype and
    16-byte alignment, an integer's being 1 or a multiple of 16."""
    if hasattr(value, "data_ptr"):
        return (str(value.dtype), value.data_ptr() % 16 == 0)
    return (value == 1, value % 16 == 0)


def kernel_constants(g: int, d: int, dv: int, block_size: int, split: bool, precision: str,
                     config: KernelConfig = DEFAULT_CONFIG, shared_kv: bool = False) -> dict[str, Any]:  # fmt: skip
    """The partial kernel's constants for ``g`` query heads per kv head, heads of ``d``/``dv``
    values, cache blocks of ``block_size`` tokens, split partitions or not, ``tl.dot``'s
    ``precision``, and whether one load serves K and V (:func:`shares_kv`)."""
    gp = query_group(g, dv)
    first, second = split_d(d)
    block_n, min_part = tiles(config, d, dv)
    return dict(
        G=g, GP=gp, GB=g // gp, D=d, DV=dv, BS=block_size, BLOCK_G=max(16, triton.next_power_of_2(gp)),
        BLOCK_D=first, BLOCK_D2=second, BLOCK_DV=block_d(dv), BLOCK_N=block_n, MIN_PART=min_part, SPLIT=split,
        PRECISION=precision, LAST_REDUCES=split and config.reduce_in_partial, SHARED_KV=shared_kv,
        **merge_tile(gp, dv),
    )  # fmt: skip


def _constants(q: Any, k_cache: Any, v_cache: Any, num_partitions: int, config: KernelConfig,
               window: Optional[int] = None, sinks: Any = None) -> dict[str, Any]:  # fmt: skip
    import torch

    _, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    c = kernel_constants(Hq // Hkv, D, v_cache.shape[3], bs, num_partitions > 1,
                         triton_target.for_device(q.device).dot_precision(q.dtype == torch.float32), config,
                         shares_kv(k_cache, v_cache))  # fmt: skip
    if window is not None or sinks is not None:  # the kernel with a window and/or sinks
        c["WINDOW"] = int(window or 0)
        c["HAS_SINKS"] = sinks is not None
    return c


def _strides(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, out: Any) -> tuple[int, ...]:
    return (
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0),
    )  # fmt: skip


def variant_key(
    q: Any, k_cache: Any, v_cache: Any, block_tables: Any, ctx_lens: Any, out: Any, num_partitions: int,
    config: KernelConfig = DEFAULT_CONFIG, window: Optional[int] = None, sinks: Any = None,
) -> tuple[Any, ...]:  # fmt: skip
    """What selects the compiled variants of a :func:`launch` (constants, dtypes, pointer
    alignment, strides' divisibility; not the values of the partition count, the context
    bound or the scale): equal keys, no new compilation."""
    consts = _constants(q, k_cache, v_cache, num_partitions, config, window, sinks)
    tensors = (q, k_cache, v_cache, block_tables, ctx_lens, out) + ((sinks,) if sinks is not None else ())
    strides = _strides(q, k_cache, v_cache, block_tables, out)
    return (config, str(q.device), tuple(sorted(consts.items())), *map(_spec, tensors), *map(_spec, strides))


def launch(
    q: Any, k_cache: Any, v_cache: Any, block_tables: Any, ctx_lens: Any, scale: float, out: Any,
    num_partitions: int, config: KernelConfig = DEFAULT_CONFIG, window: Optional[int] = None, sinks: Any = None,
) -> None:  # fmt: skip
    """Run the kernels (arguments already validated by the caller: ``q [B, Hq, D]``,
    caches ``[num_blocks, block_size, Hkv, D]`` (K) and ``[.., Hkv, DV]`` (V; ``D``, ``DV``
    any sizes :func:`freetoken.kernels.availability.head_dim_support` accepts), int32 ``block_tables [B, max_blocks]``
    and ``ctx_lens [B]`` (contiguous), ``out [B, Hq*DV]``; unit stride in every last
    dimension). The ``P > 1`` partials are fresh ``torch.empty`` buffers of fixed shape
    (under stream capture: from the graph's pool)."""
    import torch

    from freetoken.kernels.counters import zeroed_counters

    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    DV = v_cache.shape[3]
    P = int(num_partitions)
    if B == 0:
        return
    consts = _constants(q, k_cache, v_cache, P, config, window, sinks)
    sink_arg = sinks if sinks is not None else out  # not read without HAS_SINKS
    max_tokens = block_tables.shape[1] * bs
    if P > 1:
        acc = torch.empty(B, Hq, P, DV, dtype=torch.float32, device=q.device)
        ml = torch.empty(B, Hq, P, 2, dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # not used: SPLIT off stores the output directly
    groups = Hkv * consts["GB"]  # programs per sequence and partition
    # the merging programs' counters (not read without LAST_REDUCES)
    counts = zeroed_counters("attention_merge", q.device, B * groups) if consts["LAST_REDUCES"] else out
    args = (q, k_cache, v_cache, block_tables, ctx_lens, out, acc, ml, counts, float(scale) * LOG2E, P, max_tokens,
            *_strides(q, k_cache, v_cache, block_tables, out))  # fmt: skip
    extended = window is not None or sinks is not None
    target = triton_target.for_device(q.device)
    opts = target.launch_options(config.num_warps, config.num_stages)
    if extended:
        _partial_window_sinks_kernel[(B, groups, P)](*args, sink_arg, **consts, **opts)
    else:
        _partial_kernel[(B, groups, P)](*args, **consts, **opts)
    if P > 1 and not consts["LAST_REDUCES"]:
        rconsts = dict(D=DV, BLOCK_D=consts["BLOCK_DV"], BLOCK_P=config.block_p, BLOCK_N=consts["BLOCK_N"],
                       MIN_PART=consts["MIN_PART"])  # fmt: skip
        if sinks is not None:
            _reduce_sinks_kernel[(B, Hq)](acc, ml, ctx_lens, out, P, max_tokens, out.stride(0), sinks, **rconsts,
                                          **target.launch_options(4))  # fmt: skip
        else:
            _reduce_kernel[(B, Hq)](acc, ml, ctx_lens, out, P, max_tokens, out.stride(0), **rconsts,
                                    **target.launch_options(4))  # fmt: skip

