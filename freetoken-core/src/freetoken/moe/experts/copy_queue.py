"""Host-to-device copies of expert bytes off the engine's thread and stream.

:class:`CopyQueue` owns a side stream and one background thread. :meth:`CopyQueue.submit`
hands it a job -- pairs of (device destination, host source) or a callable that writes the
destinations -- ordered after an event of the compute stream (so a destination is not
overwritten while an earlier kernel still reads it). The thread enqueues the copies on
the side stream and records an end event; the engine's thread never blocks on a copy
from pageable memory (which the driver performs synchronously), and with page-locked
sources (:mod:`freetoken.moe.handoff.host_pinning`) the copies are asynchronous DMA at PCIe speed.

A :class:`CopyTicket` says when the copies are enqueued and done (:meth:`CopyTicket.done`,
polled between steps) and makes a stream wait for them (:meth:`CopyTicket.order_before`).
On a device that is not CUDA/HIP (the fake GPU plugin's host "device") the thread copies
synchronously and the ticket is done when the thread finished.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Optional, Sequence, Union

import torch

from freetoken.backends.contract import on_gpu

log = logging.getLogger(__name__)

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]
Job = Union[Pairs, Callable[[], None]]


class CopyTicket:
    def __init__(self, after: Any, nbytes: int) -> None:
        self.after = after  # compute-stream event the copies wait for (None: none)
        self.nbytes = nbytes
        self.end: Any = None  # side-stream event recorded after the copies
        self.error: Optional[BaseException] = None
        self._issued = threading.Event()

    def issued(self) -> bool:
        return self._issued.is_set()

    def done(self) -> bool:
        """The copies ran (raises the copy's error, if it failed)."""
        if not self._issued.is_set():
            return False
        if self.error is not None:
            raise RuntimeError(f"expert copy failed: {self.error}") from self.error
        return self.end is None or bool(self.end.query())

    def order_before(self, stream: Any = None, timeout_s: float = 60.0) -> None:
        """Make ``stream`` (default: the current one) wait for the copies; blocks the
        calling thread only until the copies are enqueued."""
        if not self._issued.wait(timeout_s):
            raise RuntimeError(f"expert copy not enqueued after {timeout_s:.0f} s (copy thread stalled)")
        if self.error is not None:
            raise RuntimeError(f"expert copy failed: {self.error}") from self.error
        if self.end is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.end)


class CopyQueue:
    def __init__(self, device: Any, name: str = "expert-copies") -> None:
        self.device = torch.device(device)
        self.cuda = on_gpu(self.device)
        if self.cuda and self.device.index is None:  # "cuda": the caller's current device, fixed now
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._jobs: "queue.Queue[Optional[tuple[CopyTicket, Job]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.copied_bytes = 0

    @property
    def thread(self) -> threading.Thread:
        """The thread that enqueues the copies."""
        return self._thread

    def compute_event(self) -> Any:
        """An event at the current position of the current (compute) stream, or None off CUDA."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def submit(self, job: Job, after: Any = None, nbytes: int = 0) -> CopyTicket:
        """Copy ``job`` after the compute-stream event ``after`` (see :meth:`compute_event`)."""
        if nbytes == 0 and not callable(job):
            nbytes = _pairs_bytes(job)
        ticket = CopyTicket(after, nbytes)
        self._jobs.put((ticket, job))
        return ticket

    def submit_now(self, job: Job, after: Any = None) -> CopyTicket:
        """Issue ``job`` on the copy stream from the calling thread (no hand-over to the copy
        thread): for callers that wait for the copies right away anyway. With pageable host
        memory the copies block the caller until done, which is still correct."""
        ticket = CopyTicket(after, _pairs_bytes(job))
        self._issue(ticket, job)
        ticket._issued.set()
        return ticket

    def _issue(self, ticket: CopyTicket, job: Job) -> None:
        """Enqueue ``job`` on the copy stream after ``ticket.after``, then the ticket's end event."""
        if self.cuda:
            with torch.cuda.stream(self.stream):
                if ticket.after is not None:
                    self.stream.wait_event(ticket.after)
                self._copy(job)
                end = torch.cuda.Event()
                end.record(self.stream)
            ticket.end = end
        else:
            self._copy(job)
        self.copied_bytes += ticket.nbytes

    def _run(self) -> None:
        broken: Optional[BaseException] = None  # the thread could not start: every ticket gets this error
        if self.cuda:
            try:
                torch.cuda.set_device(self.device)
            except BaseException as exc:  # noqa: BLE001 - reported through each ticket
                log.error("expert copy thread cannot use %s: %s", self.device, exc)
                broken = exc
        while True:
            item = self._jobs.get()
            if item is None:
                return
            ticket, job = item
            try:
                if broken is not None:
                    raise RuntimeError(f"copy thread cannot use {self.device}: {broken}") from broken
                self._issue(ticket, job)
            except BaseException as exc:  # noqa: BLE001 - reported through the ticket
                log.error("expert copy failed: %s", exc)
                ticket.error = exc
            ticket._issued.set()

    @staticmethod
    def _copy(job: Job) -> None:
        if callable(job):
            job()
            return
        for dst, src in job:
            dst.copy_(src, non_blocking=True)

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=30)


def _pairs_bytes(pairs: Pairs) -> int:
    return sum(d.numel() * d.element_size() for d, _ in pairs)
