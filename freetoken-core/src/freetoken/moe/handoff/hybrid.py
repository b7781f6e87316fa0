"""The layer-level hybrid MoE executor: GPU experts and CPU experts in one step.

One :class:`HybridMoEExecutor` per MoE layer. ``forward(x, ids, w)`` splits the routes
(placement), hands the CPU routes to the CPU workers through the chosen IO path while
the GPU experts run, and adds the CPU result into the GPU result::

    KERNEL_IO      publish kernel (x, cpu ids, w -> mapped memory, ready)  | CPU workers
                   GPU experts                                             |  compute y,
                   combine kernel (wait done, done = 0, out += y)          |  done = 1
    COPY           D2H copies + GpuSync.publish; GPU experts; GpuSync.wait + H2D + add
    HOST_CALLBACK  the copy path with host-callback sync (eager only)
    SYNCHRONOUS    the copy path with the CPU backend's synchronous GpuSync

Every enqueued operation is stream-ordered with no host synchronisation, so a forward
can be captured into a graph and replayed; each batch size has its own task (buffers,
flag slot, descriptor) that lives as long as the executor. Tasks for the batch sizes a
graph will use must exist before capture (:meth:`prepare`): allocation is not capturable.
Batches above :data:`EXACT_TASK_TOKENS` tokens (prompt chunks, whose sizes vary with every
prompt) share a task per power of two, so the tasks of a long-running server stay few.

A step that raises between a hand-off's publish and its wait leaves the hand-off open:
the CPU serves it and raises ``done`` with nobody to take it down, and the next wait on
that task would pass at once, before the CPU's new result. :meth:`settle` closes such
hand-offs after the device work of the failed step is complete.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from freetoken.backends.contract import Backend, BesideFn, plus_beside
from freetoken.backends.handoff_io import HandoffTask, IOPath, SyncMode
from freetoken.moe.handoff import faults
from freetoken.moe.experts.routed import GpuRoutedExperts
from freetoken.moe.placement import Placement, split_routes

log = logging.getLogger(__name__)

#: batches up to this many tokens get a task of their own size (decode batches); larger
#: ones the task of the next power of two
EXACT_TASK_TOKENS = 64

#: how long :meth:`HybridMoEExecutor.settle` waits for the CPU to finish an open hand-off
SETTLE_TIMEOUT_S = 10.0


class HybridMoEExecutor:
    def __init__(
        self,
        backend: Backend,
        layer: int,
        gpu_experts: Optional[GpuRoutedExperts],
        cpu_bank_address: int,
        top_k: int,
        io_path: IOPath,
        act_dtype: Any,
        placement: Optional[Placement] = None,
        coordinator: Any = None,
        sync_mode: Optional[SyncMode] = None,
        y_dtype: Any = None,
        hidden: Optional[int] = None,
    ) -> None:
        import torch

        if gpu_experts is None and hidden is None:
            raise ValueError("a layer without GPU experts needs its hidden size")

        self.backend = backend
        self.layer = layer
        self.experts = gpu_experts
        self.bank_address = cpu_bank_address
        self.top_k = top_k
        self.hidden = gpu_experts.hidden if gpu_experts is not None else int(hidden)  # type: ignore[arg-type]
        self.io_path = IOPath(io_path)
        self.act_dtype = act_dtype
        self.y_dtype = torch.float32 if y_dtype is None else y_dtype
        if gpu_experts is None:  # every route of this layer runs on the CPU
            placement = Placement(torch.zeros(1, dtype=torch.bool), cpu_routes_per_token=top_k)
        self.placement = placement
        self.coordinator = coordinator
        self.staging = backend.staging()
        self.tasks: dict[int, HandoffTask] = {}
        self.scratch: dict[int, Any] = {}
        self._open: set[int] = set()  # tasks (by key) published and not yet waited for
        self.kio = None
        self.sync = None
        if self.io_path == IOPath.KERNEL_IO:
            if act_dtype != torch.bfloat16:
                raise ValueError(f"KernelIO carries bfloat16 activations only, not {act_dtype}; use IOPath.COPY")
            self.kio = backend.kernel_io()
            if self.kio is None:
                raise ValueError(f"backend {backend.name} has no KernelIO")
        elif self.io_path == IOPath.HOST_CALLBACK:
            self.sync = backend.gpu_sync(SyncMode.HOST_CALLBACK)
        else:
            self.sync = backend.gpu_sync(sync_mode)

    @property
    def graph_safe(self) -> bool:
        return self.sync is None or self.sync.graph_safe

    # ---- tasks ---------------------------------------------------------------------
    def prepare(self, batch_sizes: Any) -> None:
        """Create the tasks (and device scratch) of these batch sizes ahead of capture, each
        of its exact size (a captured step cannot tell a larger task its live batch)."""
        for t in batch_sizes:
            if int(t) not in self.tasks:
                self._new_task(int(t))

    @staticmethod
    def task_key(tokens: int) -> int:
        """The task (its ``max_tokens``) a batch of ``tokens`` uses unless one of its exact
        size was prepared: its own size up to :data:`EXACT_TASK_TOKENS`, else the next
        power of two."""
        return tokens if tokens <= EXACT_TASK_TOKENS else 1 << (tokens - 1).bit_length()

    def task_for(self, tokens: int) -> HandoffTask:
        task = self.tasks.get(tokens)
        if task is not None:
            return task
        key = self.task_key(tokens)
        task = self.tasks.get(key)
        if task is not None:
            return task
        return self._new_task(key)

    def _new_task(self, tokens: int) -> HandoffTask:
        if self.backend.stream_capturing(self.backend.current_stream()):
            raise RuntimeError(
                f"layer {self.layer}: no hand-off task for batch size {tokens} and the stream is capturing; "
                "call prepare() with every captured batch size before capture"
            )
        import torch

        task = self.staging.new_task(
            self.layer, tokens, tokens, self.top_k, self.hidden, self.act_dtype, self.y_dtype, self.bank_address,
            mapped=True,
        )  # fmt: skip
        self.tasks[tokens] = task
        self.scratch[tokens] = torch.empty(tokens, self.hidden, dtype=self.y_dtype, device=self.backend.device())
        if self.coordinator is not None:
            self.coordinator.add_task(task.desc_buffer.host_ptr)
        return task

    def settle(self) -> None:
        """Close the hand-offs a failed step left open (call once the device work it
        launched is complete): wait for the CPU's ``done`` on each, then take it down as the
        wait would have. A hand-off whose CPU side does not finish in
        :data:`SETTLE_TIMEOUT_S` raises (the session cannot go on safely)."""
        import time

        for key in sorted(self._open):
            flags = self.tasks[key].flags
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while not flags.done:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"layer {self.layer}: the CPU did not finish an open hand-off of {key} tokens "
                                       f"in {SETTLE_TIMEOUT_S:.0f} s (ready={flags.ready}, err={flags.err})")
                time.sleep(1e-4)
            flags.done = 0
            flags.err = 0
            log.info("layer %d: closed the open hand-off of a failed step (%d tokens)", self.layer, key)
        self._open.clear()

    def check_errors(self) -> None:
        """Raise if the CPU side reported an error on any task (call after a sync)."""
        for task in self.tasks.values():
            task.check_error()

    def close(self) -> None:
        if self.coordinator is not None:
            for task in self.tasks.values():
                try:
                    self.coordinator.remove_task(task.desc_buffer.host_ptr)
                except Exception as exc:  # noqa: BLE001
                    log.warning("layer %d: removing task from the coordinator failed: %s", self.layer, exc)
        self.tasks.clear()
        self.scratch.clear()

    # ---- one step --------------------------------------------------------------------
    def forward(self, x: Any, ids: Any, w: Any, cpu_mask: Optional[Any] = None,
                beside: Optional[BesideFn] = None) -> Any:  # fmt: skip
        """``x [T, H]``, ``ids [T, K]`` expert ids, ``w [T, K]`` routing weights; ``cpu_mask``
        (bool ``[T, K]``) overrides the placement; ``beside`` (the layer's work that does not
        depend on its routed experts, e.g. a shared expert) runs on the GPU after the hand-off,
        while the CPU serves, and its result is added. Returns ``[T, H]`` in ``x.dtype``."""
        import torch

        tokens = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.hidden or ids.shape != (tokens, self.top_k) or w.shape != ids.shape:
            raise ValueError(
                f"layer {self.layer}: x {tuple(x.shape)}, ids {tuple(ids.shape)}, w {tuple(w.shape)} do not match "
                f"hidden={self.hidden}, top_k={self.top_k}"
            )
        if cpu_mask is None and self.placement is None:
            raise ValueError("no placement configured: pass cpu_mask")
        task = self.task_for(tokens)
        if cpu_mask is None and self.placement is not None and self.placement.explicit_mask:
            cpu_mask = self.placement.cpu_mask(ids)
        w32 = w.to(torch.float32).contiguous()
        stream = self.backend.current_stream()
        if self.kio is not None and self.kio.publishes_routes:
            # the split happens inside the publish kernel: nothing between the router and the hand-off
            split = self._kernel_split(cpu_mask)
            self.kio.publish_routes(stream, task, x.contiguous(), ids.contiguous(), w32, **split)
            self._open.add(task.max_tokens)
            all_cpu = self._all_cpu(cpu_mask)
            if all_cpu:  # the beside work alone (a new tensor), or nothing
                out = torch.zeros_like(x) if beside is None else beside().contiguous()
            elif self._own_split(cpu_mask):
                out = self.experts.forward_routes(x, ids, w).contiguous()
            else:
                if cpu_mask is None:
                    cpu_mask = self.placement.cpu_mask(ids)
                out = self.experts.forward(x, split_routes(ids, cpu_mask)[0], w).contiguous()
            if beside is not None and not all_cpu:
                out.add_(beside())
            self.kio.combine(stream, task, out)
            self._open.discard(task.max_tokens)
            return out
        own = self._own_split(cpu_mask)
        if cpu_mask is None:
            cpu_mask = self.placement.cpu_mask(ids)
        gpu_ids, cpu_ids = split_routes(ids, cpu_mask)

        def gpu_side() -> Any:
            if self.experts is None:
                return torch.zeros_like(x) if beside is None else beside()
            y = self.experts.forward_routes(x, ids, w) if own else self.experts.forward(x, gpu_ids, w)
            return plus_beside(y, beside)

        if self.kio is not None:
            self.kio.publish(stream, task, x.contiguous(), cpu_ids.contiguous(), w32)
            self._open.add(task.max_tokens)
            out = gpu_side().contiguous()
            self.kio.combine(stream, task, out)
            self._open.discard(task.max_tokens)
            return out
        self._publish_copies(stream, task, x, cpu_ids, w32)
        self._open.add(task.max_tokens)
        out = gpu_side()
        self.sync.wait(stream, task)
        self._open.discard(task.max_tokens)
        y = self.scratch[task.max_tokens][:tokens]
        y.copy_(task.y[:tokens], non_blocking=True)
        out.add_(y)
        return out

    def _own_split(self, cpu_mask: Optional[Any]) -> bool:
        """The GPU experts take the whole routing and skip what they do not hold (an expert
        cache's layer), and the split follows the same residency; or they split it themselves
        (``splits_routes``: locked fetch by position): no split kernels for the GPU side."""
        if self.experts is not None and self.experts.splits_routes:
            return True
        return (cpu_mask is None and self.experts is not None and self.experts.takes_whole_routing
                and self.placement is not None and self.placement.cpu_routes_per_token is None
                and not self.placement.explicit_mask)

    def _all_cpu(self, cpu_mask: Optional[Any]) -> bool:
        """Statically known that no route runs on the GPU (placement puts all top-k on the CPU)."""
        return cpu_mask is None and self.placement.cpu_routes_per_token == self.top_k

    def _kernel_split(self, cpu_mask: Optional[Any]) -> dict[str, Any]:
        if cpu_mask is not None:
            return {"cpu_mask": cpu_mask.contiguous()}
        if self.placement.cpu_routes_per_token is not None:
            return {"cpu_last_n": self.placement.cpu_routes_per_token}
        return {"resident": self.placement.resident}

    def _publish_copies(self, stream: int, task: HandoffTask, x: Any, cpu_ids: Any, w32: Any) -> None:
        capturing = self.backend.stream_capturing(stream)
        kind = faults.fault_for(self.io_path.value, capturing)
        if kind == "error":
            raise faults.InjectedFault(f"injected {self.io_path.value} publish error")
        tokens = x.shape[0]
        if not capturing:
            task.desc.num_tokens = tokens
        if kind == "nofence":
            self.sync.publish(stream, task)
        if kind != "stale":
            task.x[:tokens].copy_(x, non_blocking=True)
        task.ids[:tokens].copy_(cpu_ids, non_blocking=True)
        task.w[:tokens].copy_(w32, non_blocking=True)
        if kind != "nofence":
            self.sync.publish(stream, task)
