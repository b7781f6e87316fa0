"""``freetoken bench cpu-moe``: the CPU expert kernels against this machine's
memory read bandwidth, measured by the same script in the same run.

Shapes default to Qwen3-30B-A3B's experts (H=2048, I=768, 128 experts, top-8).
For each weight format it builds ``--layers`` full banks of random weights in the
format's own layout (hundreds of MB to GB each, far beyond the caches) and times
``moe_forward`` at T=1 and T=16. Calls rotate over the layers and, within a
layer, over the experts (call i routes to experts 8i..8i+7 mod 128 at T=1; fresh
random top-8 routes per token at T=16), so an expert's weights are not read
again before the whole bank has been streamed: the numbers are memory, not cache.

Each call is one hand-off task (``run_task`` on an ``ft_task_desc``, BF16
activations), the path of the CPU backend and of the coordinator.
Bytes read per call = distinct experts routed x (gate + up + down bytes of one
expert). The ceiling is a multi-threaded streaming read of a 512 MiB buffer with
the same worker pool (every worker reads its contiguous share with the kernels'
widest loads; best of 8 passes; ``freetoken_cpu_moe.timing.measure_bandwidth``), taken
just before and just after each row, so that a row is compared with the machine
as it was while the row ran.

``--compute`` first prints each format's kernel alone on one thread with its weights
resident in L2 (a 256-row matrix read again and again, ``timing.time_dot_rows``): the
per-core compute rate, which the streaming rows can only approach when it is well
above a core's share of the memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import numpy as np

FORMATS_DEFAULT = ["q4_k", "q6_k", "q8_0", "bf16", "fp8_e4m3_b128", "q5_k"]


def fill_float_weights(raw: np.ndarray, fmt: str, rng: np.random.Generator, std: float = 0.02) -> None:
    """Fill ``raw`` (uint8) with N(0, std) weights encoded as ``fmt``, in 64 MiB pieces."""
    itemsize = {"f32": 4, "f16": 2, "bf16": 2}[fmt]
    count = raw.size // itemsize
    piece = (64 << 20) // itemsize
    for start in range(0, count, piece):
        n = min(piece, count - start)
        values = rng.standard_normal(n, dtype=np.float32) * np.float32(std)
        if fmt == "f32":
            encoded = values.view(np.uint8)
        elif fmt == "f16":
            encoded = values.astype(np.float16).view(np.uint8)
        else:  # bf16: round to nearest even on the upper 16 bits
            bits = values.view(np.uint32)
            bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            encoded = bits.astype(np.uint16).view(np.uint8)
        raw[start * itemsize : (start + n) * itemsize] = encoded


def random_weights(cm: Any, fmt: str, E: int, rows: int, cols: int, rng: np.random.Generator) -> Any:
    """Random but valid (finite) weights of the format, in its raw layout."""
    info = cm.format_info(fmt)
    nbytes = E * rows * info.row_bytes(cols)
    raw = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    scale = None
    if fmt in ("f32", "f16", "bf16"):
        # Values distributed like trained weights (normal, std 0.02). Random bit patterns
        # would put most elements at tiny exponents, and the FP32 products of such weights
        # are subnormal: CPUs that take microcode assists on subnormals (Intel) then run
        # several times slower than on any real checkpoint.
        fill_float_weights(raw, fmt, rng)
    elif fmt == "fp8_e4m3_b128":
        raw &= 0xBF
        scale = rng.uniform(1e-3, 2e-3, size=(E, -(-rows // 128), -(-cols // 128))).astype(np.float32)
    elif fmt == "mxfp4":
        raw.reshape(-1, info.block_bytes)[:, 0] = 120  # E8M0 exponents: values up to 12 * 2^-8
    else:
        blocks = raw.reshape(-1, info.block_bytes)
        fields = {"q8_0": [0], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}[fmt]
        for off in fields:  # fp16 super-block scales: small, finite
            blocks[:, off : off + 2] = np.array([1e-3], dtype=np.float16).view(np.uint8)
    return cm.Weights(raw, fmt, E, rows, cols, scale=scale)


def build_bank(cm: Any, fmt: str, E: int, H: int, I: int, rng: np.random.Generator) -> Any:
    return cm.ExpertBank(
        random_weights(cm, fmt, E, I, H, rng), random_weights(cm, fmt, E, I, H, rng), random_weights(cm, fmt, E, H, I, rng)
    )


class _Task:
    """A hand-off task descriptor on numpy buffers: the path the CPU backend and the
    coordinator run (``run_task``), without the functional API's argument checks."""

    def __init__(self, bank: Any, T: int, K: int) -> None:
        import torch

        from freetoken import handoff

        H = bank.hidden
        self.x = torch.randn(T, H).to(torch.bfloat16)
        self.y = torch.empty(T, H, dtype=torch.bfloat16)
        self.ids = np.zeros((T, K), dtype=np.int32)
        self.w = np.full((T, K), 1.0 / K, dtype=np.float32)
        self.desc = handoff.TaskDesc()
        d = self.desc
        d.abi_version = handoff.ABI_VERSION
        d.max_tokens = d.num_tokens = T
        d.top_k, d.hidden = K, H
        d.act_dtype = d.out_dtype = int(handoff.Fmt.BF16)
        d.x, d.y = self.x.data_ptr(), self.y.data_ptr()
        d.ids, d.w = self.ids.ctypes.data, self.w.ctypes.data
        self.set_bank(bank)

    def set_bank(self, bank: Any) -> None:
        self.bank = bank  # keep alive
        self.desc.bank = bank.address

    @property
    def address(self) -> int:
        import ctypes

        return ctypes.addressof(self.desc)


