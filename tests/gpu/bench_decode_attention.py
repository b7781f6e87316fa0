"""Microbenchmark of paged decode attention (freetoken.models.decode_attention): the Triton
split-K kernels against the torch implementation, under CUDA graph replay, at
Qwen3-30B-A3B's attention shape (32 query heads, 4 kv heads, head_dim 128, bf16, block
size 16).

For every batch size and context length it prints the time per call and the achieved
KV-read bandwidth (bytes of K and V inside the contexts / time) beside the ceiling, the
device-to-device copy bandwidth measured in the same run, and the largest difference
between the two implementations. "in 32k" rows use block tables sized for 32k tokens with
shorter contexts, as a decode graph sized for the model's longest context runs them.

Usage (on a GPU, from the repository root; under a minute on an H200):
    python tests/gpu/bench_decode_attention.py            # the table
    python tests/gpu/bench_decode_attention.py --sweep    # also Triton tile/warp/stage variants
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Callable

import torch

from freetoken.models import decode_attention as da

HQ, HKV, D, BS = 32, 4, 128, 16
DTYPE = torch.bfloat16
CALLS_PER_GRAPH = 10


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy (read + write bytes / time)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) * 1e-3) / 1e9


def time_graph(fn: Callable[[], object], replays: int = 20) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph of CALLS_PER_GRAPH calls."""
    fn()  # eager: compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3 / (replays * CALLS_PER_GRAPH)


@dataclasses.dataclass
class Setup:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tables: torch.Tensor
    ctx: torch.Tensor
    kv_bytes: int

    def call(self, impl: str, out: torch.Tensor) -> Callable[[], object]:
        return lambda: da.paged_decode_attention(self.q, self.k, self.v, self.tables, self.ctx, D**-0.5, out, impl)


