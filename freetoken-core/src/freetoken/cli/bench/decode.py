"""``freetoken bench decode``: prompt and decode tokens/s of the whole engine, with
the memory-bandwidth ceiling measured in the same run.

Greedy decoding (or, with ``--temperature``, sampling with a seed per request) from
random prompt token ids (fixed seed): one short request warms up, then for every batch
size ``--batch`` (default 1 and 8 concurrent requests) each run times the
``engine.step()`` loops with ``time.perf_counter``: prompt tokens/s up to every
request's first token, decode tokens/s after it. Beside the speed it reports the
GPU memory torch's allocator used (peak allocated, reserved) when the engine runs on a
CUDA/HIP device, and what the backend's report (``engine.backend_info()``) says about
the decode steps: ``cpu_wait_share`` (the share of step time spent waiting for the
CPU experts) and ``step_breakdown`` (microseconds per part), "-" when it does not
report them.

Decode is bandwidth bound: each step reads the dense weights (attention, router,
output head) once and every expert that some token in the batch routes to. The
ceiling is ``measured read bandwidth / weight bytes read per step`` (times the batch
size for tokens/s); expert bytes use the distinct experts actually routed per layer
and step in the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from freetoken.cli.bench.tiles import KINDS as TILE_KINDS
from freetoken.cli.bench.tiles import apply_tiles, tiles_arg
from freetoken.cli.engine_options import (
    add_engine_arguments,
    byte_size,
    engine_config_from_args,
    engine_options_given,
    int_at_least,
    positive_int,
    usage_error,
)

if TYPE_CHECKING:
    from freetoken.engine.config import EngineConfig

logger = logging.getLogger(__name__)

#: Keys of the backend report this benchmark shows (when the backend reports them).
CPU_WAIT_KEY = "cpu_wait_share"
BREAKDOWN_KEY = "step_breakdown"


def _size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> tuple[float, str]:
    """Read bandwidth in bytes/s (best of ``repeats`` full reads of a buffer far larger
    than the caches) and how it was measured: freetoken_cpu_moe's streaming read on
    its worker pool when available, else a torch sum."""
    try:
        from freetoken_cpu_moe.timing import measure_bandwidth as cpu_moe_bandwidth
    except ImportError:
        pass
    else:
        how = f"freetoken_cpu_moe.timing.measure_bandwidth ({_size_text(nbytes)}, best of {repeats})"
        return float(cpu_moe_bandwidth(nbytes, repeats)), how
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        float(buf.sum())
        dt = time.perf_counter() - t0
        best = max(best, buf.numel() * 4 / dt)
    return best, f"torch.sum over {_size_text(nbytes)} (best of {repeats})"


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
    """Counts distinct experts routed per MoE layer and step (for the ceiling). Steps
    replayed from a decode graph do not call the router from Python and are not
    counted."""

    def __init__(self, model: Any) -> None:
        self.layers = [L.moe for L in model.layers if L.moe is not None]
        self.unique = 0
        self.calls = 0
        self._orig = []
        for moe in self.layers:
            orig = moe.route
            self._orig.append(orig)

            def route(x: torch.Tensor, _orig: Any = orig) -> Any:
                ids, w = _orig(x)
                self.unique += int(torch.unique(ids).numel())
                self.calls += 1
                return ids, w

            moe.route = route

    def mean_unique(self) -> Optional[float]:
        return self.unique / self.calls if self.calls else None

    def remove(self) -> None:
        for moe, orig in zip(self.layers, self._orig):
            moe.route = orig


def _cuda_device(eng: Any) -> Optional[torch.device]:
    """The engine's device when it is a CUDA (or HIP) device torch can query, else None."""
    try:
        dev = torch.device(eng.device)
    except (TypeError, RuntimeError):
        return None
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return dev


def _sync(dev: Optional[torch.device]) -> None:
    if dev is not None:
        torch.cuda.synchronize(dev)


