"""Triton kernels of :mod:`freetoken.models.dense_ops`: the small per-token operations of a
decoder layer fused so that a decode step launches a few kernels per layer, not dozens.

* ``add_rms_norm``   grid (T,): ``h += delta`` (optional), ``x = w * rmsnorm(h)``
* ``qk_norm_rope``   grid (T, Hq + Hkv): per head RMSNorm with its weight, NeoX rotary
                     embedding at the token's position; q heads go to a contiguous
                     ``[T, Hq, D]`` output, k heads (and the matching v head) straight into
                     their paged cache slot. Any even head size ``D`` and any v head size
                     ``DV``: a head is a tile of the next power of two, lanes past it masked
* ``bias_rope``      grid (T, Hq + Hkv): ``qk_norm_rope`` without the norm, the projections'
                     float32 biases (optional) added first (GPT-OSS: q, k and v biases, NeoX
                     RoPE with YaRN's tables)
* ``moe_bias_add``   grid (T, H / BLOCK): ``y[:, :H] + sum_k w[:, k] * bias[ids[:, k]]`` in
                     float32, stored in the activation dtype (the routed experts' down biases)
* ``router_top_k``   grid (T,): the top-k of the router logits (descending) and their
                     softmax weights (over the top-k, or over every expert)
* ``router_logits``  grid (E / BLOCK_E, T): a decode step's float32 router logits from the
                     activations as they are (no float32 copy of them, one launch instead of
                     a cast and cuBLAS's two-kernel GEMV)
* ``add_norm_route`` grid (E / BLOCK_E, T): ``add_rms_norm``, ``router_logits`` and
                     ``router_top_k`` of a decode step in one launch: every program computes
                     the token's norm (the first also stores ``h`` and ``x``) and its experts'
                     logits; the token's last program to finish (a counter taken with an
                     atomic add) selects the top-k from every program's logits and sets the
                     counter back to zero for the next launch (a float32 router bias added
                     to the logits where the router has one)
* ``add_norm_grouped_route`` the same with ``grouped_top_k``'s choice (GLM-4.5, DeepSeek)

Each kernel rounds to the activation dtype at the points where the torch implementation
(:class:`freetoken.models.dense_ops.TorchDenseOps`) stores a tensor in that dtype and
computes in float32 in between, so both agree to the rounding of one operation.

triton is optional: import this module lazily, only when the Triton implementation runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.backends import triton_target


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, h_out_ptr, x_out_ptr, N, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    h = tl.load(h_ptr + row * N + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * N + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_out_ptr.dtype.element_ty)
        tl.store(h_out_ptr + row * N + offs, h, mask=mask)
    hf = h.to(tl.float32)
    r = tl.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
    n = (hf * r).to(x_out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_out_ptr + row * N + offs, (w * n).to(x_out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(h, delta, weight, eps: float, h_out, x_out) -> None:
    T, N = h.shape
    if T == 0:
        return
    block = triton.next_power_of_2(N)
    opts = triton_target.for_device(h.device).launch_options(8 if block >= 2048 else 4)
    _add_rms_norm_kernel[(T,)](h, delta if delta is not None else h, weight, h_out, x_out, N, eps,
                               HAS_DELTA=delta is not None, BLOCK=block, **opts)  # fmt: skip


@triton.jit
def _norm_rope_head(src, w_ptr, cos, sin, offs, rolled, mask, eps, D: tl.constexpr, dtype: tl.constexpr):
    """One head: ``rope(w * rmsnorm(x))`` in ``dtype`` (rounded where torch rounds). Lanes
    ``offs >= D`` (the tile padded to a power of two) load zeros and add nothing to the norm,
    whose mean is over the ``D`` true lanes."""
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(src + rolled, mask=mask, other=0.0).to(tl.float32)  # the rotate-half partner of each element
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wr = tl.load(w_ptr + rolled, mask=mask, other=0.0).to(tl.float32)
    n = (w * (x * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    nr = (wr * (xr * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    a = (n * cos).to(dtype).to(tl.float32)
    return (a + nr * sin).to(dtype)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, q_stride, k_ptr, k_stride, v_ptr, v_stride, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                         pos_ptr, slot_ptr, q_out_ptr, kc_ptr, vc_ptr, eps,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    # any head size: the tile is the next power of two, lanes past D masked
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    rolled = tl.where(mask, (offs + D // 2) % D, 0)  # NeoX pairs (i, i + D/2) of an even D
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # the tables are float32; torch's path casts them to the activation dtype first
    cos = tl.load(cos_ptr + pos * D + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * D + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    if h < HQ:
        out = _norm_rope_head(q_ptr + t * q_stride + h * D, qw_ptr, cos, sin, offs, rolled, mask, eps, D, dtype)
        tl.store(q_out_ptr + (t * HQ + h) * D + offs, out, mask=mask)
    else:
        kh = h - HQ
        out = _norm_rope_head(k_ptr + t * k_stride + kh * D, kw_ptr, cos, sin, offs, rolled, mask, eps, D, dtype)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        tl.store(kc_ptr + slot * (HKV * D) + kh * D + offs, out.to(kc_ptr.dtype.element_ty), mask=mask)
        offs_v = tl.arange(0, BLOCK_DV)
        v_ok = offs_v < DV
        v = tl.load(v_ptr + t * v_stride + kh * DV + offs_v, mask=v_ok)
        tl.store(vc_ptr + slot * (HKV * DV) + kh * DV + offs_v, v.to(vc_ptr.dtype.element_ty), mask=v_ok)


def qk_norm_rope(q, k, v, q_weight, k_weight, cos, sin, positions, slots, k_cache, v_cache, eps: float,
                 q_out) -> None:  # fmt: skip
    """``q_out [T, Hq, D]`` = RoPE(RMSNorm(q)), and RoPE(RMSNorm(k)) and v stored into cache
    ``slots``; ``k_cache [.., Hkv, D]``, ``v_cache [.., Hkv, DV]`` (DV may differ from D).
    Any even ``D`` (the RoPE pairs ``(i, i + D/2)``), any ``DV``:
    :func:`freetoken.kernels.availability.head_dim_support` says which."""
    T, heads, opts = _head_grid(q, q_out, k_cache, v_cache)
    if T:
        _qk_norm_rope_kernel[(T, heads["HQ"] + heads["HKV"])](
            q, q.stride(0), k, k.stride(0), v, v.stride(0), q_weight, k_weight, cos, sin, positions, slots, q_out,
            k_cache, v_cache, eps, **heads, **opts)  # fmt: skip


def _head_grid(q, q_out, k_cache, v_cache) -> tuple[int, dict[str, int], dict[str, int]]:
    """The tokens, the head sizes and tiles (``HQ``, ``HKV``, ``D``, ``DV``, ``BLOCK_D``,
    ``BLOCK_DV``) and the launch options of the per-head RoPE kernels."""
    Hkv, D, DV = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    heads = dict(HQ=q_out.shape[1], HKV=Hkv, D=D, DV=DV, BLOCK_D=triton.next_power_of_2(D),
                 BLOCK_DV=triton.next_power_of_2(DV))  # fmt: skip
    return q.shape[0], heads, triton_target.for_device(q.device).launch_options(1 if max(D, DV) <= 128 else 2)


@triton.jit
def _bias_rope_head(src, b_ptr, cos, sin, offs, rolled, mask, D: tl.constexpr, dtype: tl.constexpr,
                    HAS_BIAS: tl.constexpr):  # fmt: skip
    """One head: ``rope(x + b)`` in ``dtype``, the float32 bias first rounded to ``dtype`` and
    the sum rounded again (as torch adds ``b.to(dtype)``)."""
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(src + rolled, mask=mask, other=0.0).to(tl.float32)  # the rotate-half partner of each element
    if HAS_BIAS:
        x = (x + tl.load(b_ptr + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        xr = (xr + tl.load(b_ptr + rolled, mask=mask, other=0.0).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    a = (x * cos).to(dtype).to(tl.float32)
    return (a + xr * sin).to(dtype)


@triton.jit
def _bias_rope_kernel(q_ptr, q_stride, k_ptr, k_stride, v_ptr, v_stride, qb_ptr, kb_ptr, vb_ptr, cos_ptr, sin_ptr,
                      pos_ptr, slot_ptr, q_out_ptr, kc_ptr, vc_ptr,
                      HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    rolled = tl.where(mask, (offs + D // 2) % D, 0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * D + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * D + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    if h < HQ:
        out = _bias_rope_head(q_ptr + t * q_stride + h * D, qb_ptr + h * D, cos, sin, offs, rolled, mask, D, dtype,
                              HAS_BIAS)  # fmt: skip
        tl.store(q_out_ptr + (t * HQ + h) * D + offs, out, mask=mask)
    else:
        kh = h - HQ
        out = _bias_rope_head(k_ptr + t * k_stride + kh * D, kb_ptr + kh * D, cos, sin, offs, rolled, mask, D, dtype,
                              HAS_BIAS)  # fmt: skip
        slot = tl.load(slot_ptr + t).to(tl.int64)
        tl.store(kc_ptr + slot * (HKV * D) + kh * D + offs, out.to(kc_ptr.dtype.element_ty), mask=mask)
        offs_v = tl.arange(0, BLOCK_DV)
        v_ok = offs_v < DV
        v = tl.load(v_ptr + t * v_stride + kh * DV + offs_v, mask=v_ok)
        if HAS_BIAS:
            v = (v.to(tl.float32) + tl.load(vb_ptr + kh * DV + offs_v, mask=v_ok).to(dtype).to(tl.float32)).to(dtype)
        tl.store(vc_ptr + slot * (HKV * DV) + kh * DV + offs_v, v.to(vc_ptr.dtype.element_ty), mask=v_ok)


def bias_rope(q, k, v, bias, cos, sin, positions, slots, k_cache, v_cache, q_out) -> None:
    """``q_out [T, Hq, D]`` = RoPE(q + bq), RoPE(k + bk) and v + bv stored into cache ``slots``
    (``bias``: float32 ``(bq [Hq*D], bk [Hkv*D], bv [Hkv*DV])`` or None); the head sizes as
    :func:`qk_norm_rope` takes them."""
    T, heads, opts = _head_grid(q, q_out, k_cache, v_cache)
    qb, kb, vb = bias if bias is not None else (q, k, v)  # (unread without biases)
    if T:
        _bias_rope_kernel[(T, heads["HQ"] + heads["HKV"])](
            q, q.stride(0), k, k.stride(0), v, v.stride(0), qb, kb, vb, cos, sin, positions, slots, q_out, k_cache,
            v_cache, **heads, HAS_BIAS=bias is not None, **opts)  # fmt: skip


@triton.jit
def _moe_bias_add_kernel(y_ptr, y_stride, ids_ptr, w_ptr, bias_ptr, out_ptr, H, K: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(K):
        e = tl.load(ids_ptr + t * K + j).to(tl.int64)
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += wj * tl.load(bias_ptr + e * H + offs, mask=ok & (e >= 0), other=0.0)
    y = tl.load(y_ptr + t * y_stride + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, (y + acc).to(out_ptr.dtype.element_ty), mask=ok)


def moe_bias_add(y, ids, w, bias, out) -> None:
    """``out [T, H] = y[:, :H] + sum_k w[:, k] * bias[ids[:, k]]`` (float32 ``bias [E, H]``,
    ``y`` rows of at least H values with unit stride, ids < 0 adding nothing), summed in
    float32 and stored in ``out``'s dtype."""
    T, H = out.shape
    if T == 0:
        return
    K = ids.shape[1]
    block = min(1024, triton.next_power_of_2(H))
    opts = triton_target.for_device(y.device).launch_options(4)
    _moe_bias_add_kernel[(T, triton.cdiv(H, block))](y, y.stride(0), ids, w, bias, out, H, K=K, BLOCK=block,
                                                      **opts)  # fmt: skip


