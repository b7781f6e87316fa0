"""Where a decode step's time goes on the GPU machine (a diagnostic script, not a test).

For one placement of a GGUF model on the cuda backend: the host-side split of
``engine.step`` (scheduling and inputs, the launch of the step, the output head, sampling
with its wait for the GPU, the rest), the hand-off stage split from the coordinator's
trace, the top host functions (cProfile) and the top GPU kernels and host ops
(torch.profiler) over batch-1 decode steps.

    python3 tests/gpu/profile_decode.py MODEL.gguf --moe-cpu-layers all [--steps 48] [--eager]
    python3 tests/gpu/profile_decode.py MODEL.gguf --gpu-memory-limit 16GiB [--set moe_stream_experts=all]

The GPU timeline of the profiled steps is also summed by kernel kind (per step: busy time
per kind, the idle time between kernels and the largest idle gaps), which separates the
GPU layers' work from the waits on the CPU layers. ``--prompt-profile N`` adds the same
kernel table and timeline for one prompt of N tokens (its prefill alone, timed first
without the profiler); ``--prompt-syncs`` lists where that prefill makes the host wait for
the GPU (torch's synchronisation debug mode: each call site with its count), the waits that
keep the host from queueing the next layer's kernels while the GPU runs this one's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
import traceback
import types
import warnings
from typing import Any

import torch

import freetoken.engine.engine as engine_module
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.sampling_params import SamplingParams


class StepTimer:
    """Wall time of the parts of ``engine.step`` (host clock, no added synchronisation)."""

    def __init__(self, eng: LLMEngine) -> None:
        self.parts: dict[str, list[float]] = {"forward_call": [], "logits_call": [], "sample": []}
        self.eng = eng
        forward, logits, sample = eng.session.forward, eng.model.compute_logits, engine_module.sample

        def timed(name: str, fn: Any) -> Any:
            def wrapper(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                out = fn(*a, **k)
                self.parts[name].append((time.perf_counter() - t0) * 1e6)
                return out
            return wrapper

        eng.session.forward = timed("forward_call", forward)
        eng.model.compute_logits = timed("logits_call", logits)
        engine_module.sample = timed("sample", sample)

    def reset(self) -> None:
        for v in self.parts.values():
            v.clear()


def run(eng: LLMEngine, prompt: int, tokens: int, timer: StepTimer, profile: Any = None) -> list[float]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    req = eng.add_request([(7 * i + 3) % 1000 + 5 for i in range(prompt)], params)
    while not req.output_ids:
        eng.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timer.reset()
    steps = []
    if profile is not None:
        profile.enable()
    while eng.has_work():
        t0 = time.perf_counter()
        eng.step()
        steps.append((time.perf_counter() - t0) * 1e6)
    if profile is not None:
        profile.disable()
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--moe-cpu-layers", default="all")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--cpu-threads", type=int, default=15)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--gpu-dense", default="auto", choices=["auto", "packed", "dequantized", "both"])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--kernels", type=int, default=30, help="rows of the kernel table")
    ap.add_argument("--prompt-profile", type=int, default=0, metavar="N",
                    help="also profile the prefill of one N-token prompt")
    ap.add_argument("--prompt-syncs", action="store_true",
                    help="with --prompt-profile: list the prefill's host-device synchronisation points")
    ap.add_argument("--gpu-memory-limit", default=None, help="e.g. 16GiB (the default placement under it)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="another EngineConfig field, e.g. moe_locked_fetch=0.25 (repeatable)")
    args = ap.parse_args()

    from freetoken.cli.engine_options import parse_size

    def value(text: str) -> Any:
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text

    more = {k: value(v) for k, v in (item.split("=", 1) for item in args.set)}
    limit = parse_size(args.gpu_memory_limit) if args.gpu_memory_limit else None
    eng = LLMEngine(EngineConfig(model=args.model, backend=args.backend, max_model_len=max(1024, args.prompt_profile + 64),
                                 max_running_requests=8,
                                 moe_cpu_layers=None if limit and args.moe_cpu_layers == "all" else args.moe_cpu_layers,
                                 cpu_threads=args.cpu_threads, enforce_eager=args.eager, gpu_dense=args.gpu_dense,
                                 gpu_memory_limit=limit, **more))
    info = eng.backend_info()
    print("backend:", json.dumps({k: info.get(k) for k in ("io_path", "sync_mode", "graphs", "moe_cpu_layers", "locked_fetch",
                                                           "attention", "reason")}))
    plan = info.get("memory_plan") or {}
    print("plan:", json.dumps({k: plan.get(k) for k in ("budget", "dense", "gpu_layers", "cpu_layers", "scratch",
                                                        "kv_budget", "dense_form")}))
    timer = StepTimer(eng)
    run(eng, 16, 8, timer)  # warm-up
    traced = eng.session.start_stage_trace()
    steps = run(eng, 16, args.steps, timer)
    med = statistics.median(steps)
    print(f"step (host wall, median of {len(steps)}): {med:.0f} us -> {1e6 / med:.1f} tok/s")
    parts = {k: statistics.median(v) for k, v in timer.parts.items() if v}
    parts["rest_of_step"] = med - sum(parts.values())
    print("host split (median us):", json.dumps({k: round(v, 1) for k, v in parts.items()}))
    if traced:
        print("hand-off stages (us):", json.dumps({k: round(v, 2) for k, v in (eng.session.stage_split() or {}).items()}))

    prof = cProfile.Profile()
    run(eng, 16, args.steps, timer, prof)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    print("\n".join(text.getvalue().splitlines()[:50]))

    from torch.profiler import ProfilerActivity, profile

    # decode steps only (the prompt's kernels would weigh in the per-kernel averages)
    p = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    run(eng, 16, 12, timer, types.SimpleNamespace(enable=p.start, disable=p.stop))
    table = p.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.kernels, max_name_column_width=60)
    print(table)
    table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
    print(table)
    print_timeline(p, 12)
    if args.prompt_profile:
        profile_prompt(eng, args.prompt_profile, args.kernels, args.prompt_syncs)
    eng.close()


def profile_prompt(eng: LLMEngine, n: int, rows: int, syncs: bool = False) -> None:
    """One prompt of ``n`` tokens: its prefill's wall time (the step that returns its first
    token; median of five, after a warm-up), then one more under torch.profiler; ``syncs``:
    one more in torch's synchronisation debug mode, its waits listed by call site."""
    from torch.profiler import ProfilerActivity, profile

    def prefill(seed: int) -> float:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        req = eng.add_request([(7 * i + 11 * seed) % 1000 + 5 for i in range(n)], params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while not req.output_ids:
            eng.step()
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        while eng.has_work():
            eng.step()
        return took

    prefill(0)
    walls = [prefill(s) for s in (1, 2, 3, 5, 6)]
    wall = statistics.median(walls)
    print(f"prompt {n}: {wall * 1e3:.1f} ms (median of 5: {[round(w * 1e3, 1) for w in walls]}) -> {n / wall:.0f} tok/s")
    if syncs:
        print_syncs(lambda: prefill(7))
    p = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    p.start()
    prefill(4)
    p.stop()
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))
    print_timeline(p, 1)


