"""Paged decode attention (freetoken.models.decode_attention): both implementations against
an independent float64 reference, and CUDA graph capture/replay.

The reference (:func:`reference`) loops over sequences and heads on the gathered context
in float64. Every case builds a cache full of NaN and writes finite values only into the
slots inside some sequence's context, so unused slots (the tail of a sequence's last
block, the scratch block that pads block tables) hold NaN that must never reach a
result; block tables are shuffled, non-contiguous block ids; context lengths include 1,
block boundaries, a padded row (0 -> zeros) and the table's full length; outputs are
poisoned with NaN first; seeds are fresh per session (printed with every failure).

Without a GPU (CPU CI) the Triton kernels run in Triton's interpreter on CPU tensors at
small sizes (conftest.py sets TRITON_INTERPRET=1); with one, the same tests run compiled,
and the tests marked ``gpu`` add realistic sizes (Qwen3-30B-A3B: 32 query heads, 4 kv
heads, head_dim 128, block size 16, contexts up to 32k) and graph capture.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
from typing import Optional

import pytest
import torch

from freetoken.models import decode_attention as da

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BASE_SEED = random.SystemRandom().randrange(1 << 30)
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}

try:
    import triton

    HAVE_TRITON = True
    TRITON_RUNS = DEV == "cuda" or triton.knobs.runtime.interpret
except ImportError:
    HAVE_TRITON = TRITON_RUNS = False


def _interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds a scalar as a one-element array and converts it to a
    loop bound with ``int(array)``, which NumPy >= 2.4 refuses for 1-d arrays: a loop
    ``range(lo, hi, step)`` over loaded values (the kernels' context walk) then fails.
    Convert with ``.item()`` instead."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "scalar_index", False):
        return

    def patch_with_item_index(tensor, scope):  # type: ignore[no-untyped-def]
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_with_item_index.scalar_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_with_item_index


if HAVE_TRITON and triton.knobs.runtime.interpret:
    _interpreter_scalar_index()

IMPLS = ["torch"] + (["triton"] if TRITON_RUNS else [])


# --------------------------------------------------------------------------------------
# cases and the float64 reference
# --------------------------------------------------------------------------------------


class Case:
    """A random paged cache with ``len(ctx)`` sequences; NaN wherever no context lives."""

    def __init__(self, ctx: list[int], hq: int, hkv: int, d: int, bs: int, max_blocks: int, dtype: torch.dtype,
                 seed: int, spare_blocks: int = 3, device: str = DEV, dv: Optional[int] = None) -> None:  # fmt: skip
        dv = d if dv is None else dv  # the v head size (MLA: 128 against q/k's 192)
        self.seed, self.dtype, self.bs, self.hq, self.hkv, self.d, self.dv = seed, dtype, bs, hq, hkv, d, dv
        gen = torch.Generator().manual_seed(seed)
        used = [-(-min(c, max_blocks * bs) // bs) for c in ctx]
        nb = sum(used) + spare_blocks + 1
        perm = torch.randperm(nb, generator=gen).tolist()
        self.scratch = perm.pop()  # pads the tables, holds only NaN
        k = torch.full((nb, bs, hkv, d), float("nan"))
        v = torch.full((nb, bs, hkv, dv), float("nan"))
        tables = torch.full((len(ctx), max_blocks), self.scratch, dtype=torch.int32)
        real: list[int] = []
        for b, (c, n) in enumerate(zip(ctx, used)):
            blocks = [perm.pop() for _ in range(n)]
            real += blocks
            tables[b, :n] = torch.tensor(blocks, dtype=torch.int32)
            tokens = torch.arange(min(c, max_blocks * bs))
            where = (torch.tensor(blocks, dtype=torch.int64)[tokens // bs], tokens % bs)
            k[where] = torch.randn(len(tokens), hkv, d, generator=gen)
            v[where] = torch.randn(len(tokens), hkv, dv, generator=gen)
        # some padding entries name another sequence's (finite) block instead of the scratch one
        for b, n in enumerate(used):
            if n < max_blocks and real and b % 2:
                tables[b, n] = real[int(torch.randint(len(real), (1,), generator=gen))]
        self.k_cache = k.to(dtype).to(device)
        self.v_cache = v.to(dtype).to(device)
        self.tables = tables.to(device)
        self.ctx = torch.tensor(ctx, dtype=torch.int32, device=device)
        self.q = torch.randn(len(ctx), hq, d, generator=gen, dtype=torch.float64).to(dtype).to(device)
        self.scale = float(d) ** -0.5 * (0.5 + float(torch.rand((), generator=gen)))  # scores of O(1..10)

    def refill_q(self, gen: torch.Generator) -> None:
        self.q.copy_(torch.randn(self.q.shape, generator=gen, dtype=torch.float64).to(self.dtype))

    def reference(self) -> torch.Tensor:
        return reference(self.q, self.k_cache, self.v_cache, self.tables, self.ctx, self.scale)

    def run(self, impl: str, out: Optional[torch.Tensor] = None, **kw: object) -> torch.Tensor:
        return da.paged_decode_attention(self.q, self.k_cache, self.v_cache, self.tables, self.ctx, self.scale,
                                         out=out, impl=impl, **kw)  # fmt: skip


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """float64 ``[B, Hq*D]``: per sequence, gather its context token by token, then for
    every query head a softmax over its kv head's keys."""
    B, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    dv = v_cache.shape[3]
    g = hq // hkv
    out = torch.zeros(B, hq, dv, dtype=torch.float64)
    tables_h, ctx_h = tables.cpu().tolist(), ctx_lens.cpu().tolist()
    for b in range(B):
        n = min(ctx_h[b], len(tables_h[b]) * bs)
        if n <= 0:
            continue
        blocks = torch.tensor([tables_h[b][i // bs] for i in range(n)], device=k_cache.device)
        rows = torch.arange(n, device=k_cache.device) % bs
        k = k_cache[blocks, rows].double().repeat_interleave(g, dim=1)  # [n, hq, d]: head h reads kv head h // g
        v = v_cache[blocks, rows].double().repeat_interleave(g, dim=1)
        s = torch.einsum("nhd,hd->hn", k, q[b].double()) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=1), v).cpu()
    return out.view(B, hq * dv)


def check_heads(got: torch.Tensor, ref: torch.Tensor, ctx: list[int], heads: int, tol: float, what: str) -> float:
    """Per (sequence, head) relative error < tol; rows without context exactly zero."""
    B = ref.shape[0]
    got = got.detach().cpu().double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite output (poison left or NaN leaked through masking)"
    worst = 0.0
    for b in range(B):
        if ctx[b] <= 0:
            assert (got[b] == 0).all(), f"{what}: row {b} without context is not zero"
            continue
        g, r = got[b].view(heads, -1), ref[b].view(heads, -1)
        err = float(((g - r).norm(dim=1) / r.norm(dim=1)).max())
        worst = max(worst, err)
    assert worst < tol, f"{what}: worst relative (sequence, head) error {worst:.3g} >= {tol}"
    return worst


def seed_of(*parts: object) -> int:
    return (BASE_SEED + hash(parts)) % (1 << 31)


def run_checked(case: Case, impl: str, tol: Optional[float] = None, out_dtype: Optional[torch.dtype] = None,
                **kw: object) -> float:  # fmt: skip
    B = case.q.shape[0]
    out = torch.full((B, case.hq * case.dv), float("nan"), dtype=out_dtype or case.dtype, device=case.q.device)
    res = case.run(impl, out=out, **kw)
    assert res is out
    what = (f"{impl} {case.dtype} Hq={case.hq} Hkv={case.hkv} D={case.d} DV={case.dv} bs={case.bs} {kw} "
            f"seed={case.seed}")  # fmt: skip
    return check_heads(out, case.reference(), case.ctx.tolist(), case.hq, tol or TOL[case.dtype], what)


def reduce_in_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tile config (by batch too) merges its partitions in reduce programs, not in the
    last partial program."""
    from freetoken.kernels import decode_attention as dat

    for name in ("DEFAULT_CONFIG", "ONE_SEQUENCE_CONFIG", "BATCH_CONFIG"):
        monkeypatch.setattr(dat, name, dataclasses.replace(getattr(dat, name), reduce_in_partial=False))


# --------------------------------------------------------------------------------------
# both implementations, small shapes (the interpreter on CPU; compiled on a GPU)
# --------------------------------------------------------------------------------------

# 10 sequences of up to 12 blocks of 16: 1, block boundaries on both sides, a padded row
# (0) in the middle, the table's full length, and random lengths
SMALL_CTX = [1, 16, 17, 0, 33, 64, 191, 192]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_matches_reference(impl, dtype, heads, monkeypatch):
    hq, hkv = heads
    seed = seed_of("ref", impl, dtype, heads)
    gen = random.Random(seed)
    ctx = SMALL_CTX + [gen.randrange(2, 193) for _ in range(2)]
    case = Case(ctx, hq, hkv, 32, 16, 12, dtype, seed)
    if impl == "torch":
        run_checked(case, impl)
    else:  # one partition (direct output); three (split, merged by the last partial program of
        # each kv head, fewer active for short contexts); three merged by reduce programs
        for p in (1, 3):
            run_checked(case, impl, partitions=p)
        from freetoken.kernels import decode_attention as dat
        from freetoken.kernels.counters import zeroed_counters

        assert dat.DEFAULT_CONFIG.reduce_in_partial
        assert int(zeroed_counters("attention_merge", case.q.device, 1).abs().sum()) == 0, \
            "the merge counters are left at zero"
        reduce_in_programs(monkeypatch)
        run_checked(case, impl, partitions=3)


@pytest.mark.parametrize("impl", IMPLS)
def test_head_dim_64_mha_and_other_block_sizes(impl):
    seed = seed_of("d64", impl)
    run_checked(Case([5, 0, 40, 129, 8], 4, 4, 64, 8, 17, torch.bfloat16, seed), impl)  # block 8, MHA, D=64
    run_checked(Case([1, 70, 96], 6, 2, 64, 32, 3, torch.float16, seed + 1), impl)  # block 32, G=3 (not 2^k)
    run_checked(Case([3, 9], 16, 1, 16, 4, 4, torch.float32, seed + 2), impl)  # one kv head, G=16, D=16
    if impl == "triton":
        run_checked(Case([1, 70, 96], 6, 2, 80, 16, 6, torch.bfloat16, seed + 3), impl, partitions=3)  # D=80


# head sizes that are not a power of two (Qwen3.5-MoE-shaped test models: 24),
# common real ones (80, 96, 192), 128 (no regression), one below tl.dot's 16 (8), and a v head
# size of its own (MLA's 192/128)
HEAD_SIZES = [(24, 24), (80, 80), (96, 96), (128, 128), (192, 192), (8, 8), (192, 128), (24, 40)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d,dv", HEAD_SIZES, ids=[f"d{d}v{dv}" for d, dv in HEAD_SIZES])
def test_head_sizes(impl, d, dv, monkeypatch):
    """Tiles padded to a power of two with the lanes past the head masked: direct output,
    split partitions merged in the partial kernel, and by the reduce kernel; GQA with a
    group that is not a power of two; the scale from the true head size."""
    seed = seed_of("head", impl, d, dv)
    case = Case([1, 17, 0, 40, 64], 6, 2, d, 16, 4, torch.bfloat16, seed, dv=dv)
    case.scale = float(d) ** -0.5
    if impl == "torch":
        run_checked(case, impl)
        return
    for p in (1, 3):
        run_checked(case, impl, partitions=p)
    from freetoken.kernels import decode_attention as dat

    reduce_in_programs(monkeypatch)
    run_checked(case, impl, partitions=3)


@pytest.mark.parametrize("impl", IMPLS)
def test_head_size_with_window_and_sinks(impl):
    """The window/sinks kernel variant (GPT-OSS-shaped) at a head size of 80 and a v head of 48."""
    seed = seed_of("head-ws", impl)
    case = Case([5, 40, 0, 64], 4, 2, 80, 16, 4, torch.float32, seed, dv=48)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float().to(DEV)
    B = case.q.shape[0]
    for window in (None, 9):
        out = torch.full((B, 4 * 48), float("nan"), device=DEV)
        kw = {"partitions": 3} if impl == "triton" else {}
        case.run(impl, out=out, window=window, sinks=sinks, **kw)
        ref = reference_window_sinks(case, window, sinks)
        check_heads(out, ref, case.ctx.tolist(), 4, 1e-5, f"{impl} window={window} seed={seed}")


def reference_window_sinks(case: Case, window: Optional[int], sinks: torch.Tensor) -> torch.Tensor:
    """float64: each query head over the last ``window`` tokens of its context, with its sink's
    logit in the softmax's denominator."""
    B, hq, d = case.q.shape
    _, bs, hkv, dv = case.v_cache.shape
    g = hq // hkv
    out = torch.zeros(B, hq, dv, dtype=torch.float64)
    tables, ctx = case.tables.cpu().tolist(), case.ctx.cpu().tolist()
    for b in range(B):
        n = ctx[b]
        if n <= 0:
            continue
        lo = 0 if window is None else max(0, n - window)
        idx = range(lo, n)
        blocks = torch.tensor([tables[b][i // bs] for i in idx], device=case.k_cache.device)
        rows = torch.tensor([i % bs for i in idx], device=case.k_cache.device)
        k = case.k_cache[blocks, rows].double().repeat_interleave(g, dim=1).cpu()
        v = case.v_cache[blocks, rows].double().repeat_interleave(g, dim=1).cpu()
        s = torch.einsum("nhd,hd->hn", k, case.q[b].double().cpu()) * case.scale
        s = torch.cat([s, sinks.double().cpu()[:, None]], dim=1)
        p = torch.softmax(s, dim=1)[:, :-1]
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out.view(B, hq * dv)


@pytest.mark.parametrize("impl", IMPLS)
def test_long_context_many_steps(impl):
    seed = seed_of("long", impl)
    case = Case([1000, 517, 0], 8, 2, 32, 16, 63, torch.bfloat16, seed)
    run_checked(case, impl)
    if impl == "triton":
        run_checked(case, impl, partitions=1)  # one program walks 16 steps of 64 tokens
        run_checked(case, impl, partitions=3)  # partitions of 384 tokens: the last one ragged


@pytest.mark.skipif(not TRITON_RUNS, reason="the Triton kernels need triton (a GPU or Triton's interpreter)")
def test_merge_of_many_partitions():
    """More active partitions than the merge takes at a time (kernels.decode_attention.merge_tile):
    several rounds, the last one ragged, the running max rescaled between them; with a window
    the first rounds hold only empty partitions (-inf maxima) and sinks join the denominator."""
    from freetoken.kernels import decode_attention as dat

    seed = seed_of("many-partitions")
    case = Case([3000, 2100, 0, 1500], 8, 2, 32, 16, 190, torch.float32, seed)
    assert dat.merge_tile(4, 32)["MERGE_P"] == 16  # 3000 tokens in 40 partitions of 128: 24 active
    run_checked(case, "triton", partitions=40)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float().to(DEV)
    out = torch.full((4, 8 * 32), float("nan"), device=DEV)
    case.run("triton", out=out, window=700, sinks=sinks, partitions=40)
    ref = reference_window_sinks(case, 700, sinks)
    check_heads(out, ref, case.ctx.tolist(), 8, 1e-5, f"window 700, sinks, 40 partitions seed={seed}")
    wide = Case([2600, 900], 16, 2, 128, 16, 170, torch.bfloat16, seed + 1)
    assert dat.merge_tile(8, 128)["MERGE_P"] == 8  # 2600 tokens in 24 partitions of 128: 21 active
    run_checked(wide, "triton", partitions=24)


def latent_case(ctx: list[int], heads: int, kv_lora: int, rope: int, max_blocks: int, seed: int,
                dtype: torch.dtype = torch.bfloat16) -> Case:  # fmt: skip
    """MLA with the up-projections absorbed: ``heads`` latent queries over one cached latent
    of ``kv_lora + rope`` values per token, whose first ``kv_lora`` values are the value (the
    V cache a view of the K cache, as freetoken.models.mla passes it)."""
    case = Case(ctx, heads, 1, kv_lora + rope, 16, max_blocks, dtype, seed, dv=kv_lora)
    case.v_cache = case.k_cache[..., :kv_lora]
    case.scale = float(128 + rope) ** -0.5
    return case


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads,kv_lora,rope", [(32, 512, 64), (4, 32, 16)], ids=["deepseek-v3", "tiny"])
def test_latent_attention(impl, heads, kv_lora, rope, monkeypatch):
    """DeepSeek-V3's latents (512 + 64: two q/k tiles, the values read from the keys' tile,
    the 32 query heads of the one kv head in two programs of 16) and a tiny model's (48
    values, v the first 32: separate loads from the shared cache); direct output, split
    partitions merged in the partial kernel, and by the reduce kernel."""
    from freetoken.kernels import decode_attention as dat

    seed = seed_of("latent", impl, heads, kv_lora)
    case = latent_case([1, 17, 0, 40, 64, 33], heads, kv_lora, rope, 4, seed)
    if impl == "torch":
        run_checked(case, impl)
        return
    assert dat.shares_kv(case.k_cache, case.v_cache) == (kv_lora == 512)
    assert dat.split_d(kv_lora + rope) == ((512, 64) if kv_lora == 512 else (64, 0))
    assert dat.query_group(heads, kv_lora) == min(heads, 16)
    for p in (1, 3):
        run_checked(case, impl, partitions=p)
    reduce_in_programs(monkeypatch)
    run_checked(case, impl, partitions=3)


@pytest.mark.skipif(not TRITON_RUNS, reason="the Triton kernels need triton (a GPU or Triton's interpreter)")
def test_wide_head_without_shared_values():
    """A q/k head of 320 values (tiles of 256 and 64) with v heads of their own, two kv heads."""
    seed = seed_of("wide320")
    case = Case([5, 0, 70, 33], 4, 2, 320, 16, 5, torch.float32, seed, dv=96)
    case.scale = 320.0**-0.5
    for p in (1, 3):
        run_checked(case, "triton", partitions=p)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_dtype_strides_and_strided_q(impl):
    seed = seed_of("strides", impl)
    case = Case([20, 0, 77, 1], 8, 2, 32, 16, 5, torch.bfloat16, seed)
    run_checked(case, impl, out_dtype=torch.float32)  # out in float32: written in its own dtype
    # q as a view of a fused qkv projection ([B, (Hq + 2 Hkv) D] rows), out as a column slice
    B, hq, d = case.q.shape
    qkv = torch.randn(B, (hq + 2 * case.hkv) * d, dtype=torch.float64).to(case.dtype).to(DEV)
    qkv[:, : hq * d] = case.q.reshape(B, -1)
    q_view = qkv[:, : hq * d].view(B, hq, d)
    assert not q_view.is_contiguous()
    wide = torch.full((B, hq * d + 64), float("nan"), dtype=case.dtype, device=DEV)
    out = wide[:, 32 : 32 + hq * d]
    res = da.paged_decode_attention(q_view, case.k_cache, case.v_cache, case.tables, case.ctx, case.scale,
                                    out=out, impl=impl)  # fmt: skip
    assert res.data_ptr() == out.data_ptr()
    check_heads(out, case.reference(), case.ctx.tolist(), hq, TOL[case.dtype], f"{impl} strided seed={seed}")
    assert wide[:, :32].isnan().all() and wide[:, 32 + hq * d :].isnan().all(), "wrote outside out"


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_rows_are_zero_even_with_nan_queries_and_ctx_is_clamped(impl):
    seed = seed_of("pad", impl)
    case = Case([0, 25, 0, 48], 8, 2, 32, 16, 3, torch.float32, seed)
    case.q[0] = float("nan")  # a padded row's query is never used
    case.q[2] = float("inf")
    res = case.run(impl)
    assert res.dtype == torch.float32 and res.shape == (4, 8 * 32)
    assert (res[0] == 0).all() and (res[2] == 0).all()
    check_heads(res[[1, 3]], case.reference()[[1, 3]], [25, 48], 8, TOL[torch.float32], f"{impl} seed={seed}")
    # lengths past the table (3 blocks = 48 tokens) read the whole table; negative ones nothing
    full = case.run(impl).clone()
    case.ctx.copy_(torch.tensor([-5, 25, 0, 1000], dtype=torch.int32))
    clamped = case.run(impl)
    assert (clamped[0] == 0).all()
    torch.testing.assert_close(clamped[3], full[3], rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch(impl):
    case = Case([4], 4, 2, 32, 16, 2, torch.bfloat16, 1)
    q = case.q[:0]
    res = da.paged_decode_attention(q, case.k_cache, case.v_cache, case.tables[:0], case.ctx[:0], 1.0, impl=impl)
    assert res.shape == (0, 4 * 32)


def test_torch_impl_chunks_the_gather(monkeypatch):
    """Chunks of a few block columns give the same result as one chunk (and as the reference)."""
    seed = seed_of("chunks")
    case = Case([150, 3, 0, 97], 8, 2, 32, 16, 10, torch.float32, seed)
    whole = case.run("torch").clone()
    per_column = 4 * 16 * 2 * 32 * 4 * 2
    monkeypatch.setattr(da, "TORCH_CHUNK_BYTES", 3 * per_column)  # 4 chunks, the last one of 1 column
    run_checked(case, "torch")
    # float32 sums in another order (and torch's thread count decides the matmuls' blocking):
    # equal to float32 rounding of values of order 1
    torch.testing.assert_close(case.run("torch"), whole, rtol=1e-5, atol=1e-6)


def test_auto_and_validation():
    case = Case([4, 9], 8, 2, 32, 16, 2, torch.bfloat16, seed_of("auto"))
    impl, why = da.default_impl(DEV)
    if DEV == "cpu":
        assert impl == "torch", why
    check_heads(case.run("auto"), case.reference(), [4, 9], 8, TOL[torch.bfloat16], f"auto ({impl})")
    args = (case.q, case.k_cache, case.v_cache, case.tables, case.ctx, 1.0)
    cases = [
        ((case.q[0],) + args[1:], {}, "q must be"),
        ((case.q.float(),) + args[1:], {}, "share one dtype"),
        ((case.q.double(), case.k_cache.double(), case.v_cache.double()) + args[3:], {}, "share one dtype"),
        (args[:2] + (case.v_cache[:, :8],) + args[3:], {}, "both be"),
        ((case.q[:, :7],) + args[1:], {}, "multiple of kv_heads"),
        ((case.q[..., :16],) + args[1:], {}, "head_dim differs"),
        (args[:3] + (case.tables.long(),) + args[4:], {}, "block_tables must be int32"),
        (args[:3] + (case.tables[:1],) + args[4:], {}, "block_tables must be int32"),
        (args[:3] + (case.tables[:, :0],) + args[4:], {}, "max_blocks must be >= 1"),
        (args[:4] + (case.ctx.long(),) + args[5:], {}, "ctx_lens must be int32"),
        (args, {"out": torch.empty(2, 8 * 32 + 1, device=DEV)}, "out must be"),
        (args, {"out": torch.empty(2, 8 * 32, dtype=torch.int32, device=DEV)}, "out must be"),
        (args, {"impl": "flash"}, "unknown decode attention implementation"),
    ]
    for a, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            da.paged_decode_attention(*a, **kw)
    if TRITON_RUNS:
        with pytest.raises(ValueError, match="partitions=0"):
            da.paged_decode_attention(*args, impl="triton", partitions=0)
        wide = Case([3], 2, 1, 776, 16, 1, torch.float32, 2)
        with pytest.raises(ValueError, match="wider than the kernel's 768/512"):
            wide.run("triton")


def test_partition_count_follows_shapes_only():
    for batch, hkv, max_blocks in [(1, 4, 2048), (8, 4, 256), (64, 4, 2048), (1, 32, 4), (3, 1, 1)]:
        p = da.num_partitions(batch, hkv, max_blocks, 16, DEV)
        assert 1 <= p <= da.MAX_PARTITIONS
        assert p <= -(-max_blocks * 16 // 128), "more partitions than the longest context can fill"
        assert da.num_partitions(batch * 2, hkv, max_blocks, 16, DEV) <= p  # more rows: no more partitions
    assert da.num_partitions(1, 1, 1, 16, DEV) == 1  # 16 tokens: one partition, no reduce


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_tiles_by_batch_where_shared_memory_holds_them():
    from freetoken.kernels import decode_attention as dat

    h100, consumer = 227 * 1024, 99 * 1024
    assert dat.config_for(1, 128, 128, 2, h100) is dat.ONE_SEQUENCE_CONFIG
    assert dat.config_for(4, 128, 128, 2, h100) is dat.DEFAULT_CONFIG
    assert dat.config_for(dat.BATCH_FROM, 128, 128, 2, h100) is dat.BATCH_CONFIG
    assert dat.config_for(64, 128, 128, 2, h100) is dat.BATCH_CONFIG
    # a consumer GPU's shared memory holds neither at head size 128; the interpreter (0) none
    for batch in (1, 4, 8, 64):
        assert dat.config_for(batch, 128, 128, 2, consumer) is dat.DEFAULT_CONFIG
        assert dat.config_for(batch, 128, 128, 2, 0) is dat.DEFAULT_CONFIG
    # head size 64 in 16 bits: three 64-token stages fit a consumer GPU
    assert dat.config_for(1, 64, 64, 2, consumer) is dat.ONE_SEQUENCE_CONFIG
    # MLA's latents: 32-token steps whatever the config (tiles()), one load for K and V
    assert dat.stage_bytes(dat.BATCH_CONFIG, 576, 512, 2, shared_kv=True) == 2 * 32 * 576 * 2
    assert dat.stage_bytes(dat.BATCH_CONFIG, 128, 128, 4) == 2 * 128 * 256 * 4
    assert dat.shared_limit(torch.device("cpu")) == 0
    # float32: 32-token steps of 8 warps (the stages as chosen), on any device
    for batch in (1, 4, 8, 64):
        for limit in (h100, consumer, 0):
            c = dat.config_for(batch, 128, 128, 4, limit)
            assert (c.block_n, c.num_warps) == (dat.FLOAT32_BLOCK_N, dat.FLOAT32_WARPS)
            assert c.num_stages == dat.config_for(batch, 128, 128, 2, limit).num_stages


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_no_register_spills_on_sm90():
    """The partial kernels at every preset's head sizes, batches 1-32, float32 and bfloat16,
    with the tiles config_for gives an H100, compiled for sm_90 (no GPU needed:
    tests/gpu/attention_sm90_spills.py): none keeps values in local memory. Float32 with the
    16-bit tiles kept up to 7.8 KB a thread there, inside the token loop."""
    from packed_sm90_spills import spill_report

    report = spill_report("attention_sm90_spills.py")
    assert len(report) >= 40
    spilled = {name: r for name, r in report.items() if r["stack_bytes"]}
    assert not spilled, spilled


@pytest.mark.skipif(not TRITON_RUNS, reason="the Triton kernels need triton (a GPU or Triton's interpreter)")
@pytest.mark.parametrize("batch", [1, 10], ids=["one_sequence", "batch"])
def test_tiles_by_batch_match_reference(batch, monkeypatch):
    """The batch's tiles (three stages for one sequence, 128-token steps from 8) against the
    reference, whatever this device's shared memory (the interpreter's limit is raised)."""
    from freetoken.kernels import decode_attention as dat

    monkeypatch.setattr(dat, "shared_limit", lambda device: 1 << 30)
    seed = seed_of("tiles-by-batch", batch)
    gen = random.Random(seed)
    ctx = ([gen.randrange(130, 385)] if batch == 1 else SMALL_CTX + [gen.randrange(2, 385) for _ in range(2)])
    case = Case(ctx, 8, 2, 32, 16, 24, torch.bfloat16, seed)
    expected = dat.ONE_SEQUENCE_CONFIG if batch == 1 else dat.BATCH_CONFIG
    assert dat.config_for(batch, 32, 32, 2, dat.shared_limit(DEV)) is expected
    for p in (1, 3):
        run_checked(case, "triton", partitions=p)
    reduce_in_programs(monkeypatch)
    run_checked(case, "triton", partitions=3)


# --------------------------------------------------------------------------------------
# the kernels compile for the H200 (sm_90) without a GPU
# --------------------------------------------------------------------------------------

SM90_SCRIPT = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freetoken.kernels import decode_attention as dat

STRIDES = ["stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt", "stride_vh",
           "stride_btb", "stride_ob"]
cfg = dat.DEFAULT_CONFIG
target = GPUTarget("cuda", 90, 32)

def partial(dt, G, D, BS, split, DV=None, shared=False, cfg=cfg):
    DV = D if DV is None else DV
    sig = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "bt_ptr": "*i32", "ctx_ptr": "*i32",
           "out_ptr": f"*{dt}", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "count_ptr": "*i32", "scale_log2": "fp32", "P": "i32",
           "max_tokens": "i32", **{s: "i32" for s in STRIDES}}
    consts = dat.kernel_constants(G, D, DV, BS, split, "ieee" if dt == "fp32" else "tf32", cfg, shared)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in [*range(9), *range(12, 22)]}
    return triton.compile(ASTSource(dat._partial_kernel, sig, consts, attrs), target=target,
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))

def reduce(dt, D):
    sig = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "ctx_ptr": "*i32", "out_ptr": f"*{dt}", "P": "i32",
           "max_tokens": "i32", "stride_ob": "i32"}
    consts = dict(D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n,
                  MIN_PART=cfg.min_part)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in [0, 1, 2, 3, 6]}
    return triton.compile(ASTSource(dat._reduce_kernel, sig, consts, attrs), target=target, options=dict(num_warps=4))

def describe(k):
    ptx = k.asm["ptx"]
    return {"cubin": bool(k.asm.get("cubin")), "mma_bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
            or "wgmma.mma_async" in ptx, "mma_f16": ".f32.f16.f16.f32" in ptx,
            "cp_async": "cp.async" in ptx, "shared": k.metadata.shared}

report = {
    "bf16_qwen3_split": describe(partial("bf16", 8, 128, 16, True)),
    "bf16_qwen3_direct": describe(partial("bf16", 8, 128, 16, False)),
    "fp16_d64_mha": describe(partial("fp16", 1, 64, 16, True)),
    "fp32_g4": describe(partial("fp32", 4, 128, 16, True)),
    "reduce_bf16": describe(reduce("bf16", 128)),
    "reduce_fp32_d80": describe(reduce("fp32", 80)),
    # head sizes that are not a power of two, and MLA's v head of its own
    **{f"bf16_d{d}_v{dv}": describe(partial("bf16", 4, d, 16, True, dv))
       for d, dv in [(24, 24), (80, 80), (96, 96), (192, 192), (192, 128)]},
    "reduce_bf16_d24": describe(reduce("bf16", 24)),
    # MLA with the up-projections absorbed (DeepSeek-V3: 128 heads over one latent of 512 + 64)
    "bf16_mla_split": describe(partial("bf16", 128, 576, 16, True, 512, shared=True)),
    "bf16_mla_direct": describe(partial("bf16", 16, 576, 64, False, 512, shared=True)),
    # the tiles by batch (where the GPU's shared memory holds them: an H100/H200's 227 KiB)
    "bf16_qwen3_one_sequence": describe(partial("bf16", 8, 128, 16, True, cfg=dat.ONE_SEQUENCE_CONFIG)),
    "bf16_qwen3_batch": describe(partial("bf16", 8, 128, 16, True, cfg=dat.BATCH_CONFIG)),
    "bf16_mla_batch": describe(partial("bf16", 128, 576, 16, True, 512, shared=True, cfg=dat.BATCH_CONFIG)),
}
print(json.dumps(report))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SM90_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(info["cubin"] for info in report.values()), report
    for name in ("bf16_qwen3_split", "bf16_qwen3_direct"):
        assert report[name]["mma_bf16"], f"{name}: no bf16 tensor-core MMA with fp32 accumulation"
        assert report[name]["cp_async"], f"{name}: K/V loads not pipelined"
        assert report[name]["shared"] <= 100 * 1024, f"{name}: {report[name]['shared']} bytes of shared memory"
    assert report["fp16_d64_mha"]["mma_f16"], "fp16: no tensor-core MMA"
    for d, dv in [(24, 24), (80, 80), (96, 96), (192, 192), (192, 128)]:
        assert report[f"bf16_d{d}_v{dv}"]["mma_bf16"], f"head size {d}/{dv}: no bf16 tensor-core MMA"
    for name in ("bf16_mla_split", "bf16_mla_direct"):  # within a consumer GPU's 100 KiB per block
        assert report[name]["mma_bf16"], f"{name}: no bf16 tensor-core MMA"
        assert report[name]["cp_async"], f"{name}: latent loads not pipelined"
        assert report[name]["shared"] <= 100 * 1024, f"{name}: {report[name]['shared']} bytes of shared memory"
    # the tiles by batch take at most what config_for counts for them (so its choice fits)
    from freetoken.kernels import decode_attention as dat

    for name, cfg, d, dv, shared_kv in [("bf16_qwen3_one_sequence", dat.ONE_SEQUENCE_CONFIG, 128, 128, False),
                                        ("bf16_qwen3_batch", dat.BATCH_CONFIG, 128, 128, False),
                                        ("bf16_mla_batch", dat.BATCH_CONFIG, 576, 512, True)]:
        counted = dat.stage_bytes(cfg, d, dv, 2, shared_kv) + dat.SHARED_MARGIN
        assert report[name]["mma_bf16"] and report[name]["cp_async"], name
        assert report[name]["shared"] <= counted, f"{name}: {report[name]['shared']} bytes > {counted} counted"


# --------------------------------------------------------------------------------------
# on the GPU: realistic sizes and CUDA graphs
# --------------------------------------------------------------------------------------

QWEN3 = dict(hq=32, hkv=4, d=128, bs=16)


def qwen3_case(ctx: list[int], max_blocks: int, dtype: torch.dtype, seed: int) -> Case:
    return Case(ctx, QWEN3["hq"], QWEN3["hkv"], QWEN3["d"], QWEN3["bs"], max_blocks, dtype, seed)


GPU_SIZES = [
    (1, 32768, [32768]),
    (1, 32768, [1000]),  # short context in a long table: spread over the partitions
    (8, 4096, [4096, 1, 16, 17, 0, 2500, 4095, 333]),
    (64, 8192, None),  # random lengths
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_ctx,lens", GPU_SIZES, ids=["b1_32k", "b1_1k_in_32k", "b8_4k", "b64_8k"])
def test_gpu_qwen3_sizes(batch, max_ctx, lens):
    seed = seed_of("gpu", batch, max_ctx)
    gen = random.Random(seed)
    if lens is None:
        lens = [gen.randrange(0, max_ctx + 1) for _ in range(batch)]
        lens[:3] = [0, 1, max_ctx]
    case = qwen3_case(lens, max_ctx // 16, torch.bfloat16, seed)
    ref = case.reference()
    for impl in ("triton", "torch"):
        out = torch.full((batch, 32 * 128), float("nan"), dtype=torch.bfloat16, device=DEV)
        case.run(impl, out=out)
        err = check_heads(out, ref, lens, 32, TOL[torch.bfloat16], f"{impl} B={batch} seed={seed}")
        logging.getLogger(__name__).info("%s B=%d ctx<=%d: worst error %.3g", impl, batch, max_ctx, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes(dtype):
    seed = seed_of("gpu-dtype", dtype)
    for impl in ("triton", "torch"):
        run_checked(qwen3_case([3000, 0, 1, 700], 256, dtype, seed), impl)


def _graph_replays(impl: str, warm: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    B, max_blocks = 6, 128  # 2048 tokens per table
    case = qwen3_case([0] * B, max_blocks, torch.bfloat16, seed)
    # a pool of filled blocks the replays draw their tables from
    pool = qwen3_case([2048] * 3, max_blocks, torch.bfloat16, seed + 1)
    case.k_cache, case.v_cache = pool.k_cache, pool.v_cache
    blocks = [int(b) for b in pool.tables.unique().tolist()]
    out = torch.full((B, 32 * 128), float("nan"), dtype=torch.bfloat16, device="cuda")

    def fill() -> list[int]:
        lens = [rnd.choice([0, 1, 16, 17, 2048, rnd.randrange(1, 2049)]) for _ in range(B)]
        tables = torch.tensor([rnd.sample(blocks, max_blocks) for _ in range(B)], dtype=torch.int32)
        case.tables.copy_(tables)
        case.ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        case.refill_q(gen)
        return lens

    fill()
    if warm:
        da.warmup(case.q, case.k_cache, case.v_cache, case.tables, case.ctx, case.scale, out, impl=impl)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(impl, out=out)
    for i in range(6):
        lens = fill() if i else [0] * B
        if not i:
            case.ctx.zero_()  # every row padded
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_heads(out, case.reference(), lens, 32, TOL[torch.bfloat16], f"{impl} replay {i} seed={seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "triton", "torch"])
def test_gpu_graph_capture_and_replay(impl):
    assert da.default_impl("cuda")[0] == "triton", da.default_impl("cuda")[1]
    before = da.capture_fallbacks
    _graph_replays(impl, warm=True, seed=seed_of("graph", impl))
    assert da.capture_fallbacks == before, "a warmed-up Triton variant was compiled again during capture"


@pytest.mark.gpu
def test_gpu_capture_without_warmup_falls_back_to_torch():
    from freetoken.kernels import decode_attention as dat

    # a block size no other test compiles: a variant this process has not seen
    case = Case([40, 7], 8, 2, 64, 8, 8, torch.bfloat16, seed_of("cold"))
    out = torch.full((2, 8 * 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    key = dat.variant_key(case.q, case.k_cache, case.v_cache, case.tables, case.ctx, out, 3)
    assert key not in da._compiled
    before = da.capture_fallbacks
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run("triton", out=out, partitions=3)
    assert da.capture_fallbacks == before + 1
    graph.replay()
    torch.cuda.synchronize()
    check_heads(out, case.reference(), [40, 7], 8, TOL[torch.bfloat16], "fallback replay")
