"""The MXFP4 kernels on every tier against independent float64 dequantizations (gguf-py's
``gguf.quants.dequantize``, and numpy from ggml's block layout as documented), on blocks
with every code and a wide range of exponents, row / column / token counts that leave
partial groups (16 blocks per exponent gather, pairs of blocks per register, 16 rows
summed together at T=1, tokens in fours), several worker counts, and a GPT-OSS-shaped
MoE layer with the clamped SwiGLU. The AVX-512 tiers run both their paths where the CPU
has AVX512-VBMI (``_core.set_mxfp4_vbmi``)."""

from __future__ import annotations

import numpy as np
import pytest

from cpu_moe_cases import cm
from freetoken_cpu_moe import _core
from cpu_moe_reference import moe_reference, quantize_act, random_routes, rel_err, rel_err_allowing, RawWeights

def _vbmi_supported() -> bool:
    before = _core.mxfp4_vbmi()
    try:
        _core.set_mxfp4_vbmi(True)
        return True
    except ValueError:
        return False
    finally:
        _core.set_mxfp4_vbmi(before)


#: (tier, VBMI path on/off; None where the tier has no such choice)
PATHS = [(isa, vbmi) for isa in cm.isa_tiers()
         for vbmi in ((False, True) if _vbmi_supported() else (False,)) if isa in ("avx512", "amx")]
PATHS += [(isa, None) for isa in cm.isa_tiers() if isa not in ("avx512", "amx")]


@pytest.fixture(params=PATHS, ids=lambda p: p[0] + ("" if p[1] is None else "-vbmi" if p[1] else "-novbmi"))
def isa(request) -> str:
    """A tier, with the AVX-512 MXFP4 kernels' VBMI path set for the test."""
    tier, vbmi = request.param
    before = _core.mxfp4_vbmi()
    if vbmi is not None:
        _core.set_mxfp4_vbmi(vbmi)
    yield tier
    _core.set_mxfp4_vbmi(before)


KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float64)


