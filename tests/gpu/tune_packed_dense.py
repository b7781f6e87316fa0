"""Time the packed dense GEMV of freetoken.kernels.packed_linear over tile configs at the
Qwen3-30B-A3B shapes (q/k/v fused [5120, 2048] Q4_K, o [2048, 4096] Q4_K, head [151936, 2048]
Q6_K), beside BF16 ``F.linear`` on the same values and the HBM floor of each form (4.3 TB/s);
then, per batch size, the GEMV against the large-batch path (rows dequantized into a scratch,
then a matmul), which says where ``PackedLinearConfig.max_gemv_tokens`` belongs. Graph replay,
CUDA events (graph_timing.py).
Usage (GPU machine): python3 tests/gpu/tune_packed_dense.py [--tokens 1 4 16] [--quick]
(53 configs per shape and batch size; --quick: 12)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import numpy as np
import torch
import torch.nn.functional as F

from graph_timing import graph_time_us

from freetoken.models.gguf_writer import random_blocks
from freetoken.models import packed_linear
from freetoken.kernels import packed_linear as plt

HBM = 4.3e12
SHAPES = [("qkv", 4096 + 512 + 512, 2048, 12), ("o", 2048, 4096, 12), ("head", 151936, 2048, 14)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--quick", action="store_true", help="fewer tile configs")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    base = plt.DEFAULT_CONFIG
    if args.quick:
        variants = [dict(block_n=bn, block_k=bk) for bn, bk in itertools.product((2, 4, 8), (256, 512))]
    else:
        variants = [dict(block_n=bn, block_k=bk, num_warps=nw) for bn, bk, nw in
                    itertools.product((1, 2, 4, 8, 16), (256, 512, 1024), (2, 4, 8))]
        variants += [dict(num_stages=ns) for ns in (1, 3, 4)] + [dict(block_t=bt) for bt in (1, 2, 4, 16)]
    print(f"default {base}", flush=True)
    for name, rows, cols, fmt in SHAPES:
        b = random_blocks(fmt, rows, cols, rng, scale=1e-4)
        w = plt.PackedMatrix.from_bytes(torch.from_numpy(b).reshape(-1).cuda(), fmt, rows, cols)
        dense = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
        plt.dequantize_rows(w, dense)
        print(f"{name} [{rows}, {cols}] {plt.FORMAT_NAMES[fmt]}: {w.nbytes / 1e6:.1f} MB packed "
              f"(floor {w.nbytes / HBM * 1e6:.1f} us), {dense.numel() * 2 / 1e6:.1f} MB bf16 "
              f"(floor {dense.numel() * 2 / HBM * 1e6:.1f} us)", flush=True)
        for tokens in args.tokens:
            x = torch.randn(tokens, cols, device="cuda").to(torch.bfloat16)
            y = torch.empty(tokens, rows, dtype=torch.bfloat16, device="cuda")
            bf16_us = graph_time_us(lambda: F.linear(x, dense), iters=100)
            results = []
            for v in [{}] + variants:
                cfg = dataclasses.replace(base, **v)
                try:
                    us = graph_time_us(lambda: plt.gemv(x, w, y, cfg), iters=100)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile
                    print(f"  T={tokens} {v}: {type(exc).__name__}", flush=True)
                    continue
                results.append((us, v))
            results.sort(key=lambda r: r[0])
            default_us = next(us for us, v in results if not v)
            print(f"  T={tokens}: bf16 F.linear {bf16_us:.1f} us, packed default {default_us:.1f} us "
                  f"({w.nbytes / (default_us * 1e-6) / 1e9:.0f} GB/s); best:", flush=True)
            for us, v in results[:5]:
                print(f"    {us:7.1f} us  {v or 'default'}", flush=True)
    # the large-batch path against the GEMV: where max_gemv_tokens belongs
    print("GEMV (default tiles) against the scratch + matmul path, q/k/v shape:", flush=True)
    name, rows, cols, fmt = SHAPES[0]
    b = random_blocks(fmt, rows, cols, rng, scale=1e-4)
    data = torch.from_numpy(b).cuda()
    scratch = packed_linear.PrefillScratch(torch.device("cuda"), torch.bfloat16)
    gemv = packed_linear.PackedLinear(data, fmt, (rows, cols), scratch, "triton",
                                      dataclasses.replace(base, max_gemv_tokens=1 << 20))  # fmt: skip
    matmul = packed_linear.PackedLinear(data, fmt, (rows, cols), scratch, "triton",
                                        dataclasses.replace(base, max_gemv_tokens=0))  # fmt: skip
    for tokens in (2, 4, 8, 16, 32, 64, 128, 512):
        x = torch.randn(tokens, cols, device="cuda").to(torch.bfloat16)
        g_us = graph_time_us(lambda: gemv(x), iters=50)
        m_us = graph_time_us(lambda: matmul(x), iters=50)
        print(f"  T={tokens:4d}: gemv {g_us:8.1f} us, scratch + matmul {m_us:8.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
