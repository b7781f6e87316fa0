"""Time the grouped prompt kernels (freetoken.kernels.moe_grouped) over tile configs for one MoE
layer at prompt sizes: 128 experts, 8 random routes per token (~32 routes per expert at 512
tokens), Qwen3-30B-A3B's H 2048 / I 768 with Q4_K gate/up and a Q6_K (qwen3) or Q4_K down, or
GLM-4.5-Air's H 4096 / I 1408 with Q4_K gate/up and a Q8_0 down. Each config's whole launch
(grouping, both kernels, the routes' sum) from a CUDA graph; its output against the default
config's (relative error of the worst token row), so a fast wrong tile shows.
Usage (GPU machine): python3 tests/gpu/tune_grouped.py [--tokens 512] [--shape qwen3 glm]
[--routes-blocks]"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np
import torch

from graph_timing import graph_time_us

from freetoken.kernels import moe_grouped as mg
from freetoken.kernels.moe_packed import PackedStack
from freetoken.models.gguf_writer import random_blocks

E, K = 128, 8
SHAPES = {"qwen3": (2048, 768, (12, 12, 14)), "qwen3-q4k": (2048, 768, (12, 12, 12)), "glm": (4096, 1408, (12, 12, 8))}

#: the default tiles first (the routes block from the routes), then the candidates (the first
#: of them the tiles before blocks of twice the mean)
CANDIDATES = [dict()] + [
    dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
    for bm, bn, bk, nw, ns in ((32, 64, 64, 4, 2), (64, 128, 64, 8, 2), (64, 32, 64, 4, 2), (64, 64, 64, 8, 2),
                               (64, 64, 128, 4, 2), (64, 64, 32, 4, 2), (64, 64, 64, 4, 1), (64, 64, 64, 4, 3),
                               (32, 64, 64, 8, 2), (64, 32, 128, 4, 2), (64, 64, 64, 2, 2))
]
#: ``--routes-blocks``: the routes block alone, default tiles otherwise
ROUTES_BLOCKS = [dict(block_m=None)] + [dict(block_m=bm) for bm in (16, 32, 64, 128)]


def stack(fmt: int, rows: int, cols: int, rng: np.random.Generator) -> PackedStack:
    b = random_blocks(fmt, E * rows, cols, rng, scale=1e-4)
    return PackedStack.from_bytes(torch.from_numpy(np.ascontiguousarray(b)).reshape(-1).cuda(), fmt, E, rows, cols)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[512])
    ap.add_argument("--shape", nargs="+", default=["qwen3", "glm"], choices=sorted(SHAPES))
    ap.add_argument("--routes-blocks", action="store_true", help="time only the routes block (16-128)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for shape in args.shape:
        hidden, inter, *mixes = SHAPES[shape]
        for fmts in mixes:
            gate, up, down = stack(fmts[0], inter, hidden, rng), stack(fmts[1], inter, hidden, rng), \
                stack(fmts[2], hidden, inter, rng)
            for tokens in args.tokens:
                x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
                ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(tokens)]).to(torch.int32)
                w = torch.rand(tokens, K, device="cuda")
                y = torch.empty(tokens, hidden, device="cuda")
                flops = 2 * tokens * K * 3 * hidden * inter
                print(f"{shape} formats {fmts} T={tokens}: {flops / 1e9:.1f} GFLOP per layer", flush=True)
                want = None
                results = []
                for v in (ROUTES_BLOCKS if args.routes_blocks else CANDIDATES):
                    cfg = dataclasses.replace(mg.GroupedConfig(), **v)
                    try:
                        us = graph_time_us(lambda: mg.launch(x, ids, w, gate, up, down, y, "silu", cfg), iters=20)
                    except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit
                        print(f"  {v}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    mg.launch(x, ids, w, gate, up, down, y, "silu", cfg)
                    got = y.double()
                    if want is None:
                        want = got.clone()
                    err = float(((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)).max())
                    results.append((us, v))
                    print(f"  {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s  err {err:.2e}  {v}", flush=True)
                if results:
                    default_us = results[0][0]
                    results.sort(key=lambda r: r[0])
                    print(f"  best: {results[0][0]:.1f} us {results[0][1]} ({default_us / results[0][0]:.2f}x the "
                          f"default's {default_us:.1f} us)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