def print_syncs(work: Any) -> None:
    """Run ``work`` in torch's synchronisation debug mode and print each call site (the
    innermost frames of this repository's code) where the host waited for the GPU."""
    sites: dict[str, int] = {}
    shown = warnings.showwarning

    def record(message: Any, category: Any, *rest: Any, **kw: Any) -> None:
        if "synchroniz" not in str(message):
            shown(message, category, *rest, **kw)
            return
        ours = [f for f in traceback.extract_stack()[:-1] if "/freetoken" in f.filename]
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(ours[-3:]))
        sites[where or "(outside freetoken)"] = sites.get(where or "(outside freetoken)", 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    print(f"prompt syncs: {sum(sites.values())} at {len(sites)} call sites")
    for where, count in sorted(sites.items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d}  {where}")


#: kernel kinds by name fragment, first match wins
KINDS = (("gate/up experts", ("gate_up",)), ("down experts", ("_down",)),
         ("hand-off (KernelIO)", ("kio_", "ft_flag")), ("attention", ("attention", "_partial", "_reduce")),
         ("dense GEMV", ("gemv", "linear", "gemm", "xmma")), ("norm/rope/kv", ("norm", "rope", "store")),
         ("router/top-k", ("router", "route_slots", "top")), ("sampling", ("sample", "argmax", "greedy")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, parts in KINDS:
        if any(p in low for p in parts):
            return kind
    return "other: " + name[:50]


def print_timeline(p: Any, steps: int) -> None:
    """GPU kernels of the profiled decode steps summed by kind, per step, and the idle time
    between consecutive kernels (the GPU waiting on the CPU layers or the host)."""
    from torch.autograd import DeviceType

    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in p.events()
                      if e.device_type == DeviceType.CUDA), key=lambda k: k[0])
    if not kernels:
        print("timeline: no GPU kernels recorded")
        return
    span = kernels[-1][1] - kernels[0][0]
    busy: dict[str, float] = {}
    names: dict[str, set[str]] = {}
    gaps: list[tuple[float, str, str]] = []
    end = kernels[0][0]
    prev = ""
    for start, stop, name in kernels:
        k = kind_of(name)
        busy[k] = busy.get(k, 0.0) + (stop - start)
        names.setdefault(k, set()).add(name[:70])
        if start > end:
            gaps.append((start - end, prev, name))
        end = max(end, stop)
        prev = name
    idle = sum(g for g, _, _ in gaps)
    print(f"timeline: {len(kernels)} kernels over {span:.0f} us in {steps} steps: "
          f"{span / steps:.0f} us/step, busy {(span - idle) / steps:.0f}, idle {idle / steps:.0f}")
    for k, v in sorted(busy.items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {v / steps:8.1f} us/step  ({len(names[k])} kernel names: {sorted(names[k])[:3]})")
    gaps.sort(reverse=True)
    small = [g for g, _, _ in gaps if g < 20]
    print(f"  idle gaps: {len(gaps)}, {len(small)} under 20 us summing {sum(small) / steps:.0f} us/step; largest:")
    for g, a, b in gaps[:12]:
        print(f"    {g:8.1f} us after {a[:50]} before {b[:50]}")


if __name__ == "__main__":
    main()
