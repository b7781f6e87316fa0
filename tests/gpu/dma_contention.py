"""Does a host-to-device DMA stream take host memory bandwidth from the CPU expert workers?
(A diagnostic script for the GPU machine, not a test.)

Copies from page-locked host memory to the device run on the GPU's copy engine; whether the
CPU workers keep their read bandwidth while such copies run decides whether copying some of
a CPU layer's routed experts to the GPU, while the CPU computes the others, can shorten the
layer. This script copies a page-locked buffer to the device in a loop on a side stream for
``--seconds`` and prints the copy rate; run `freetoken bench cpu-moe` beside it and alone to
compare the CPU side.

    python3 tests/gpu/dma_contention.py --seconds 12 --gib 2 &
    python3 -m freetoken.cli.main bench cpu-moe --formats q4_k --tokens 1 --threads 15 --seconds 4

``--gather N`` instead times what a decode step would do: the GPU's gather kernel
(:mod:`freetoken.moe.experts.expert_gather`) reading ``N`` experts of a Qwen3-30B-A3B-shaped Q4_K
layer (three stacks: gate and up Q4_K, down Q6_K) from page-locked, mapped host memory
into a device buffer, one step after another over different experts, each timed with CUDA
events.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--gib", type=float, default=2.0, help="size of the page-locked source")
    ap.add_argument("--chunk-mib", type=int, default=64, help="bytes per copy")
    ap.add_argument("--gather", type=int, default=0, help="experts per step read by the gather kernel")
    args = ap.parse_args()
    if args.gather:
        gather(args.gather, args.seconds)
        return
    n = int(args.gib * (1 << 30))
    chunk = args.chunk_mib << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    src.random_(0, 255)  # touch every page: the copies read memory, not zero pages
    dst = torch.empty(chunk * 4, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    copied, t0, last = 0, time.perf_counter(), time.perf_counter()
    window = 0
    with torch.cuda.stream(stream):
        while time.perf_counter() - t0 < args.seconds:
            for off in range(0, n - chunk + 1, chunk):
                k = (off // chunk) % 4
                dst[k * chunk:(k + 1) * chunk].copy_(src[off:off + chunk], non_blocking=True)
                copied += chunk
                window += chunk
            stream.synchronize()
            now = time.perf_counter()
            if now - last >= 1.0:
                print(f"[{now - t0:5.1f} s] host->device {window / (now - last) / 1e9:.1f} GB/s", flush=True)
                window, last = 0, now
    print(f"host->device copies: {copied / (time.perf_counter() - t0) / 1e9:.1f} GB/s over "
          f"{time.perf_counter() - t0:.1f} s", flush=True)


def gather(per_step: int, seconds: float) -> None:
    from freetoken.moe.experts.expert_gather import gather_experts
    from freetoken.moe.experts.locked_fetch import DevicePointer

    experts, layers = 128, 8
    # bytes of one expert: gate and up [768, 2048] Q4_K (144 bytes per 256), down [2048, 768] Q6_K (210 per 256)
    sizes = (768 * 2048 // 256 * 144, 768 * 2048 // 256 * 144, 2048 * 768 // 256 * 210)
    stacks = [[torch.empty(experts * b, dtype=torch.uint8, pin_memory=True) for b in sizes] for _ in range(layers)]
    for layer in stacks:
        for t in layer:
            t.random_(0, 255)
    dst = [torch.empty(experts * b, dtype=torch.uint8, device="cuda") for b in sizes]
    counts = torch.zeros(experts, dtype=torch.int32, device="cuda")
    times: list[float] = []
    step, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        counts.zero_()
        first = (step * per_step * 7) % (experts - per_step)
        counts[first:first + per_step] = 1
        layer = stacks[step % layers]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for src, out in zip(layer, dst):
            gather_experts(DevicePointer(src.data_ptr(), torch.uint8), out, counts, experts)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
        step += 1
    times = sorted(times[3:])
    med = times[len(times) // 2]
    nbytes = per_step * sum(sizes)
    print(f"gather of {per_step} experts ({nbytes / 1e6:.2f} MB) from mapped host memory: median {med:.1f} us "
          f"({nbytes / med / 1e3:.1f} GB/s), p10 {times[len(times) // 10]:.1f} us, p90 "
          f"{times[len(times) * 9 // 10]:.1f} us over {len(times)} steps", flush=True)


if __name__ == "__main__":
    main()
