"""``freetoken bench moe-layer``: latency of hybrid MoE layers and of their hand-off.

Workload (defaults): FP8 (E4M3, 128x128 block scales) expert weights, BF16 activations,
H=2048, I=768, E=8, K=4, three layers chained, batch 1, four CPU workers, one CPU
route per token (the last of the top-k), the other routes on the GPU (BF16 experts
dequantized from the same FP8 weights), hybrid accumulation. For every IO path
(KernelIO, copy + memop, host callbacks) eager and graph replay (host callbacks:
eager only), plus the CPU expert compute alone (``run_task`` on the same task, from
Python) and the GPU experts alone, so the hand-off overhead is visible:

    overhead per layer = layer latency - max(CPU expert compute, GPU experts)

The GPU experts alone are timed for both implementations (``torch``, ``triton``, graph
replay and eager) next to their HBM floor (bytes of the distinct routed experts' weights /
``--hbm-tbps``); the layers use ``--gpu-impl`` (auto: Triton where it runs). Diagnostic
rows split the hand-off: ``empty_*`` puts every route on the GPU (the CPU task is empty:
KernelIO completes it on the GPU without waking the CPU; copy + memop still round-trips
through the coordinator), so its overhead is the GPU-side cost of the hand-off; ``floor_*``
puts every route on the CPU with tiny experts. ``triton_*`` rows time alternative block
configurations of the Triton kernels (tuning data).

Stage rows (``--stages``, graph replay, with a CPU route): the coordinator traces one
block of hand-offs, which gives the CPU task as served (claim -> done), the hand-off
overhead against it measured in the same block (``overhead_vs_serve``: free of the
drift between interleaved blocks), and the time from one layer's ``done`` to the next
layer's claim split into its parts with the KernelIO kernels' GPU clock stamps (see
``_stage_split``); ``cpu_task_native_loop`` / ``cpu_task_host_driven_handoff`` run the
CPU tasks from a native loop and through the coordinator driven by a host thread, so
the coordinator's own cost shows without a GPU.

Each configuration is timed with device events over ``--iters`` steps, ``--repeats``
times (median); the parent runs ``--processes`` worker processes and reports medians
across them. Results go to stdout and, with ``--json``, to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser("moe-layer", help="hybrid MoE layer latency and hand-off overhead (GPU)")
    p.add_argument("--backend", default=None, help="backend name (default: automatic selection)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cpu-threads", type=int, default=4)
    p.add_argument("--cpu-routes-per-token", type=int, default=1)
    p.add_argument("--paths", default="kernel_io,copy,host_callback")
    p.add_argument(
        "--floor-intermediate", type=int, default=128,
        help="also time a hand-off floor: every route on the CPU with this tiny I (0: skip)",
    )  # fmt: skip
    p.add_argument("--gpu-impl", default="auto", choices=("auto", "triton", "torch"), help="GPU experts in the layers")
    p.add_argument(
        "--empty-cpu", type=int, default=1,
        help="also time the layers with every route on the GPU (empty CPU task: the GPU-side hand-off cost; 0: skip)",
    )  # fmt: skip
    p.add_argument("--triton-sweep", type=int, default=1, help="time alternative Triton block configurations (0: skip)")
    p.add_argument("--stages", type=int, default=1, help="split the graph hand-offs into stages (0: skip)")
    p.add_argument("--hbm-tbps", type=float, default=4.3, help="HBM bandwidth for the GPU experts' floor (TB/s)")
    p.add_argument("--iters", type=int, default=200, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=7, help="timed blocks per configuration (median)")
    p.add_argument("--processes", type=int, default=3, help="worker processes (median across them)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        result = worker(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    runs = []
    for i in range(args.processes):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            path = tmp.name
        cmd = [sys.executable, "-m", "freetoken.cli.main", "bench", "moe-layer", "--worker", "--json", path]
        for key in WORKER_ARGS:
            value = getattr(args, key)
            if value is not None:
                cmd += [f"--{key.replace('_', '-')}", str(value)]
        print(f"process {i + 1}/{args.processes}: {' '.join(cmd[2:])}", file=sys.stderr)
        subprocess.run(cmd, check=True)
        with open(path) as f:
            runs.append(json.load(f))
        os.unlink(path)
        if args.json:  # after every process, so a run cut short still leaves its results
            with open(args.json, "w") as f:
                json.dump({"summary": summarize(runs), "runs": runs}, f, indent=1)
    summary = summarize(runs)
    print_table(summary)
    return 0


WORKER_ARGS = (
    "backend", "hidden", "intermediate", "experts", "top_k", "layers", "batch", "cpu_threads", "cpu_routes_per_token",
    "paths", "iters", "repeats", "floor_intermediate", "gpu_impl", "empty_cpu", "triton_sweep", "hbm_tbps", "stages",
)  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(field: str) -> dict[str, float]:
        keys = runs[0][field].keys()
        return {k: statistics.median(r[field][k] for r in runs if k in r[field]) for k in keys}

    return {
        "config": runs[0]["config"],
        "device": runs[0]["device"],
        "processes": len(runs),
        "gpu_impl": [r.get("gpu_impl") for r in runs],
        "triton_errors": [r["triton_error"] for r in runs if r.get("triton_error")],
        "per_layer_us": med("per_layer_us"),
        "cpu_alone_interleaved_us": med("cpu_alone_interleaved_us"),
        "overhead_per_layer_us": med("overhead_per_layer_us"),
        "hbm_floor_us": med("hbm_floor_us"),
        "stages_us": med("stages_us"),
        "per_process_overhead_us": [r["overhead_per_layer_us"] for r in runs],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def print_table(summary: dict[str, Any]) -> None:
    print(f"\nhybrid MoE layer, {summary['device']}, medians across {summary['processes']} processes")
    print(f"config: {summary['config']}")
    print(f"GPU experts in the layers: {summary['gpu_impl']}")
    for err in summary["triton_errors"]:
        print(f"Triton error: {err}")
    width = max([24] + [len(k) + 2 for k in summary["per_layer_us"]] + [len(k) + 14 for k in summary["hbm_floor_us"]])
    print(f"{'configuration':<{width}}{'us/layer':>10}{'cpu alone':>11}{'overhead':>10}")
    for k, v in summary["per_layer_us"].items():
        cpu = summary["cpu_alone_interleaved_us"].get(k)
        ov = summary["overhead_per_layer_us"].get(k)
        print(f"{k:<{width}}{v:>10.1f}{'' if cpu is None else f'{cpu:>11.1f}'}{'' if ov is None else f'{ov:>10.1f}'}")
    for k, v in summary["hbm_floor_us"].items():
        print(f"{k + ' (HBM floor)':<{width}}{v:>10.1f}")
    if summary["stages_us"]:
        print("\nhand-off stages (us; medians of per-hand-off values, see the module doc)")
        for k, v in summary["stages_us"].items():
            print(f"  {k:<{width}}{v:>10.1f}")


# --------------------------------------------------------------------------------------
# one worker process
# --------------------------------------------------------------------------------------


def fp8_experts(num_experts: int, rows: int, cols: int, gen: Any) -> tuple[Any, Any, Any]:
    """Random FP8 E4M3 weights with float32 128x128 block scales, and their BF16 dequantization."""
    import torch

    w = torch.randn(num_experts, rows, cols, generator=gen) / cols**0.5
    rb, cb = -(-rows // 128), -(-cols // 128)
    pad = torch.zeros(num_experts, rb * 128, cb * 128)
    pad[:, :rows, :cols] = w
    blocks = pad.view(num_experts, rb, 128, cb, 128)
    scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-8) / 448.0  # [E, rb, cb]
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, :, None, :, None]).view(num_experts, rb * 128, cb * 128)[:, :rows, :cols]
    q = q.view(num_experts, rb * 128, cb * 128)[:, :rows, :cols].contiguous()
    return q.view(torch.uint8), scale.contiguous(), deq.to(torch.bfloat16)


#: Untimed steps queued ahead of each timed block: the block before may have been host
#: work long enough for the coordinator and the pool to go to sleep (after 2 ms idle), and
#: the first hand-off would then pay their wake-up (up to ~1 ms) inside the timed block.
WARMUP_STEPS = 3


def _device_block(fn: Any, iters: int) -> float:
    import torch

    # a blocking end event: the timing thread sleeps instead of spinning next to the CPU workers
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=True)
    for _ in range(WARMUP_STEPS):
        fn()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def _host_block(fn: Any, iters: int) -> float:
    for _ in range(WARMUP_STEPS):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def _time_interleaved(dev_fn: Any, host_fn: Any, iters: int, repeats: int) -> tuple[float, float]:
    """Medians (us per call) of device-timed blocks of ``dev_fn`` and host-timed blocks of
    ``host_fn``, alternating block by block so drift (clocks, neighbours) hits both alike."""
    import torch

    for _ in range(max(10, iters // 10)):
        dev_fn()
        host_fn()
    torch.cuda.synchronize()
    dev, host = [], []
    for _ in range(repeats):
        dev.append(_device_block(dev_fn, iters))
        host.append(_host_block(host_fn, iters))
    return statistics.median(dev), statistics.median(host)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import freetoken_cpu_moe as cm
    from freetoken.backends.registry import get_backend

    backend = get_backend(args.backend)
    impls, triton_error = _gpu_impls(backend.device())
    layer_impl = args.gpu_impl if args.gpu_impl != "auto" else impls[-1]
    if layer_impl not in impls:
        raise SystemExit(f"--gpu-impl {layer_impl}: not usable here ({triton_error})")
    bench = _Bench(args, backend, cm, impls, layer_impl)
    pool = cm.Pool(args.cpu_threads)
    coordinator = cm.Coordinator(pool=pool, watchdog_ms=5000.0).start()
    all_paths = [p for p in args.paths.split(",") if p]
    try:
        bench.measure(pool, coordinator, args.intermediate, args.cpu_routes_per_token, "", all_paths, sweep=True)
        if args.empty_cpu and args.cpu_routes_per_token:
            # every route on the GPU, the CPU task empty: the GPU-side part of the hand-off
            graph_paths = [p for p in all_paths if p != "host_callback"]
            bench.measure(pool, coordinator, args.intermediate, 0, "empty_", graph_paths)
        if args.floor_intermediate:
            # the hand-off floor: every route on the CPU, tiny experts, no GPU experts at all
            bench.measure(pool, coordinator, args.floor_intermediate, args.top_k, "floor_", all_paths)
    finally:
        coordinator.stop()
    props = torch.cuda.get_device_properties(backend.device())
    return {
        "config": {k: getattr(args, k) for k in ("hidden", "intermediate", "experts", "top_k", "layers", "batch",
                                                  "cpu_threads", "cpu_routes_per_token", "iters", "repeats",
                                                  "floor_intermediate", "hbm_tbps")},  # fmt: skip
        "device": f"{props.name}, torch {torch.__version__}, {os.cpu_count()} CPUs",
        "gpu_impl": bench.layer_impl,
        "triton_error": triton_error or bench.triton_error,
        "per_layer_us": bench.results,
        "cpu_alone_interleaved_us": bench.cpu_alone,
        "overhead_per_layer_us": bench.overhead,
        "hbm_floor_us": bench.floors,
        "stages_us": bench.stages,
    }


def _stage_split(coordinator: Any, replay: Any, tasks: list[Any], iters: int, key: str) -> dict[str, float]:
    """Trace one block of graph replays on the coordinator and split a layer's time.

    ``traced_latency``: us per layer of the traced block; ``serve``: the coordinator's
    claim -> done (the CPU task with the pool's wake-up); ``overhead_vs_serve``: their
    difference, the hand-off overhead measured against the CPU work of the same block;
    ``gpu_gap``: done of layer l -> claim of layer l+1 within a step (done reaching the
    GPU, combine, the next layer's publish and ``ready`` reaching the CPU: the GPU side
    of one hand-off); ``step_gap``: the same across a step boundary (graph launch).
    With the KernelIO kernels' clock stamps the gap splits further, exactly (the offset
    between the GPU and host clocks cancels in the sum): ``combine_read`` = GPU saw done
    -> y read and added; ``kernel_boundary`` = -> next layer's publish kernel entry
    (combine's closing fence, kernel end, launch); ``publish_body`` = -> its stamp before the fence (route split,
    x/ids/w stores); ``signal_latency`` = the rest (the publish fence and ready reaching
    the CPU, plus done reaching the GPU).
    """
    import torch

    torch.cuda.synchronize()
    coordinator.trace_start()
    step_us = _device_block(replay, iters)
    order = {t.desc_buffer.host_ptr: l for l, t in enumerate(tasks)}
    # the block's untimed warm-up steps come first in the trace
    from freetoken.moe.session.stage_trace import split_trace

    return split_trace(coordinator.trace()[WARMUP_STEPS * len(tasks) :], order, step_us, key)


def _host_driven(pool: Any, coordinator: Any, tasks: list[Any], iters: int, prefix: str) -> dict[str, float]:
    """The same CPU tasks run from a native loop (no Python) and handed off through the
    coordinator by a native host thread standing in for the GPU: their difference is the
    coordinator's own cost (seeing ready, waking the pool, releasing done)."""
    from freetoken_cpu_moe.timing import drive_handoffs, time_run_task

    direct = time_run_task(tasks, iters, pool=pool)
    for task in tasks:
        coordinator.add_task(task)
    try:
        driven = drive_handoffs(tasks, iters)
    finally:
        for task in tasks:
            coordinator.remove_task(task)
    return {
        f"{prefix}cpu_task_native_loop": statistics.median(direct) / 1e3,
        f"{prefix}cpu_task_host_driven_handoff": statistics.median(driven) / 1e3,
    }


