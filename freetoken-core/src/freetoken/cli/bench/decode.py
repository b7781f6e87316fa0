"""``freetoken bench decode``: prompt and decode tokens/s of the whole engine, with
the memory-bandwidth ceiling measured in the same run.

Decode is bandwidth bound: each step reads the dense weights (attention, router,
output head) once and every expert that some token in the batch routes to. The
ceiling is ``measured read bandwidth / weight bytes read per step`` (times the batch
size for tokens/s); expert bytes use the distinct experts actually routed per layer
and step in the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> tuple[float, str]:
    """Read bandwidth in bytes/s (best of ``repeats`` full reads of a buffer far larger
    than the caches) and how it was measured: freetoken_cpu_moe's streaming read on
    its worker pool when available, else a torch sum."""
    try:
        from freetoken_cpu_moe.timing import measure_bandwidth as cpu_moe_bandwidth
    except ImportError:
        pass
    else:
        how = "freetoken_cpu_moe.timing.measure_bandwidth (1 GiB, best of 5)"
        return float(cpu_moe_bandwidth(nbytes, repeats)), how
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        float(buf.sum())
        dt = time.perf_counter() - t0
        best = max(best, nbytes / dt)
    return best, "torch.sum over 1 GiB (best of 5)"


def _cpu_ticks() -> tuple[int, int]:
    """(busy ticks of the whole machine, ticks of this process) from /proc: the
    difference over a run shows how much CPU other processes took meanwhile."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        busy = sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)  # minus idle and iowait
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        mine = int(fields[11]) + int(fields[12])  # utime + stime of all threads
        return busy, mine
    except (OSError, ValueError, IndexError):
        return 0, 0


class _RouteCounter:
    """Counts distinct experts routed per MoE layer and step (for the ceiling)."""

    def __init__(self, model: Any) -> None:
        self.layers = [L.moe for L in model.layers if L.moe is not None]
        self.unique = 0
        self.calls = 0
        self._orig = []
        for moe in self.layers:
            orig = moe.route
            self._orig.append(orig)

            def route(x: torch.Tensor, _orig=orig) -> Any:
                ids, w = _orig(x)
                self.unique += int(torch.unique(ids).numel())
                self.calls += 1
                return ids, w

            moe.route = route

    def reset(self) -> None:
        self.unique = self.calls = 0

    def mean_unique(self) -> float:
        return self.unique / max(1, self.calls)

    def remove(self) -> None:
        for moe, orig in zip(self.layers, self._orig):
            moe.route = orig


