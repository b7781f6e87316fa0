"""The FP8 E4M3 (128x128 block scales) kernels on every tier against a float64 reference
whose E4M3 decoder is written here from the format's definition (sign, 4-bit exponent of
bias 7, 3-bit mantissa; exponent 0: subnormal (m/8) 2^-6; S.1111.111 NaN), not from the
package's or torch's.

Every one of the 254 non-NaN codes, +-0 and the 14 subnormal ones included, is checked on
its own (a row of one code repeated: each output is that code's value times a dot product
of scales and activations, so a wrong decoding of one code fails its row however small the
value) and among all the others (rows holding every code in a random order). Block scales
and activations are random (neither is 1 or 0; activations of very different magnitudes in
one row), the matrices span several 128-row scale blocks with a partial last one, the
column counts leave partial 128-column blocks and columns past the last whole 32 (the
AVX2 kernels' tails), and the token counts cover the kernels' groupings (1-4 alone, fours
and eights, the rest after them). Outputs are poisoned with NaN before each call."""

from __future__ import annotations

import numpy as np
import pytest

from cpu_moe_cases import cm

#: the two NaN codes of E4M3 (OCP "fn": no infinities), which checkpoints never hold
NAN_CODES = (0x7F, 0xFF)
CODES = np.array([c for c in range(256) if c not in NAN_CODES], np.uint8)
#: what each tier needs of the CPU, for the skip reasons
TIER_NEEDS = {
    "amx": "AMX-TILE/INT8/BF16 with AVX-512",
    "avx512": "AVX-512 F/BW/VL/DQ + VNNI",
    "avx_vnni": "AVX-VNNI with AVX2 + FMA + F16C",
    "avx2": "AVX2 + FMA + F16C",
    "scalar": "nothing",
}