def time_format(cm: Any, banks: list, T: int, K: int, E: int, seconds: float, rng: np.random.Generator, pool: Any) -> dict:
    task = _Task(banks[0], T, K)
    # route plans: T=1 walks the experts in order; T>1 draws distinct top-K per token
    plans = []
    for i in range(64):
        if T == 1:
            ids = ((np.arange(K) + K * i) % E).reshape(1, K)
        else:
            ids = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)])
        plans.append(ids.astype(np.int32))
    per_expert = banks[0].expert_nbytes()
    for i in range(4):  # warm-up: page in, wake workers
        task.set_bank(banks[i % len(banks)])
        task.ids[:] = plans[i]
        cm.run_task(task.address, pool=pool)
    times, nbytes = [], []
    t_end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < t_end or len(times) < 10:
        task.set_bank(banks[i % len(banks)])
        ids = plans[(i // len(banks)) % len(plans)]
        task.ids[:] = ids
        t0 = time.perf_counter()
        cm.run_task(task.address, pool=pool)
        times.append(time.perf_counter() - t0)
        nbytes.append(len(np.unique(ids)) * per_expert)
        i += 1
    rates = sorted(b / t for b, t in zip(nbytes, times))
    return {
        "us": statistics.median(times) * 1e6,
        "GBs": statistics.median(rates) / 1e9,  # median call: robust to a descheduled worker
        "GBs_mean": sum(nbytes) / sum(times) / 1e9,  # all calls, outliers included
        "GBs_p90": rates[int(0.9 * (len(rates) - 1))] / 1e9,  # the fastest 10% of calls: an unloaded machine
        "calls": len(times),
        "MB_per_call": statistics.mean(nbytes) / 1e6,
    }


def time_compute(cm: Any, fmt: str, T: int, cols: int, rng: np.random.Generator, seconds: float = 0.3) -> dict:
    """One thread, weights resident in L2: a 256-row matrix read ``rounds`` times by ``time_dot_rows``."""
    from freetoken_cpu_moe.timing import time_dot_rows

    rows = 256
    w = random_weights(cm, fmt, 1, rows, cols, rng)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    once = min(time_dot_rows(w, x, 3))
    rounds = max(10, int(seconds * 1e9 / max(once, 1)))
    ns = statistics.median(time_dot_rows(w, x, rounds))
    blocks = rows * cols / cm.format_info(fmt).block_elems
    return {"format": fmt, "T": T, "ns_per_block": ns / blocks, "GBs": w.nbytes / ns, "KB": w.nbytes / 1024}


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser("cpu-moe", help="CPU expert kernels vs this machine's measured memory bandwidth")
    p.add_argument("--formats", nargs="+", default=FORMATS_DEFAULT, help="weight formats (freetoken_cpu_moe.FORMATS)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16], help="batch sizes T")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=2, help="banks per format to rotate over (each far larger than the caches)")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: one per physical core)")
    p.add_argument("--seconds", type=float, default=2.0, help="timing per (format, T)")
    p.add_argument("--isa", default=None, help="kernel tier (default: the best this CPU has)")
    p.add_argument("--compute", action="store_true", help="also time each kernel on one thread with its weights in L2")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import freetoken_cpu_moe as cm
    from freetoken_cpu_moe.timing import measure_bandwidth

    if args.isa:
        cm.set_isa(args.isa)
    pool = cm.Pool(args.threads) if args.threads else cm.default_pool()
    rng = np.random.default_rng(0)

    def ceiling() -> float:  # 512 MiB (16x the L3 here), best of 8 passes
        return measure_bandwidth(512 << 20, 8, pool=pool)

    E, H, I, K = args.experts, args.hidden, args.intermediate, args.top_k
    print(f"machine: {platform.processor() or platform.machine()}, {pool.num_threads} worker threads, tier {cm.active_isa()}")
    compute = []
    if args.compute:
        print(f"compute: one thread, weights in L2 (256 x {H} matrix read again and again), ns per block of the format")
        print(f"{'format':<15}{'T':>4}{'ns/block':>10}{'GB/s':>8}{'KB':>7}")
        for fmt in args.formats:
            for T in args.tokens:
                c = time_compute(cm, fmt, T, H, rng)
                compute.append(c)
                print(f"{fmt:<15}{T:>4}{c['ns_per_block']:>10.2f}{c['GBs']:>8.1f}{c['KB']:>7.0f}", flush=True)
    print(f"shapes: H={H} I={I} E={E} top-{K}; {args.layers} banks per format, routes rotated (no cache reuse)")
    print("ceiling: streaming read of a 512 MiB buffer by the same pool (best of 8 passes), measured just before")
    print("and just after each row; the row is compared with the higher of the two (other tenants of a shared")
    print("machine move both). GB/s = expert weight bytes read / time, for the median call and for the call at")
    print("the 90th percentile of speed ('fast').")
    print(f"{'format':<15}{'T':>4}{'us/layer':>10}{'MB/call':>9}{'GB/s':>7}{'ceiling':>14}{'%':>5}{'fast GB/s':>11}{'fast %':>8}")
    results = []
    for fmt in args.formats:
        banks = [build_bank(cm, fmt, E, H, I, rng) for _ in range(args.layers)]
        for T in args.tokens:
            before = ceiling()
            r = time_format(cm, banks, T, K, E, args.seconds, rng, pool)
            after = ceiling()
            bw = max(before, after)
            r.update(
                format=fmt, T=T, ceiling_GBs=bw / 1e9, ceiling_before_GBs=before / 1e9, ceiling_after_GBs=after / 1e9,
                pct=100.0 * r["GBs"] * 1e9 / bw, pct_p90=100.0 * r["GBs_p90"] * 1e9 / bw,
            )
            results.append(r)
            print(
                f"{fmt:<15}{T:>4}{r['us']:>10.1f}{r['MB_per_call']:>9.1f}{r['GBs']:>7.1f}"
                f"{f'{before / 1e9:.0f}/{after / 1e9:.0f}':>14}{r['pct']:>4.0f}%{r['GBs_p90']:>11.1f}{r['pct_p90']:>7.0f}%",
                flush=True,
            )
        del banks
    if args.json:
        print(json.dumps({"threads": pool.num_threads, "isa": cm.active_isa(), "results": results, "compute": compute}))
    return 0
