"""Time the packed decode kernels (expert gate/up and down, dense GEMV) over tile configs with
their weights read from HBM, as in a whole model, not from L2.

tune_packed.py and tune_packed_dense.py replay one launch over the same weights: at most ~15 MB
per launch, which stays in the H200's 50 MB L2 between replays, so they time L2-hot kernels.
In a model every layer reads other weights. Here one graph holds a sequence of launches that
each read different weights (launch j: experts 8j .. 8j+7 of a 128-expert stack; copy j of a
dense matrix), more bytes than the L2 per replay, so every launch reads cold weights.

Prints each kernel's best tiles and, last, ``TILES --tiles <kind>:<fields>`` lines: the fields that
beat the byte tiles (``DEFAULT_CONFIG`` / ``WIDE_CONFIG``; NVIDIA's defaults are int8 tiles of the
``--int8`` sweep, ``NVIDIA_CONFIG``), for whole-model A/B runs (``freetoken bench decode --tiles``,
which changes both).
T = 1, Qwen3-30B-A3B shapes.
Usage (GPU machine): python3 tests/gpu/tune_cold.py [--quick] [--int8]"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from typing import Any, Callable

import numpy as np
import torch

from graph_timing import graph_sequence_time_us

from freetoken.models.gguf_writer import random_blocks
from freetoken.kernels import packed_linear as plt
from freetoken.kernels import moe_packed as tp

H, I, E, K = 2048, 768, 128, 8
HBM = 4.3e12  # bytes/s: the device-to-device copy rate measured on these machines
Q4_K, Q6_K = 12, 14


def stack(fmt: int, rows: int, cols: int, rng: np.random.Generator) -> tp.PackedStack:
    b = random_blocks(fmt, E * rows, cols, rng, scale=1e-4)
    return tp.PackedStack.from_bytes(torch.from_numpy(np.ascontiguousarray(b)).reshape(-1).cuda(), fmt, E, rows, cols)


def sweep(name: str, variants: list[dict[str, Any]], make_calls: Callable[[Any], list[Callable[[], object]]],
          base: Any, nbytes: float) -> list[tuple[float, dict[str, Any]]]:
    """Times the default and each variant of ``base``; prints the best five; returns all, fastest first."""
    results = []
    for v in [{}] + variants:
        cfg = dataclasses.replace(base, **v)
        try:
            cfg.validate()
            us = graph_sequence_time_us(make_calls(cfg))
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit
            print(f"  {name} {v}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            continue
        results.append((us, v))
    results.sort(key=lambda r: r[0])
    default_us = next(us for us, v in results if not v)
    print(f"{name}: {nbytes / 1e6:.1f} MB per call, floor {nbytes / HBM * 1e6:.1f} us; default {default_us:.1f} us "
          f"({nbytes / default_us / 1e3:.0f} GB/s)", flush=True)
    for us, v in results[:5]:
        print(f"  {us:7.1f} us ({nbytes / us / 1e3:5.0f} GB/s)  {v or 'default'}", flush=True)
    return results


def timed(results: list[tuple[float, dict[str, Any]]], variant: dict[str, Any]) -> Any:
    """The time of ``variant`` in ``results`` (None if it did not run)."""
    return next((us for us, v in results if v == variant), None)


def tile_fields(v: dict[str, Any]) -> str:
    return ",".join(f"{k}={int(x)}" for k, x in sorted(v.items()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer tile configs")
    ap.add_argument("--int8", action="store_true", help="only the int8-dot tiles (int8_dot) against the defaults")
    ap.add_argument("--launch-only", action="store_true",
                    help="no sweep: each kernel with the default tiles launched 4 times on other weights, "
                         "eagerly (for a profiler: tests/gpu/ncu_packed.sh)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    base = tp.DEFAULT_CONFIG
    print(f"experts default {base}", flush=True)
    gate, up, down = stack(Q4_K, I, H, rng), stack(Q4_K, I, H, rng), stack(Q6_K, H, I, rng)
    sets = E // K  # launches per replay, each on other experts
    x = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    ids = [torch.arange(j * K, (j + 1) * K, device="cuda", dtype=torch.int32).reshape(1, K) for j in range(sets)]
    w = torch.rand(1, K, device="cuda")
    y = torch.empty(1, H, device="cuda")
    h = torch.randn(1, K, I, device="cuda")
    per_route_gu = (gate.nbytes + up.nbytes) / E
    per_route_d = down.nbytes / E

    if args.launch_only:
        for i in ids[:4]:
            tp.launch_gate_up(x, i, gate, up, h, "silu", base)
        for i in ids[:4]:
            tp.launch_down(h, i, w, down, y, base)
        for rows, cols, fmt in ((4096 + 512 + 512, 2048, Q4_K), (2048, 4096, Q4_K)):
            b = random_blocks(fmt, rows * 4, cols, rng, scale=1e-4)
            data = torch.from_numpy(np.ascontiguousarray(b)).reshape(-1).cuda()
            per = data.numel() // 4
            xd = torch.randn(1, cols, device="cuda").to(torch.bfloat16)
            yd = torch.empty(1, rows, dtype=torch.bfloat16, device="cuda")
            for j in range(4):
                plt.gemv(xd, plt.PackedMatrix.from_bytes(data[j * per:(j + 1) * per], fmt, rows, cols), yd)
        torch.cuda.synchronize()
        return 0

    gu_variants = [dict(block_i=bi, block_h=bh, num_warps=nw) for bi, bh, nw in
                   itertools.product((1, 2, 4, 8), (512, 2048), (2, 4))]
    # steps of a loop pipelined deeper: printed only (num_stages is shared with down, whose variants keep
    # the default, and the chosen pair must agree on it)
    gu_variants += [dict(block_i=bi, block_h=bh, num_stages=ns) for bi, bh, ns in
                    itertools.product((2, 4), (512, 1024), (1, 3, 4))]
    d_variants = [dict(block_n=bn, block_r=br, down_num_warps=nw, down_routes_tile=True)
                  for bn, br, nw in itertools.product((1, 2, 4, 8), (256, 1024), (2, 4))]
    d_variants += [dict(block_n=bn, down_num_warps=4, down_routes_tile=False) for bn in (2, 4, 16)]
    d_variants += [dict(block_n=bn, block_r=br, down_num_warps=nw, down_h_once=True, down_routes_tile=True)
                   for bn, br, nw in itertools.product((2, 4, 8), (256, 1024), (2, 4))]
    if args.quick:
        gu_variants, d_variants = gu_variants[::4], d_variants[::4]
    # int8 dots: with int8_h the gate/up kernel leaves h quantized for the down kernel (quantized_h);
    # the down variants that read it carry int8_h (and a block_i that allows it), the others quantize h
    # in every program
    int8_gu = [dict(block_i=bi, block_h=bh, num_warps=nw, int8_dot=True) for bi, bh, nw in
               ((8, 2048, 4), (16, 2048, 4), (16, 2048, 2), (32, 2048, 4))]
    int8_gu += [dict(block_i=bi, block_h=2048, num_warps=nw, int8_dot=True, int8_h=True) for bi, nw in
                ((16, 4), (16, 2), (32, 4))]
    int8_d = [dict(block_n=4, down_num_warps=4, int8_dot=True, down_routes_tile=True)]
    int8_d += [dict(block_i=16, int8_h=True, block_n=bn, down_num_warps=nw, int8_dot=True, down_routes_tile=True)
               for bn, nw in ((2, 2), (4, 2), (4, 4), (8, 4), (16, 8))]
    if args.int8:
        gu_variants, d_variants = int8_gu, int8_d
    else:
        gu_variants, d_variants = gu_variants + int8_gu, d_variants + int8_d

    gu = sweep("gate/up Q4_K, 8 routes", gu_variants,
               lambda cfg: [lambda i=i: tp.launch_gate_up(x, i, gate, up, h, "silu", cfg, h_int8=tp.quantized_h(cfg, Q6_K))
                           for i in ids],
               base, K * per_route_gu)
    dn = sweep("down Q6_K, 8 routes", d_variants,
               lambda cfg: [lambda i=i: tp.launch_down(h, i, w, down, y, cfg) for i in ids],
               base, K * per_route_d)
    tiles = {}
    default_pair = timed(gu, {}) + timed(dn, {})
    # a down variant timed with the default warps keeps them when the gate/up variant changes num_warps;
    # a pair agrees on the fields both kernels read and on the form of h between them (block_i is gate/up's)
    def h_int8(v: dict[str, Any]) -> bool:
        return tp.quantized_h(dataclasses.replace(base, **v), Q6_K)

    pairs = [(g_us + d_us, {**g, "down_num_warps": base.down_num_warps or base.num_warps,
                            **{k: x for k, x in d.items() if k != "block_i"}})
             for g_us, g in gu for d_us, d in dn
             if all(g.get(f, getattr(base, f)) == d.get(f, getattr(base, f)) for f in ("num_stages", "int8_dot"))
             and h_int8(g) == h_int8(d)]
    best_us, best_v = min(pairs, key=lambda p: p[0])
    print(f"experts: default {default_pair:.1f} us per layer, best pair {best_us:.1f} us {best_v}", flush=True)
    fields = {k: v for k, v in best_v.items() if getattr(base, k) != v}
    if best_us < 0.95 * default_pair and fields:
        # the same outputs as the default tiles (whose kernels the GPU tests check against float64)
        chosen = dataclasses.replace(base, **fields)
        outs = []
        for cfg in (base, chosen):
            tp.launch_gate_up(x, ids[3], gate, up, h, "silu", cfg, h_int8=tp.quantized_h(cfg, down.fmt))
            h1 = h.clone()
            tp.launch_down(h1, ids[3], w, down, y, cfg)
            outs.append((h1, y.clone()))
        # y only: with quantized_h the buffer of h holds int8 codes
        err = float((outs[1][1] - outs[0][1]).abs().max() / outs[0][1].abs().max())
        print(f"experts: chosen tiles against the default's output: max relative error {err:.2e}", flush=True)
        if err < (3e-2 if chosen.int8_dot else 1e-4):  # int8 dots: the activations' rounding (~1e-2)
            tiles["experts"] = tile_fields(fields)

    shapes = [("qkv", 4096 + 512 + 512, 2048, Q4_K, 16), ("o", 2048, 4096, Q4_K, 16), ("head", 151936, 2048, Q6_K, 1)]
    narrow = [dict(block_n=bn, block_k=bk, num_warps=nw) for bn, bk, nw in
              itertools.product((1, 2, 4, 8, 16), (512, 2048), (2, 4))]
    wide = [dict(block_n=bn, block_k=bk, num_warps=nw) for bn, bk, nw in itertools.product((4, 8, 16, 32), (256, 512), (4, 8))]
    if args.quick:
        narrow, wide = narrow[::4], wide[::4]
    int8_narrow = [dict(block_n=bn, block_k=bk, num_warps=nw, int8_dot=True) for bn, bk, nw in
                   ((8, 2048, 2), (16, 2048, 2), (16, 2048, 4), (32, 2048, 2), (32, 2048, 4))]
    int8_wide = [dict(block_n=bn, block_k=bk, num_warps=nw, int8_dot=True) for bn, bk, nw in
                 ((32, 512, 8), (64, 512, 8), (64, 256, 8))]
    narrow, wide = (int8_narrow, int8_wide) if args.int8 else (narrow + int8_narrow, wide + int8_wide)
    dense: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    first: dict[str, Any] = {}  # one matrix of each shape and its input, for the output check

    def same_outputs(name: str, variant: dict[str, Any]) -> bool:
        m, xd = first[name]
        cfg0 = plt.config_for(m.rows)
        want = plt.gemv(xd, m, torch.empty(1, m.rows, dtype=torch.float32, device="cuda"), cfg0)
        got = plt.gemv(xd, m, torch.empty(1, m.rows, dtype=torch.float32, device="cuda"),
                       dataclasses.replace(cfg0, **variant))
        err = float((got - want).abs().max() / want.abs().max())
        print(f"dense {name}: {variant} against the default's outputs: max relative error {err:.2e}", flush=True)
        return err < (3e-2 if variant.get("int8_dot") else 1e-4)
    for name, rows, cols, fmt, copies in shapes:
        b = random_blocks(fmt, rows * copies, cols, rng, scale=1e-4)
        data = torch.from_numpy(np.ascontiguousarray(b)).reshape(-1).cuda()
        per = data.numel() // copies
        mats = [plt.PackedMatrix.from_bytes(data[j * per:(j + 1) * per], fmt, rows, cols) for j in range(copies)]
        xd = torch.randn(1, cols, device="cuda").to(torch.bfloat16)
        yd = torch.empty(1, rows, dtype=torch.bfloat16, device="cuda")
        dense[name] = sweep(f"dense {name} [{rows}, {cols}] {plt.FORMAT_NAMES[fmt]}", wide if name == "head" else narrow,
                            lambda cfg, mats=mats, xd=xd, yd=yd: [lambda m=m: plt.gemv(xd, m, yd, cfg) for m in mats],
                            plt.config_for(rows), per)
        first[name] = (mats[0], xd)
        del mats, data
    # q/k/v and o share the default config: the variant with the least time over both
    both = [(us + timed(dense["o"], v), v) for us, v in dense["qkv"] if timed(dense["o"], v) is not None]
    n_us, n_v = min(both, key=lambda p: p[0])
    n_default = timed(dense["qkv"], {}) + timed(dense["o"], {})
    print(f"dense q/k/v + o: default {n_default:.1f} us, best {n_us:.1f} us {n_v or 'default'}", flush=True)
    fields = {k: v for k, v in n_v.items() if getattr(plt.DEFAULT_CONFIG, k) != v}
    if n_us < 0.95 * n_default and fields and same_outputs("qkv", n_v) and same_outputs("o", n_v):
        tiles["dense"] = tile_fields(fields)
    h_us, h_v = dense["head"][0]
    fields = {k: v for k, v in h_v.items() if getattr(plt.WIDE_CONFIG, k) != v}
    if h_us < 0.95 * timed(dense["head"], {}) and fields and same_outputs("head", h_v):
        tiles["dense-wide"] = tile_fields(fields)
    for k, v in tiles.items():
        print(f"TILES --tiles {k}:{v}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