def e4m3_to_float64(codes: np.ndarray) -> np.ndarray:
    """float64 values of E4M3 codes from the format's definition."""
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 0x7
    value = np.where(e == 0, (m / 8.0) * 2.0**-6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    value = np.where((e == 15) & (m == 7), np.nan, value)
    return sign * value


def test_decoder_reference_points() -> None:
    """The reference decoder itself, on values the format's definition fixes."""
    want = {0x00: 0.0, 0x80: -0.0, 0x01: 2.0**-9, 0x07: 7 * 2.0**-9, 0x08: 2.0**-6, 0x38: 1.0, 0xB8: -1.0,
            0x3C: 1.5, 0x40: 2.0, 0x7E: 448.0, 0xFE: -448.0, 0x87: -7 * 2.0**-9}
    got = e4m3_to_float64(np.array(list(want), np.uint8))
    assert got.tolist() == list(want.values())
    assert np.isnan(e4m3_to_float64(np.array(NAN_CODES, np.uint8))).all()
    assert np.unique(e4m3_to_float64(CODES)).size == 253  # +0 and -0 compare equal


def tier(name: str) -> str:
    if name not in cm.isa_tiers():
        pytest.skip(f"the {name} tier is not offered here: the CPU lacks {TIER_NEEDS.get(name, name)}, "
                    f"or FREETOKEN_CPU_MOE_ISA caps the tiers below it (offered: {', '.join(cm.isa_tiers())})")
    return name


def fp8_matrix(cols: int, mixed_rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Codes [rows, cols]: one row per non-NaN code, that code in every column, in a random
    order of rows, then `mixed_rows` rows each holding every code (repeated to fill the
    columns) in a random order; and block scales [ceil(rows/128), ceil(cols/128)] spread
    over three decades."""
    single = np.repeat(rng.permutation(CODES)[:, None], cols, axis=1)
    mixed = np.stack([rng.permutation(np.resize(rng.permutation(CODES), cols)) for _ in range(mixed_rows)])
    codes = np.ascontiguousarray(np.concatenate([single, mixed]))
    rows = codes.shape[0]
    sr, sc = -(-rows // 128), -(-cols // 128)
    scale = (np.exp(rng.uniform(np.log(1e-4), np.log(1e-1), size=(sr, sc))) * rng.choice([-1.0, 1.0], size=(sr, sc))).astype(np.float32)
    return codes, scale


def dense_of(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    rows, cols = codes.shape
    full = np.repeat(np.repeat(scale.astype(np.float64), 128, axis=0), 128, axis=1)[:rows, :cols]
    return e4m3_to_float64(codes) * full


def activations(T: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random, no zeros, blocks of columns at very different magnitudes."""
    x = rng.standard_normal((T, cols))
    x = np.where(np.abs(x) < 1e-3, 1e-3, x)
    x *= np.exp2(rng.integers(-10, 7, size=(T, -(-cols // 48))).repeat(48, axis=1)[:, :cols])
    return x.astype(np.float32)


def check(codes: np.ndarray, scale: np.ndarray, T: int, isa: str, rng: np.random.Generator, pool=None) -> None:
    rows, cols = codes.shape
    dense = dense_of(codes, scale)
    wts = cm.Weights(codes.reshape(1, rows, cols), "fp8_e4m3_b128", 1, rows, cols, scale=scale.reshape(1, *scale.shape))
    x = activations(T, cols, rng)
    out = np.full((T, rows), np.nan, np.float32)
    assert cm.linear(wts, x, out=out, isa=isa, pool=pool) is out
    x64 = x.astype(np.float64)
    ref = x64 @ dense.T
    # float32 accumulation: each output within 1e-5 of the sum of its products' magnitudes
    # (a row of one code: of |code value| times its dot product's magnitudes, so every code
    # counts, subnormal ones too; rows of +-0 must give exactly 0)
    mag = np.abs(x64) @ np.abs(dense).T
    err = np.abs(out.astype(np.float64) - ref)
    bad = ~(err <= 1e-5 * mag)
    if bad.any():
        t, r = np.argwhere(bad)[0]
        code = int(codes[r, 0]) if r < CODES.size else None
        raise AssertionError(
            f"fp8 {isa} rows={rows} cols={cols} T={T}: {int(bad.sum())} outputs off, first [{t}, {r}] "
            f"(code {code if code is None else hex(code)}): {out[t, r]!r} vs {ref[t, r]!r}, "
            f"error {err[t, r]:.3e}, bound {1e-5 * mag[t, r]:.3e}"
        )


@pytest.mark.parametrize("isa", cm.ops.TIER_ORDER)
# columns: a partial 128-block with whole 32s and a rest (200 = 128 + 64 + 8; 333 = 2 x 128
# + 64 + 13; 1000 = 7 x 128 + 96 + 8), no whole 32 at all (20), only whole 32s (96), whole
# blocks (256)
@pytest.mark.parametrize("cols", [20, 96, 200, 256, 333, 1000])
def test_every_code_tails_and_token_counts(cols: int, isa: str, rng) -> None:
    codes, scale = fp8_matrix(cols, 46, rng)  # 300 rows: scale blocks of 128, 128, 44
    for T in (1, 2, 3, 4, 5, 7, 8, 9, 16, 19):
        check(codes, scale, T, tier(isa), rng)


@pytest.mark.parametrize("workers", [1, 3])
def test_row_splits_across_workers(workers: int, rng) -> None:
    """Workers' row ranges start and end inside 128-row scale blocks."""
    codes, scale = fp8_matrix(333, 200, rng)
    with cm.Pool(workers, pin=False) as pool:
        for T in (1, 3, 8, 13):
            check(codes, scale, T, cm.active_isa(), rng, pool=pool)


def test_subnormal_codes_alone(rng) -> None:
    """Rows of subnormal codes only (values (m/8) 2^-6 times the block scale, down to
    1e-7): exact to float32 accumulation, never flushed to zero, on every tier."""
    sub = np.array([c for c in CODES if (c & 0x78) == 0 and (c & 0x07) != 0], np.uint8)
    assert sub.size == 14
    rows, cols = 140, 296
    codes = rng.choice(sub, size=(rows, cols))
    scale = np.full((2, 3), 1e-3, np.float32) * rng.uniform(0.5, 2.0, size=(2, 3)).astype(np.float32)
    for isa in cm.isa_tiers():
        for T in (1, 2, 4, 8, 11):
            check(codes, scale, T, isa, rng)
            x = activations(T, cols, rng)
            y = cm.linear(cm.Weights(codes.reshape(1, rows, cols), "fp8_e4m3_b128", 1, rows, cols,
                                     scale=scale.reshape(1, 2, 3)), x, isa=isa)
            assert (y != 0).all(), f"{isa} T={T}: subnormal weights read as zero"


def test_callers_floating_point_environment_kept(rng) -> None:
    """The kernels that read subnormal weights switch DAZ off for their duration only: the
    calling thread's environment (here Python's: subnormals kept) is what it was."""
    tiny = np.float32(1e-38)

    def subnormals_survive() -> bool:
        return float(tiny / np.float32(4.0)) != 0.0 and float(np.float32(2.5e-39) * np.float32(2.0)) != 0.0

    assert subnormals_survive()
    codes, scale = fp8_matrix(200, 10, rng)
    with cm.Pool(1) as solo:  # everything on the calling thread
        for isa in cm.isa_tiers():
            for T in (1, 8, 9):
                check(codes, scale, T, isa, rng, pool=solo)
                assert subnormals_survive(), isa
