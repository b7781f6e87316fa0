"""The numerical check behind startup qualification: one small hybrid layer, random
inputs and routes, eager steps or graph replays, compared with the oracle.

Oracle: the CPU routes through :meth:`CpuExperts.run` (synchronous CPU execution of the
same BF16 expert bank) plus the GPU routes through a float64 torch
loop (:func:`_oracle_gpu_routes`). Never the path itself.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

from freetoken.backends.contract import Backend, CpuExperts

from freetoken.backends.handoff_io import IOPath, SyncMode

#: Route patterns cycled over steps/replays: mixed splits, no CPU route (the empty-route
#: skip), every route on the CPU.
PATTERNS = ("mixed", "no_cpu", "mixed", "all_cpu", "mixed", "mixed", "no_cpu", "mixed")


class CheckFailure(AssertionError):
    """Results differ from the oracle; ``record`` describes the check."""

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


def _random_layer(num_experts: int, hidden: int, intermediate: int, generator: Any) -> tuple[Any, Any, Any]:
    """The check's random BF16 experts on the CPU: ``gate/up [E, I, H]``, ``down [E, H, I]``,
    scaled by 1/sqrt(fan-in) so activations stay O(1)."""
    import torch

    def mk(*shape: int, fan_in: int) -> Any:
        return (torch.randn(*shape, generator=generator) / math.sqrt(fan_in)).to(torch.bfloat16)

    return (
        mk(num_experts, intermediate, hidden, fan_in=hidden),
        mk(num_experts, intermediate, hidden, fan_in=hidden),
        mk(num_experts, hidden, intermediate, fan_in=intermediate),
    )


def _oracle_gpu_routes(x: Any, gpu_ids: Any, w: Any, gate: Any, up: Any, down: Any) -> Any:
    """The oracle of the GPU routes: ``sum_k w[t,k] * down_e(silu(gate_e x_t) * up_e x_t)``
    over routes with id >= 0, in float64 on the CPU, one route at a time; ``[T, H]``."""
    import torch
    import torch.nn.functional as F

    x64 = x.detach().cpu().double()
    g64, u64, d64 = (t.detach().cpu().double() for t in (gate, up, down))
    ids_c, w_c = gpu_ids.detach().cpu(), w.detach().cpu().double()
    y = torch.zeros(x64.shape[0], d64.shape[1], dtype=torch.float64)
    for t in range(x64.shape[0]):
        for k in range(ids_c.shape[1]):
            e = int(ids_c[t, k])
            if e < 0:
                continue
            h = F.silu(g64[e] @ x64[t]) * (u64[e] @ x64[t])
            y[t] += w_c[t, k] * (d64[e] @ h)
    return y


class QualLayer:
    """Weights, CPU bank, GPU experts and a running coordinator for the checks.
    ``copy_sync``: the GpuSync mode of the copy path (None: the backend's default)."""

    def __init__(
        self,
        backend: Backend,
        act_dtype: Any,
        config: Any,
        cpu_experts: CpuExperts,
        copy_sync: Optional[SyncMode] = None,
    ) -> None:
        import torch

        from freetoken.handoff import Fmt
        from freetoken.loading.tensors import RawTensor
        from freetoken.moe.experts.gpu_experts import GpuExperts
        from freetoken.models.moe_layer import ExpertWeights

        self.cpu = cpu_experts
        self.copy_sync = copy_sync
        self.backend = backend
        self.act_dtype = act_dtype
        self.config = config
        seed = config.seed if config.seed is not None else time.time_ns() % (2**31)
        self.gen = torch.Generator().manual_seed(seed)
        e, h, i = config.num_experts, config.hidden, config.intermediate
        self.gate, self.up, self.down = _random_layer(e, h, i, self.gen)
        raw = [RawTensor(name, tuple(t.shape), Fmt.BF16, t, "qualification")
               for name, t in (("gate", self.gate), ("up", self.up), ("down", self.down))]
        self.bank = cpu_experts.bank(ExpertWeights(*raw, e, h, i), "silu")
        dev = backend.device()
        self.experts = GpuExperts(self.gate.to(dev), self.up.to(dev), self.down.to(dev), "silu")  # the oracle's
        self.coordinator = cpu_experts.coordinator(config.cpu_threads, config.watchdog_ms)
        self.executors: dict[IOPath, Any] = {}

    def close(self) -> None:
        for ex in self.executors.values():
            ex.close()
        self.executors.clear()
        self.coordinator.stop()

    def executor(self, path: IOPath) -> Any:
        from freetoken.moe.handoff.hybrid import HybridMoEExecutor

        ex = self.executors.get(path)
        if ex is None:
            ex = HybridMoEExecutor(
                self.backend, 0, self.experts, self.bank.address, self.config.top_k, path, self.act_dtype,
                coordinator=self.coordinator, sync_mode=self.copy_sync if path == IOPath.COPY else None,
            )  # fmt: skip
            ex.prepare(self.config.batch_sizes)
            self.executors[path] = ex
        return ex

    def sync_mode(self, path: IOPath) -> Optional[str]:
        if path == IOPath.KERNEL_IO:
            return "kernel_io"
        ex = self.executor(path)
        return ex.sync.mode.value if ex.sync is not None else None

    def graph_capable(self, path: IOPath) -> bool:
        return self.backend.graph_capture() is not None and self.executor(path).graph_safe

    # ---- inputs and oracle ---------------------------------------------------------------
    def inputs(self, tokens: int, pattern: str) -> tuple[Any, Any, Any, Any]:
        import torch

        k, e = self.config.top_k, self.config.num_experts
        x = torch.randn(tokens, self.config.hidden, generator=self.gen).to(self.act_dtype)
        ids = torch.stack([torch.randperm(e, generator=self.gen)[:k] for _ in range(tokens)]).to(torch.int32)
        w = torch.rand(tokens, k, generator=self.gen) + 0.1
        if pattern == "no_cpu":
            mask = torch.zeros(tokens, k, dtype=torch.bool)
        elif pattern == "all_cpu":
            mask = torch.ones(tokens, k, dtype=torch.bool)
        else:
            mask = torch.rand(tokens, k, generator=self.gen) < 0.5
            mask[0, 0], mask[-1, -1] = True, False  # at least one route on each side
        return x, ids, w, mask

    def oracle(self, x: Any, ids: Any, w: Any, mask: Any) -> Any:
        import torch

        from freetoken.moe.placement import split_routes

        gpu_ids, cpu_ids = split_routes(ids, mask)
        ref = _oracle_gpu_routes(x, gpu_ids, w, self.gate, self.up, self.down)
        if bool(mask.any()):
            y_cpu = self.cpu.run(self.bank, x, cpu_ids, w, torch.float32)
            ref = ref + torch.as_tensor(y_cpu).double()
        return ref

    def _compare(self, out: Any, ref: Any) -> float:
        import torch

        got = out.detach().cpu().double()
        if not torch.isfinite(got).all():
            return float("inf")
        return float((got - ref).norm() / ref.norm().clamp_min(1e-12))

    # ---- the checks ------------------------------------------------------------------
    def check(self, path: IOPath, graph: bool) -> dict[str, Any]:
        """Run the path; return a record, or raise CheckFailure (wrong) / anything (API error)."""
        ex = self.executor(path)
        record: dict[str, Any] = {"path": path.value, "mode": "graph" if graph else "eager", "steps": 0}
        errors = []
        problems = []
        for tokens in self.config.batch_sizes:
            if graph:
                errs, problem = self._graph_run(ex, tokens)
            else:
                errs, problem = self._eager_run(ex, tokens)
            errors += errs
            if problem:
                problems.append(problem)
        record["steps"] = len(errors)
        record["max_rel_error"] = max(errors) if errors else None
        worst = [f"{e:.3g}" for e in errors if not e <= self.config.tolerance]
        record["ok"] = not worst and not problems
        if not record["ok"]:
            why = "; ".join(problems + ([f"relative errors {worst} > {self.config.tolerance}"] if worst else []))
            record["why"] = why
            raise CheckFailure(why, record)
        return record

    def _eager_run(self, ex: Any, tokens: int) -> tuple[list[float], Optional[str]]:
        dev = self.backend.device()
        errs = []
        for step in range(self.config.eager_steps):
            x, ids, w, mask = self.inputs(tokens, PATTERNS[step % len(PATTERNS)])
            out = ex.forward(x.to(dev), ids.to(dev), w.to(dev), mask.to(dev))
            self.backend.synchronize()
            ex.check_errors()
            errs.append(self._compare(out, self.oracle(x, ids, w, mask)))
        return errs, None

    def _graph_run(self, ex: Any, tokens: int) -> tuple[list[float], Optional[str]]:
        import torch

        dev = self.backend.device()
        x, ids, w, mask = self.inputs(tokens, "mixed")
        sx, sids, sw, smask = x.to(dev), ids.to(dev), w.to(dev), mask.to(dev)
        sout = torch.empty(tokens, self.config.hidden, dtype=self.act_dtype, device=dev)
        # warm up eagerly on the static buffers (allocations happen outside capture)
        sout.copy_(ex.forward(sx, sids, sw, smask))
        self.backend.synchronize()
        ex.check_errors()
        task = ex.tasks[tokens]
        before = (task.flags.ready, task.flags.done)
        graph = self.backend.graph_capture().capture(lambda: sout.copy_(ex.forward(sx, sids, sw, smask)))
        self.backend.synchronize()
        problem = None
        if (task.flags.ready, task.flags.done) != before:
            problem = f"flag slot changed during capture ({before} -> {(task.flags.ready, task.flags.done)})"
        errs = []
        for r in range(self.config.replays):
            x, ids, w, mask = self.inputs(tokens, PATTERNS[r % len(PATTERNS)])
            sx.copy_(x.to(dev)), sids.copy_(ids.to(dev)), sw.copy_(w.to(dev)), smask.copy_(mask.to(dev))
            sout.fill_(float("nan"))
            graph.replay()
            self.backend.synchronize()
            ex.check_errors()
            errs.append(self._compare(sout, self.oracle(x, ids, w, mask)))
        return errs, problem
