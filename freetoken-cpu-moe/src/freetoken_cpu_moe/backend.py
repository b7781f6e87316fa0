"""The ``cpu`` backend: the contract on a machine without a GPU (entry point ``cpu`` of
``freetoken.backends``, registered by freetoken-cpu-moe).

The model runs on the host: dense projections in their checkpoint format through the
CPU kernels (:mod:`freetoken_cpu_moe.dense`), routed experts synchronously on the worker
pool (:class:`CpuModelSession`).

There is no stream to order against, so the hand-off is synchronous: the "stream"
is the calling thread. :class:`SynchronousSync` raises ``ready`` and (when it was
given one) runs the CPU side of the task right there; ``wait`` blocks the caller
until ``done`` is set, with a watchdog bound, and raises on an error. Host memory
is ordinary (page-aligned, optionally ``mlock``-ed) memory; there is no mapped
memory, no KernelIO and no graph capture.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from typing import Any, Callable, Optional

from freetoken import handoff
from freetoken.backends.contract import Backend, Capabilities, ExpertsFn, ModelSession, MoELayerSpec, ProbeResult
from freetoken.backends.handoff_io import GpuSync, HandoffError, HandoffTask, HostBuffer, IOPath, Staging, SyncMode
from freetoken.backends.options import EngineOptions
from freetoken.backends.hookspecs import hookimpl
from freetoken.backends.selection import BUILTIN_PRIORITY

log = logging.getLogger(__name__)

#: Alignment of every host buffer (two cache lines; flag slots get their own line).
HOST_ALIGNMENT = 128

#: How long :meth:`SynchronousSync.wait` waits for ``done`` before it gives up.
DEFAULT_WAIT_TIMEOUT_S = 30.0


def _aligned_bytes(nbytes: int, alignment: int = HOST_ALIGNMENT) -> Any:
    """A zeroed uint8 CPU tensor of ``nbytes`` whose data starts on ``alignment``."""
    import torch

    raw = torch.zeros(nbytes + alignment, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % alignment
    return raw[skip : skip + nbytes]


class SynchronousSync(GpuSync):
    """Hand-off on the calling thread.

    ``publish`` sets ``ready = 1`` and, if this object has a ``serve`` callable
    (the CPU side, e.g. freetoken-cpu-moe's coordinator serving one task), calls it
    inline; ``serve`` follows the protocol (clears ``ready``, writes ``y``,
    release-stores ``done = 1``). Without one, another thread serves the task.
    ``wait`` returns once ``done == 1`` and resets it.

    Ordering: everything the caller wrote before ``publish`` is visible to the
    server (same thread, or the server's acquire of ``ready``); everything the
    server wrote before ``done`` is visible after ``wait`` returns.
    """

    mode = SyncMode.SYNCHRONOUS
    graph_safe = False

    def __init__(
        self, serve: Optional[Callable[[HandoffTask], None]] = None, timeout_s: float = DEFAULT_WAIT_TIMEOUT_S
    ) -> None:
        self.serve = serve
        self.timeout_s = timeout_s

    def publish(self, stream: int, task: HandoffTask) -> None:
        flags = task.flags
        if flags.ready or flags.done:
            raise HandoffError(
                f"layer {task.layer} slot {task.slot}: publish while the previous hand-off is unfinished "
                f"(ready={flags.ready} done={flags.done}); every publish needs its wait"
            )
        flags.ready = 1
        if self.serve is not None:
            self.serve(task)

    def wait(self, stream: int, task: HandoffTask) -> None:
        flags = task.flags
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while not flags.done:
            spins += 1
            if spins > 1000:
                if time.monotonic() > deadline:
                    raise HandoffError(
                        f"layer {task.layer} slot {task.slot}: CPU side did not finish within "
                        f"{self.timeout_s:g} s (ready={flags.ready}); is a CPU worker serving this task?"
                    )
                time.sleep(0)
        flags.done = 0
        task.check_error()


class _MlockHandle:
    """A host range locked with ``mlock`` for as long as this handle lives."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.address = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.element_size()
        self.locked = False
        self.reason = ""
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._libc = libc
        if libc.mlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes)) == 0:
            self.locked = True
        else:
            errno = ctypes.get_errno()
            self.reason = f"mlock failed: errno {errno} (raise RLIMIT_MEMLOCK, e.g. `ulimit -l unlimited`)"
            log.warning("could not lock %d bytes of host expert memory: %s", self.nbytes, self.reason)

    def close(self) -> None:
        if self.locked:
            self._libc.munlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes))
            self.locked = False

    def __del__(self) -> None:
        self.close()