def run_batch(eng: Any, batch: int, prompt_len: int, tokens: int, vocab: int, seed: int,
              dev: Optional[torch.device] = None, temperature: float = 0.0) -> dict[str, float]:
    """``batch`` concurrent requests of ``prompt_len`` random token ids, ``tokens``
    generated each (greedy at ``temperature`` 0, else sampled at that temperature, each
    request with its own seed drawn from ``seed`` after the prompts): prompt tokens/s up
    to every request's first token, decode tokens/s after it."""
    from freetoken.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    seeds = [rng.randrange(1 << 63) if temperature > 0 else None for _ in range(batch)]
    _sync(dev)
    busy0, mine0 = _cpu_ticks()
    reqs = [eng.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=temperature, ignore_eos=True,
                                                   seed=request_seed))
            for prompt, request_seed in zip(prompts, seeds)]
    t0 = time.perf_counter()
    while any(not r.output_ids for r in reqs):
        eng.step()
    _sync(dev)
    t1 = time.perf_counter()
    steps = 0
    ends = [t1]  # each decode step's end on the host clock (a step returns once its tokens are known)
    while eng.has_work():
        eng.step()
        steps += 1
        ends.append(time.perf_counter())
    _sync(dev)
    t2 = time.perf_counter()
    ms = [1000 * (b - a) for a, b in zip(ends, ends[1:])]
    median = statistics.median(ms) if ms else 0.0
    slowest = sorted(range(len(ms)), key=lambda i: -ms[i])[:3]
    busy1, mine1 = _cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    others = max(0, (busy1 - busy0) - (mine1 - mine0)) / hz / (t2 - t0) / (os.cpu_count() or 1)
    decoded = sum(len(r.output_ids) - 1 for r in reqs)
    return {
        "other_processes_cpu": others,
        "prompt_tok_s": batch * prompt_len / (t1 - t0),
        "decode_tok_s": decoded / (t2 - t1) if steps else 0.0,
        "decode_step_ms": 1000 * (t2 - t1) / max(1, steps),
        "decode_steps": steps,
        # the steps' spread: the median step, and the time above it (one slow step, or many)
        "decode_step_ms_median": median,
        "decode_ms_above_median": sum(max(0.0, m - median) for m in ms),
        "decode_slowest_steps": [[i, round(ms[i], 2)] for i in slowest],
    }