def _gpu_impls(device: Any) -> tuple[list[str], str]:
    """The GPU expert implementations that run here (torch always; triton last when its
    kernels compile and run on a small smoke input) and why Triton is missing, if it is."""
    import torch

    from freetoken.kernels import availability
    from freetoken.moe.experts.gpu_experts import GpuExperts

    impl, why = availability.default_impl(device)
    if impl != "triton":
        return ["torch"], why
    try:
        gate, up = (torch.randn(4, 128, 256, device=device).to(torch.bfloat16) / 16 for _ in range(2))
        down = torch.randn(4, 256, 128, device=device).to(torch.bfloat16) / 11
        experts = GpuExperts(gate, up, down, impl="triton")
        ids = torch.tensor([[0, 3], [-1, 3]], dtype=torch.int32, device=device)
        experts.forward(torch.randn(2, 256, device=device).to(torch.bfloat16), ids, torch.rand(2, 2, device=device))
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported in the results
        return ["torch"], f"Triton smoke run failed: {type(exc).__name__}: {exc}"
    return ["torch", "triton"], ""


def _triton_sweep() -> dict[str, Any]:
    from freetoken.kernels.moe_experts import BlockConfig

    return {
        "i32_n64": BlockConfig(block_i=32, block_n=64),
        "i16_h256_n16_r256": BlockConfig(block_i=16, block_h=256, block_n=16, block_r=256),
        "i64_h64_n64_r64": BlockConfig(block_i=64, block_h=64, block_n=64, block_r=64),
        "i16_n32_w2_s4": BlockConfig(num_warps=2, num_stages=4),
    }


