"""The async streaming interface (what the HTTP server uses).

One background thread owns the :class:`LLMEngine` and runs its steps; coroutines
submit requests through a thread-safe inbox and receive :class:`StreamDelta`
objects on per-request asyncio queues. Model compute never runs on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import Any, AsyncIterator, Optional

from freetoken.engine.config import EngineConfig
from freetoken.engine.constraints import TokenConstraint
from freetoken.engine.engine import EngineStats, LLMEngine, RequestRejected
from freetoken.engine.outputs import RequestError, StreamDelta
from freetoken.engine.request import new_request_id
from freetoken.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "QueueFull", "RequestRejected", "EngineStats", "EngineDead", "StepFailed", "RequestFailed"]


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_queued_requests``; retry later."""


class EngineDead(RuntimeError):
    """The engine loop stopped because of an error."""


class StepFailed(RuntimeError):
    """A model step raised; the requests in flight were dropped (the engine goes on)."""


class RequestFailed(RuntimeError):
    """The engine failed this request alone (``error.code`` says why: "out_of_memory");
    the others go on."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


class _Stream:
    __slots__ = ("loop", "queue", "finished")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False


class AsyncEngine:
    """Loads the model (blocking) and streams generations asynchronously."""

    #: after this many failing steps in a row the loop stops (EngineDead from then on)
    MAX_CONSECUTIVE_FAILURES = 3

    def __init__(self, config: EngineConfig, backend: Any = None) -> None:
        self.config = config
        self.engine = LLMEngine(config, backend=backend)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="freetoken-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        t = self._thread
        if t is None:
            return
        self._stop = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, t.join)
        self._thread = None
        for rid, st in list(self._streams.items()):
            self._post(st, EngineDead("the engine was shut down"))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -------------------------------------------------------------- queries

    def stats(self) -> EngineStats:
        s = self.engine.stats()
        s.num_waiting += self._pending_adds
        return s

    def backend_info(self) -> dict[str, Any]:
        return self.engine.backend_info()

    # --------------------------------------------------------------- stream

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: Optional[str] = None,
                     constraint: Optional[TokenConstraint] = None,
                     fault: Optional[str] = None) -> AsyncIterator[StreamDelta]:
        """Generate for one request, yielding deltas; the last has ``finished=True``.
        ``constraint`` restricts the tokens it may sample (see :mod:`freetoken.engine.constraints`);
        it is used from the engine thread from then on. ``fault``: see
        :mod:`freetoken.engine.step_faults` (tests only).

        Raises :class:`RequestRejected` or :class:`QueueFull` before yielding anything,
        :class:`RequestFailed` when the engine fails this request alone (a step that ran out
        of memory), :class:`StepFailed` when a step failed every request in flight.
        Closing the iterator early aborts the request and frees its KV pages.
        """
        if self._error is not None:
            raise EngineDead(f"the engine stopped after an error: {self._error}")
        if not self.running:
            raise RuntimeError("AsyncEngine.start() has not been awaited")
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.engine.validate(prompt_token_ids, params)
        st_ = self.stats()
        free_slots = max(0, self.config.max_running_requests - st_.num_running)
        if st_.num_waiting - free_slots >= self.config.max_queued_requests:
            raise QueueFull(f"{self.config.max_queued_requests} requests are already waiting; retry later")
        rid = request_id or new_request_id()
        if rid in self._streams:
            raise RequestRejected(f"request id {rid!r} is already in use")
        st = _Stream(asyncio.get_running_loop())
        self._streams[rid] = st
        with self._lock:
            self._pending_adds += 1
        self._inbox.append(("add", (rid, prompt_token_ids, params, constraint, fault)))
        self._wake.set()
        try:
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    st.finished = True
                    raise item
                if item.finished:
                    st.finished = True
                yield item
                if item.finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not st.finished:
                self._inbox.append(("abort", rid))
                self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    # ---------------------------------------------------------- the thread

    def _post(self, st: _Stream, item: Any) -> None:
        try:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            pass

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == "add":
                rid, ids, params, constraint, fault = arg
                with self._lock:
                    self._pending_adds -= 1
                st = self._streams.get(rid)
                if st is None:  # closed before it was admitted
                    continue
                try:
                    self.engine.add_request(ids, params, request_id=rid, constraint=constraint, fault=fault)
                except Exception as exc:
                    self._post(st, exc)
            else:
                self.engine.abort(arg)

    def _fail_in_flight(self, exc: BaseException) -> None:
        """A step raised: every request in the engine gets the error and is dropped
        (its KV pages freed); requests submitted later run normally."""
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            st = self._streams.get(rid)
            if st is not None:
                self._post(st, StepFailed(f"the engine step failed: {type(exc).__name__}: {exc}"))

    def _loop(self) -> None:
        failures = 0
        try:
            while not self._stop:
                self._drain_inbox()
                if not self.engine.has_work():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    deltas = self.engine.step()
                    failures = 0
                except Exception as exc:
                    failures += 1
                    logger.exception("engine step failed (%d in a row); failing the requests in flight", failures)
                    self._fail_in_flight(exc)
                    if failures >= self.MAX_CONSECUTIVE_FAILURES:
                        raise
                    continue
                for d in deltas:
                    st = self._streams.get(d.request_id)
                    if st is not None:
                        self._post(st, RequestFailed(d.error) if d.error is not None else d)
                    elif not d.finished:
                        self.engine.abort(d.request_id)
        except BaseException as exc:  # reported to every waiter; later submissions get EngineDead
            logger.exception("engine loop stopped")
            self._error = exc
            for st in list(self._streams.values()):
                self._post(st, EngineDead(f"the engine stopped after an error: {exc}"))
