"""The "amx" tier's matrix path (many tokens against the same rows) for every format it
covers, against float64 references and against the vector kernels.

Integer formats (Q4_K, Q5_K, Q6_K, Q8_0) keep the vector kernels' numerics: the same
int8 activation codes, so against the float64 math with that quantization modelled
what remains is float32 accumulation (TIGHT). BF16 and FP8 split float32 activations
into two BF16 halves (16 significant bits): ~2e-6 normwise against float64, within
TIGHT too. Shapes cover whole 16-row tiles, a tail of rows the vector kernels take,
partial 16-token tiles, and an FP8 matrix whose scale blocks end inside a tile row.
"""

from __future__ import annotations

import numpy as np
import pytest

from cpu_moe_cases import cm
from cpu_moe_reference import make_weights, moe_reference, quantize_act, rel_err, rel_err_allowing

pytestmark = pytest.mark.skipif("amx" not in cm.isa_tiers(), reason="this CPU (or kernel) offers no AMX tiles")

TIGHT = 1e-5
QUANTIZED = {"q8_0": 32, "q4_k": 32, "q5_k": 32, "q6_k": 32}
SHAPES = {  # (rows, cols) per format: cols hold whole blocks
    "q4_k": [(48, 512), (200, 256)],
    "q5_k": [(48, 512), (200, 256)],
    "q6_k": [(48, 512), (200, 256)],
    "q8_0": [(48, 544), (200, 96)],
    "bf16": [(48, 512), (200, 96)],
    "fp8_e4m3_b128": [(48, 512), (200, 352)],
}


def linear_reference(raw, x: np.ndarray) -> np.ndarray:
    xq = quantize_act(x.astype(np.float64), QUANTIZED.get(raw.fmt))
    return xq @ raw.dense[0].T


@pytest.mark.parametrize("T", [8, 16, 37, 64])
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_linear_many_tokens(rng, fmt: str, T: int) -> None:
    for rows, cols in SHAPES[fmt]:
        raw = make_weights(fmt, 1, rows, cols, rng, 0.1)
        w = cm.Weights(raw.data, fmt, 1, rows, cols, scale=raw.scale)
        x = rng.standard_normal((T, cols)).astype(np.float32)
        y = cm.linear(w, x, isa="amx")
        ref = linear_reference(raw, x)
        assert rel_err(y, ref) <= TIGHT, f"{fmt} {rows}x{cols} T={T}: {rel_err(y, ref):.2e}"
        y_vec = cm.linear(w, x, isa="avx512")
        assert rel_err(y, y_vec) <= TIGHT, f"{fmt} {rows}x{cols} T={T} against avx512: {rel_err(y, y_vec):.2e}"


def test_same_bits_for_any_number_of_workers(rng) -> None:
    raw = make_weights("q4_k", 1, 256, 512, rng, 0.1)
    w = cm.Weights(raw.data, "q4_k", 1, 256, 512)
    x = rng.standard_normal((53, 512)).astype(np.float32)
    with cm.Pool(1) as p1, cm.Pool(3) as p3:
        a = cm.linear(w, x, pool=p1, isa="amx")
        b = cm.linear(w, x, pool=p3, isa="amx")
    assert np.array_equal(a, b)


@pytest.mark.parametrize("fmts", [("q4_k", "q4_k", "q6_k"), ("q5_k", "q8_0", "q6_k"), ("bf16", "fp8_e4m3_b128", "bf16")])
def test_moe_prefill(bank_for, rng, fmts) -> None:
    """A prefill-sized call (every expert gets dozens of tokens) against the float64
    reference with the activation quantization modelled (as test_moe_matrix), and
    against the avx512 tier."""
    case = bank_for(fmts)
    T, K = 96, 4
    x = rng.standard_normal((T, case.H)).astype(np.float32)
    ids = rng.integers(0, case.E, size=(T, K)).astype(np.int32)
    wts = rng.uniform(0.05, 1.0, size=(T, K)).astype(np.float32)
    y = cm.moe_forward(case.bank, x, ids, wts, isa="amx")
    ref, allowance = moe_reference(*case.raw, x.astype(np.float64), ids, wts, act=case.activation, with_allowance=True)
    bound = 1e-4 if set(fmts) & set(QUANTIZED) else TIGHT
    err = rel_err_allowing(y.astype(np.float64), ref, allowance)
    assert err <= bound, f"{fmts}: {err:.2e} (bank seed {case.seed})"
    y_vec = cm.moe_forward(case.bank, x, ids, wts, isa="avx512")
    assert rel_err(y, y_vec) <= 1e-3, f"{fmts} against avx512: {rel_err(y, y_vec):.2e}"