def backend_step_report(info: dict[str, Any]) -> tuple[Optional[float], Optional[dict[str, float]]]:
    """``cpu_wait_share`` and ``step_breakdown`` (name -> microseconds) as the backend's
    report gives them; None where it does not (or not as a number / a dict of numbers)."""
    share = info.get(CPU_WAIT_KEY)
    share = float(share) if isinstance(share, (int, float)) and not isinstance(share, bool) else None
    parts = info.get(BREAKDOWN_KEY)
    breakdown: Optional[dict[str, float]] = None
    if isinstance(parts, dict):
        breakdown = {str(k): float(v) for k, v in parts.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return share, breakdown


def _temperature(text: str) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a number >= 0") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a number >= 0 (0: greedy)")
    return value


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "decode",
        help="engine prompt/decode tokens/s at batch 1 and 8, GPU memory, CPU-expert wait, bandwidth ceiling",
        description="Prompt and decode tokens/s of the whole engine at batch 1 and 8 (greedy unless --temperature, "
        "random prompt ids), "
        "the GPU memory it used, the share of decode step time spent waiting for the CPU experts (as the backend "
        "reports it) and the memory-bandwidth ceiling, as one table (or --json).",
    )
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8], metavar="B",
                   help="batch sizes to measure, each as that many concurrent requests (default: 1 8)")
    p.add_argument("--prompt-len", type=positive_int, default=512, metavar="N",
                   help="prompt tokens per request (default: 512)")
    p.add_argument("--gen-len", "--tokens", dest="gen_len", type=int_at_least(2), default=64, metavar="N",
                   help="tokens generated per request (default: 64; --tokens is the same option)")
    p.add_argument("--temperature", type=_temperature, default=0.0, metavar="T",
                   help="sampling temperature of every request (default: 0, greedy), each request seeded from --seed "
                        "and its index; a high temperature (e.g. 1000) draws near-uniformly random tokens, as "
                        "llama-bench's generation test feeds random tokens (greedy decoding of a random-weight model "
                        "tends to repeat a few tokens)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch threads (dense layers, prefill on the CPU) (default: torch's)")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                   help="runs per batch size; the run of the median decode rate is reported, "
                        "with the median of the runs' prompt rates (default: 3)")
    p.add_argument("--bandwidth-bytes", type=byte_size, default=1 << 30, metavar="SIZE",
                   help="buffer read to measure the memory bandwidth, far larger than the caches (default: 1GiB)")
    p.add_argument("--stages", action="store_true",
                   help="also trace one batch-1 run's hand-offs and report where a layer's time goes "
                        "(CPU experts, GPU side per layer, per-step gap; backends with CPU layers only)")
    p.add_argument("--cpu-profile", action="store_true",
                   help="cpu backend: also run one batch-1 request with timers around the model's parts and "
                        "print where prefill and decode steps spend their time (freetoken_cpu_moe.step_profile)")
    p.add_argument("--gpu-profile", action="store_true",
                   help="also run one batch-1 request under torch.profiler and cProfile and print where its prompt "
                        "and decode steps spend their time: device busy vs idle, top kernels, top host ops and "
                        "Python functions (to stderr with --json)")
    p.add_argument("--tiles", type=tiles_arg, action="append", default=[], metavar="KIND:FIELDS",
                   help="other tiles for the Triton kernels in this run: KIND one of "
                        f"{', '.join(TILE_KINDS)}, FIELDS name=value,... over that config's fields, like "
                        "experts:block_n=4,int8_dot=0 (repeatable; see freetoken/cli/bench/tiles.py) "
                        "(default: the engine's tiles)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    add_engine_arguments(
        p,
        defaults={"max_running_requests": None, "prefill_chunk": None},
        default_text={
            "max_running_requests": "the largest --batch",
            "prefill_chunk": "the largest --batch times --prompt-len: a batch's prompts in one step",
            "max_model_len": "--prompt-len + --gen-len + 1",
            "kv_cache_tokens": "enough for the largest --batch at --max-model-len",
            "seed": "0; also seeds the random prompts and, with --temperature, the requests",
        },
    )
    p.set_defaults(func=run)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options, with this benchmark's sizes where the flags leave them open."""
    given = engine_options_given(args)
    maxb = max(args.batch)
    ctx = args.prompt_len + args.gen_len + 1
    if given.get("max_running_requests") is not None and given["max_running_requests"] < maxb:
        usage_error(args, f"--max-running-requests {given['max_running_requests']} is below the largest --batch "
                    f"{maxb}: the batch would not run concurrently")
    if given.get("max_model_len") is not None and given["max_model_len"] < ctx:
        usage_error(args, f"--max-model-len {given['max_model_len']} is below --prompt-len + --gen-len + 1 = {ctx}")
    length = given.get("max_model_len") or ctx
    auto = {
        "max_running_requests": maxb,
        "prefill_chunk": maxb * args.prompt_len,
        "max_model_len": ctx,
        "kv_cache_tokens": maxb * (length + 16) + 64,
    }
    return engine_config_from_args(args, **{k: v for k, v in auto.items() if given.get(k) is None})


def _gpu_memory(dev: Optional[torch.device]) -> dict[str, Optional[int]]:
    if dev is None:
        return {"gpu_max_allocated_bytes": None, "gpu_reserved_bytes": None}
    return {"gpu_max_allocated_bytes": int(torch.cuda.max_memory_allocated(dev)),
            "gpu_reserved_bytes": int(torch.cuda.memory_reserved(dev))}


def run(args: argparse.Namespace) -> int:
    from freetoken.backends.contract import BackendError
    from freetoken.engine.engine import LLMEngine
    from freetoken.moe.qualify.startup import QualificationError

    if args.threads:
        torch.set_num_threads(args.threads)
    config = engine_config(args)
    try:
        args.tiles_applied = apply_tiles(args.tiles) if args.tiles else None
    except ValueError as exc:
        usage_error(args, str(exc))
    try:
        eng = LLMEngine(config)
    except (ValueError, MemoryError, BackendError, QualificationError) as exc:
        print(f"freetoken bench decode: {exc}", file=sys.stderr)
        return 1
    try:
        return _bench(args, eng, config)
    finally:
        eng.close()


