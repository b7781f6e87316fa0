"""Time the packed expert kernels of freetoken.kernels.moe_packed over tile configs at
Qwen3-30B-A3B sizes (128 experts, H=2048, I=768, Q4_K gate/up, Q6_K or Q4_K down), one layer
per call, 8 routes per token, every route on the GPU; graph replay, CUDA events. Every replay
reads the same experts, which stay in the L2: tune_cold.py times the kernels as a model runs them.
Usage (GPU machine): python3 tests/gpu/tune_packed.py [--tokens 1 4]"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import numpy as np
import torch

from graph_timing import graph_time_us

from freetoken.models.gguf_writer import random_blocks
from freetoken.kernels import moe_packed as tp

H, I, E, K = 2048, 768, 128, 8


def stack(fmt: int, rows: int, cols: int, rng: np.random.Generator) -> tp.PackedStack:
    b = random_blocks(fmt, E * rows, cols, rng, scale=1e-4)
    return tp.PackedStack.from_bytes(torch.from_numpy(np.ascontiguousarray(b)).reshape(-1).cuda(), fmt, E, rows, cols)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    gate, up = stack(12, I, H, rng), stack(12, I, H, rng)
    downs = {"q6_k": stack(14, H, I, rng), "q4_k": stack(12, H, I, rng)}
    base = tp.DEFAULT_CONFIG
    gate_up = [dict(block_i=bi, block_h=bh, num_warps=nw) for bi, bh, nw in
               itertools.product((2, 4, 8), (256, 512), (2, 4))]
    # the routes as a tile dimension, then the loop over them
    down = [dict(block_n=bn, block_r=br, num_warps=nw, down_routes_tile=True) for bn, br, nw in
            itertools.product((1, 2, 4), (128, 256), (2, 4))]
    down += [dict(block_n=8, block_r=256, num_warps=4, down_routes_tile=False)]
    print(f"default {base}", flush=True)
    for tokens in args.tokens:
        x = torch.randn(tokens, H, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(tokens)]).to(torch.int32)
        w = torch.rand(tokens, K, device="cuda")
        y = torch.empty(tokens, H, device="cuda")
        h = torch.randn(tokens, K, I, device="cuda")
        per_route = (gate.nbytes + up.nbytes) / E
        print(f"T={tokens} gate/up Q4_K: {tokens * K * per_route / 1e6:.1f} MB per call "
              f"({tokens * K * per_route / 4.8e12 * 1e6:.1f} us at 4.8 TB/s)", flush=True)
        timed = [("gate_up", gate_up, lambda cfg: tp.launch_gate_up(x, ids, gate, up, h, "silu", cfg))]
        for dname, dstack in downs.items():
            timed.append((f"down {dname} ({tokens * K * dstack.nbytes / E / 1e6:.1f} MB)", down,
                          lambda cfg, d=dstack: tp.launch_down(h, ids, w, d, y, cfg)))
        for name, variants, fn in timed:
            results = []
            for v in variants:
                cfg = dataclasses.replace(base, **v)
                try:
                    us = graph_time_us(lambda: fn(cfg), iters=100)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile
                    print(f"  {name} {v}: {type(exc).__name__}", flush=True)
                    continue
                results.append((us, v))
            results.sort(key=lambda r: r[0])
            default_us = graph_time_us(lambda: fn(base), iters=100)
            print(f"  {name}: default {default_us:.1f} us; best " + "; ".join(f"{us:.1f} us {v}" for us, v in results[:5])
                  + (f" | worst {results[-1][0]:.1f} us {results[-1][1]}" if results else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
