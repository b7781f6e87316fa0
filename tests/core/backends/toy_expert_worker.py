"""A CPU worker that serves hand-off tasks with a toy expert, for contract tests.

The "expert" e scales a token by (e + 1): y[t] = sum over CPU routes k of
w[t, k] * (ids[t, k] + 1) * x[t]. It follows the flag protocol exactly (acquire
``ready``, clear it, compute, write y, set ``done``, count ``seq``), so a GpuSync
under test is checked against a real second thread, not against itself.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch


def reference_output(x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The toy experts in float64 numpy, from the test's own copies of the inputs."""
    scale = np.where(ids >= 0, w.astype(np.float64) * (ids.astype(np.float64) + 1.0), 0.0).sum(axis=1)
    return x.astype(np.float64) * scale[:, None]


def random_inputs(tokens: int, hidden: int, top_k: int, experts: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = rng.integers(0, experts, size=(tokens, top_k)).astype(np.int32)
    ids[rng.random((tokens, top_k)) < 0.3] = -1  # some routes stay on the GPU
    w = rng.random((tokens, top_k)).astype(np.float32)
    return x, ids, w


def serve_once(task, delay_s: float = 0.0) -> None:
    """The CPU side of one hand-off on ``task`` (called once ready == 1)."""
    flags = task.flags
    flags.ready = 0
    x = task.x.to(torch.float64)
    ids = task.ids.to(torch.int64)
    w = task.w.to(torch.float64)
    scale = torch.where(ids >= 0, w * (ids + 1).to(torch.float64), torch.zeros_like(w)).sum(dim=1)
    if delay_s:
        time.sleep(delay_s)  # a slow CPU: the GPU side must still wait for done
    task.y.copy_((x * scale[:, None]).to(task.y.dtype))
    flags.seq += 1
    flags.done = 1


class Worker:
    """Serves ``count`` hand-offs on ``task`` from a thread, like the CPU coordinator."""

    def __init__(self, task, count: int = 1, delay_s: float = 0.0, timeout_s: float = 20.0) -> None:
        self.task, self.count, self.delay_s, self.timeout_s = task, count, delay_s, timeout_s
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            flags = self.task.flags
            for _ in range(self.count):
                deadline = time.monotonic() + self.timeout_s
                while not flags.ready:
                    if time.monotonic() > deadline:
                        raise TimeoutError("ready never raised")
                    time.sleep(0)
                serve_once(self.task, self.delay_s)
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> "Worker":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(self.timeout_s + 5)
        if self.error is not None:
            raise self.error