def _bench(args: argparse.Namespace, eng: Any, config: EngineConfig) -> int:
    torch_threads = torch.get_num_threads()
    model = eng.model
    vocab = eng.model_config.vocab_size
    bpt = model.bytes_per_token()
    dev = _cuda_device(eng)
    moe_layers = sum(1 for L in model.layers if L.moe is not None)
    # warm-up: one short request pages the weights in and pays first-call costs; one request
    # of the timed prompt's length compiles the prompt-sized kernels (Triton compiles a
    # variant on its first launch, seconds that are no part of a prompt's speed)
    run_batch(eng, 1, min(16, args.prompt_len), 4, vocab, args.seed + 99, dev, args.temperature)
    if args.prompt_len > 16:
        run_batch(eng, 1, args.prompt_len, 1, vocab, args.seed + 98, dev, args.temperature)
    gpu_peak = _gpu_memory(dev)["gpu_max_allocated_bytes"]
    bw, bw_how = measure_bandwidth(args.bandwidth_bytes)
    info = eng.backend_info()
    results: dict[str, Any] = {
        "model": eng.model_name,
        "path": eng.loaded.path,
        "backend": info.get("backend"),
        "device": str(eng.device),
        "dtype": str(eng.kv.layers[0][0].dtype).removeprefix("torch.") if eng.kv.layers else config.dtype,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or ''}".strip(", "),
        "torch_threads": torch_threads,
        "cpu_threads": info.get("cpu_threads"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "temperature": args.temperature,
        "repeats": args.repeats,
        "engine_config": dataclasses.asdict(config),
        "tiles_given": [f"{kind}:{','.join(f'{k}={v}' for k, v in fields.items())}" for kind, fields in args.tiles],
        "tiles": getattr(args, "tiles_applied", None),
        "bandwidth_GBs": bw / 1e9,
        "bandwidth_method": bw_how,
        "dense_bytes_per_step": bpt["dense"],
        "expert_bytes_per_token_b1": bpt["experts"],
        "batches": {},
    }

    per_expert = bpt["experts"] / max(1, model.config.top_k * moe_layers)
    for b in args.batch:
        if dev is not None:
            torch.cuda.reset_peak_memory_stats(dev)
        # a distinct seed per run and batch size: no prompt repeats, so no run reads the prefix cache
        runs = sorted((run_batch(eng, b, args.prompt_len, args.gen_len, vocab, args.seed + 7 * i + 1000 * b, dev,
                                 args.temperature)
                       for i in range(args.repeats)), key=lambda x: x["decode_tok_s"])
        r: dict[str, Any] = dict(runs[len(runs) // 2])
        r["decode_tok_s_runs"] = [round(x["decode_tok_s"], 2) for x in runs]
        r["other_processes_cpu_runs"] = [round(x["other_processes_cpu"], 3) for x in runs]
        r["prompt_tok_s_runs"] = [round(x["prompt_tok_s"], 2) for x in runs]
        # the prompt's own median: the run of the median decode rate need not have it
        r["prompt_tok_s"] = statistics.median(x["prompt_tok_s"] for x in runs)
        r.update(_gpu_memory(dev))
        if r["gpu_max_allocated_bytes"] is not None:
            gpu_peak = max(gpu_peak or 0, r["gpu_max_allocated_bytes"])
        r[CPU_WAIT_KEY], r[BREAKDOWN_KEY] = backend_step_report(eng.backend_info())
        # decode steps only: prefill routes many tokens at once; count from a decode-only run,
        # the only one with the counter (its torch.unique per layer, a device sync on a GPU,
        # stays out of the timed runs)
        counter = _RouteCounter(model)
        try:
            run_batch(eng, b, 1, min(args.gen_len, 16), vocab, args.seed + 1000 + b, dev, args.temperature)
        finally:
            counter.remove()
        uniq = counter.mean_unique()
        r["distinct_experts_per_layer"] = uniq
        if uniq is None:  # no router call seen (graph replay): no ceiling
            r["bytes_per_step"] = r["ceiling_tok_s"] = r["fraction_of_ceiling"] = r["effective_GBs"] = None
        else:
            step_bytes = bpt["dense"] + uniq * per_expert * moe_layers
            r["bytes_per_step"] = step_bytes
            r["ceiling_tok_s"] = b * bw / step_bytes
            r["fraction_of_ceiling"] = r["decode_tok_s"] / r["ceiling_tok_s"]
            r["effective_GBs"] = r["decode_tok_s"] / b * step_bytes / 1e9
        results["batches"][str(b)] = r
    results["stages_b1_us"] = _stages(eng, args, vocab, dev) if args.stages else None
    bw1, _ = measure_bandwidth(args.bandwidth_bytes)
    results["bandwidth_GBs_after"] = bw1 / 1e9
    final = _gpu_memory(dev)
    results["gpu_max_allocated_bytes"] = gpu_peak
    results["gpu_reserved_bytes"] = final["gpu_reserved_bytes"]
    results["gpu_total_bytes"] = int(torch.cuda.get_device_properties(dev).total_memory) if dev is not None else None
    results["decode_tok_s"] = {k: v["decode_tok_s"] for k, v in results["batches"].items()}
    results["prompt_tok_s"] = {k: v["prompt_tok_s"] for k, v in results["batches"].items()}
    results["backend_report"] = eng.backend_info()
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print(format_table(results))
    if args.cpu_profile:
        _cpu_profile(eng, args, vocab, dev)
    if args.gpu_profile:
        from freetoken.cli.bench.gpu_profile import profile_request

        report = profile_request(eng, args.prompt_len, min(args.gen_len, 16), vocab, args.seed + 5151, dev)
        print(report, file=sys.stderr if args.json else sys.stdout)
    return 0


def _cpu_profile(eng: Any, args: argparse.Namespace, vocab: int, dev: Optional[torch.device]) -> None:
    """Per-part split of one batch-1 request's prefill and decode steps (cpu backend)."""
    try:
        from freetoken_cpu_moe.step_profile import StepProfiler, pool_call_us
    except ImportError:
        print("cpu profile: freetoken_cpu_moe is not installed", file=sys.stderr)
        return
    pool = getattr(eng.session, "pool", None)
    with StepProfiler(eng) as prof:
        run_batch(eng, 1, args.prompt_len, args.gen_len, vocab, args.seed + 4242, dev, args.temperature)
    call_us = pool_call_us(pool) if pool is not None else None
    gap_us = pool_call_us(pool, repeats=100, gap_us=300.0) if pool is not None else None
    attention = getattr(getattr(eng.session, "attention", None), "mode", "-")
    ops = getattr(getattr(eng.model, "ops", None), "name", "-")
    print(f"\ncpu profile (batch 1, prompt {args.prompt_len}, {args.gen_len} tokens; "
          f"{getattr(pool, 'num_threads', '-')} pool threads, {torch.get_num_threads()} torch threads; "
          f"attention {attention}, dense ops {ops}):")
    print(prof.report(eng.model_config.num_layers, call_us, gap_us))


def _stages(eng: Any, args: argparse.Namespace, vocab: int, dev: Optional[torch.device]) -> Optional[dict[str, float]]:
    """One batch-1 run (``--prompt-len``, ``--gen-len`` tokens) with the session's stage trace."""
    if not eng.session.start_stage_trace():
        return None
    run_batch(eng, 1, args.prompt_len, args.gen_len, vocab, args.seed + 999, dev, args.temperature)  # no timed run's prompt
    return eng.session.stage_split()


# ---------------------------------------------------------------- the table


def _num(value: Optional[float], fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _gib(value: Optional[int], unit: bool = True) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}{' GiB' if unit else ''}"


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return out


def _sampling_text(temperature: float) -> str:
    return "greedy" if not temperature else f"temperature {temperature:g}, a seed per request"


def format_table(results: dict[str, Any]) -> str:
    """The results as text a person reads: the setting, one row per batch size, notes."""
    rep = results.get("backend_report") or {}
    graphs = rep.get("graphs")
    lines = [
        f"model {results['model']} ({results['path']})",
        f"backend {results['backend'] or '-'} on {results['device']} ({results['dtype']}; io path "
        f"{rep.get('io_path', '-')}, sync {rep.get('sync_mode', '-')}, graphs "
        f"{'-' if graphs is None else ('on' if graphs else 'off')}, CPU expert threads "
        f"{results['cpu_threads'] if results['cpu_threads'] is not None else '-'}, torch threads "
        f"{results['torch_threads']})",
        f"machine {results['machine']}; {results['date']}",
        f"prompt {results['prompt_len']} random token ids, {results['gen_len']} tokens generated per request "
        f"({_sampling_text(results.get('temperature', 0.0))}); median of {results['repeats']} run(s) per batch size "
        "(decode: the run of the median decode rate; prompt: the median prompt rate)",
        f"read bandwidth {results['bandwidth_GBs']:.1f} GB/s ({results['bandwidth_method']}; "
        f"{results['bandwidth_GBs_after']:.1f} GB/s after the runs, the ceiling uses the first); weights read: "
        f"dense {results['dense_bytes_per_step'] / 1e6:.1f} MB/step, experts "
        f"{results['expert_bytes_per_token_b1'] / 1e6:.1f} MB/token at batch 1",
        "",
    ]
    header = ("batch", "prompt tok/s", "decode tok/s", "ms/step", "CPU wait", "GPU peak GiB", "GPU resv GiB",
              "ceiling tok/s", "% ceiling", "experts/layer", "other CPU")
    rows = []
    for b, r in results["batches"].items():
        rows.append((
            b, _num(r["prompt_tok_s"]), _num(r["decode_tok_s"]), _num(r["decode_step_ms"], "{:.2f}"),
            _pct(r[CPU_WAIT_KEY]), _gib(r["gpu_max_allocated_bytes"], False), _gib(r["gpu_reserved_bytes"], False),
            _num(r["ceiling_tok_s"]), _pct(r["fraction_of_ceiling"]), _num(r["distinct_experts_per_layer"]),
            _pct(max(r["other_processes_cpu_runs"])),
        ))
    lines += _columns(header, rows)
    lines.append("")
    runs = ", ".join(f"batch {b} {r['decode_tok_s_runs']}" for b, r in results["batches"].items())
    lines.append(f"decode tok/s of each run: {runs}")
    runs = ", ".join(f"batch {b} {r['prompt_tok_s_runs']}" for b, r in results["batches"].items())
    lines.append(f"prompt tok/s of each run: {runs}")
    if results.get("tiles_given"):
        lines.append(f"kernel tiles changed for this run: --tiles {' --tiles '.join(results['tiles_given'])}")
    if results["gpu_total_bytes"] is None:
        lines.append("GPU memory: - (no CUDA/HIP device in use)")
    else:
        lines.append(f"GPU memory (torch's allocator): peak allocated {_gib(results['gpu_max_allocated_bytes'])}, "
                     f"reserved {_gib(results['gpu_reserved_bytes'])} of {_gib(results['gpu_total_bytes'])}")
    breakdowns = [(b, r[BREAKDOWN_KEY]) for b, r in results["batches"].items() if r[BREAKDOWN_KEY]]
    if not breakdowns:
        lines.append(f"decode step breakdown: - (the backend reports no {BREAKDOWN_KEY})")
    for b, parts in breakdowns:
        text = ", ".join(f"{name} {us:.0f} us" for name, us in parts.items())
        lines.append(f"decode step breakdown at batch {b} (backend's report): {text}")
    stages = results.get("stages_b1_us")
    if stages:
        text = ", ".join(f"{name.removeprefix('layer_')} {us:.1f}" for name, us in stages.items())
        lines.append(f"hand-off stages at batch 1 (us; medians per layer, step_us per step): {text}")
    elif "stages_b1_us" in results and results["stages_b1_us"] is None:
        lines.append("hand-off stages: - (no CPU layers, or the backend records no trace)")
    lines.append("CPU wait: share of decode step time spent waiting for the CPU experts, as the backend reports "
                 "it ('-': not reported); GPU peak/resv: torch's max_memory_allocated and memory_reserved during the "
                 "batch's runs; other CPU: the busiest run's CPU share taken by other processes")
    return "\n".join(lines)
