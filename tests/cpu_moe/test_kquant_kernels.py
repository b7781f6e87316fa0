"""The K-quant kernels on every tier against gguf-py's dequantization, on blocks
the model-like generator of cpu_moe_reference never makes (every bit of the 6-bit
scales and mins set at random, int8 Q6_K scales over their whole range), on row /
column / token counts that leave partial groups (16 rows summed together at T=1,
tokens in fours), and the single-thread timing harness."""

from __future__ import annotations

import numpy as np
import pytest

from cpu_moe_cases import cm
from cpu_moe_reference import BLOCK_BYTES, FP16_FIELDS, act_quant_block, gguf_dequantize, quantize_act
from freetoken_cpu_moe.timing import time_dot_rows

KQUANTS = ["q4_k", "q5_k", "q6_k"]


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Raw blocks with every byte random except the fp16 super-block scales; and their float64 values."""
    nb = rows * cols // 256
    raw = rng.integers(0, 256, size=(nb, BLOCK_BYTES[fmt]), dtype=np.uint8)
    for off in FP16_FIELDS[fmt]:
        v = rng.uniform(0.5e-3, 1e-3, size=nb).astype(np.float16)
        raw[:, off : off + 2] = v.view(np.uint8).reshape(nb, 2)
    return raw, gguf_dequantize(raw, fmt, 1, rows, cols)[0]


@pytest.mark.parametrize("isa", cm.isa_tiers())
@pytest.mark.parametrize("fmt", KQUANTS)
# (35, 4608): many-token calls run rows in tiles of 16 rows x 16 super-blocks (4096 columns):
# two column tiles, the second partial, and a partial row tile
@pytest.mark.parametrize("rows,cols", [(1, 256), (15, 768), (17, 512), (33, 2048), (35, 4608)])
def test_kquant_full_range_and_tails(fmt: str, rows: int, cols: int, isa: str, rng) -> None:
    raw, dense = random_blocks(fmt, rows, cols, rng)
    wts = cm.Weights(raw, fmt, 1, rows, cols)
    for T in (1, 2, 3, 4, 5, 8):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        x[0, : cols // 2] *= 50.0  # sub-blocks of very different activation scales in one block
        out = np.full((T, rows), np.nan, np.float32)
        cm.linear(wts, x, out=out, isa=isa)
        xq = quantize_act(x.astype(np.float64), act_quant_block(fmt, isa))
        tight = xq @ dense.T
        # float32 accumulation: each output within 1e-5 of the sum of its products' magnitudes
        # (measured: below 1e-7; a dot product can cancel, so no bound relative to the result)
        scale = np.abs(xq) @ np.abs(dense).T
        worst = float(np.max(np.abs(out - tight) / scale))
        assert worst < 1e-5, f"{fmt} {isa} rows={rows} cols={cols} T={T}: {worst:.2e}"


@pytest.mark.parametrize("fmt", KQUANTS)
def test_time_dot_rows(fmt: str, rng) -> None:
    raw, _ = random_blocks(fmt, 64, 512, rng)
    wts = cm.Weights(raw, fmt, 1, 64, 512)
    for isa in cm.isa_tiers():
        times = time_dot_rows(wts, rng.standard_normal((2, 512)).astype(np.float32), 3, isa=isa)
        assert len(times) == 3 and all(ns > 0 for ns in times)
    with pytest.raises(ValueError, match="must be"):
        time_dot_rows(wts, np.zeros((1, 256), np.float32), 1)


@pytest.mark.parametrize("isa", cm.isa_tiers())
def test_activation_codes_on_every_tier(isa: str, rng) -> None:
    """Q6_K rows that each pick one element (code 33 there, 32 = zero elsewhere, scales 1,
    d = 1) return the int8-quantized activations themselves: every tier must round like
    the reference (half away from zero, ties included) and scale by absmax / 127 of its
    block (32 elements; 256 on the AVX2 tiers, act_quant_block)."""
    n = 512
    nb = n // 256
    raw = np.zeros((n, nb, 210), dtype=np.uint8)
    codes = np.full((n, n), 32, dtype=np.int64)
    codes[np.arange(n), np.arange(n)] = 33
    c = codes.reshape(n, nb, 2, 128)  # [row][block][half][element of the half]
    lo = (c & 0xF).astype(np.uint8)
    hi = (c >> 4).astype(np.uint8)
    raw[:, :, 0:128] = (lo[..., 0:64] | (lo[..., 64:128] << 4)).reshape(n, nb, 128)
    qh = hi[..., 0:32] | (hi[..., 32:64] << 2) | (hi[..., 64:96] << 4) | (hi[..., 96:128] << 6)
    raw[:, :, 128:192] = qh.reshape(n, nb, 64)
    raw[:, :, 192:208] = 1
    raw[:, :, 208:210] = np.array([1.0], dtype=np.float16).view(np.uint8)
    wts = cm.Weights(raw.reshape(-1), "q6_k", 1, n, n)
    x = rng.standard_normal((3, n)).astype(np.float32)
    x[1, :32] = np.arange(-16, 16) + 0.5  # amax 15.5, scale 127/15.5: no exact ties
    x[2, :32] = np.concatenate([[127.0], np.arange(-15, 16) + 0.5])  # id = 1: ties at every k + 0.5
    x[2, 32:64] = -0.0
    block = act_quant_block("q6_k", isa)
    if block == 256:  # the same cases over whole super-blocks
        x[1, :256] = np.arange(-128, 128) / 8.0 + 0.0625  # amax 15.9375: no exact ties
        x[2, :256] = np.concatenate([[127.0, -0.5, -126.5], np.arange(-126, 127) + 0.5])  # id = 1: ties at k + 0.5
        x[2, 256:288] = -0.0
    y = cm.linear(wts, x, isa=isa)
    xq = quantize_act(x.astype(np.float64), block)
    step = np.repeat(np.abs(x).reshape(3, -1, block).max(axis=2) / 127.0, block, axis=1)
    # the zero codes (32) cancel against the -32 offset only up to float32 rounding of the
    # block's partial sums; one code off is a whole step, far above both allowances
    noise = np.repeat(32.0 * np.abs(xq).reshape(3, -1, 256).sum(axis=2), 256, axis=1) * 1e-6
    assert (np.abs(y - xq) <= 0.05 * step + noise).all()


def test_bench_compute_rate(rng) -> None:
    """``freetoken bench cpu-moe --compute``: one kernel on one thread, weights in L2."""
    from freetoken.cli.bench.cpu_moe import time_compute

    r = time_compute(cm, "q4_k", 2, 512, rng, seconds=0.01)
    assert r["format"] == "q4_k" and r["T"] == 2 and r["KB"] == 256 * 2 * 144 / 1024
    assert r["ns_per_block"] > 0 and r["GBs"] > 0


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "bf16"])
def test_moe_same_result_on_any_pool(bank_for, rng, fmt: str) -> None:
    """Every output row is computed by one work item, whatever the split: the down items
    that wait for their expert's gate/up items (moe_forward) give bit-identical results
    on 1 worker and on more workers than cores."""
    from cpu_moe_reference import random_routes

    case = bank_for(fmt)
    with cm.Pool(1, pin=False) as one, cm.Pool(5, pin=False) as five:
        for T, K in [(1, 8), (3, 2), (16, 8)]:
            x = rng.standard_normal((T, case.H)).astype(np.float32)
            ids, w = random_routes(rng, T, K, case.E)
            y1 = cm.moe_forward(case.bank, x, ids, w, pool=one)
            y5 = cm.moe_forward(case.bank, x, ids, w, pool=five)
            assert np.array_equal(y1, y5), f"T={T} K={K}"