class CpuStaging(Staging):
    """Plain host memory: nothing is mapped into a device, fetches are copies."""

    def alloc_host(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        if nbytes < 1:
            raise ValueError(f"alloc_host needs a positive size, got {nbytes}")
        tensor = _aligned_bytes(nbytes)
        # No device: `mapped` cannot be honoured; the buffer says so (mapped=False, device_ptr=0).
        return HostBuffer(tensor=tensor, host_ptr=tensor.data_ptr(), device_ptr=0, nbytes=nbytes, mapped=False)

    def register_host(self, tensor: Any, mapped: bool = False, read_only: bool = False) -> _MlockHandle:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("register_host needs a contiguous CPU tensor")
        return _MlockHandle(tensor)

    def fetch(self, stream: int, dst: Any, src: Any) -> None:
        dst.copy_(src)


#: torch threads for prompt steps (default 1: the pool owns the cores; see CpuModelSession)
TORCH_THREADS_ENV = "FREETOKEN_CPU_TORCH_THREADS"

#: ``1`` (default): routed experts and packed dense projections that sit in a file mapping are
#: copied into huge pages at load while that leaves 4 GiB of RAM available
#: (``freetoken_cpu_moe.dense.huge_page_copy``); ``0``: read in place
HUGE_PAGES_ENV = "FREETOKEN_CPU_HUGE_PAGES"


def env_switch(name: str, default: bool, on: str, off: str) -> bool:
    """The 0/1 environment variable ``name`` (``default`` when unset); anything else is an
    error naming what 1 (``on``) and 0 (``off``) mean."""
    import os

    value = os.environ.get(name, "1" if default else "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 1 ({on}) or 0 ({off})")
    return value == "1"


def prefill_torch_threads() -> int:
    """torch threads for prompt steps: ``$FREETOKEN_CPU_TORCH_THREADS``, else 1."""
    import os

    env = os.environ.get(TORCH_THREADS_ENV, "").strip()
    if not env:
        return 1
    try:
        n = int(env)
    except ValueError:
        raise ValueError(f"{TORCH_THREADS_ENV}={env!r}: expected a positive number of threads") from None
    if n < 1:
        raise ValueError(f"{TORCH_THREADS_ENV}={env!r}: expected a positive number of threads")
    return n


class CpuModelSession(ModelSession):
    """A model on the host: packed dense weights, synchronous CPU experts.

    One owner per core at a time (docs/cpu-moe.md, "Threading"): every projection, the
    router and the experts run on the worker pool, called from this thread (the pool's
    worker 0), and torch runs the rest between those calls on this same thread. torch
    gets more threads only for prompt steps and only when ``FREETOKEN_CPU_TORCH_THREADS``
    asks for them (attention over long prompts); the pool's workers then sleep as soon
    as a call is done (``spin_us = 0``) instead of spinning on the cores torch's threads
    work on. Measured on the 2-core VM (256-token prompt, 8 layers): torch's small ops
    (RMSNorm) took 12-17x longer with 2 torch threads than with one, next to the pool.

    The two fast paths are always on where the model allows them; the class attributes below
    let a test (``monkeypatch.setattr(CpuModelSession, ...)``) take the reference path instead.
    """

    #: decode steps of a model :class:`freetoken_cpu_moe.decode_step.NativeDecode` takes run as
    #: one native call (False: the model's per-op forward)
    native_decode_step: bool = True
    #: plain greedy requests take their tokens from the output head's pool call
    #: (:class:`freetoken_cpu_moe.greedy_head.GreedyHead`; False: from the logits)
    greedy_head_picks: bool = True

    def __init__(self, options: EngineOptions) -> None:
        import torch

        from freetoken.models.dense_ops import use_dense_ops
        from freetoken_cpu_moe.attention import ATTENTION_ENV, CpuAttention
        from freetoken_cpu_moe.decode_ops import CpuDenseOps
        from freetoken_cpu_moe.dense import CpuWeightPolicy
        from freetoken_cpu_moe.host_experts import HostExperts
        from freetoken_cpu_moe.pool import Pool, default_pool

        self.options = options
        pool = default_pool()
        self._own_pool = None
        if options.cpu_threads is not None and options.cpu_threads != pool.num_threads:
            pool = self._own_pool = Pool(options.cpu_threads)
        self.pool = pool
        self._huge_pages = env_switch(HUGE_PAGES_ENV, True, "weights in huge pages", "in place")
        self.weight_policy = CpuWeightPolicy(options.act_dtype or torch.float32, pool, huge_pages=self._huge_pages)
        self.host = HostExperts(pool)
        self.model: Any = None
        self.kv_caches: list[Any] = []
        self._torch_threads_before = torch.get_num_threads()
        self._prefill_threads = prefill_torch_threads()
        self._threads = self._torch_threads_before
        self._decode_spin_us = pool.spin_us
        # attention over the paged cache and the per-token ops between the matmuls: native
        # calls (freetoken_cpu_moe.attention, freetoken_cpu_moe.decode_ops)
        self.attention = CpuAttention(pool)
        self.ops = CpuDenseOps(pool)
        #: the one-call decode step (set by start() when the model allows it), else None
        self.native_decode: Any = None
        #: the greedy picks in the output head's pool call (set by start()), else None
        self.greedy_head: Any = None
        self._ops_before = use_dense_ops("cpu", self.ops)
        self._ops_installed = True
        log.info("cpu backend: %d pool threads, attention %s (%s), dense ops %s", pool.num_threads,
                 self.attention.mode, ATTENTION_ENV, self.ops.name)

    def routed_experts(self, spec: MoELayerSpec) -> ExpertsFn:
        import torch

        from freetoken_cpu_moe import _core
        from freetoken_cpu_moe.dense import ACT_FMT

        bank = self.host.bank(spec.experts, spec.activation, huge_pages=self._huge_pages)
        run = self.host.run
        address, pool = bank.address, self.pool._core

        def experts(x: Any, ids: Any, w: Any) -> Any:
            # IOPath.SYNCHRONOUS: the activations are host memory already. The router's own
            # outputs (int32 ids, float32 weights, contiguous) go straight to the kernel.
            fmt = ACT_FMT.get(x.dtype)
            if (fmt is None or x.dim() != 2 or not x.is_contiguous() or ids.dtype != torch.int32
                    or w.dtype != torch.float32 or not ids.is_contiguous() or not w.is_contiguous()
                    or ids.shape != w.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]):
                return run(bank, x, ids, w)
            y = torch.empty_like(x)
            _core.moe_forward(address, x.data_ptr(), fmt, ids.data_ptr(), w.data_ptr(), y.data_ptr(), fmt,
                              x.shape[0], ids.shape[1], False, pool, "")
            return y

        experts.bank = bank  # type: ignore[attr-defined]  # keeps the bank alive with the function
        return experts

    def kv_cache_budget(self) -> Optional[int]:
        from freetoken.loading.memory import available_ram

        avail = available_ram()
        return None if avail is None else int(avail * 0.5)

    def start(self, model: Any, kv: Any) -> None:
        from freetoken_cpu_moe.decode_step import NativeDecode
        from freetoken_cpu_moe.greedy_head import GreedyHead

        self.model = model
        self.kv_caches = kv.layers
        self.native_decode = None
        if self.native_decode_step:
            self.native_decode, why = NativeDecode.build(model, kv.layers, self.ops, self.attention.mode, self.pool)
        else:
            why = "CpuModelSession.native_decode_step is off"
        log.info("cpu backend: decode steps %s (%s)", "native" if self.native_decode is not None else "per op", why)
        self.greedy_head, why = None, "CpuModelSession.greedy_head_picks is off"
        if self.greedy_head_picks:
            self.greedy_head, why = GreedyHead.build(model, self.pool)
        log.info("cpu backend: greedy tokens %s (%s)", "in the head" if self.greedy_head is not None else "from the logits",
                 why)

    def greedy_tokens(self, hidden: Any) -> Optional[list[int]]:
        return None if self.greedy_head is None else self.greedy_head(hidden)

    def forward(self, input_ids: Any, positions: Any, meta: Any) -> Any:
        import torch

        want = 1 if meta.decode else self._prefill_threads
        if want != self._threads:
            torch.set_num_threads(want)
            self._threads = want
            self.pool.spin_us = self._decode_spin_us if want == 1 else 0.0
        return self._step(input_ids, positions, meta)

    def _step(self, input_ids: Any, positions: Any, meta: Any) -> Any:
        if meta.decode and self.native_decode is not None:
            out = self.native_decode(input_ids, positions, meta)
            if out is not None:
                return out
        meta.kernel = self.attention.for_step(meta, int(input_ids.shape[0]))
        return self.model.forward(input_ids, positions, meta, self.kv_caches)

    def report(self) -> dict[str, Any]:
        return {
            "backend": "cpu",
            "io_path": IOPath.SYNCHRONOUS.value,
            "sync_mode": SyncMode.SYNCHRONOUS.value,
            "graphs": False,
            "reason": "CPU backend: routed experts run synchronously on the CPU workers",
            "cpu_threads": self.pool.num_threads,
            "moe_cpu_layers": "all",
            "weights": self.weight_policy.describe(),
        }

    def close(self) -> None:
        if self._ops_installed:
            from freetoken.models.dense_ops import use_dense_ops

            use_dense_ops("cpu", self._ops_before)
            self._ops_installed = False
        self.pool.spin_us = self._decode_spin_us
        if self._threads != self._torch_threads_before:
            import torch

            torch.set_num_threads(self._torch_threads_before)
            self._threads = self._torch_threads_before
        if self._own_pool is not None:
            self._own_pool.close()
            self._own_pool = None


