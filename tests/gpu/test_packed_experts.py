"""Routed experts in their GGUF block formats (freetoken.kernels.moe_packed behind
freetoken.moe.experts.gpu_packed_experts.PackedGpuExperts).

Every result is compared, token row by token row, with the float64 per-route loop
(:func:`expert_reference.reference_experts`) over the weights gguf-py dequantizes from the
same random blocks (gguf.quants.dequantize); outputs are poisoned (NaN) first; ids hold
-1 (routes not on the GPU), duplicates, and tokens with no GPU route (their row must come
out exactly zero). Formats: Q4_K, Q5_K, Q6_K, Q8_0, and mixes of them across gate, up and
down (Q4_K_M files keep some down projections in Q6_K).

Without a GPU the kernels run in Triton's interpreter (conftest.py) at small sizes with
large tiles (the interpreter's cost is per program); the same tests run compiled on a GPU,
where the ``gpu``-marked ones add Qwen3-30B-A3B sizes, graph capture and a timing against
the BF16 kernels (``pytest tests/gpu/test_packed_experts.py -m gpu -k timing -s``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("gguf")

import triton  # noqa: E402
from expert_reference import reference_experts  # noqa: E402
from graph_timing import graph_time_us  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from freetoken.handoff import Fmt  # noqa: E402
from freetoken.models.gguf_writer import random_blocks  # noqa: E402
from freetoken.loading.tensors import RawTensor  # noqa: E402
from freetoken.kernels import moe_experts  # noqa: E402
from freetoken.kernels import moe_packed  # noqa: E402
from freetoken.moe.experts.gpu_packed_experts import DequantScratch, PackedGpuExperts  # noqa: E402
from freetoken.models.moe_layer import ExpertWeights  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = DEV == "cpu"
if INTERPRET and not triton.knobs.runtime.interpret:
    pytest.skip("no GPU and Triton's interpreter is off (TRITON_INTERPRET unset at import)", allow_module_level=True)

E, H, I = 6, 512, 256
Q4, Q5, Q6, Q8, MX = int(Fmt.Q4_K), int(Fmt.Q5_K), int(Fmt.Q6_K), int(Fmt.Q8_0), int(Fmt.MXFP4)
#: one program per route / token in the interpreter; the GPU's default tiles elsewhere
WIDE = moe_packed.PackedConfig(block_i=256, block_h=512, block_n=512, block_r=256)
#: the BF16 per-route kernels (freetoken.kernels.moe_experts, GpuExperts) with one program per route
#: (gate/up) and per token (down) up to 256 x 256 experts: the engine tests' BF16 layers and
#: startup qualification in the interpreter
WIDE_BF16 = dataclasses.replace(moe_experts.DEFAULT_CONFIG, route_block_i=256, route_block_h=256, route_block_n=256,
                                route_block_r=256)  # fmt: skip
#: the tiles of the tests that do not choose their own: WIDE in the interpreter, the
#: default ones compiled on a GPU (WIDE's tiles take minutes to compile there)
BASE = WIDE if INTERPRET else moe_packed.DEFAULT_CONFIG
#: several programs and steps, steps smaller than a 256-value block (offsets inside blocks)
NARROW = moe_packed.PackedConfig(block_i=128, block_h=128, block_n=256, block_r=64)
FP32_TOL, BF16_TOL = 1e-5, 1e-2
#: the large-batch path multiplies BF16 weights and BF16 activations (as GpuExperts does)
DEQUANT_TOL = 2e-2
#: the grouped kernels (BF16 products, ``h`` in BF16): test_grouped_experts.py's bound, whose
#: interpreter runs round BF16 by truncation
GROUPED_TOL = 3e-2 if INTERPRET else 2e-2
#: scale of the random fp16 block scales, per format, so that weights are O(0.01 .. 0.1)
SCALES = {Q4: 2e-4, Q5: 1e-4, Q6: 1e-4, Q8: 2e-4, MX: 2e-3}


def packed_stack(fmt: int, rows: int, cols: int, rng: np.random.Generator, name: str) -> tuple[RawTensor, torch.Tensor]:
    """Random blocks of ``E`` experts as a RawTensor, and gguf-py's float64 dequantization."""
    b = random_blocks(fmt, E * rows, cols, rng, scale=SCALES[fmt])
    ref = gguf_dequantize(b, GGMLQuantizationType(fmt)).astype(np.float64).reshape(E, rows, cols)
    raw = RawTensor(name=name, shape=(E, rows, cols), fmt=fmt, data=b.reshape(E, rows, -1), source="random")
    return raw, torch.from_numpy(ref)


def random_layer(fmts: tuple[int, int, int], seed: int):
    rng = np.random.default_rng(seed)
    gate, g64 = packed_stack(fmts[0], I, H, rng, "ffn_gate_exps")
    up, u64 = packed_stack(fmts[1], I, H, rng, "ffn_up_exps")
    down, d64 = packed_stack(fmts[2], H, I, rng, "ffn_down_exps")
    return (gate, up, down), (g64, u64, d64)