def run_batch(eng: Any, batch: int, prompt_len: int, tokens: int, vocab: int, seed: int) -> dict[str, float]:
    from freetoken.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    busy0, mine0 = _cpu_ticks()
    reqs = [eng.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params) for _ in range(batch)]
    t0 = time.perf_counter()
    while any(not r.output_ids for r in reqs):
        eng.step()
    t1 = time.perf_counter()
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
    t2 = time.perf_counter()
    busy1, mine1 = _cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    others = max(0, (busy1 - busy0) - (mine1 - mine0)) / hz / (t2 - t0) / (os.cpu_count() or 1)
    decoded = sum(len(r.output_ids) - 1 for r in reqs)
    return {
        "other_processes_cpu": others,
        "prompt_tok_s": batch * prompt_len / (t1 - t0),
        "decode_tok_s": decoded / (t2 - t1),
        "decode_step_ms": 1000 * (t2 - t1) / max(1, steps),
        "decode_steps": steps,
    }


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser("decode", help="engine prompt/decode tokens/s at batch 1 and 8, with the bandwidth ceiling")
    p.add_argument("--model", default=None, help=".gguf or HF directory (default: the demo model)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--backend", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="runs per batch size; the median run is reported")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    maxb = max(args.batch)
    ctx = args.prompt_len + args.tokens + 1
    eng = LLMEngine(EngineConfig(
        model=args.model, backend=args.backend, max_running_requests=maxb,
        kv_cache_tokens=maxb * (ctx + 16) + 64, prefill_chunk=maxb * args.prompt_len, max_model_len=ctx,
    ))
    model = eng.model
    vocab = eng.model_config.vocab_size
    bpt = model.bytes_per_token()
    counter = _RouteCounter(model)
    # warm-up: page the weights in, first-call costs
    run_batch(eng, 1, min(16, args.prompt_len), 4, vocab, args.seed + 99)
    bw, bw_how = measure_bandwidth()
    results: dict[str, Any] = {
        "model": eng.model_name,
        "path": eng.loaded.path,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or ''}".strip(", "),
        "torch_threads": eng._prefill_threads,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "bandwidth_GBs": bw / 1e9,
        "bandwidth_method": bw_how,
        "dense_bytes_per_step": bpt["dense"],
        "expert_bytes_per_token_b1": bpt["experts"],
        "batches": {},
    }

    per_expert = bpt["experts"] / max(1, model.config.top_k * len(counter.layers))
    for b in args.batch:
        runs = sorted((run_batch(eng, b, args.prompt_len, args.tokens, vocab, args.seed + 7 * i + b)
                       for i in range(max(1, args.repeats))), key=lambda x: x["decode_tok_s"])
        r = runs[len(runs) // 2]
        r["decode_tok_s_runs"] = [round(x["decode_tok_s"], 2) for x in runs]
        r["other_processes_cpu_runs"] = [round(x["other_processes_cpu"], 3) for x in runs]
        r["prompt_tok_s_runs"] = [round(x["prompt_tok_s"], 2) for x in runs]
        # decode steps only: prefill routes many tokens at once; count from a decode-only run
        counter.reset()
        r2 = run_batch(eng, b, 1, min(args.tokens, 16), vocab, args.seed + 1000 + b)
        uniq = counter.mean_unique()
        step_bytes = bpt["dense"] + uniq * per_expert * len(counter.layers)
        r["distinct_experts_per_layer"] = uniq
        r["bytes_per_step"] = step_bytes
        r["ceiling_tok_s"] = b * bw / step_bytes
        r["fraction_of_ceiling"] = r["decode_tok_s"] / r["ceiling_tok_s"]
        r["effective_GBs"] = r["decode_tok_s"] / b * step_bytes / 1e9
        del r2
        results["batches"][str(b)] = r
    counter.remove()
    bw1, _ = measure_bandwidth()
    results["bandwidth_GBs_after"] = bw1 / 1e9
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"model {results['model']} ({results['path']})")
    print(f"machine {results['machine']}, torch threads {results['torch_threads']} (1 in decode steps), "
          f"{results['date']}")
    print(f"measured read bandwidth {results['bandwidth_GBs']:.1f} GB/s ({bw_how}); dense {bpt['dense'] / 1e6:.1f} MB/step, "
          f"experts {bpt['experts'] / 1e6:.1f} MB/token at batch 1")
    print(f"(bandwidth again after the runs: {bw1 / 1e9:.1f} GB/s; the ceiling uses the first)")
    for b, r in results["batches"].items():
        print(f"batch {b}: prompt {r['prompt_tok_s']:.1f} tok/s, decode {r['decode_tok_s']:.1f} tok/s "
              f"(runs {r['decode_tok_s_runs']}, other processes' CPU share during each "
              f"{[f'{100 * v:.0f}%' for v in r['other_processes_cpu_runs']]}) "
              f"({r['decode_step_ms']:.1f} ms/step); ceiling {r['ceiling_tok_s']:.1f} tok/s "
              f"({r['bytes_per_step'] / 1e6:.0f} MB/step, {r['distinct_experts_per_layer']:.1f} experts/layer) -> "
              f"{100 * r['fraction_of_ceiling']:.0f}% of ceiling, {r['effective_GBs']:.1f} GB/s effective")
    return 0