class CpuBackend(Backend):
    """Runs everything on the host; the hybrid MoE layer calls the CPU kernels directly."""

    name = "cpu"
    priority = BUILTIN_PRIORITY
    hardware = "cpu"
    hands_off = False  # the MoE layers call the CPU kernels in place
    default_dtype = "float32"

    @classmethod
    def probe(cls) -> ProbeResult:
        import os

        return ProbeResult(available=True, reason="the CPU is always there", device_name="cpu",
                           details={"cores": os.cpu_count()})

    def capabilities(self) -> Capabilities:
        return Capabilities(
            stream_memops=False,
            mapped_memory=False,
            graph_capture=False,
            memops_in_graphs=False,
            kernel_io=False,
            host_callbacks=False,
            flag_wait_kernel=False,
            extra={"sync_modes": [SyncMode.SYNCHRONOUS.value], "flag_slot_bytes": ctypes.sizeof(handoff.FlagSlot)},
        )

    def device(self) -> Any:
        import torch

        return torch.device("cpu")

    def gpu_sync(self, mode: Optional[SyncMode] = None) -> GpuSync:
        if mode not in (None, SyncMode.SYNCHRONOUS):
            raise ValueError(f"the cpu backend supports only {SyncMode.SYNCHRONOUS.value!r} hand-off, not {mode}")
        return SynchronousSync()

    def staging(self) -> Staging:
        return CpuStaging()

    def out_of_memory(self, exc: BaseException) -> bool:
        """torch's host allocator reports a failed allocation as a plain RuntimeError."""
        return super().out_of_memory(exc) or (
            isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc))

    def open_model(self, options: EngineOptions) -> ModelSession:
        if options.moe_cpu_layers is not None:
            from freetoken.moe.placement import parse_layer_spec

            kind, _ = parse_layer_spec(options.moe_cpu_layers)
            if kind != "all":
                log.info("cpu backend: every layer's experts run on the CPU (--moe-cpu-layers %s has no effect)",
                         options.moe_cpu_layers)
        return CpuModelSession(options)


@hookimpl
def freetoken_backend() -> type[Backend]:
    return CpuBackend