@triton.jit
def _router_top_k_kernel(logits_ptr, ids_ptr, w_ptr, E, K: tl.constexpr, KP: tl.constexpr,
                         NORM: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    vals = tl.load(logits_ptr + row * E + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    kk, ids, w = _select_top_k(vals, offs, BLOCK, K, KP, NORM)
    tl.store(ids_ptr + row * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + row * K + kk, w, mask=kk < K)


@triton.jit
def _select_top_k(vals, offs, BLOCK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr):
    """The top-``K`` of the float32 logits ``vals`` (``-inf`` past the experts; descending,
    the lowest index among equal values) and their weights: ``(kk, ids, w)`` over ``KP`` lanes."""
    kk = tl.arange(0, KP)
    top = tl.full((KP,), float("-inf"), tl.float32)
    ids = tl.zeros((KP,), tl.int32)
    rest = vals
    for j in tl.static_range(K):
        m = tl.max(rest, axis=0)
        i = tl.min(tl.where(rest == m, offs, BLOCK), axis=0)
        top = tl.where(kk == j, m, top)
        ids = tl.where(kk == j, i, ids)
        rest = tl.where(offs == i, float("-inf"), rest)
    if NORM:  # softmax of the top-k logits
        p = tl.exp(top - tl.max(top, axis=0))
        w = p / tl.sum(p, axis=0)
    else:  # their probabilities under the softmax over every expert
        mx = tl.max(vals, axis=0)
        w = tl.exp(top - mx) / tl.sum(tl.exp(vals - mx), axis=0)
    return kk, ids, w


def router_top_k(logits, k: int, norm: bool, ids_out, w_out) -> None:
    T, E = logits.shape
    if T == 0:
        return
    opts = triton_target.for_device(logits.device).launch_options(1 if E <= 256 else 4)
    _router_top_k_kernel[(T,)](logits, ids_out, w_out, E, K=k, KP=triton.next_power_of_2(k), NORM=norm,
                               BLOCK=triton.next_power_of_2(E), **opts)  # fmt: skip


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, H: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_H: tl.constexpr):  # fmt: skip
    t = tl.program_id(1).to(tl.int64)
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    acc = tl.zeros((BLOCK_E, BLOCK_H), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        xv = tl.load(x_ptr + t * H + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + offs_e.to(tl.int64)[:, None] * H + offs_h[None, :], mask=e_ok[:, None] & h_ok[None, :],
                     other=0.0)
        acc += wv * xv[None, :]
    tl.store(out_ptr + t * E + offs_e, tl.sum(acc, axis=1), mask=e_ok)


#: experts per program of :func:`router_logits` (Qwen3-30B-A3B: 32 programs of 4 x 2048 float32 weights)
ROUTER_BLOCK_E = 4


def router_logits(x, weight, out) -> None:
    """``out [T, E]`` float32 = ``x [T, H]`` (any float dtype, contiguous) times the float32
    ``weight [E, H]`` transposed, accumulated in float32."""
    T, H = x.shape
    E = weight.shape[0]
    if T == 0:
        return
    opts = triton_target.for_device(x.device).launch_options(4)
    _router_logits_kernel[(triton.cdiv(E, ROUTER_BLOCK_E), T)](
        x, weight, out, H=H, E=E, BLOCK_E=ROUTER_BLOCK_E, BLOCK_H=min(512, triton.next_power_of_2(H)), **opts)


@triton.jit
def _norm_route_logits(h_ptr, d_ptr, nw_ptr, rw_ptr, rb_ptr, h_out_ptr, x_out_ptr, logits_ptr, count_ptr, N, E, eps,
                       BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """The shared part of the fused decode routings: token ``t``'s ``add_rms_norm`` (the
    first program stores ``h`` and ``x``) and this program's experts' float32 logits (plus the
    router's bias); True in the token's last program to finish, which then sees every
    program's logits (and sets the counter back to zero after its selection)."""
    pid = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    # this program's experts' router weights (no kernel writes them: loaded first)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    wv = tl.load(rw_ptr + offs_e.to(tl.int64)[:, None] * N + offs[None, :], mask=e_ok[:, None] & mask[None, :],
                 other=0.0)
    # add_rms_norm, rounded at the same points as _add_rms_norm_kernel
    h = tl.load(h_ptr + t * N + offs, mask=mask, other=0.0)
    d = tl.load(d_ptr + t * N + offs, mask=mask, other=0.0)
    h = (h.to(tl.float32) + d.to(tl.float32)).to(h_out_ptr.dtype.element_ty)
    hf = h.to(tl.float32)
    r = tl.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
    n = (hf * r).to(x_out_ptr.dtype.element_ty).to(tl.float32)
    nw = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = (nw * n).to(x_out_ptr.dtype.element_ty)
    if pid == 0:
        tl.store(h_out_ptr + t * N + offs, h, mask=mask)
        tl.store(x_out_ptr + t * N + offs, x, mask=mask)
    # this program's experts' logits: float32 weights times the activations as stored (plus
    # the router's float32 bias)
    logit = tl.sum(wv * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        logit += tl.load(rb_ptr + offs_e, mask=e_ok, other=0.0)
    tl.store(logits_ptr + t * E + offs_e, logit, mask=e_ok)
    # every thread's logits stored before the count goes up (the atomic releases them at GPU
    # scope); the program that takes the count to the number of programs selects
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel", scope="gpu")
    return done == tl.num_programs(0) - 1


@triton.jit
def _add_norm_route_kernel(h_ptr, d_ptr, nw_ptr, rw_ptr, rb_ptr, h_out_ptr, x_out_ptr, logits_ptr, count_ptr,
                           ids_ptr, w_ptr, N, E, eps, K: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                           BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, EP: tl.constexpr,
                           HAS_BIAS: tl.constexpr):  # fmt: skip
    t = tl.program_id(1).to(tl.int64)
    if _norm_route_logits(h_ptr, d_ptr, nw_ptr, rw_ptr, rb_ptr, h_out_ptr, x_out_ptr, logits_ptr, count_ptr, N, E,
                          eps, BLOCK, BLOCK_E, HAS_BIAS):  # fmt: skip
        eo = tl.arange(0, EP)
        vals = tl.load(logits_ptr + t * E + eo, mask=eo < E, other=float("-inf"), cache_modifier=".cg")
        kk, ids, w = _select_top_k(vals, eo, EP, K, KP, NORM)
        tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)
        tl.store(w_ptr + t * K + kk, w, mask=kk < K)
        tl.atomic_xchg(count_ptr + t, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _add_norm_grouped_route_kernel(h_ptr, d_ptr, nw_ptr, rw_ptr, h_out_ptr, x_out_ptr, logits_ptr, count_ptr, cb_ptr,
                                   ids_ptr, w_ptr, N, eps, scale, E: tl.constexpr, GROUPS: tl.constexpr,
                                   PER: tl.constexpr, GP: tl.constexpr, PP: tl.constexpr,
                                   TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                                   SIGMOID: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr,
                                   BLOCK_E: tl.constexpr):  # fmt: skip
    t = tl.program_id(1).to(tl.int64)
    if _norm_route_logits(h_ptr, d_ptr, nw_ptr, rw_ptr, rw_ptr, h_out_ptr, x_out_ptr, logits_ptr, count_ptr, N, E,
                          eps, BLOCK, BLOCK_E, False):  # fmt: skip
        kk, ids, w = _grouped_select(logits_ptr + t * E, cb_ptr, E, GROUPS, PER, GP, PP, TOPK_GROUP, K, KP, SIGMOID,
                                     NORM, ".cg")  # fmt: skip
        tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)
        tl.store(w_ptr + t * K + kk, w * scale, mask=kk < K)
        tl.atomic_xchg(count_ptr + t, 0, sem="relaxed", scope="gpu")  # ready for the next launch


#: experts per program of :func:`add_norm_route`
ROUTE_BLOCK_E = 4


def _route_warps(block: int) -> int:
    """Warps of the fused routings' programs for rows of ``block`` values (a power of two):
    a program holds ``ROUTE_BLOCK_E`` rows of router weights, ``BLOCK_E * block / (32 *
    warps)`` float32 values a thread: 16 warps from 8192 (DeepSeek-V3's 7168, GLM-4.5's
    5120: 128 registers a thread for sm_90 instead of 254 with 8), 8 from 2048, else 4."""
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def add_norm_route(h, delta, norm_weight, eps: float, router_weight, k: int, norm: bool, h_out, x_out, logits,
                   counts, ids_out, w_out, block_e: int = ROUTE_BLOCK_E, num_warps: int = 0,
                   bias=None) -> None:  # fmt: skip
    """``add_rms_norm(h, delta)`` into ``h_out``/``x_out``, the router's float32 logits of
    ``x_out`` (plus its float32 ``bias [E]``, if any) into ``logits [T, E]`` and their
    :func:`router_top_k` into ``ids_out``/``w_out``,
    one launch. ``counts``: int32 ``[>= T]`` zeros, left zero (one program per token and
    launch increments it; the last sets it back). ``block_e`` experts per program (a power of
    two) and ``num_warps`` (0: :func:`_route_warps`) are the tile."""
    T, N = h.shape
    E = router_weight.shape[0]
    if T == 0:
        return
    block = triton.next_power_of_2(N)
    opts = triton_target.for_device(h.device).launch_options(num_warps or _route_warps(block))
    _add_norm_route_kernel[(triton.cdiv(E, block_e), T)](
        h, delta, norm_weight, router_weight, router_weight if bias is None else bias, h_out, x_out, logits, counts,
        ids_out, w_out, N, E, eps, K=k, KP=triton.next_power_of_2(k), NORM=norm, BLOCK=block, BLOCK_E=block_e,
        EP=triton.next_power_of_2(E), HAS_BIAS=bias is not None, **opts)  # fmt: skip


@triton.jit
def _grouped_select(row_ptr, bias_ptr, E: tl.constexpr, GROUPS: tl.constexpr, PER: tl.constexpr, GP: tl.constexpr,
                    PP: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                    SIGMOID: tl.constexpr, NORM: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
    """:func:`grouped_top_k`'s choice for one token's float32 logits at ``row_ptr``: ``(kk,
    ids, w)`` over ``KP`` lanes, the weights not yet scaled. ``CACHE``: the logits' load's
    cache modifier ("" or ".cg" where other programs of the launch just stored them)."""
    g = tl.arange(0, GP)[:, None]
    p = tl.arange(0, PP)[None, :]
    ok = (g < GROUPS) & (p < PER)
    idx = g * PER + p  # [GP, PP]: the expert of each lane
    v = tl.load(row_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=CACHE).to(tl.float32)
    if SIGMOID:
        scores = tl.where(ok, 1.0 / (1.0 + tl.exp(-v)), 0.0)
        choice = tl.where(ok, scores + tl.load(bias_ptr + idx, mask=ok, other=0.0), float("-inf"))
    else:
        ex = tl.where(ok, tl.exp(v - tl.max(tl.max(v, axis=1), axis=0)), 0.0)
        scores = ex / tl.sum(tl.sum(ex, axis=1), axis=0)
        choice = tl.where(ok, scores, float("-inf"))
    if TOPK_GROUP < GROUPS:
        # a group's score: its two best corrected scores summed (sigmoid), its best (softmax)
        best = tl.max(choice, axis=1)  # [GP]
        if SIGMOID and PER > 1:
            first = tl.min(tl.where(choice == best[:, None], idx, E), axis=1)
            best += tl.max(tl.where(idx == first[:, None], float("-inf"), choice), axis=1)
        gi = tl.arange(0, GP)
        best = tl.where(gi < GROUPS, best, float("-inf"))
        kept = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            m = tl.max(best, axis=0)
            pick = tl.min(tl.where(best == m, gi, GP), axis=0)
            kept = kept | (gi == pick)
            best = tl.where(gi == pick, float("-inf"), best)
        choice = tl.where(kept[:, None], choice, float("-inf"))
    kk = tl.arange(0, KP)
    ids = tl.zeros((KP,), tl.int32)
    w = tl.zeros((KP,), tl.float32)
    for j in tl.static_range(K):
        m = tl.max(tl.max(choice, axis=1), axis=0)
        i = tl.min(tl.min(tl.where(choice == m, idx, E), axis=1), axis=0)
        ids = tl.where(kk == j, i, ids)
        w = tl.where(kk == j, tl.sum(tl.sum(tl.where(idx == i, scores, 0.0), axis=1), axis=0), w)
        choice = tl.where(idx == i, float("-inf"), choice)
    if NORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    return kk, ids, w


@triton.jit
def _grouped_top_k_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, scale, E: tl.constexpr, GROUPS: tl.constexpr,
                          PER: tl.constexpr, GP: tl.constexpr, PP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                          K: tl.constexpr, KP: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    kk, ids, w = _grouped_select(logits_ptr + row * E, bias_ptr, E, GROUPS, PER, GP, PP, TOPK_GROUP, K, KP, SIGMOID,
                                 NORM, "")  # fmt: skip
    tl.store(ids_ptr + row * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + row * K + kk, w * scale, mask=kk < K)


def _grouped_consts(E: int, groups: int, topk_group: int, k: int, sigmoid: bool, norm: bool) -> dict:
    """The constexprs of the grouped selection (:func:`_grouped_select`)."""
    per = E // groups
    return dict(E=E, GROUPS=groups, PER=per, GP=triton.next_power_of_2(groups), PP=triton.next_power_of_2(per),
                TOPK_GROUP=topk_group, K=k, KP=triton.next_power_of_2(k), SIGMOID=sigmoid, NORM=norm)


def add_norm_grouped_route(h, delta, norm_weight, eps: float, router_weight, correction_bias, groups: int,
                           topk_group: int, k: int, sigmoid: bool, norm: bool, scale: float, h_out, x_out, logits,
                           counts, ids_out, w_out, block_e: int = ROUTE_BLOCK_E) -> None:  # fmt: skip
    """:func:`add_norm_route` with :func:`grouped_top_k`'s choice (``correction_bias``: float32
    ``[E]`` for sigmoid scoring, None for softmax), one launch."""
    T, N = h.shape
    E = router_weight.shape[0]
    if T == 0:
        return
    block = triton.next_power_of_2(N)
    opts = triton_target.for_device(h.device).launch_options(_route_warps(block))
    _add_norm_grouped_route_kernel[(triton.cdiv(E, block_e), T)](
        h, delta, norm_weight, router_weight, h_out, x_out, logits, counts,
        correction_bias if correction_bias is not None else router_weight, ids_out, w_out, N, eps, float(scale),
        **_grouped_consts(E, groups, topk_group, k, sigmoid, norm), BLOCK=block, BLOCK_E=block_e, **opts)  # fmt: skip


#: the most routed experts :func:`grouped_top_k` takes (a program holds a token's scores)
GROUPED_TOP_K_MAX_EXPERTS = 1024


def grouped_top_k(logits, bias, groups: int, topk_group: int, k: int, sigmoid: bool, norm: bool, scale: float,
                  ids_out, w_out) -> None:  # fmt: skip
    """Grouped top-``k`` of float32 ``logits [T, E]`` into ``ids_out`` (int32 ``[T, k]``) and
    ``w_out`` (float32), one program per token: sigmoid scores plus the float32 correction
    ``bias [E]`` for the choice (``sigmoid``; else softmax scores and no bias), the experts
    of the ``topk_group`` best of ``groups`` consecutive groups (a group's score: the sum of
    its two best choices, or its best under softmax), the ``k`` best choices among them in
    descending order (the lowest id among equals), weighted by their scores, divided by
    their sum (plus 1e-20) when ``norm``, times ``scale``."""
    T, E = logits.shape
    if T == 0:
        return
    opts = triton_target.for_device(logits.device).launch_options(1 if E <= 256 else 4)
    _grouped_top_k_kernel[(T,)](logits, bias if bias is not None else logits, ids_out, w_out, float(scale),
                                **_grouped_consts(E, groups, topk_group, k, sigmoid, norm), **opts)  # fmt: skip