def setup(batch: int, ctx: int, table_tokens: int) -> Setup:
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + ctx)
    blocks_per_seq = table_tokens // BS
    nb = batch * blocks_per_seq + 1
    k = torch.randn(nb, BS, HKV, D, device="cuda", generator=gen).to(DTYPE)
    v = torch.randn(nb, BS, HKV, D, device="cuda", generator=gen).to(DTYPE)
    perm = torch.randperm(nb, device="cuda", generator=gen)[: batch * blocks_per_seq]
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", generator=gen).to(DTYPE)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return Setup(q, k, v, tables, lens, batch * ctx * HKV * D * 2 * k.element_size())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time Triton tile/warp/stage variants")
    parser.add_argument("--sweep-partitions", action="store_true",
                        help="also time partition counts at batch 1-2 and long contexts, merged in the last "
                             "partial program and by a second launch")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    ceiling = copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(f"{name}: device copy {ceiling:.0f} GB/s; Hq={HQ} Hkv={HKV} D={D} {DTYPE} block {BS}; "
          f"auto -> {da.default_impl('cuda')[0]}")  # fmt: skip
    print(f"{'B':>3} {'ctx':>6} {'table':>6} {'P':>4} {'KV MiB':>8} | {'triton us':>9} {'GB/s':>6} {'%copy':>5} | "
          f"{'torch us':>9} {'GB/s':>6} | {'x':>5} {'max|diff|':>9}")  # fmt: skip
    cases = [(b, c, c) for b in (1, 8, 32) for c in (512, 4096, 32768)]
    cases += [(1, 512, 32768), (32, 512, 32768), (8, 4096, 32768)]
    for batch, ctx, table in cases:
        s = setup(batch, ctx, table)
        P = da.num_partitions(batch, HKV, table // BS, BS, "cuda")
        outs, times = {}, {}
        for impl in ("triton", "torch"):
            outs[impl] = torch.empty(batch, HQ * D, dtype=DTYPE, device="cuda")
            times[impl] = time_graph(s.call(impl, outs[impl]))
        diff = float((outs["triton"].float() - outs["torch"].float()).abs().max())
        mib = s.kv_bytes / 2**20
        gbs = {k: s.kv_bytes / t / 1e9 for k, t in times.items()}
        print(f"{batch:>3} {ctx:>6} {table:>6} {P:>4} {mib:>8.1f} | "
              f"{times['triton'] * 1e6:>9.1f} {gbs['triton']:>6.0f} {100 * gbs['triton'] / ceiling:>5.1f} | "
              f"{times['torch'] * 1e6:>9.1f} {gbs['torch']:>6.0f} | "
              f"{times['torch'] / times['triton']:>5.1f} {diff:>9.2e}")  # fmt: skip
        del s, outs
        torch.cuda.empty_cache()
    if args.sweep:
        sweep(ceiling)
    if args.sweep_partitions:
        sweep_partitions(ceiling)
    return 0


def _launch(s: Any, out: torch.Tensor, partitions: int, cfg: Any) -> Callable[[], None]:
    """One call of the Triton kernel over ``s``'s batch with ``partitions`` and ``cfg``."""
    from freetoken.kernels import decode_attention as dat

    def call() -> None:
        dat.launch(s.q, s.k, s.v, s.tables, s.ctx, D**-0.5, out, partitions, cfg)

    return call


def sweep_partitions(ceiling: float) -> None:
    """Few sequences over a long context leave each partial program a few steps when the
    partitions fill the GPU, and one program then merges every partition: time the counts
    in between (the default count is marked *)."""
    from freetoken.kernels import decode_attention as dat

    print("\nPartitions (us per call, % of the copy bandwidth; merge in the last partial / in a second launch):")
    for batch, ctx in ((1, 4096), (1, 16384), (1, 32768), (2, 32768), (4, 16384)):
        s = setup(batch, ctx, ctx)
        out = torch.empty(batch, HQ * D, dtype=DTYPE, device="cuda")
        default = da.num_partitions(batch, HKV, ctx // BS, BS, "cuda")
        row = []
        for P in sorted({8, 16, 24, 33, 48, 66, 99, 132, 198, 256, default}):
            cells = []
            for merge_in_partial in (True, False):
                cfg = dataclasses.replace(dat.DEFAULT_CONFIG, reduce_in_partial=merge_in_partial)

                t = time_graph(_launch(s, out, P, cfg))
                cells.append(f"{t * 1e6:.1f} ({100 * s.kv_bytes / t / 1e9 / ceiling:.0f}%)")
            row.append(f"P={P}{'*' if P == default else ''}: " + " / ".join(cells))
        print(f"B={batch} ctx={ctx}:\n  " + "\n  ".join(row))
        del s
        torch.cuda.empty_cache()


def _name(cfg: Any) -> str:
    return f"n{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}"


def sweep(ceiling: float) -> None:
    from freetoken.kernels import decode_attention as dat

    base = dat.DEFAULT_CONFIG
    configs = [dataclasses.replace(base, block_n=n, num_warps=w, num_stages=st, min_part_blocks=max(1, 128 // n))
               for n in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]  # fmt: skip
    print("\nTriton variants (us per call, GB/s):")
    for batch, ctx in ((1, 16384), (1, 32768), (8, 4096), (32, 32768)):
        s = setup(batch, ctx, ctx)
        out = torch.empty(batch, HQ * D, dtype=DTYPE, device="cuda")
        P = da.num_partitions(batch, HKV, ctx // BS, BS, "cuda")
        row = []
        for cfg in configs:
            try:
                t = time_graph(_launch(s, out, P, cfg))
                row.append(f"{_name(cfg)}: {t * 1e6:.1f} "
                           f"({s.kv_bytes / t / 1e9:.0f}, {100 * s.kv_bytes / t / 1e9 / ceiling:.0f}%)")  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a variant that does not fit (shared memory) is reported
                row.append(f"{_name(cfg)}: {type(exc).__name__}")
        print(f"B={batch} ctx={ctx} P={P}:\n  " + "\n  ".join(row))
        del s
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