def numpy_dequantize(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """float64 values of ggml block_mxfp4 rows: byte 0 = e, then value j < 16 in the low
    nibble of byte 1 + j and value j + 16 in its high nibble; value = KVALUES[code] * 2^(e - 128)
    (exponents 0 and 1, float32 subnormals, count as zero like the kernels' DAZ)."""
    b = raw.reshape(rows, cols // 32, 17)
    e = b[..., 0].astype(np.int64)
    codes = np.concatenate([b[..., 1:] & 0x0F, b[..., 1:] >> 4], axis=-1)
    scale = np.where(e >= 2, np.ldexp(1.0, e - 128), 0.0)
    return (KVALUES[codes] * scale[..., None]).reshape(rows, cols)


def random_blocks(rows: int, cols: int, rng: np.random.Generator, e_range: tuple[int, int] = (110, 130)) -> np.ndarray:
    """Raw MXFP4 bytes, every code random, exponents in ``e_range``."""
    raw = rng.integers(0, 256, size=(rows, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(*e_range, size=(rows, cols // 32))
    return raw.reshape(rows, -1)


def gguf_dequantize(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    gguf = pytest.importorskip("gguf")
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4), np.float64).reshape(rows, cols)


def test_layout_as_documented(rng) -> None:
    """gguf-py's decoder and the layout the kernels implement agree (exponents 2..254)."""
    raw = random_blocks(9, 320, rng, (2, 251))
    np.testing.assert_array_equal(numpy_dequantize(raw, 9, 320), gguf_dequantize(raw, 9, 320))


def check_linear(raw: np.ndarray, rows: int, cols: int, T: int, isa: str, rng: np.random.Generator, pool=None) -> None:
    dense = gguf_dequantize(raw, rows, cols)
    wts = cm.Weights(raw, "mxfp4", 1, rows, cols)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    x[0, : cols // 2] *= 50.0  # blocks of very different activation scales in one row
    out = np.full((T, rows), np.nan, np.float32)
    assert cm.linear(wts, x, out=out, isa=isa, pool=pool) is out
    xq = quantize_act(x.astype(np.float64), 32)
    # float32 accumulation: each output within 1e-5 of the sum of its products' magnitudes
    scale = np.abs(xq) @ np.abs(dense).T
    worst = float(np.max(np.abs(out - xq @ dense.T) / scale))
    assert worst < 1e-5, f"mxfp4 {isa} rows={rows} cols={cols} T={T}: {worst:.2e}"
    # and the unquantized math: off by at most half an int8 step of each activation
    half_step = np.repeat(np.abs(x.astype(np.float64)).reshape(T, -1, 32).max(axis=2) / 254.0, 32, axis=1)
    bound = half_step @ np.abs(dense).T * 1.001 + 1e-5 * scale
    assert (np.abs(out - x.astype(np.float64) @ dense.T) <= bound).all(), f"mxfp4 {isa} rows={rows} cols={cols} T={T}"


@pytest.mark.parametrize("rows,cols", [(1, 32), (15, 96), (17, 512), (33, 1056), (20, 2912)])
def test_linear_tiers_tails_tokens(rows: int, cols: int, isa: str, rng) -> None:
    raw = random_blocks(rows, cols, rng)
    for T in (1, 2, 3, 4, 5, 16, 64):
        check_linear(raw, rows, cols, T, isa, rng)


def test_subnormal_and_extreme_exponents(isa: str, rng) -> None:
    """Exponents 0 and 1 (ggml: 2^-128, 2^-127) give zero; large exponents keep full scale."""
    rows, cols = 18, 640
    raw = random_blocks(rows, cols, rng, (0, 2)).reshape(rows, -1, 17)
    raw[::2, ::3, 0] = rng.integers(150, 190, size=raw[::2, ::3, 0].shape)
    raw = raw.reshape(rows, -1)
    dense = numpy_dequantize(raw, rows, cols)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    out = np.full((3, rows), np.nan, np.float32)
    cm.linear(cm.Weights(raw, "mxfp4", 1, rows, cols), x, out=out, isa=isa)
    xq = quantize_act(x.astype(np.float64), 32)
    scale = np.abs(xq) @ np.abs(dense).T
    assert (out[:, 1::2] == 0).all()  # rows of subnormal blocks only
    assert float(np.max(np.abs(out - xq @ dense.T) / np.maximum(scale, 1e-300))) < 1e-5


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_worker_counts(workers: int, rng) -> None:
    raw = random_blocks(200, 2912, rng)
    with cm.Pool(workers, pin=False) as pool:
        for T in (1, 3, 16):
            check_linear(raw, 200, 2912, T, cm.active_isa(), rng, pool=pool)


def gpt_oss_bank(rng: np.random.Generator, E: int, H: int, I: int) -> list[RawWeights]:
    out = []
    for rows, cols in ((I, H), (I, H), (H, I)):
        raw = random_blocks(E * rows, cols, rng, (118, 124))
        dense = gguf_dequantize(raw, E * rows, cols).reshape(E, rows, cols)
        out.append(RawWeights("mxfp4", raw, None, dense))
    return out


def test_moe_gpt_oss_shapes(isa: str, rng) -> None:
    """A MoE layer of GPT-OSS's block counts (hidden 2880 + 32 bias columns = 91 blocks,
    an odd number) with swiglu_oai, several T and top-4 routes, against float64."""
    E, H, I = 6, 2912, 96
    raws = gpt_oss_bank(rng, E, H, I)
    ws = [cm.Weights(r.data, "mxfp4", E, r.dense.shape[1], r.dense.shape[2]) for r in raws]
    bank = cm.ExpertBank(*ws, activation="swiglu_oai")
    for T in (1, 3, 16):
        x = rng.standard_normal((T, H)).astype(np.float32) * 3.0
        ids, w = random_routes(rng, T, 4, E)
        out = np.full((T, H), np.nan, np.float32)
        y = cm.moe_forward(bank, x, ids, w, out=out, isa=isa).astype(np.float64)
        assert np.isfinite(y).all()
        tight, allowance = moe_reference(*raws, x.astype(np.float64), ids, w, act="swiglu_oai", with_allowance=True)
        loose = moe_reference(*raws, x.astype(np.float64), ids, w, act="swiglu_oai", quantized=False)
        assert rel_err_allowing(y, tight, allowance) < 1e-4, f"{isa} T={T}"
        assert rel_err(y, loose) < 3e-2, f"{isa} T={T}"
