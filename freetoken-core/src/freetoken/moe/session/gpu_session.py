"""A whole model on a GPU backend: the dense part on the device, each MoE layer's routed
experts either resident on the device or computed by the CPU workers in the same step.

:class:`GpuModelSession` is the :class:`~freetoken.backends.contract.ModelSession` of every
backend built from the contract's GPU capabilities (the native CUDA/ROCm backends, and any
plugin that provides GpuSync/Staging/KernelIO/GraphCapture). Its parts, in engine order:

* **plan** -- the memory plan of :mod:`freetoken.moe.session.gpu_memory_plan` (budget, dense form,
  KV cache, expert cache, buffers, which layers' experts fit on the device), made before any
  weight is read; a plan that does not fit fails there, naming the sizes and the flags.
* **routed_experts** -- device-resident layers keep their experts in the file's block
  formats where the packed kernels read them
  (:class:`~freetoken.moe.experts.gpu_packed_experts.PackedGpuExperts`), else dequantized once into
  the activation dtype (:class:`~freetoken.moe.experts.gpu_experts.GpuExperts`); no hand-off at all.
  CPU layers get a CPU expert bank over the checkpoint bytes and, at start, a
  :class:`~freetoken.moe.handoff.hybrid.HybridMoEExecutor` on the qualified IO path, with the expert
  cache, long-prompt streaming, locked fetch and statistics of
  :class:`~freetoken.moe.handoff.expert_traffic.ExpertTraffic` around it.
* **start** -- startup qualification of the hand-off (:func:`freetoken.moe.qualify.startup.qualify`)
  in the model's shapes and activation dtype, when any layer hands off; the CPU
  coordinator; decode graphs per batch-size bucket (:mod:`freetoken.moe.session.decode_graphs`).
* **forward** -- decode steps that fit a bucket replay a graph; others run eagerly.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import statistics
import time
from typing import Any, Optional

import torch

from freetoken.backends.contract import (Backend, BesideFn, CpuExperts, ExpertsFn, MoELayerSpec, ModelSession,
                                        ModelShape, OverlappedExpertsFn, on_gpu, plus_beside)
from freetoken.backends.handoff_io import IOPath
from freetoken.backends.options import EngineOptions
from freetoken.models.layers import DeviceWeightPolicy
from freetoken.moe.handoff.expert_traffic import ExpertTraffic
from freetoken.moe.session.gpu_memory_plan import GpuMemoryPlanner, MemoryPlan, gib, layer_ranges
from freetoken.moe.experts.gpu_packed_experts import DequantScratch, PackedGpuExperts
from freetoken.moe.session.host_threads import HostThreads

log = logging.getLogger(__name__)

#: How long the CPU expert workers spin after a hand-off on a GPU device (ms): longer than a
#: decode step's stretch of GPU layers (2.3 ms at 16 GiB on the H200, more on slower GPUs),
#: so the next step's first hand-off finds them awake instead of asleep.
GPU_SPIN_MS = 20.0

#: The shortest prompt the start-up warm-up prefills (:meth:`GpuModelSession.warmup_prompt_lengths`):
#: shorter steps take the decode kernels, which the decode graphs' capture builds.
WARMUP_MIN_PROMPT = 16


class GpuModelSession(ModelSession):
    def __init__(self, backend: Backend, options: EngineOptions, cpu_experts: CpuExperts) -> None:
        self.backend = backend
        self.options = options
        self.cpu = cpu_experts
        self.act_dtype = options.act_dtype or torch.bfloat16
        self.device = torch.device(backend.device())
        self.weight_policy: Any = DeviceWeightPolicy(self.device, self.act_dtype)
        self.planner: Optional[GpuMemoryPlanner] = None
        self.plan_result: Optional[MemoryPlan] = None
        self.shape: Optional[ModelShape] = None
        self.layer_fns: dict[int, ExpertsFn] = {}
        self.banks: dict[int, Any] = {}
        self.gpu_experts: dict[int, Any] = {}
        self.executors: dict[int, Any] = {}
        # where packed experts are dequantized only by a graph capture that meets a kernel
        # variant not compiled yet (PackedGpuExperts' capture fallback): shared by every layer
        self.dequant_scratch = DequantScratch()
        self.traffic: Optional[ExpertTraffic] = None
        self.experts_kernel: Any = None  # what --moe-gpu-kernel offers packed GPU experts (plan)
        self.cpu_weights: dict[int, Any] = {}  # the CPU layers' ExpertWeights
        self.coordinator: Any = None
        self.host_threads: Optional[HostThreads] = None
        self.cpu_spin_ms: Optional[float] = None
        self._host_threads_off = ""
        self.model: Any = None
        self.kv: Any = None
        self.runner: Any = None
        self.qualification: Any = None
        self.graphs = False
        self.reason = ""
        self.warnings: list[str] = []
        self.attention_impl = "torch"
        self._decode_samples: collections.deque[tuple[int, int]] = collections.deque(maxlen=1024)
        self._failures = 0  # the coordinator's failed hand-offs seen so far
        self._last: Optional[tuple[int, int, bool]] = None  # (time, coordinator busy, decode) of the last step

    # ---- plan -----------------------------------------------------------------------------
    def plan(self, shape: ModelShape) -> None:
        """The memory plan (:class:`~freetoken.moe.session.gpu_memory_plan.GpuMemoryPlanner`), and the
        expert traffic of the CPU layers it leaves."""
        o = self.options
        self.shape = shape
        planner = GpuMemoryPlanner(self.backend, o, self.device, self.act_dtype)
        self.planner = planner
        plan = self.plan_result = planner.plan(shape)
        self.weight_policy = planner.weight_policy
        self.experts_kernel = planner.experts_kernel
        t = planner.traffic_plan
        self.traffic = ExpertTraffic(dataclasses.replace(o.moe, locked_fetch=t.locked_fetch), self.device,
                                     self.act_dtype, shape.moe_layers, shape.top_k, max(o.max_running_requests, 1),
                                     plan.cache, planner.packed_capable, self.dequant_scratch,
                                     stream_planned=t.streams, locked_setting=t.locked_setting,
                                     native=self.experts_kernel)

    @property
    def dense_form(self) -> str:
        """``dequantized`` or ``packed`` (the file's block formats kept on the device)."""
        return self.plan_result.dense_form if self.plan_result else "dequantized"

    @property
    def packed_capable(self) -> bool:
        """Whether packed experts can stay packed on this device (known once planned)."""
        return self.planner.packed_capable if self.planner else False

    def kv_cache_budget(self) -> Optional[int]:
        return self.plan_result.kv_budget if self.plan_result else None

    def kv_cache_allocated(self, nbytes: int) -> None:
        """With the expert cache's size ``auto`` (``MemoryPlan.cache_auto``), what the KV cache
        leaves of its budget becomes the expert cache: memory a whole layer of experts did not
        fit, its routes to the cached experts run on the GPU. Less than one expert per CPU
        layer stays unused."""
        plan, shape = self.plan_result, self.shape
        if plan is None or shape is None or self.traffic is None or not plan.cache_auto or plan.kv_budget is None:
            return
        spare = (plan.kv_budget - nbytes) // (1 << 20) * (1 << 20)  # whole MiB
        least = plan.expert_layer_bytes // max(shape.num_experts, 1) * len(plan.cpu_layers)
        if spare < least:
            log.info("expert cache (auto): none, %s left beside the KV cache (one expert per CPU layer is %s)",
                     gib(max(spare, 0)), gib(least))
            return
        plan.cache, plan.kv_budget = spare, nbytes
        self.traffic.cache_bytes = spare
        log.info("expert cache (auto): %s, what the KV cache (%s) leaves of the plan's budget", gib(spare), gib(nbytes))

    def prefill_chunk(self, requested: Optional[int]) -> int:
        asked = requested or self.options.prompt_chunk(on_gpu(self.device))
        plan = self.plan_result
        return min(asked, plan.prefill_chunk) if plan is not None and plan.prefill_chunk else asked

    def warmup_prompt_lengths(self, chunk: int) -> list[int]:
        """On a GPU whose Triton kernels run: powers of two from :data:`WARMUP_MIN_PROMPT`
        tokens up to the chunk, and the chunk. The Triton prompt kernels are compiled at the
        first use of each variant (the grouped expert kernels' routes block follows the
        tokens of a step, 16 to 64 routes)."""
        from freetoken.backends import triton_target

        if not on_gpu(self.device) or not triton_target.for_device(self.device).usable:
            return []
        lengths = {chunk}
        n = WARMUP_MIN_PROMPT
        while n < chunk:
            lengths.add(n)
            n *= 2
        return sorted(lengths)

    def warmup_done(self) -> None:
        if self.traffic is not None:
            self.traffic.after_warmup()

    # ---- experts ------------------------------------------------------------------------
    def routed_experts(self, spec: MoELayerSpec) -> ExpertsFn:
        from freetoken.moe.experts.gpu_experts import GpuExperts

        layer = spec.layer
        plan = self.plan_result
        on_cpu = plan is None or layer in set(plan.cpu_layers)
        e = spec.experts
        if on_cpu:
            self.banks[layer] = self.cpu.bank(e, spec.activation)
            self.cpu_weights[layer] = e
            if self.traffic is not None:
                self.traffic.add_cpu_layer(layer, e, spec.activation)
        elif layer in plan.packed_layers:
            experts = PackedGpuExperts.from_expert_weights(e, self.device, activation=spec.activation,
                                                           scratch=self.dequant_scratch, native=self.experts_kernel)
            self.gpu_experts[layer] = experts
            self.layer_fns[layer] = experts.forward
        else:
            gate, up, down = (self._to_device(t) for t in (e.gate, e.up, e.down))
            experts = GpuExperts(gate, up, down, activation=spec.activation)
            self.gpu_experts[layer] = experts
            self.layer_fns[layer] = experts.forward
        fns, executors = self.layer_fns, self.executors

        def run(x: Any, ids: Any, w: Any, beside: Optional[BesideFn]) -> Any:
            # looked up at each call: a CPU layer's executor is installed at start
            ex = executors.get(layer)
            if beside is not None and ex is not None:
                return ex.forward(x, ids, w, beside=beside)  # beside the CPU's serve
            return plus_beside(fns[layer](x, ids, w), beside)

        if self.traffic is not None:
            return self.traffic.wrap(layer, run)
        return OverlappedExpertsFn(run)

    def _to_device(self, raw: Any) -> torch.Tensor:
        from freetoken.loading.dequant import to_device_float

        return to_device_float(raw, self.device, self.act_dtype)

    # ---- start ------------------------------------------------------------------------------
    def start(self, model: Any, kv: Any) -> None:
        from freetoken.moe.qualify.startup import GraphSettings, QualifyConfig, qualify

        self.model = model
        self.kv = kv
        o = self.options
        capture = self.backend.graph_capture()
        settings = GraphSettings(enabled=o.graphs and capture is not None)
        if not o.graphs:
            reasons = ["decode graphs off (--enforce-eager)"]
        elif capture is None:
            reasons = [f"backend {self.backend.name} cannot capture graphs: eager only"]
        else:
            reasons = []
        io_path = None
        sync_mode = None
        if self.traffic is not None:
            self.traffic.start(self.cpu, self.banks, self.backend.staging())
            self.warnings.extend(self.traffic.notes)
        if self.banks:
            s = self.shape
            assert s is not None
            config = QualifyConfig(hidden=self._expert_hidden(), intermediate=s.moe_intermediate,
                                   num_experts=min(s.num_experts, 16), top_k=min(s.top_k, s.num_experts),
                                   cpu_threads=2)
            self.qualification = qualify(self.backend, self.act_dtype, settings, config=config,
                                         cpu_experts=self.cpu)
            io_path = IOPath(self.qualification.io_path)
            sync_mode = self.qualification.sync_mode
            reasons.append(self.qualification.reason)
            self.warnings.extend(self.qualification.warnings)
            self._start_cpu_layers(io_path, sync_mode)
        else:
            reasons.append("every layer's experts are on the GPU: no hand-off")
        self.io_path = io_path.value if io_path else "none"
        self.sync_mode = sync_mode
        if settings.enabled:
            self._capture_graphs()
        self.graphs = self.runner is not None
        self.reason = "; ".join(r for r in reasons if r)

    def _start_cpu_layers(self, io_path: IOPath, sync_mode: Optional[str]) -> None:
        from freetoken.backends.handoff_io import SyncMode
        from freetoken.moe.handoff.hybrid import HybridMoEExecutor

        spin_ms = self.options.cpu_spin_ms
        if spin_ms is None and on_gpu(self.device):
            spin_ms = GPU_SPIN_MS
        self.coordinator = self.cpu.coordinator(self.options.cpu_threads,
                                                spin_us=None if spin_ms is None else spin_ms * 1e3)
        self.cpu_spin_ms = spin_ms
        self._pin_host_threads()
        # the cores belong to the expert workers: torch's own host work (sampling that
        # is not greedy, tokenisation) gets what they leave instead of competing with them
        workers, cores = int(self.coordinator.pool.num_threads), os.cpu_count() or 1
        free = cores - workers
        if 0 < free < torch.get_num_threads():
            log.info("torch host threads %d -> %d (the CPU expert workers take %d cores)",
                     torch.get_num_threads(), free, workers)
            torch.set_num_threads(free)
        mode = SyncMode(sync_mode) if sync_mode and io_path != IOPath.KERNEL_IO else None
        s = self.shape
        assert s is not None
        for layer, bank in self.banks.items():
            gpu_side, placement = self.traffic.gpu_side(layer) if self.traffic else (None, None)
            ex = HybridMoEExecutor(self.backend, layer, gpu_side, bank.address, s.top_k, io_path, self.act_dtype,
                                   placement=placement,
                                   coordinator=self.coordinator, sync_mode=mode, hidden=self._expert_hidden(layer))
            self.executors[layer] = ex
            self.layer_fns[layer] = ex.forward

    def _pin_host_threads(self) -> None:
        """This thread and the expert copy thread onto the CPUs the workers leave free (the
        thread that steps the model later is pinned at its first step)."""
        if self.options.pin_host_threads != "on":
            self._host_threads_off = "off (--pin-host-threads off)"
            return
        if not on_gpu(self.device):  # the fake GPU's "device" work runs on this thread itself
            self._host_threads_off = f"no GPU device ({self.device.type}): the host threads run the device's work"
            return
        self.host_threads = HostThreads(self.coordinator.free_cpus())
        self.host_threads.keep()
        copies = getattr(self.traffic, "copies", None)
        if copies is not None:
            self.host_threads.keep(copies.thread)
        log.info("host threads on CPUs %s: %s", sorted(self.host_threads.cpus),
                 self.host_threads.refusal or f"{self.host_threads.threads} pinned")

    def _expert_hidden(self, layer: Optional[int] = None) -> int:
        """The width of the activations the routed experts take (a family may widen the
        hidden size, e.g. with a column that carries the expert biases)."""
        weights = self.cpu_weights.get(layer) if layer is not None else next(iter(self.cpu_weights.values()), None)
        return int(weights.hidden) if weights is not None else int(self.shape.hidden)  # type: ignore[union-attr]

    def recapture_graphs(self) -> None:
        """Capture the decode graphs again (e.g. after a kernel's variant changed): the old
        graphs are dropped, the hand-off tasks and the scratch cache block they used are
        kept and reused. Call between steps, from the engine's thread."""
        old = self.runner
        if old is None:
            raise RuntimeError("this session replays no decode graphs (eager only): nothing to recapture")
        self.runner = None
        if on_gpu(self.device):  # a step launched ahead may still replay an old graph
            torch.cuda.synchronize(self.device)
        old.close()
        self._capture_graphs(scratch=old.scratch_block)

    def _capture_graphs(self, scratch: Optional[int] = None) -> None:
        from freetoken.moe.session.decode_graphs import DecodeGraphRunner, graph_buckets

        o = self.options
        # up to the running requests' count, that count included (a batch of it never pads)
        buckets = graph_buckets(min(o.graph_max_batch_size, max(o.max_running_requests, 1)), o.graph_batch_sizes)
        if not buckets:
            return
        self.attention_impl = _attention_impl(self.device, getattr(self.model.config, "head_dim", None))
        kv = self.kv
        max_len = min(o.max_model_len or kv.total_tokens, kv.total_tokens)
        max_blocks = (max_len + kv.block_size - 1) // kv.block_size
        if scratch is None:
            scratch = kv.allocate(1)[0]
        top_k = self.shape.top_k if self.shape else 1
        for ex in self.executors.values():
            ex.prepare(buckets)
            if ex.experts is not None:
                ex.experts.warmup(buckets, top_k, self.act_dtype)
        for experts in self.gpu_experts.values():
            experts.warmup(buckets, top_k, self.act_dtype)
        capture = self.backend.graph_capture()
        assert capture is not None
        runner = DecodeGraphRunner(self._eager, capture, buckets, self.device, kv.block_size, max_blocks, scratch,
                                   self.attention_impl)
        try:
            runner.capture_all()
        except Exception:
            runner.close()
            kv.free([scratch])
            raise
        finally:
            if self.traffic is not None:
                self.traffic.after_capture()
        self.runner = runner

    # ---- steps ----------------------------------------------------------------------------
    def _eager(self, input_ids: Any, positions: Any, meta: Any) -> Any:
        return self.model.forward(input_ids, positions, meta, self.kv.layers)

    def forward(self, input_ids: Any, positions: Any, meta: Any) -> Any:
        if self.host_threads is not None:
            self.host_threads.keep()  # the stepping thread (a dict lookup after its first step)
        busy = self._account(meta.decode)
        if self.traffic is not None:
            self.traffic.before_step(int(input_ids.shape[0]), bool(meta.decode), busy)
        runner = self.runner
        if runner is not None and meta.decode and len(meta.seqs) <= runner.max_batch:
            return runner.run(meta, input_ids)
        return self._eager(input_ids, positions, meta)

    def decode_ahead(self, input_ids: Any, positions: Any, meta: Any) -> Optional[Any]:
        """A decode step from device token ids: the graph runner stages the host inputs in
        its own page-locked buffers and copies the ids on the device; eager steps take the
        device tensors as they are (device work is queued, not waited for)."""
        if not meta.decode:
            return None
        return self.forward(input_ids, positions, meta)

    def _account(self, decode: bool) -> Optional[int]:
        """Raise the error of a failed hand-off (the coordinator counts them; the flags of
        the failed task say which layer). Time from each decode step's start to the next step's start and the CPU
        workers' busy time in it (the last 1024 decode steps), for the share of decode
        time spent on CPU experts."""
        if self.coordinator is None:
            return None
        now = time.perf_counter_ns()
        stats = self.coordinator.stats()
        busy = int(stats.get("busy_ns", 0))
        failures = int(stats.get("errors", 0)) + int(stats.get("watchdog_fired", 0))
        if failures != self._failures:  # a hand-off failed since the last step: raise its error
            self._failures = failures
            for ex in self.executors.values():
                ex.check_errors()
        last = self._last
        if last is not None and last[2]:
            self._decode_samples.append((now - last[0], busy - last[1]))
        self._last = (now, busy, decode)
        return busy

    # ---- diagnostics ----------------------------------------------------------------------
    def start_stage_trace(self) -> bool:
        if self.coordinator is None:
            return False
        self.coordinator.trace_start()
        return True

    def stage_split(self) -> Optional[dict[str, float]]:
        """The hand-off stages traced since :meth:`start_stage_trace`: ``layer_*`` for the
        batch-1 decode steps, ``prefill_*`` for the largest prefill chunk traced (its CPU
        experts per layer, ``prefill_serve``, against the GPU side between two layers,
        ``prefill_gpu_gap``; ``prefill_tokens`` is the chunk's size)."""
        from freetoken.moe.session.stage_trace import split_trace

        if self.coordinator is None:
            return None
        records = self.coordinator.trace()
        out: dict[str, float] = {}
        order = self._task_order(1)
        trace = [r for r in records if r.desc in order]
        first = [r.claim_ns for r in trace if order[r.desc] == 0]
        periods = [(b - a) / 1e3 for a, b in zip(first, first[1:])]
        if periods:
            out.update(split_trace(trace, order, statistics.median(periods), "layer"))
            out["step_us"] = statistics.median(periods)
            out["steps"] = float(len(first))
            out["cpu_layers"] = float(len(order))
        served = {r.desc for r in records}
        sizes = [t for ex in self.executors.values() for t, task in ex.tasks.items()
                 if t > 1 and task.desc_buffer.host_ptr in served]
        if sizes:
            chunk = max(sizes)
            order = self._task_order(chunk)
            trace = [r for r in records if r.desc in order]
            span = (trace[-1].done_ns - trace[0].claim_ns) / 1e3
            part = split_trace(trace, order, span, "prefill")
            out.update({k: v for k, v in part.items() if k in ("prefill_serve", "prefill_gpu_gap")})
            out["prefill_tokens"] = float(chunk)
        return out or None

    def _task_order(self, tokens: int) -> dict[int, int]:
        """Descriptor address -> position of its layer among the CPU layers, for the tasks
        of one batch size."""
        order: dict[int, int] = {}
        for rank, layer in enumerate(sorted(self.executors)):
            task = self.executors[layer].tasks.get(tokens)
            if task is not None:
                order[task.desc_buffer.host_ptr] = rank
        return order

    # ---- report ---------------------------------------------------------------------------
    def _gemv_report(self) -> dict[str, Any]:
        """``--gpu-gemv`` and what it came to: the kernel of one-token packed linears."""
        if self.dense_form not in ("packed", "both"):  # the dense part dequantized: no packed linear
            return {"setting": self.options.gpu_gemv, "kernel": None, "native_linears": 0}
        policy: Any = self.weight_policy  # a PackedWeightPolicy
        return {"setting": self.options.gpu_gemv, "kernel": policy.gemv.name if policy.gemv is not None else "triton",
                "native_linears": policy.native_linears}

    def _experts_kernel_report(self) -> dict[str, Any]:
        """``--moe-gpu-kernel`` and what it came to: the GPU layers whose decode routes run
        the backend's kernels, and why the others do not (one reason per distinct one)."""
        packed = [e for e in self.gpu_experts.values() if isinstance(e, PackedGpuExperts)]
        native = [e for e in packed if e.native is not None]
        why = sorted({e.native_refusal for e in packed if e.native is None})
        return {"setting": self.options.moe.gpu_kernel, "native_layers": len(native),
                "triton_layers": len(packed) - len(native), "triton_because": why}

    def report(self) -> dict[str, Any]:
        plan = self.plan_result
        out: dict[str, Any] = {
            "backend": self.backend.name,
            "io_path": getattr(self, "io_path", None),
            "sync_mode": getattr(self, "sync_mode", None),
            "graphs": self.graphs,
            "reason": self.reason,
            "warnings": list(self.warnings),
            "act_dtype": str(self.act_dtype).replace("torch.", ""),
            "moe_cpu_layers": layer_ranges(plan.cpu_layers) if plan else None,
            "moe_gpu_layers": len(plan.gpu_layers) if plan else None,
            "memory_plan": plan.as_dict() if plan else None,
            "weights": self.weight_policy.describe(),
            "dense_form": self.dense_form,
            "gpu_gemv": self._gemv_report(),
            "moe_gpu_kernel": self._experts_kernel_report(),
            "attention": self.attention_impl if self.runner is not None else "torch (eager)",
        }
        if self.runner is not None:
            out["graph_batch_sizes"] = list(self.runner.buckets)
            out["graph_capture_seconds"] = round(self.runner.capture_seconds, 2)
        if self.coordinator is not None:
            out["cpu_threads"] = self.coordinator.pool.num_threads
            out["cpu_spin_ms"] = self.cpu_spin_ms
            stats = self.coordinator.stats()
            out["coordinator"] = {k: int(stats.get(k, 0)) for k in ("served", "sleeps")}
            out["host_threads"] = ({"setting": "on", **self.host_threads.describe()} if self.host_threads is not None
                                   else {"setting": self.options.pin_host_threads, "because": self._host_threads_off})
            samples = list(self._decode_samples)
            if samples:
                # medians over the recent decode steps: a pause between two steps (an idle
                # server, a benchmark between runs) is one outlier, not a longer step
                step = statistics.median(s[0] for s in samples)
                busy = statistics.median(s[1] for s in samples)
                out["cpu_wait_share"] = busy / step if step else None
                out["step_breakdown"] = {"decode_step_us": step / 1e3, "cpu_experts_us": busy / 1e3}
        if self.traffic is not None:
            out.update(self.traffic.report())
        if on_gpu(self.device):
            out["gpu_memory"] = {"allocated": torch.cuda.memory_allocated(self.device),
                                 "max_allocated": torch.cuda.max_memory_allocated(self.device),
                                 "reserved": torch.cuda.memory_reserved(self.device)}
        return out

    def step_failed(self) -> None:
        """After a step that raised: wait for the work it launched (the CPU routes it handed
        off are served either way), close the hand-offs it left open, then give the device
        memory its allocations left cached back to the driver."""
        self.backend.synchronize()
        for ex in self.executors.values():
            ex.settle()
        if on_gpu(self.device):
            torch.cuda.empty_cache()

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        for ex in self.executors.values():
            ex.close()
        self.executors.clear()
        if self.coordinator is not None:
            self.coordinator.stop()
            self.coordinator = None
        if self.host_threads is not None:
            self.host_threads.release()
            self.host_threads = None
        if self.traffic is not None:
            self.traffic.close()


def _attention_impl(device: torch.device, head_dim: Optional[int] = None, v_head_dim: Optional[int] = None) -> str:
    """The capturable decode attention for ``device`` and the model's head sizes: Triton where
    it runs (:mod:`freetoken.backends.triton_target`) and takes the head sizes
    (:func:`freetoken.kernels.availability.head_dim_support`; a size it does not take is
    logged here, when the graphs are prepared), else the torch implementation."""
    from freetoken.backends import triton_target
    from freetoken.kernels.availability import head_dim_support

    if not triton_target.for_device(device).usable:
        return "torch"
    if head_dim is not None:
        support = head_dim_support(head_dim, v_head_dim)
        if not support.decode_attention:
            log.warning("decode attention in the decode graphs: torch, not the Triton kernel: %s",
                        support.decode_attention_why)  # fmt: skip
            return "torch"
    return "triton"
