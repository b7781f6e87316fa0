"""``freetoken bench decode --gpu-profile``: where one request's prompt and decode steps
spend their time on a GPU backend.

One batch-1 request (``--prompt-len`` tokens, ``--gen-len`` generated) runs under
``torch.profiler`` (host ops and device activity), its prompt steps and its decode steps
profiled apart. For each phase the report gives the wall time, the time the device spent
in kernels and in copies (the union of their intervals, so overlapping work counts once),
what is left of the wall time with no kernel running (launch overhead, host
synchronisation, host work between launches), the kernels that took the most device time
and the host ops that took the most host time. Then the prompt of a second request runs
under ``cProfile``: the Python functions with the most own time, which is where a prompt
that leaves the device idle spends it.

Profiling slows the host side (every op is recorded), so its wall times are above the
benchmark's; the split and the ranking are what it is for.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import time
from typing import Any, Iterable, Optional

import torch

#: rows in each ranking
TOP = 18


def _sync(dev: Optional[torch.device]) -> None:
    if dev is not None:
        torch.cuda.synchronize(dev)


def _union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _device_events(prof: Any) -> list[Any]:
    device = torch.autograd.DeviceType.CUDA
    return [e for e in prof.events() if e.device_type == device]


def _is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset", "memcpy", "memset"))


def phase_report(prof: Any, title: str, wall_s: float, steps: int, tokens: int) -> str:
    """The summary of one profiled phase (see the module docstring)."""
    dev = _device_events(prof)
    kernels = [(e.time_range.start, e.time_range.end) for e in dev if not _is_copy(e.name)]
    copies = [(e.time_range.start, e.time_range.end) for e in dev if _is_copy(e.name)]
    wall_us = wall_s * 1e6
    k_us, c_us = _union_us(kernels), _union_us(copies)
    lines = [f"{title}: {steps} steps, {tokens} tokens, {wall_us / 1e3:.2f} ms wall under the profiler "
             f"({wall_us / max(steps, 1):.0f} us per step)",
             f"  device: kernels {k_us / 1e3:.2f} ms ({k_us / wall_us:.0%} of wall; {len(kernels)} launches, "
             f"{len(kernels) / max(steps, 1):.0f} per step), copies {c_us / 1e3:.2f} ms ({len(copies)}); "
             f"no kernel running {max(0.0, wall_us - k_us) / 1e3:.2f} ms"]
    per_kernel: dict[str, list[float]] = {}
    for e in dev:
        per_kernel.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    ranked = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:TOP]
    lines.append(f"  {'device time ms':>14} {'calls':>6} {'mean us':>9}  kernel / copy")
    for name, times in ranked:
        lines.append(f"  {sum(times) / 1e3:14.3f} {len(times):6d} {sum(times) / len(times):9.1f}  {name[:110]}")
    host: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            host.setdefault(e.name, []).append(e.self_cpu_time_total)
    ranked_host = sorted(host.items(), key=lambda kv: -sum(kv[1]))[:TOP]
    lines.append(f"  {'host self ms':>14} {'calls':>6} {'mean us':>9}  host op")
    for name, times in ranked_host:
        lines.append(f"  {sum(times) / 1e3:14.3f} {len(times):6d} {sum(times) / len(times):9.1f}  {name[:110]}")
    return "\n".join(lines)


def profile_request(eng: Any, prompt_len: int, gen_len: int, vocab: int, seed: int,
                    dev: Optional[torch.device]) -> str:
    """Profile one batch-1 request's prompt and decode phases, then a second prompt under
    cProfile; returns the report (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    from freetoken.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev is not None else [])
    out = []

    req = eng.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
    _sync(dev)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        steps = 0
        while not req.output_ids:
            eng.step()
            steps += 1
        _sync(dev)
        wall = time.perf_counter() - t0
    out.append(phase_report(prof, f"prompt of {prompt_len} tokens", wall, steps, prompt_len))
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        steps = 0
        while eng.has_work():
            eng.step()
            steps += 1
        _sync(dev)
        wall = time.perf_counter() - t0
    out.append(phase_report(prof, "decode", wall, steps, steps))

    req = eng.add_request([rng.randrange(vocab) for _ in range(prompt_len)],
                          SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    _sync(dev)
    py = cProfile.Profile()
    t0 = time.perf_counter()
    py.enable()
    while eng.has_work():
        eng.step()
    _sync(dev)
    py.disable()
    wall = time.perf_counter() - t0
    text = io.StringIO()
    pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(TOP + 12)
    body = text.getvalue()
    body = body[body.find("ncalls"):] if "ncalls" in body else body
    out.append(f"prompt of {prompt_len} tokens under cProfile: {wall * 1e3:.1f} ms wall; "
               f"Python functions by own time:\n{body.rstrip()}")
    return "\n\n".join(out)
