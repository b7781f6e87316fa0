"""The CPU half of MoE layers for every backend (:class:`freetoken.backends.contract.CpuExperts`):
expert banks over the checkpoint's bytes, the synchronous kernels, and hand-off coordinators."""

from __future__ import annotations

from typing import Any, Optional

from freetoken.backends.contract import CpuExperts
from freetoken_cpu_moe.coordinator import DEFAULT_SPIN_US, Coordinator
from freetoken_cpu_moe.dense import weights_of
from freetoken_cpu_moe.ops import moe_forward
from freetoken_cpu_moe.pool import Pool, coordinator_threads, default_pool
from freetoken_cpu_moe.weights import ExpertBank


class HostExperts(CpuExperts):
    """Banks and coordinators on one worker pool (``pool``; default: the process-wide pool)."""

    def __init__(self, pool: Optional[Pool] = None) -> None:
        self.pool = pool or default_pool()

    def bank(self, experts: Any, activation: str, huge_pages: bool = False) -> ExpertBank:
        """The layer's bank over the experts' bytes; ``huge_pages``: weights that sit in a
        file mapping are copied into huge pages first (:func:`freetoken_cpu_moe.dense.huge_page_copy`)."""
        e = experts
        gate = weights_of(e.gate, e.num_experts, e.intermediate, e.hidden, huge_pages)
        up = weights_of(e.up, e.num_experts, e.intermediate, e.hidden, huge_pages)
        down = weights_of(e.down, e.num_experts, e.hidden, e.intermediate, huge_pages)
        return ExpertBank(gate, up, down, activation=activation)

    def run(self, bank: Any, x: Any, ids: Any, weights: Any, out_dtype: Any = None) -> Any:
        return moe_forward(bank, x.contiguous(), ids.contiguous(), weights.contiguous(), out_dtype or x.dtype,
                           self.pool)

    def coordinator(self, threads: Optional[int] = None, watchdog_ms: float = 2000.0,
                    spin_us: Optional[float] = None) -> Coordinator:
        """A started hand-off coordinator on ``threads`` workers (default:
        :func:`~freetoken_cpu_moe.pool.coordinator_threads`, all physical cores but one).
        ``spin_us``: how long its poll thread and workers spin after a hand-off before they
        sleep (default :data:`~freetoken_cpu_moe.coordinator.DEFAULT_SPIN_US`); a pool of its
        own takes it, the shared pool (``threads`` equal to its size) keeps its own."""
        threads = coordinator_threads() if threads is None else threads
        spin = DEFAULT_SPIN_US if spin_us is None else float(spin_us)
        pool = self.pool if threads == self.pool.num_threads else Pool(threads, spin_us=spin)
        return Coordinator(pool=pool, watchdog_ms=watchdog_ms, spin_us=spin).start()