def routes(tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Random ids with -1s, a duplicate within token 0, and (from 3 tokens) a token with no route."""
    ids = torch.randint(0, E, (tokens, top_k), generator=gen)
    ids[torch.rand(tokens, top_k, generator=gen) < 0.3] = -1
    if top_k >= 2:
        ids[0, 0] = ids[0, top_k - 1] = int(torch.randint(0, E, (1,), generator=gen))
    if tokens >= 3:
        ids[1] = -1
    return ids.to(torch.int32)


def check_rows(out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    got = out.detach().cpu().double()
    assert torch.isfinite(got).all(), "non-finite output (poison left or NaN computed)"
    empty = ref.abs().amax(dim=1) == 0
    assert (got[empty] == 0).all(), "a token without GPU routes got a non-zero row"
    if (~empty).any():
        err = (got[~empty] - ref[~empty]).norm(dim=1) / ref[~empty].norm(dim=1)
        assert float(err.max()) < tol, f"worst token row relative error {float(err.max()):.3g} >= {tol}"
        return float(err.max())
    return 0.0


def run_case(
    fmts: tuple[int, int, int], tokens: int, top_k: int, seed: int, xdtype: torch.dtype = torch.float32,
    outdtype: torch.dtype = torch.float32, config: moe_packed.PackedConfig = BASE, tol: float = FP32_TOL,
    **kwargs,
) -> PackedGpuExperts:  # fmt: skip
    (gate, up, down), (g64, u64, d64) = random_layer(fmts, seed)
    experts = PackedGpuExperts(gate, up, down, DEV, config=config, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(xdtype)
    ids = routes(tokens, top_k, gen)
    w = torch.rand(tokens, top_k, generator=gen) + 0.1
    out = torch.full((tokens, H), float("nan"), dtype=outdtype, device=DEV)
    assert experts.forward(x.to(DEV), ids.to(DEV), w.to(DEV), out=out) is out
    check_rows(out, reference_experts(x, ids, w, g64, u64, d64), tol)
    return experts


MIXES = {
    "q4k_q4k_q6k": (Q4, Q4, Q6),
    "q5k": (Q5, Q5, Q5),
    "q8_0": (Q8, Q8, Q8),
    "q6k_q5k_q4k": (Q6, Q5, Q4),
    "mxfp4": (MX, MX, MX),
}


@pytest.mark.parametrize("tokens,top_k", [(1, 8), (3, 8)])
@pytest.mark.parametrize("mix", list(MIXES))
def test_packed_matches_gguf_reference(mix, tokens, top_k):
    run_case(MIXES[mix], tokens, top_k, seed=list(MIXES).index(mix) * 10 + tokens)


@pytest.mark.parametrize("config", ["base", "loop"])
def test_output_stored_in_its_dtype(config):
    """The down kernel stores its float32 sums once in the output's dtype: a BF16 output (a
    caller's, or the one returned for BF16 activations, with no conversion after the kernel)
    equals the float32 output rounded to BF16, value for value, compiled (round to nearest
    even, as torch converts); Triton's interpreter truncates instead, so there it is within
    one BF16 step."""
    cfg = BASE if config == "base" else dataclasses.replace(BASE, down_routes_tile=False)
    (gate, up, down), (g64, u64, d64) = random_layer((Q4, Q4, Q6), seed=61)
    experts = PackedGpuExperts(gate, up, down, DEV, config=cfg)
    gen = torch.Generator().manual_seed(62)
    x = torch.randn(3, H, generator=gen).to(torch.bfloat16).to(DEV)
    ids, w = routes(3, 8, gen).to(DEV), (torch.rand(3, 8, generator=gen) + 0.1).to(DEV)
    y32 = torch.full((3, H), float("nan"), device=DEV)
    experts.forward(x, ids, w, out=y32)
    check_rows(y32, reference_experts(x.cpu().float(), ids.cpu(), w.cpu(), g64, u64, d64), FP32_TOL)
    y16 = torch.full((3, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert experts.forward(x, ids, w, out=y16) is y16
    if INTERPRET:
        step = y32.cpu().abs() * 2.0**-7  # one BF16 step at each value (7 stored mantissa bits)
        assert bool(((y16.cpu().float() - y32.cpu()).abs() <= step).all())
        assert not torch.equal(y32.cpu(), y16.cpu().float())  # rounded, not kept in float32
    else:
        assert torch.equal(y16.cpu(), y32.cpu().to(torch.bfloat16))
    got = experts.forward(x, ids, w)
    assert got.dtype == torch.bfloat16 and torch.equal(got.cpu(), y16.cpu())
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        moe_packed.launch(x, ids, w, experts.gate, experts.up, experts.down,
                                 torch.empty(3, H, dtype=torch.float64, device=DEV),
                                 torch.empty(3, 8, I, device=DEV), "silu", cfg)


@pytest.mark.parametrize("config", ["base", "loop"])
def test_ids_through_a_slot_table(config):
    """With a slot table the kernels run expert ``table[id]`` for each route (an expert
    cache's slots, the table read on the device) and skip routes whose table entry is -1,
    as the float64 reference over the mapped ids; prompt-sized batches map the ids before
    the other kernels."""
    cfg = BASE if config == "base" else dataclasses.replace(BASE, down_routes_tile=False)
    (gate, up, down), (g64, u64, d64) = random_layer((Q4, Q5, Q6), seed=63)
    experts = PackedGpuExperts(gate, up, down, DEV, config=cfg, large_batch="grouped")
    gen = torch.Generator().manual_seed(64)
    n = 3 * E  # ids of a larger numbering, most of them in no slot
    table = torch.full((n,), -1, dtype=torch.int32)
    table[torch.randperm(n, generator=gen)[:E]] = torch.randperm(E, generator=gen).to(torch.int32)
    for tokens in (3, 40):  # 24 routes: the per-route kernels; 320: the grouped kernels
        x = torch.randn(tokens, H, generator=gen)
        ids = torch.randint(-1, n, (tokens, 8), generator=gen).to(torch.int32)
        ids[0, :3] = torch.nonzero(table >= 0)[:3, 0].to(torch.int32)  # some routes surely hit
        w = torch.rand(tokens, 8, generator=gen) + 0.1
        mapped = torch.where(ids >= 0, table[ids.clamp(min=0).long()], -1)
        assert 0 < int((mapped >= 0).sum()) < int((ids >= 0).sum())
        out = torch.full((tokens, H), float("nan"), device=DEV)
        experts.forward(x.to(DEV), ids.to(DEV), w.to(DEV), out=out, slot_table=table.to(DEV))
        tol = FP32_TOL if tokens * 8 <= cfg.max_routes else GROUPED_TOL
        check_rows(out, reference_experts(x, mapped, w, g64, u64, d64), tol)


@pytest.mark.parametrize("tokens", [1, 3])
def test_mxfp4_swiglu_oai(tokens):
    """GPT-OSS's experts: MXFP4 with the clamped SwiGLU."""
    (gate, up, down), (g64, u64, d64) = random_layer((MX, MX, MX), seed=70 + tokens)
    experts = PackedGpuExperts(gate, up, down, DEV, activation="swiglu_oai", config=BASE)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen) * 4  # gate/up values past the clamp limit
    ids = routes(tokens, 4, gen)
    w = torch.rand(tokens, 4, generator=gen) + 0.1
    out = torch.full((tokens, H), float("nan"), device=DEV)
    experts.forward(x.to(DEV), ids.to(DEV), w.to(DEV), out=out)
    ref = reference_experts(x, ids, w, g64, u64, d64, "swiglu_oai")
    check_rows(out, ref, FP32_TOL)
    assert float(x.abs().max()) * float(g64.abs().max()) > 0  # sanity: the inputs are not degenerate


@pytest.mark.parametrize("fmt", [MX, Q5, Q8])
def test_nvidia_byte_tiles_match_the_reference(fmt):
    """The tiles an NVIDIA GPU gives experts whose rows the int8 dots do not read
    (gate_up_tiles / down_tiles of NVIDIA_CONFIG: 16 rows x 512-value steps with 8 warps,
    down steps of 128 or 256), run here (the interpreter, or compiled on a GPU) against the
    float64 reference."""
    nv = moe_packed.NVIDIA_CONFIG
    gu = moe_packed.gate_up_tiles(nv, fmt, fmt, "cuda")
    dn = moe_packed.down_tiles(nv, fmt, 4, "cuda")
    cfg = dataclasses.replace(nv, block_h=gu.block_h, num_warps=gu.num_warps, block_r=dn.block_r,
                              down_num_warps=dn.down_num_warps)  # fmt: skip
    assert (cfg.block_i, cfg.block_h, cfg.num_warps) == (16, 512, 8)
    act = "swiglu_oai" if fmt == MX else "silu"
    (gate, up, down), (g64, u64, d64) = random_layer((fmt, fmt, fmt), seed=90 + fmt)
    experts = PackedGpuExperts(gate, up, down, DEV, activation=act, config=cfg)
    gen = torch.Generator().manual_seed(fmt)
    x = torch.randn(3, H, generator=gen)
    ids = routes(3, 4, gen)
    w = torch.rand(3, 4, generator=gen) + 0.1
    out = torch.full((3, H), float("nan"), device=DEV)
    experts.forward(x.to(DEV), ids.to(DEV), w.to(DEV), out=out)
    check_rows(out, reference_experts(x, ids, w, g64, u64, d64, act), FP32_TOL)


def fp8_stack(rows: int, cols: int, gen: torch.Generator, name: str) -> tuple[RawTensor, torch.Tensor]:
    """Random FP8 E4M3 experts ``[E, rows, cols]`` with one float32 scale per 128 x 128
    tile (the HF block-scaled layout), and their float64 values (torch's E4M3 decoding)."""
    codes = torch.randint(0, 256, (E, rows, cols), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    scale = torch.rand(E, -(-rows // 128), cols // 128, generator=gen) * 2e-4 + 1e-4
    full = scale.double().repeat_interleave(128, 1)[:, :rows].repeat_interleave(128, 2)
    ref = codes.view(torch.float8_e4m3fn).double() * full
    raw = RawTensor(name=name, shape=(E, rows, cols), fmt=int(Fmt.FP8_E4M3_B128), data=codes.numpy(), source="random",
                    scale=scale)
    return raw, ref


@pytest.mark.parametrize("config", ["base", "narrow"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_fp8_block_scaled(tokens, config):
    """FP8 block-scaled experts (rows of 132-byte blocks on the device) against float64."""
    gen = torch.Generator().manual_seed(80 + tokens)
    (gate, g64), (up, u64), (down, d64) = (fp8_stack(r, c, gen, n) for r, c, n in ((I, H, "g"), (I, H, "u"), (H, I, "d")))
    cfg = BASE if config == "base" else NARROW
    experts = PackedGpuExperts(gate, up, down, DEV, config=cfg)
    assert experts.formats == ("FP8_B128",) * 3
    values = 3 * E * H * I
    assert experts.device_bytes == values // 128 * 132 < 1.05 * gate.nbytes * 3
    x = torch.randn(tokens, H, generator=gen)
    ids = routes(tokens, 8, gen)
    w = torch.rand(tokens, 8, generator=gen) + 0.1
    out = torch.full((tokens, H), float("nan"), device=DEV)
    experts.forward(x.to(DEV), ids.to(DEV), w.to(DEV), out=out)
    check_rows(out, reference_experts(x, ids, w, g64, u64, d64), FP32_TOL)


def test_fp8_rows_dequantized_by_torch_and_triton():
    """The device rows dequantized (the torch fallback into BF16, the Triton kernel into
    float32) equal the exact values rounded to float32 (then BF16)."""
    from freetoken.moe.experts.gpu_packed_experts import _fp8_rows_to

    gen = torch.Generator().manual_seed(3)
    raw, ref = fp8_stack(I, H, gen, "g")
    stack = moe_packed.PackedStack.from_fp8(torch.from_numpy(raw.data), raw.scale, DEV)
    want = ref.float().to(torch.bfloat16)  # the float32 product, then BF16
    got = _fp8_rows_to(stack, torch.full((E, I, H), float("nan"), dtype=torch.bfloat16, device=DEV))
    assert torch.equal(got.cpu(), want)
    got = moe_packed.dequantize_experts(stack, torch.full((E, I, H), float("nan"), dtype=torch.float32,
                                                                 device=DEV))
    assert torch.equal(got.cpu(), ref.float())  # one float32 product per value, correctly rounded


def test_fp8_layout_refusals():
    gen = torch.Generator().manual_seed(1)
    codes = torch.zeros(2, 128, 96, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 128"):
        moe_packed.PackedStack.from_fp8(codes, torch.ones(2, 1, 1), DEV)
    raw, _ = fp8_stack(I, H, gen, "g")
    with pytest.raises(ValueError, match="does not match"):
        moe_packed.PackedStack.from_fp8(torch.from_numpy(raw.data), torch.ones(E, 1, 1), DEV)


@pytest.mark.parametrize("mix", ["q4k_q4k_q6k", "q5k", "q8_0", "mxfp4"])
def test_narrow_tiles(mix):
    """Several programs per route and several steps per row, steps inside 256-value blocks."""
    run_case(MIXES[mix], 2, 4, seed=len(mix), config=NARROW)


@pytest.mark.parametrize("routes_tile", [True, False])
@pytest.mark.parametrize("top_k", [3, 6])
def test_down_routes_tile_and_loop(routes_tile, top_k):
    """The down kernel's two forms (the token's routes as a tile dimension, or a loop over
    them), with route counts that are not powers of two (the tile is padded and masked)."""
    cfg = dataclasses.replace(NARROW, down_routes_tile=routes_tile)
    run_case((Q4, Q4, Q4), 3, top_k, seed=40 + top_k, config=cfg)


@pytest.mark.parametrize("mix,top_k", [("q4k_q4k_q6k", 3), ("mxfp4", 8)])
def test_routes_tile_with_h_loaded_once(mix, top_k):
    """The routes tile with each route's h loaded once and broadcast over its rows, several
    rows per route (block_n > 1), a padded route count, several steps per row."""
    cfg = dataclasses.replace(NARROW, down_routes_tile=True, down_h_once=True, block_n=16, block_r=128)
    run_case(MIXES[mix], 3, top_k, seed=90 + top_k, config=cfg)


@pytest.mark.parametrize("mix", ["q4k_q4k_q6k", "q5k", "q6k_q5k_q4k"])
def test_routes_tile_over_mixed_formats(mix):
    """The routes as the down kernel's tile dimension over the Q4_K/Q5_K/Q6_K mixes, several
    rows per route."""
    cfg = dataclasses.replace(BASE, down_routes_tile=True, block_n=min(BASE.block_n, 64))
    run_case(MIXES[mix], 3, 8, seed=60 + len(mix), config=cfg)


#: int8 dots: gate/up steps of 2 pairs of sub-blocks, down steps of 1 half block (several steps
#: per row in the interpreter's sizes), several rows per route in the down tile (in the
#: interpreter two tiles of 256 of a token's 512 rows: its cost is per program); h quantized per
#: 16 values by the gate/up kernel for the down kernel (int8_h), or per 32 by every down program
INT8_CFG = dataclasses.replace(BASE, int8_dot=True, down_routes_tile=True, block_i=max(16, BASE.block_i),
                               block_h=128, block_r=128, block_n=H // 2 if INTERPRET else min(BASE.block_n, 64))
#: a row's relative error against the reference with the same quantized activations: float32
#: sums in another order, and a code rounded the other way where h differs in its last bits
#: (one code off moves a row by ~1e-4); the unquantized float64 result is ~1e-2 away
INT8_TOL = 1e-3


def int8_rounding(config: moe_packed.PackedConfig, fmts: tuple[int, int, int]) -> dict[str, Any]:
    """:func:`reference_experts`'s arguments for the activations' rounding of ``config``'s
    per-route kernels here: int8 dots round Q4_K gate/up pairs' inputs per 32 values and a
    Q4_K/Q6_K down kernel's h (per 16 when the gate/up kernel quantizes it, else per 32)."""
    config = moe_packed.for_target(config, torch.device(DEV))
    if not config.int8_dot:
        return {}
    down = config.down_routes_tile and fmts[2] in (Q4, Q6)
    return {"int8_x": fmts[0] == fmts[1] == Q4,
            "int8_h": (16 if moe_packed.quantized_h(config, fmts[2]) else 32) if down else 0}


@pytest.mark.parametrize("fmts,int8_x,down_int8,int8_h,tokens,top_k", [
    ((Q4, Q4, Q6), True, True, True, 1, 8), ((Q4, Q4, Q6), True, True, True, 3, 3),
    ((Q4, Q4, Q4), True, True, True, 1, 8), ((Q4, Q4, Q4), True, True, True, 3, 3),
    ((Q5, Q5, Q6), False, True, True, 1, 8), ((Q5, Q5, Q6), False, True, False, 3, 3),
    ((Q4, Q4, Q8), True, False, True, 1, 8), ((Q4, Q4, Q8), True, False, False, 3, 3),
    ((Q4, Q4, Q6), True, True, False, 1, 8), ((Q4, Q4, Q4), True, True, False, 3, 3)])  # fmt: skip
def test_int8_dots(fmts, int8_x, down_int8, int8_h, tokens, top_k):
    """Q4_K gate/up and Q4_K/Q6_K down with int8-quantized activations against float64 over
    the same quantized activations (tests/gpu/expert_reference.int8_groups), and against the
    unquantized result (the quantization's error only); other formats keep their byte tiles
    in the same launch (Q5_K gate/up, Q8_0 down). h quantized per 16 values by the gate/up
    kernel (``int8_h``), or per 32 by every down program."""
    config = dataclasses.replace(INT8_CFG, int8_h=int8_h)
    by_gate_up = moe_packed.quantized_h(config, fmts[2])
    assert by_gate_up == (down_int8 and int8_h)
    (gate, up, down), (g64, u64, d64) = random_layer(fmts, seed=70 + tokens + top_k)
    experts = PackedGpuExperts(gate, up, down, DEV, config=config)
    gen = torch.Generator().manual_seed(tokens * top_k)
    x = torch.randn(tokens, H, generator=gen)
    x[0, :32] = 0.0  # a group of zeros: scale 0, no division by it
    ids = routes(tokens, top_k, gen)
    w = torch.rand(tokens, top_k, generator=gen) + 0.1
    out = torch.full((tokens, H), float("nan"), device=DEV)
    experts.forward(x.to(DEV), ids.to(DEV), w.to(DEV), out=out)
    h_group = (16 if by_gate_up else 32) if down_int8 else 0
    check_rows(out, reference_experts(x, ids, w, g64, u64, d64, int8_x=int8_x, int8_h=h_group), INT8_TOL)
    err = check_rows(out, reference_experts(x, ids, w, g64, u64, d64), 5e-2)
    assert err > INT8_TOL, "no quantization error: were the activations quantized?"


def test_int8_dots_only_where_they_run(monkeypatch):
    """int8 dots run on NVIDIA and in the interpreter; an AMD device gets the byte tiles."""
    from freetoken.backends import triton_target

    cfg = dataclasses.replace(BASE, int8_dot=True, int8_h=True, block_i=max(16, BASE.block_i))
    assert moe_packed.for_target(cfg, DEV) is cfg
    monkeypatch.setattr(triton_target, "for_device", lambda device: triton_target.hip_target("gfx942"))
    amd = moe_packed.for_target(cfg, DEV)
    assert (amd.int8_dot, amd.int8_h) == (False, False) and amd.block_i == cfg.block_i


@pytest.mark.parametrize("target", ["cuda", "hip", "none"])
def test_default_tiles_by_device(target, monkeypatch):
    """NVIDIA's default tiles are the int8 dots (experts, and the one-token GEMV of packed
    dense weights, whose batches keep the byte tiles); AMD and the interpreter get the byte
    tiles (DEFAULT_CONFIG / WIDE_CONFIG)."""
    from freetoken.backends import triton_target
    from freetoken.models import packed_linear
    from freetoken.kernels import packed_linear as plt

    made = {"cuda": lambda: triton_target.cuda_target((9, 0)), "hip": lambda: triton_target.hip_target("gfx1030"),
            "none": lambda: triton_target.no_target("the interpreter")}[target]()  # fmt: skip
    monkeypatch.setattr(triton_target, "for_device", lambda device: made)
    nvidia = target == "cuda"
    experts = moe_packed.default_config(DEV)
    assert experts is (moe_packed.NVIDIA_CONFIG if nvidia else moe_packed.DEFAULT_CONFIG)
    assert experts.int8_dot == experts.int8_h == nvidia
    assert moe_packed.NVIDIA_CONFIG.int8_dot and not moe_packed.DEFAULT_CONFIG.int8_dot
    for rows, byte in ((plt.WIDE_ROWS, plt.WIDE_CONFIG), (64, plt.DEFAULT_CONFIG)):
        one = plt.config_for(rows, DEV)
        assert one.int8_dot == nvidia and (one is byte) != nvidia, (rows, one)
        assert plt.config_for(rows) is byte  # no device: the byte tiles
        data = torch.zeros(rows, 256 // 256 * 144, dtype=torch.uint8)
        lin = packed_linear.PackedLinear(data, Q4, (rows, 256), packed_linear.PrefillScratch(torch.device("cpu"),
                                         torch.float32), "triton")  # fmt: skip
        assert lin.config is one and lin.batch_config is byte


def test_int8_dots_need_whole_pairs():
    with pytest.raises(ValueError, match="int8 dots"):
        dataclasses.replace(BASE, int8_dot=True, block_r=64).validate()
    with pytest.raises(ValueError, match="16-value groups"):
        dataclasses.replace(BASE, int8_dot=True, int8_h=True, block_i=8).validate()
    with pytest.raises(ValueError, match="16-value groups"):
        dataclasses.replace(BASE, int8_h=True).validate()


def test_bf16_activations_and_output_small_top_k():
    run_case((Q4, Q8, Q6), 1, 1, seed=3, xdtype=torch.bfloat16, outdtype=torch.bfloat16, tol=BF16_TOL)
    experts = run_case((Q4, Q4, Q6), 3, 2, seed=4, xdtype=torch.bfloat16, tol=FP32_TOL)
    # a return value in x's dtype, no route at all: zeros
    x = torch.randn(2, H, device=DEV).to(torch.bfloat16)
    y = experts.forward(x, torch.full((2, 2), -1, dtype=torch.int32, device=DEV), torch.ones(2, 2, device=DEV))
    assert y.dtype == torch.bfloat16 and bool((y == 0).all())


def test_large_batches_dequantize_to_bf16():
    """Above max_routes with ``large_batch="dequantize"``: the experts are dequantized into
    the shared scratch and the BF16 kernels run (here both the per-route and the tiled BF16
    kernels). The default, the grouped kernels, is tested in test_grouped_experts.py."""
    scratch = DequantScratch()
    per_route = moe_experts.BlockConfig(block_i=64, block_h=128, block_n=128, block_r=128, route_block_i=64,
                                       route_block_n=128)  # fmt: skip
    tiled = moe_experts.BlockConfig(block_i=64, block_h=128, block_n=128, block_r=128, route_kernels_max_routes=0)
    small = dataclasses.replace(BASE, max_routes=2)
    for bf16_config in (per_route, tiled):
        experts = run_case((Q4, Q4, Q6), 3, 4, seed=5, config=small, tol=DEQUANT_TOL, scratch=scratch,
                           bf16_config=bf16_config, large_batch="dequantize")  # fmt: skip
        assert any(k[0] == "bf16" for k in experts._compiled)
    assert scratch.nbytes == 3 * E * H * I * 2
    # a third of the experts at a time (the scratch of a memory-planned GPU session): the
    # groups' outputs add up to the same result
    grouped = DequantScratch()
    run_case((Q4, Q5, Q8), 4, 4, seed=6, config=small, tol=DEQUANT_TOL, scratch=grouped, bf16_config=tiled,
             dequant_group=2, large_batch="dequantize")
    assert grouped.nbytes == 3 * 2 * H * I * 2


@pytest.mark.parametrize("fmt", [Q4, Q5, Q6, Q8])
def test_dequantize_experts_kernel(fmt):
    """The one-launch dequantization (the large-batch path on a GPU) equals gguf-py's, for a
    range of experts inside the stack; rows outside the range are not written."""
    rng = np.random.default_rng(fmt)
    rows, cols = 48, 512
    raw, ref = packed_stack(fmt, rows, cols, rng, "s")
    stack = moe_packed.PackedStack.from_bytes(torch.from_numpy(np.ascontiguousarray(raw.data)).reshape(-1).to(DEV),
                                                     fmt, E, rows, cols)
    # float32: the same arithmetic as gguf-py, bit for bit; bfloat16: one rounding (the
    # interpreter truncates, hence 2^-7 rather than 2^-8)
    for dtype, rtol in ((torch.float32, 0.0), (torch.bfloat16, 2**-7)):
        out = torch.full((3, rows, cols), float("nan"), dtype=dtype, device=DEV)
        moe_packed.dequantize_experts(stack, out, first=2, count=3)
        got = out.double().cpu()
        assert torch.isfinite(got).all()
        assert torch.allclose(got, ref[2:5], rtol=rtol, atol=0.0), dtype
    with pytest.raises(ValueError, match="contiguous"):
        moe_packed.dequantize_experts(stack, torch.empty(2, rows, cols, device=DEV), first=0, count=3)


def test_device_bytes_construction_and_warmup():
    (gate, up, down), _ = random_layer((Q4, Q4, Q6), seed=6)
    layer = ExpertWeights(gate=gate, up=up, down=down, num_experts=E, hidden=H, intermediate=I)
    experts = PackedGpuExperts.from_expert_weights(layer, DEV, config=BASE)
    assert experts.file_bytes == layer.nbytes
    assert experts.device_bytes <= 1.05 * layer.nbytes
    assert experts.device_bytes == E * I * (H // 256) * 144 * 2 + E * H * (I // 256) * 210
    assert experts.formats == ("Q4_K", "Q4_K", "Q6_K")
    experts.warmup([1], 8)
    keys = set(experts._compiled)
    # the output in the activations' dtype, and in a caller's float32 buffer
    assert len(keys) == 2 and {k[6] for k in keys} == {torch.bfloat16, torch.float32}
    experts.warmup([1], 8)
    assert experts._compiled == keys


def test_refuses_other_formats_and_shapes():
    (gate, up, down), _ = random_layer((Q4, Q4, Q6), seed=7)
    f32 = RawTensor(name="g", shape=(E, I, H), fmt=int(Fmt.F32), data=np.zeros((E, I, H), np.float32), source="t")
    with pytest.raises(ValueError, match="packed GPU experts hold"):
        PackedGpuExperts(f32, up, down, DEV)
    with pytest.raises(ValueError, match="expert shapes"):
        PackedGpuExperts(gate, up, gate, DEV)
    with pytest.raises(ValueError, match="block_h"):
        PackedGpuExperts(gate, up, down, DEV, config=moe_packed.PackedConfig(block_h=16))


_COMPILE_SCRIPT = r"""
import dataclasses
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freetoken.kernels import moe_packed as tp

def rb(f, cols):
    per, nb, _ = tp.FORMATS[f]
    return cols // per * nb

report = {}
fast = dataclasses.replace(tp.DEFAULT_CONFIG, block_n=2, down_routes_tile=True)
once = dataclasses.replace(tp.DEFAULT_CONFIG, down_h_once=True)
int8 = dataclasses.replace(tp.DEFAULT_CONFIG, int8_dot=True, block_i=8, block_n=8)
int8_h = dataclasses.replace(tp.DEFAULT_CONFIG, int8_dot=True, int8_h=True, block_i=16, num_warps=4)
for gf, uf, df, cfg in [(12, 12, 14, tp.DEFAULT_CONFIG), (13, 8, 13, once), (12, 12, 12, fast),
                        (13, 13, 14, fast), (39, 39, 39, tp.DEFAULT_CONFIG), (100, 100, 100, tp.DEFAULT_CONFIG),
                        (12, 12, 14, int8), (12, 12, 12, int8), (12, 12, 14, int8_h)]:
    H, I = 2048, 768
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    # ids through an expert cache's slot table with the default tiles (a cached layer's decode)
    slots = cfg is tp.DEFAULT_CONFIG
    sig = {"x_ptr": "*bf16", "ids_ptr": "*i32", "table_ptr": "*i32", "g_u8": "*u8", "g_i8": "*i8", "g_f16": "*fp16",
           "u_u8": "*u8", "u_i8": "*i8", "u_f16": "*fp16", "h_ptr": "*fp32", "T": "i32"}
    consts = dict(K=8, H=H, I=I, GATE_FMT=gf, GATE_RB=rb(gf, H), GATE_G=tp.FORMATS[gf][2], UP_FMT=uf,
                  UP_RB=rb(uf, H), UP_G=tp.FORMATS[uf][2], ACT=0, ALPHA=1.702, LIMIT=7.0,
                  BLOCK_I=cfg.block_i, BLOCK_H=cfg.block_h, SLOTS=slots, INT8=cfg.int8_dot,
                  DP4A=cfg.int8_dot, H_INT8=tp.quantized_h(cfg, df))
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(10)}
    gu = triton.compile(ASTSource(tp._gate_up_packed_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                        options=opts)
    # the output in the activations' dtype (the default tiles) or float32 (a caller's buffer)
    sig = {"h_ptr": "*fp32", "ids_ptr": "*i32", "table_ptr": "*i32", "w_ptr": "*fp32", "d_u8": "*u8", "d_i8": "*i8",
           "d_f16": "*fp16", "y_ptr": "*bf16" if cfg is tp.DEFAULT_CONFIG else "*fp32", "T": "i32"}
    consts = dict(K=8, H=H, I=I, DOWN_FMT=df, DOWN_RB=rb(df, I), DOWN_G=tp.FORMATS[df][2], BLOCK_N=cfg.block_n,
                  BLOCK_R=cfg.block_r, KP=8, ROUTES_TILE=cfg.down_routes_tile, SLOTS=slots,
                  H_ONCE=cfg.down_h_once, INT8=cfg.int8_dot, DP4A=cfg.int8_dot, H_INT8=tp.quantized_h(cfg, df))
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}
    dn = triton.compile(ASTSource(tp._down_packed_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                        options={**opts, "num_warps": cfg.down_num_warps or cfg.num_warps})
    name = f"{gf}_{uf}_{df}" + ("_int8" if cfg.int8_dot else "") + ("_h" if tp.quantized_h(cfg, df) else "")
    report[name] = [bool(k.asm.get("cubin")) and (not cfg.int8_dot or "dp4a.s32.s32" in k.asm["ptx"]) for k in (gu, dn)]
print(json.dumps(report))
"""


def test_kernels_compile_for_sm90():
    """The packed kernels compile for the H200 (sm_90) with Triton's bundled ptxas, no GPU
    needed (a subprocess without TRITON_INTERPRET): catches what the interpreter accepts
    and the compiler does not; the int8 dots' kernels hold the dp4a instruction."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"12_12_14": [True, True], "13_8_13": [True, True], "12_12_12": [True, True],
                      "13_13_14": [True, True], "39_39_39": [True, True], "100_100_100": [True, True],
                      "12_12_14_int8": [True, True], "12_12_12_int8": [True, True], "12_12_14_int8_h": [True, True]}


def test_no_register_spills_on_sm90():
    """Every expert format at the presets' decode shapes, and one token through packed dense
    matrices, with the tiles an NVIDIA GPU gives them (tests/gpu/packed_sm90_spills.py:
    cubins for sm_90, cuobjdump's stack per thread): no kernel keeps values in local memory. NVIDIA_CONFIG's int8 tiles, run as byte tiles
    over Q5_K/Q6_K/Q8_0/MXFP4 gate/up rows, kept 14 KB a thread there (GPT-OSS-120B's decode
    step 56 ms on an H100). The int8 Q4_K case keeps NVIDIA_CONFIG's measured tiles."""
    from packed_sm90_spills import spill_report

    report = spill_report("packed_sm90_spills.py")
    assert len(report) == 12
    for case, kernels in report.items():
        for kernel, info in kernels.items():
            assert info["stack_bytes"] == 0, (case, kernel, info)
    nv = moe_packed.NVIDIA_CONFIG
    assert report["qwen3_q4k_q6k"]["gate_up"]["tiles"] == [nv.block_i, nv.block_h, nv.num_warps]
    assert report["qwen3_q4k_q6k"]["down"]["tiles"] == [nv.block_n, nv.block_r, nv.down_num_warps]


@pytest.mark.parametrize("backend", ["cuda", "hip", "none"])
def test_byte_tiles_are_capped_on_nvidia_only(backend):
    """gate_up_tiles / down_tiles: where the int8 dots run, and off NVIDIA, the tiles as given;
    NVIDIA's byte tiles at most BYTE_TILE_VALUES accumulator values per thread, the grid's
    tile dimension (block_i, block_n) kept."""
    cap = moe_packed.BYTE_TILE_VALUES * 32
    for cfg in (moe_packed.NVIDIA_CONFIG, moe_packed.DEFAULT_CONFIG, WIDE, NARROW):
        if cfg.int8_dot or backend != "cuda":  # Q4_K through the int8 dots, or not NVIDIA: as given
            assert moe_packed.gate_up_tiles(cfg, Q4, Q4, backend) is cfg
        for fmt in (Q4, Q6, Q8, MX):
            gu = moe_packed.gate_up_tiles(cfg, fmt, fmt, backend)
            dn = moe_packed.down_tiles(cfg, fmt, 8, backend)
            assert (gu.block_i, dn.block_n) == (cfg.block_i, cfg.block_n)
            if backend != "cuda":
                assert gu is cfg and dn is cfg
                continue
            if not (cfg.int8_dot and fmt == Q4):
                assert gu.block_i * gu.block_h <= cap * gu.num_warps or gu.block_h == 32, (cfg, fmt, gu)
            if not (cfg.int8_dot and cfg.down_routes_tile and fmt in (Q4, Q6)):
                rows = (8 if dn.down_routes_tile else 1) * dn.block_n
                assert rows * dn.block_r <= cap * dn.down_num_warps or dn.block_r <= 32, (cfg, fmt, dn)
    from freetoken.kernels import packed_linear as plt

    for cfg in (plt.NVIDIA_CONFIG, plt.NVIDIA_WIDE_CONFIG, plt.DEFAULT_CONFIG, plt.WIDE_CONFIG):
        for fmt in (Q4, Q5, Q6, Q8):
            one = plt.one_token_tiles(cfg, fmt, backend)
            if backend != "cuda" or (cfg.int8_dot and fmt in (Q4, Q6)):
                assert one is cfg
            else:
                assert one.block_n == cfg.block_n and one.block_n * one.block_k <= cap * one.num_warps, (cfg, fmt, one)
    if backend == "cuda":  # GPT-OSS's MXFP4 gate/up under NVIDIA's tiles: 8 warps over 512-value steps
        gu = moe_packed.gate_up_tiles(moe_packed.NVIDIA_CONFIG, MX, MX, backend)
        assert (gu.block_i, gu.block_h, gu.num_warps) == (16, 512, 8)


# --------------------------------------------------------------------------------------
# on the GPU: Qwen3-30B-A3B sizes, graph capture, timing against the BF16 kernels
# --------------------------------------------------------------------------------------


def _qwen3_layer(num_experts: int, fmts: tuple[int, int, int], seed: int, reference: bool):
    """Random blocks of ``num_experts`` experts of H=2048, I=768 (and their float64 values)."""
    hid, inter = 2048, 768
    rng = np.random.default_rng(seed)
    raws, refs = [], []
    for fmt, rows, cols, name in ((fmts[0], inter, hid, "g"), (fmts[1], inter, hid, "u"), (fmts[2], hid, inter, "d")):
        b = random_blocks(fmt, num_experts * rows, cols, rng, scale=SCALES[fmt])
        data = b.reshape(num_experts, rows, -1)
        raws.append(RawTensor(name=name, shape=(num_experts, rows, cols), fmt=fmt, data=data))
        if reference:
            v = gguf_dequantize(b, GGMLQuantizationType(fmt)).astype(np.float64)
            refs.append(torch.from_numpy(v).reshape(num_experts, rows, cols))
    return raws, refs


@pytest.mark.gpu
@pytest.mark.parametrize("fmts", [(Q4, Q4, Q6), (MX, MX, MX)], ids=["q4_k_m", "mxfp4"])
@pytest.mark.parametrize("tokens,top_k", [(1, 8), (3, 8), (16, 8), (64, 8), (512, 8)])
def test_gpu_qwen3_sizes(tokens, top_k, fmts):
    """The device's default tiles at H=2048, I=768 (1, 3, 16 tokens: per-route kernels; 64,
    512: grouped). On NVIDIA the per-route Q4_K_M layer runs the int8 dots: against the
    reference over the activations rounded as they round them (and farther from the
    unrounded one)."""
    (gate, up, down), (g64, u64, d64) = _qwen3_layer(16, fmts, seed=tokens, reference=True)
    experts = PackedGpuExperts(gate, up, down, "cuda")
    assert experts.config == moe_packed.default_config(torch.device("cuda"))
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 2048, generator=gen).to(torch.bfloat16)
    ids = torch.randint(-1, 16, (tokens, top_k), generator=gen).to(torch.int32)
    w = torch.rand(tokens, top_k, generator=gen) + 0.1
    out = torch.full((tokens, 2048), float("nan"), device="cuda")
    experts.forward(x.cuda(), ids.cuda(), w.cuda(), out=out)
    per_route = tokens * top_k <= experts.config.max_routes
    rounding = int8_rounding(experts.config, fmts) if per_route else {}
    plain = reference_experts(x, ids, w, g64, u64, d64)
    if not any(rounding.values()):  # grouped kernels, or formats the int8 dots do not serve (MXFP4)
        check_rows(out, plain, FP32_TOL * 10 if per_route else DEQUANT_TOL)
        return
    check_rows(out, reference_experts(x, ids, w, g64, u64, d64, **rounding), INT8_TOL)
    got, rows = out.double().cpu(), plain.abs().amax(dim=1) > 0
    away = (got[rows] - plain[rows]).norm(dim=1) / plain[rows].norm(dim=1)
    assert float(away.max()) > INT8_TOL, f"{float(away.max()):.3g} from the unrounded result: not rounded?"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 512])
def test_gpu_fp8_qwen3_sizes(tokens):
    """FP8 rows at H=2048, I=768, compiled: per-route (1, 16 tokens) and grouped (512)."""
    gen = torch.Generator().manual_seed(tokens)
    (gate, g64), (up, u64), (down, d64) = (fp8_stack(r, c, gen, n) for r, c, n in
                                           ((768, 2048, "g"), (768, 2048, "u"), (2048, 768, "d")))  # fmt: skip
    experts = PackedGpuExperts(gate, up, down, "cuda")
    x = torch.randn(tokens, 2048, generator=gen).to(torch.bfloat16)
    ids = torch.randint(-1, E, (tokens, 8), generator=gen).to(torch.int32)
    w = torch.rand(tokens, 8, generator=gen) + 0.1
    out = torch.full((tokens, 2048), float("nan"), device="cuda")
    experts.forward(x.cuda(), ids.cuda(), w.cuda(), out=out)
    tol = FP32_TOL * 10 if tokens * 8 <= experts.config.max_routes else DEQUANT_TOL
    check_rows(out, reference_experts(x, ids, w, g64, u64, d64), tol)


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [True, False])
def test_gpu_graph_capture_and_replay(warm, caplog):
    (gate, up, down), (g64, u64, d64) = random_layer((Q4, Q4, Q6), seed=23 + warm)
    experts = PackedGpuExperts(gate, up, down, "cuda")
    tokens, top_k = 4, 4
    if warm:
        experts.warmup([tokens], top_k)
    gen = torch.Generator().manual_seed(int(warm))
    sx = torch.zeros(tokens, H, dtype=torch.bfloat16, device="cuda")
    sids = torch.zeros(tokens, top_k, dtype=torch.int32, device="cuda")
    sw = torch.zeros(tokens, top_k, device="cuda")
    sout = torch.empty(tokens, H, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sout.copy_(experts.forward(sx, sids, sw))
    assert experts.capture_fallbacks == (0 if warm else 1)
    if not warm:
        assert "not compiled before stream capture" in caplog.text
    for _ in range(3):
        x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
        ids, w = routes(tokens, top_k, gen), torch.rand(tokens, top_k, generator=gen) + 0.1
        sx.copy_(x.cuda()), sids.copy_(ids.cuda()), sw.copy_(w.cuda())
        sout.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rounding = int8_rounding(experts.config, (Q4, Q4, Q6)) if warm else {}  # the fallback: BF16, no int8
        check_rows(sout, reference_experts(x, ids, w, g64, u64, d64, **rounding), BF16_TOL if warm else DEQUANT_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4])
def test_gpu_timing_against_bf16(tokens):
    """Graph-replay time of one layer (128 experts, H=2048, I=768, Q4_K/Q4_K/Q6_K as in
    Qwen3-30B-A3B Q4_K_M), 8 routes per token all on the GPU, against GpuExperts on the same
    weights dequantized to BF16, with the HBM floors (printed; run with -s)."""
    from freetoken.moe.experts.gpu_experts import GpuExperts

    ne, top_k = 128, 8
    (gate, up, down), _ = _qwen3_layer(ne, (Q4, Q4, Q6), seed=1, reference=False)
    packed = PackedGpuExperts(gate, up, down, "cuda")
    bf16 = GpuExperts(*packed._dequantized(), impl="triton")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 2048, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(ne, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32).cuda()
    w = torch.rand(tokens, top_k, generator=gen).cuda()
    got, want = packed.forward(x, ids, w).float(), bf16.forward(x, ids, w).float()
    assert float((got - want).norm() / want.norm()) < DEQUANT_TOL
    distinct = len(set(ids.flatten().tolist()))
    t_packed = graph_time_us(lambda: packed.forward(x, ids, w))
    t_bf16 = graph_time_us(lambda: bf16.forward(x, ids, w))
    per_expert_packed = packed.device_bytes / ne
    per_expert_bf16 = 3 * 2048 * 768 * 2
    bw = 4.3e12  # measured HBM bandwidth of the H200 (docs/gpu.md)
    print(
        f"\nT={tokens} K={top_k} ({distinct} distinct experts): packed {t_packed:.1f} us "
        f"(floor {distinct * per_expert_packed / bw * 1e6:.1f} us), BF16 {t_bf16:.1f} us "
        f"(floor {distinct * per_expert_bf16 / bw * 1e6:.1f} us); device bytes {packed.device_bytes / 2**30:.3f} GiB "
        f"packed vs {ne * per_expert_bf16 / 2**30:.3f} GiB BF16"
    )
    print(json.dumps({"tokens": tokens, "packed_us": t_packed, "bf16_us": t_bf16, "distinct": distinct}))
