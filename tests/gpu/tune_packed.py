"""Time the packed expert kernels of freetoken.moe.triton_moe_packed over tile configs at
Qwen3-30B-A3B sizes (128 experts, H=2048, I=768, Q4_K gate/up, Q6_K or Q4_K down), one layer
per call, 8 routes per token, every route on the GPU; graph replay, CUDA events.
Usage (GPU machine): python3 tests/gpu/tune_packed.py [--tokens 1 4]"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import numpy as np
import torch

from graph_timing import graph_time_us

from freetoken.loading.gguf_writer import random_blocks
from freetoken.moe import triton_moe_packed as tp

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
               itertools.product((4, 8, 16, 32), (256, 512), (2, 4))]
    down = [dict(block_n=bn, block_r=br, num_warps=nw) for bn, br, nw in
            itertools.product((4, 8, 16), (128, 256, 512), (2, 4))]
    for tokens in args.tokens:
        x = torch.randn(tokens, H, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(tokens)]).to(torch.int32)
        w = torch.rand(tokens, K, device="cuda")
        y = torch.empty(tokens, H, device="cuda")
        h = torch.empty(tokens, K, I, device="cuda")
        moved = tokens * K * (gate.nbytes + up.nbytes + downs["q6_k"].nbytes) / E
        print(f"T={tokens}: {moved / 1e6:.1f} MB of weights per call (Q4_K/Q4_K/Q6_K), "
              f"{moved / 4.8e12 * 1e6:.1f} us at 4.8 TB/s", flush=True)
        for dname, dstack in downs.items():
            results = []
            for name, variants in (("gate_up", gate_up), ("down", down)) if dname == "q6_k" else ():
                for v in variants:
                    cfg = dataclasses.replace(base, **v)
                    try:
                        us = graph_time_us(lambda: tp.launch(x, ids, w, gate, up, dstack, y, h, "silu", cfg), iters=100)
                    except Exception as exc:  # noqa: BLE001 - a tile that does not compile
                        print(f"  {name} {v}: {type(exc).__name__}", flush=True)
                        continue
                    results.append((us, name, v))
            for name in ("gate_up", "down"):
                best = sorted(r for r in results if r[1] == name)[:4]
                print(f"  down={dname} sweep {name}: " + "; ".join(f"{us:.1f} us {v}" for us, _, v in best), flush=True)
            print(f"  down={dname} default {graph_time_us(lambda: tp.launch(x, ids, w, gate, up, dstack, y, h, 'silu', base), iters=100):.1f} us",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