class _Bench:
    """One worker's measurements, accumulated over the configurations it runs."""

    def __init__(self, args: argparse.Namespace, backend: Any, cm: Any, impls: list[str], layer_impl: str) -> None:
        self.args, self.backend, self.cm = args, backend, cm
        self.impls, self.layer_impl = impls, layer_impl
        self.triton_error = ""
        self.results: dict[str, float] = {}
        self.cpu_alone: dict[str, float] = {}
        self.overhead: dict[str, float] = {}
        self.floors: dict[str, float] = {}
        self.stages: dict[str, float] = {}

    def _layers(self, intermediate: int, gen: Any) -> list[dict[str, Any]]:
        import torch

        from freetoken.moe.experts.gpu_experts import GpuExperts

        args, cm, dev = self.args, self.cm, self.backend.device()
        E, H, I, K, T = args.experts, args.hidden, intermediate, args.top_k, args.batch
        layers = []
        for _ in range(args.layers):
            (gq, gs, gd), (uq, us, ud), (dq, ds, dd) = (
                fp8_experts(E, I, H, gen), fp8_experts(E, I, H, gen), fp8_experts(E, H, I, gen)
            )  # fmt: skip
            bank = cm.ExpertBank(
                cm.Weights(gq, "fp8_e4m3_b128", E, I, H, scale=gs),
                cm.Weights(uq, "fp8_e4m3_b128", E, I, H, scale=us),
                cm.Weights(dq, "fp8_e4m3_b128", E, H, I, scale=ds),
            )
            experts = GpuExperts(gd.to(dev), ud.to(dev), dd.to(dev), impl=self.layer_impl)
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32).to(dev)
            w = torch.softmax(torch.randn(T, K, generator=gen), dim=-1).to(dev)
            layers.append({"bank": bank, "experts": experts, "ids": ids, "w": w, "keep": (gq, gs, uq, us, dq, ds)})
        return layers

    def measure(
        self, pool: Any, coordinator: Any, intermediate: int, cpu_routes: int, prefix: str, path_names: list[str],
        sweep: bool = False,
    ) -> None:  # fmt: skip
        import torch

        from freetoken.backends.handoff_io import IOPath
        from freetoken.moe.handoff.hybrid import HybridMoEExecutor
        from freetoken.moe.placement import Placement, split_routes

        args, backend, cm = self.args, self.backend, self.cm
        dev = backend.device()
        E, H, K, T = args.experts, args.hidden, args.top_k, args.batch
        gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
        layers = self._layers(intermediate, gen)
        placement = Placement.all_gpu(E, dev)
        placement.cpu_routes_per_token = cpu_routes
        x0 = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
        if cpu_routes < K:
            for layer in layers:  # compile the Triton variants eagerly, before any capture
                layer["experts"].warmup([T], K, torch.bfloat16)

        def make_step(exs: list[Any]) -> Any:
            def step() -> Any:  # the layers alone: their output stays in the graph's pool
                h = x0
                for ex, layer in zip(exs, layers):
                    h = ex.forward(h, layer["ids"], layer["w"])
                return h

            return step

        paths = [IOPath(name) for name in path_names]
        executors: dict[str, list[Any]] = {}
        for path in paths:
            exs = [
                HybridMoEExecutor(backend, l, layer["experts"], layer["bank"].address, K, path, torch.bfloat16,
                                  placement=placement, coordinator=coordinator)  # fmt: skip
                for l, layer in enumerate(layers)
            ]
            for ex in exs:
                ex.prepare([T])
            executors[path.value] = exs
        # the CPU expert compute alone: the same work run_task'd synchronously from Python on the
        # same pool (its own tasks, same inputs), timed block by block next to each configuration
        cpu_tasks = []
        for l, layer in enumerate(layers):
            task = backend.staging().new_task(
                l, 999, T, K, H, torch.bfloat16, torch.float32, layer["bank"].address, mapped=False
            )  # fmt: skip
            task.x.copy_(x0.cpu())
            mask = placement.cpu_mask(layer["ids"]).cpu()
            task.ids.copy_(torch.where(mask, layer["ids"].cpu(), torch.full_like(layer["ids"].cpu(), -1)))
            task.w.copy_(layer["w"].cpu())
            cpu_tasks.append(task)

        def cpu_only() -> None:
            for task in cpu_tasks:
                cm.run_task(task.desc_buffer.host_ptr, pool=pool)

        results: dict[str, float] = {}
        cpu_alone: dict[str, float] = {}
        graphs: dict[str, Any] = {}
        for path in paths:
            exs = executors[path.value]
            step = make_step(exs)
            key = f"{prefix}{path.value}_eager"
            results[key], cpu_alone[key] = _time_interleaved(step, cpu_only, args.iters, args.repeats)
            for ex in exs:
                ex.check_errors()
            if all(ex.graph_safe for ex in exs):
                graph = graphs[path.value] = backend.graph_capture().capture(step)
                key = f"{prefix}{path.value}_graph"
                results[key], cpu_alone[key] = _time_interleaved(graph.replay, cpu_only, args.iters, args.repeats)
                for ex in exs:
                    ex.check_errors()
        results = {k: v / args.layers for k, v in results.items()}
        cpu_alone = {k: v / args.layers for k, v in cpu_alone.items()}
        if args.stages and cpu_routes:
            for name, graph in graphs.items():
                tasks = [ex.task_for(T) for ex in executors[name]]
                self.stages.update(_stage_split(coordinator, graph.replay, tasks, args.iters, f"{prefix}{name}_graph"))
            self.stages.update(_host_driven(pool, coordinator, cpu_tasks, args.iters, prefix))
        for exs in executors.values():
            for ex in exs:
                ex.close()

        gpu_alone = 0.0
        if cpu_routes < K:  # the GPU experts alone (the routes the GPU serves), each implementation
            gpu_parts = [split_routes(layer["ids"], placement.cpu_mask(layer["ids"]))[0] for layer in layers]
            distinct = statistics.mean(int(torch.unique(g[g >= 0]).numel()) for g in gpu_parts)
            weight_bytes = distinct * 3 * H * intermediate * 2  # bf16 gate, up, down of each distinct expert
            self.floors[f"{prefix}gpu_experts"] = weight_bytes / (args.hbm_tbps * 1e12) * 1e6
            configs: dict[str, Any] = {impl: (impl, None) for impl in self.impls}
            if sweep and args.triton_sweep and "triton" in self.impls:
                configs.update({f"triton_{name}": ("triton", cfg) for name, cfg in _triton_sweep().items()})
            for name, (impl, cfg) in configs.items():
                try:
                    graph_us, eager_us = self._gpu_alone(layers, gpu_parts, x0, impl, cfg)
                except Exception as exc:  # noqa: BLE001 - a failing configuration is reported, not fatal
                    self.triton_error = self.triton_error or f"{name}: {type(exc).__name__}: {exc}"
                    print(f"GPU experts {name} failed: {exc}", file=sys.stderr)
                    continue
                results[f"{prefix}gpu_experts_alone_{name}_graph"] = graph_us
                results[f"{prefix}gpu_experts_alone_{name}_eager"] = eager_us
                if name == self.layer_impl:
                    gpu_alone = graph_us
            results[f"{prefix}gpu_experts_alone"] = gpu_alone
        results[f"{prefix}cpu_compute_alone"] = statistics.median(cpu_alone.values())
        self.results.update(results)
        self.cpu_alone.update(cpu_alone)
        self.overhead.update({k: results[k] - max(cpu_alone[k], gpu_alone) for k in cpu_alone})

    def _gpu_alone(
        self, layers: list[dict[str, Any]], gpu_parts: list[Any], x0: Any, impl: str, cfg: Any
    ) -> tuple[float, float]:
        """(graph replay, eager) us per layer of the GPU experts alone with this implementation."""
        import torch

        from freetoken.moe.experts.gpu_experts import GpuExperts

        args = self.args
        exps = [GpuExperts(l["experts"].gate, l["experts"].up, l["experts"].down, impl=impl, block_config=cfg)
                for l in layers]  # fmt: skip

        def gpu_only() -> None:
            h = x0
            for ex, layer, gids in zip(exps, layers, gpu_parts):
                h = ex.forward(h, gids, layer["w"])

        gpu_only()  # compiles the Triton variant before the capture
        torch.cuda.synchronize()
        graph = self.backend.graph_capture().capture(gpu_only)
        if any(ex.capture_fallbacks for ex in exps):
            raise RuntimeError("the captured graph fell back to torch")
        graph_us = _time_interleaved(graph.replay, lambda: None, args.iters, args.repeats)[0] / args.layers
        eager_us = _time_interleaved(gpu_only, lambda: None, args.iters, args.repeats)[0] / args.layers
        return graph_us, eager_us
