"""Simulated GPU streams: each one a host thread running enqueued operations in order.

Like a real stream, enqueueing never blocks the caller, operations run one after
another in submission order, and an operation that fails poisons the stream: the
error is raised by the next :meth:`FakeStream.synchronize`.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Callable, Optional

_handles = itertools.count(1)
_streams: dict[int, "FakeStream"] = {}
_streams_lock = threading.Lock()


class FakeStream:
    """An in-order queue of host callables, executed by one daemon thread."""

    def __init__(self) -> None:
        self.handle = next(_handles)
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"fakegpu-stream-{self.handle}", daemon=True)
        self._thread.start()
        with _streams_lock:
            _streams[self.handle] = self

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            try:
                if op is None:
                    return
                if self._error is None:  # a failed stream skips the rest, as a faulted GPU context does
                    op()
            except BaseException as exc:  # kept for synchronize()
                self._error = exc
            finally:
                self._queue.task_done()

    def enqueue(self, op: Callable[[], None]) -> None:
        self._queue.put(op)

    def synchronize(self) -> None:
        """Block until every enqueued operation ran; raise the first failure."""
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"fakegpu stream {self.handle} failed: {error}") from error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        with _streams_lock:
            _streams.pop(self.handle, None)


def stream_for(handle: int) -> FakeStream:
    """The stream behind an integer handle (what the contract passes around)."""
    with _streams_lock:
        try:
            return _streams[handle]
        except KeyError:
            raise ValueError(f"no fakegpu stream has handle {handle}") from None
