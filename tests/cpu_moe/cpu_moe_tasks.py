"""Hand-off tasks for the tests, built by freetoken-core's own allocate_task on
plain (unpinned) host memory, and a Python "GPU" that drives the flag slot."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from freetoken import handoff
from freetoken.backends.handoff_io import HandoffTask, HostBuffer, Staging
from freetoken.backends.handoff_io import allocate_task


class HostStaging(Staging):
    """Staging on ordinary host memory (what the CPU backend needs; no GPU)."""

    def alloc_host(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        t = torch.empty(nbytes, dtype=torch.uint8)
        return HostBuffer(tensor=t, host_ptr=int(t.data_ptr()), device_ptr=0, nbytes=nbytes, mapped=False)

    def register_host(self, tensor: Any, mapped: bool = False, read_only: bool = False) -> Any:
        return None

    def fetch(self, stream: int, dst: Any, src: Any) -> None:  # pragma: no cover - no device here
        raise NotImplementedError


def new_task(bank: Any, max_tokens: int, top_k: int, act_dtype: Any, out_dtype: Any, layer: int = 0, slot: int = 0) -> HandoffTask:
    return allocate_task(
        HostStaging(), layer, slot, max_tokens, top_k, bank.hidden, act_dtype, out_dtype, bank_addr=bank.address, mapped=False
    )


def fill_inputs(task: HandoffTask, x: torch.Tensor, ids: np.ndarray, w: np.ndarray) -> None:
    """Write a batch into the task's buffers and set num_tokens (what the GPU publishes)."""
    T = x.shape[0]
    task.x[:T].copy_(x.to(task.x.dtype))
    task.ids[:T].copy_(torch.from_numpy(ids))
    task.w[:T].copy_(torch.from_numpy(w))
    task.desc.num_tokens = T


def gpu_handoff(task: HandoffTask, timeout_s: float = 10.0) -> None:
    """Play the GPU side of one hand-off: ready = 1, wait done == 1, done = 0.

    Inputs are written before ready (x86 keeps stores in order, as a GPU's
    system-scope fence does).
    """
    flags = task.flags
    assert flags.done == 0 and flags.ready == 0, "slot not idle before a hand-off"
    flags.ready = 1
    t0 = time.monotonic()
    while flags.done != 1:
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"no done within {timeout_s}s (ready={flags.ready}, seq={flags.seq})")
        time.sleep(0)
    flags.done = 0


def err_name(task: HandoffTask) -> str:
    return handoff.Err(task.flags.err).name
