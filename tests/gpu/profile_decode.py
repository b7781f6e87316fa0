"""Where a decode step's time goes on the GPU machine (a diagnostic script, not a test).

For one placement of a GGUF model on the cuda backend: the host-side split of
``engine.step`` (scheduling and inputs, the launch of the step, the output head, sampling
with its wait for the GPU, the rest), the hand-off stage split from the coordinator's
trace, the top host functions (cProfile) and the top GPU kernels and host ops
(torch.profiler) over batch-1 decode steps.

    python3 tests/gpu/profile_decode.py MODEL.gguf --moe-cpu-layers all [--steps 48] [--eager]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
import types
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
    ap.add_argument("--gpu-dense", default="auto", choices=["auto", "packed", "dequantized"])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--kernels", type=int, default=30, help="rows of the kernel table")
    args = ap.parse_args()

    eng = LLMEngine(EngineConfig(model=args.model, backend=args.backend, max_model_len=1024, max_running_requests=8,
                                 moe_cpu_layers=args.moe_cpu_layers, cpu_threads=args.cpu_threads,
                                 enforce_eager=args.eager, gpu_dense=args.gpu_dense))
    info = eng.backend_info()
    print("backend:", json.dumps({k: info.get(k) for k in ("io_path", "sync_mode", "graphs", "moe_cpu_layers",
                                                           "attention", "reason")}))
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
    eng.close()


if __name__ == "__main__":
    main()
