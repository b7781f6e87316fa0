"""freetoken_cpu_moe.paged_attention against a float64 numpy reference: decode (one query per
sequence) and prompt chunks (causal), GQA ratios, several sequences of different lengths in one
call, contexts on and around block boundaries, sliding windows and sinks, float32 / bfloat16 /
float16 caches, every ISA tier, pools of 1..n workers, poisoned outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import freetoken_cpu_moe as cm
from freetoken_cpu_moe.attention import paged_attention
from freetoken_cpu_moe.pool import Pool

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_case(rng: np.random.Generator, ctxs: list[int], qlens: list[int], kvh: int, g: int, D: int, bs: int,
              dtype: torch.dtype, extra_blocks: int = 3):  # fmt: skip
    """Random caches with each sequence's blocks scattered over the pool (shuffled ids)."""
    need = [-(-c // bs) for c in ctxs]
    nb = sum(need) + extra_blocks
    ids = rng.permutation(nb)
    tables, at = [], 0
    width = max(need) + 1
    for n in need:
        row = np.full(width, rng.integers(0, nb), dtype=np.int64)  # padding: any valid id
        row[:n] = ids[at:at + n]
        at += n
        tables.append(row)
    k = torch.from_numpy(rng.standard_normal((nb, bs, kvh, D)).astype(np.float32)).to(dtype)
    v = torch.from_numpy(rng.standard_normal((nb, bs, kvh, D)).astype(np.float32)).to(dtype)
    T = sum(qlens)
    q = torch.from_numpy(rng.standard_normal((T, kvh * g, D)).astype(np.float32)).to(dtype)
    starts = np.cumsum([0] + qlens[:-1]).astype(np.int32)
    return q, k, v, starts, np.array(qlens, np.int32), np.array(ctxs, np.int32), np.stack(tables)


def reference(q, k, v, starts, qlens, ctxs, table, scale, window=None, sinks=None) -> np.ndarray:
    """float64: every query against its sequence's gathered context, masked causally."""
    qf = q.double().numpy()
    kf, vf = k.double().numpy(), v.double().numpy()
    T, H, D = qf.shape
    nb, bs, kvh, _ = kf.shape
    g = H // kvh
    out = np.zeros((T, H, D))
    for s in range(len(starts)):
        ctx, ql = int(ctxs[s]), int(qlens[s])
        pos = np.arange(ctx)
        ks = kf[table[s, pos // bs], pos % bs]  # [ctx, kvh, D]
        vs = vf[table[s, pos // bs], pos % bs]
        for i in range(ql):
            p = ctx - ql + i
            allowed = pos <= p
            if window is not None:
                allowed &= pos > p - window
            for h in range(H):
                sc = ks[:, h // g] @ qf[starts[s] + i, h] * scale
                sc = np.where(allowed, sc, -np.inf)
                m = sc.max()
                if sinks is not None:
                    m = max(m, float(sinks[h]))
                e = np.exp(sc - m)
                den = e.sum() + (np.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
                out[starts[s] + i, h] = (e @ vs[:, h // g]) / den
    return out.reshape(T, H * D)


def tol(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]


def check(out: torch.Tensor, ref: np.ndarray, dtype: torch.dtype) -> None:
    got = out.double().numpy()
    assert np.isfinite(got).all()
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err < tol(dtype), f"max error {err:.3g} (relative to the largest output)"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("g", [1, 4, 8])
def test_decode_several_sequences(rng, dtype, g):
    dt = DTYPES[dtype]
    bs = 16
    ctxs = [1, 15, 16, 17, 33, 200, 513]  # inside, on and just past block boundaries
    q, k, v, starts, qlens, ctx, table = make_case(rng, ctxs, [1] * len(ctxs), kvh=2, g=g, D=64, bs=bs, dtype=dt)
    scale = 64 ** -0.5
    out = torch.full((len(ctxs), 2 * g * 64), float("nan"), dtype=dt)  # poisoned
    paged_attention(q, k, v, starts, qlens, ctx, table, scale, out=out)
    check(out, reference(q, k, v, starts, qlens, ctx, table, scale), dt)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("ctx_len", [1, 31, 32, 64, 65, 700, 2049])
def test_decode_pool_sizes_and_lengths(rng, threads, ctx_len):
    """One sequence, Qwen3-30B-A3B heads (32 q / 4 kv of 128): the contexts split into pieces
    the merge puts back together, whatever the number of workers."""
    q, k, v, starts, qlens, ctx, table = make_case(rng, [ctx_len], [1], kvh=4, g=8, D=128, bs=16,
                                                   dtype=torch.float32)  # fmt: skip
    with Pool(threads) as pool:
        out = paged_attention(q, k, v, starts, qlens, ctx, table, 128 ** -0.5, pool=pool)
    check(out, reference(q, k, v, starts, qlens, ctx, table, 128 ** -0.5), torch.float32)


@pytest.mark.parametrize("isa", cm.isa_tiers())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("D", [80, 128])
def test_prompt_chunks_every_tier(rng, isa, dtype, D):
    """Prompt steps: a whole prompt (q_len == ctx_len), a chunk after cached context, and a
    decode token in the same call; head_dim 80 (not a multiple of 16) and 128."""
    dt = DTYPES[dtype]
    ctxs, qlens = [70, 150, 9], [70, 37, 1]
    q, k, v, starts, ql, ctx, table = make_case(rng, ctxs, qlens, kvh=2, g=3, D=D, bs=8, dtype=dt)
    out = paged_attention(q, k, v, starts, ql, ctx, table, 0.11, isa=isa)
    check(out, reference(q, k, v, starts, ql, ctx, table, 0.11), dt)


@pytest.mark.parametrize("isa", cm.isa_tiers())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("D", [64, 128, 256])
def test_register_blocked_head_dims_every_tier(rng, isa, dtype, D):
    """The head sizes the vector tiers hold in registers (64, 128, 256), on every tier this CPU
    has: decode tokens and a prompt chunk whose contexts end inside, on and past a chunk of
    keys (8 on avx2, 16 on avx512), with a sliding window and sinks, into a poisoned output."""
    dt = DTYPES[dtype]
    ctxs, qlens = [1, 7, 8, 9, 17, 95, 60], [1, 1, 1, 1, 1, 1, 23]
    q, k, v, starts, ql, ctx, table = make_case(rng, ctxs, qlens, kvh=2, g=4, D=D, bs=16, dtype=dt)
    sinks = torch.from_numpy(rng.standard_normal(8).astype(np.float32) * 2)
    scale = D ** -0.5
    for w, s in ((None, None), (13, sinks)):
        out = torch.full((int(ql.sum()), 8 * D), float("nan"), dtype=dt)
        paged_attention(q, k, v, starts, ql, ctx, table, scale, window=w, sinks=s, out=out, isa=isa)
        check(out, reference(q, k, v, starts, ql, ctx, table, scale, window=w,
                             sinks=None if s is None else s.numpy()), dt)  # fmt: skip


@pytest.mark.parametrize("isa", cm.isa_tiers())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("D, g", [(64, 1), (128, 8), (256, 2)])
def test_prompt_blocks_across_key_chunks(rng, isa, dtype, D, g):
    """Many query vectors per kv head (the vector tiers' block kernels: chunks of 64 keys on
    avx512, 16 on avx2, transposed): whole prompts and chunks after cached context whose contexts
    end inside, on and just past a chunk, queries whose causal limit falls in a chunk's middle,
    beside decode tokens (a GQA group of 8 or of 2 heads, or 1), plain and with a window and
    sinks, into a poisoned output."""
    dt = DTYPES[dtype]
    ctxs, qlens = [129, 64, 300, 65, 18], [129, 40, 77, 1, 18]
    q, k, v, starts, ql, ctx, table = make_case(rng, ctxs, qlens, kvh=2, g=g, D=D, bs=16, dtype=dt)
    H = 2 * g
    sinks = torch.from_numpy(rng.standard_normal(H).astype(np.float32) * 2)
    scale = D ** -0.5
    for w, s in ((None, None), (70, sinks)):
        out = torch.full((int(ql.sum()), H * D), float("nan"), dtype=dt)
        paged_attention(q, k, v, starts, ql, ctx, table, scale, window=w, sinks=s, out=out, isa=isa)
        check(out, reference(q, k, v, starts, ql, ctx, table, scale, window=w,
                             sinks=None if s is None else s.numpy()), dt)  # fmt: skip


@pytest.mark.parametrize("window", [1, 5, 64])
def test_window_and_sinks(rng, window):
    ctxs, qlens = [100, 40], [1, 40]
    q, k, v, starts, ql, ctx, table = make_case(rng, ctxs, qlens, kvh=2, g=2, D=64, bs=16, dtype=torch.float32)
    sinks = torch.from_numpy(rng.standard_normal(4).astype(np.float32) * 3)
    for w, s in ((window, None), (None, sinks), (window, sinks)):
        out = paged_attention(q, k, v, starts, ql, ctx, table, 0.125, window=w, sinks=s)
        check(out, reference(q, k, v, starts, ql, ctx, table, 0.125, window=w,
                             sinks=None if s is None else s.numpy()), torch.float32)  # fmt: skip


def test_rows_without_a_sequence_are_zero(rng):
    q, k, v, starts, ql, ctx, table = make_case(rng, [20], [1], kvh=1, g=2, D=32, bs=4, dtype=torch.float32)
    q = torch.cat([q, q])  # token 1 belongs to no sequence
    out = torch.full((2, 64), float("nan"))
    paged_attention(q, k, v, starts, ql, ctx, table, 0.2, out=out)
    assert (out[1] == 0).all()
    check(out[:1], reference(q[:1], k, v, starts, ql, ctx, table, 0.2), torch.float32)


def test_strided_queries(rng):
    """q as the first heads of a wider [T, heads + kv_heads, D] tensor (the fused q/k output)."""
    q, k, v, starts, ql, ctx, table = make_case(rng, [50, 3], [1, 3], kvh=2, g=2, D=32, bs=16, dtype=torch.float32)
    wide = torch.cat([q, torch.randn(q.shape[0], 2, 32)], dim=1)
    out = paged_attention(wide[:, :4], k, v, starts, ql, ctx, table, 0.3)
    check(out, reference(q, k, v, starts, ql, ctx, table, 0.3), torch.float32)


def test_bad_input_is_an_error(rng):
    q, k, v, starts, ql, ctx, table = make_case(rng, [20], [1], kvh=2, g=2, D=32, bs=4, dtype=torch.float32)
    bad = table.copy()
    bad[0, 0] = k.shape[0]
    with pytest.raises(ValueError, match="block id"):
        paged_attention(q, k, v, starts, ql, ctx, bad, 0.2)
    with pytest.raises(ValueError, match="blocks, the table has"):
        paged_attention(q, k, v, starts, ql, np.array([999], np.int32), table, 0.2)
    with pytest.raises(ValueError, match="shorter than"):
        paged_attention(q, k, v, starts, np.array([1], np.int32), np.array([0], np.int32), table, 0.2)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention(q[:, :3], k, v, starts, ql, ctx, table, 0.2)
