"""Every weight format x every ISA tier x activation dtype x T x top-k, against float64.

Each case draws fresh activations and routes (ids with -1 and duplicates, one
token routed entirely elsewhere), poisons the output with NaN, runs
``moe_forward`` on one tier and compares with two float64 references:

* tight: the exact float64 math with the kernels' documented activation
  quantization modelled (int8 with a float scale per 32 elements for Q8_0, MXFP4 and
  the K-quants; float formats use float32 activations). What remains is float32 accumulation
  (~1e-6 relative) and rare rounding-boundary flips of one int8 step in the
  quantized formats (<1e-4 each), so TIGHT = 1e-5 for float formats and 1e-3 for
  quantized ones. Any wrong scale, nibble, sign or block offset is far above that.
* loose: the exact float64 math without activation quantization, i.e. what a
  checkpoint means. Two int8 roundings (x, then h = act(g) * u) add ~1.2% normwise
  (median; max 1.8% over 3600 random draws of these shapes), below the 4-8 bit
  weight formats' own error; LOOSE bounds it at 3%. On the tiers whose K-quant
  kernels take one activation scale per 256 elements (avx2, avx_vnni) the int8
  step is coarser: 1.9% median, 2.8% p99, max 3.4% over 3360 draws of K-quant
  banks of these shapes, so LOOSE_PER_256 bounds it at 5%.

Output rounding is added on top: bf16 keeps 8 bits (relative 2^-9 per element,
we allow 4e-3), float16 11 bits (1e-3).
"""

from __future__ import annotations

import numpy as np
import pytest

from cpu_moe_cases import cm
from cpu_moe_reference import (
    KQUANT_PER_256_TIERS,
    moe_reference,
    random_routes,
    rel_err,
    rel_err_allowing,
    round_to,
)

TIERS = cm.isa_tiers()
QUANTIZED = {"q8_0", "q4_k", "q5_k", "q6_k", "mxfp4"}
TIGHT = {f: (1e-4 if f in QUANTIZED else 1e-5) for f in cm.FORMATS}
LOOSE = {f: (3e-2 if f in QUANTIZED else 1e-5) for f in cm.FORMATS}
KQUANTS = {"q4_k", "q5_k", "q6_k"}
LOOSE_PER_256 = 5e-2


def loose_bound(fmt: str, isa: str) -> float:
    if fmt in KQUANTS and isa in KQUANT_PER_256_TIERS:
        return LOOSE_PER_256
    return LOOSE[fmt]
OUT_ROUNDING = {"float32": 0.0, "float16": 1e-3, "bfloat16": 4e-3}


def make_x(rng: np.random.Generator, T: int, H: int, dtype: str):
    """Activations of the dtype (numpy for float32/float16, torch for bfloat16) and their float64 values."""
    x32 = rng.standard_normal((T, H)).astype(np.float32)
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(x32).to(torch.bfloat16), round_to(x32, dtype)
    x = x32.astype(dtype)
    return x, x.astype(np.float64)


def poisoned_out(x, T: int, H: int):
    if isinstance(x, np.ndarray):
        return np.full((T, H), np.nan, dtype=x.dtype)
    import torch

    return torch.full((T, H), float("nan"), dtype=x.dtype)


def to_f64(y) -> np.ndarray:
    if isinstance(y, np.ndarray):
        return y.astype(np.float64)
    import torch

    return y.to(torch.float64).numpy()


def check_case(case, isa: str, dtype: str, T: int, K: int, rng: np.random.Generator) -> None:
    x, x64 = make_x(rng, T, case.H, dtype)
    ids, w = random_routes(rng, T, K, case.E)
    out = poisoned_out(x, T, case.H)
    y = cm.moe_forward(case.bank, x, ids, w, out=out, isa=isa)
    assert y is out
    y64 = to_f64(y)
    assert np.isfinite(y64).all(), "output left poisoned"
    unrouted = (ids < 0).all(axis=1)
    assert (y64[unrouted] == 0).all(), "a token with no CPU route must get y = 0"
    fmt = max(case.fmts, key=lambda f: TIGHT[f])
    tight, allowance = moe_reference(*case.raw, x64, ids, w, act=case.activation, with_allowance=True, isa=isa)
    loose = moe_reference(*case.raw, x64, ids, w, act=case.activation, quantized=False)
    extra = OUT_ROUNDING[dtype]
    err_t, err_l = rel_err_allowing(y64, tight, allowance), rel_err(y64, loose)
    info = f"{case.fmts} isa={isa} {dtype} T={T} K={K} bank seed={case.seed}: err {err_t:.2e} / {err_l:.2e}"
    assert err_t <= TIGHT[fmt] + extra, info
    assert err_l <= max(loose_bound(f, isa) for f in case.fmts) + extra, info


@pytest.mark.parametrize("K", [1, 2, 8])
@pytest.mark.parametrize("T", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("isa", TIERS)
@pytest.mark.parametrize("fmt", cm.FORMATS)
def test_moe_matrix(bank_for, rng, fmt: str, isa: str, dtype: str, T: int, K: int) -> None:
    check_case(bank_for(fmt), isa, dtype, T, K, rng)


@pytest.mark.parametrize("isa", TIERS)
@pytest.mark.parametrize(
    "fmts", [("q4_k", "q4_k", "q6_k"), ("q5_k", "q8_0", "q6_k"), ("bf16", "fp8_e4m3_b128", "f16"), ("q8_0", "f32", "q4_k")]
)
def test_mixed_formats_in_one_bank(bank_for, rng, fmts, isa: str) -> None:
    """gate/up/down each in their own format (Q4_K_M files mix Q4_K and Q6_K)."""
    for T, K in [(1, 8), (16, 2)]:
        check_case(bank_for(fmts), isa, "float32", T, K, rng)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
@pytest.mark.parametrize("fmt", ["bf16", "q4_k", "q8_0", "fp8_e4m3_b128"])
def test_activations(bank_for, rng, fmt: str, activation: str) -> None:
    for isa in TIERS:
        check_case(bank_for(fmt, activation), isa, "bfloat16", 5, 2, rng)
