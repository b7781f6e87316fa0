"""Running one HTTP request's engine streams: sampling parameters, context checks,
several choices at once, errors mapped to HTTP, and cancellation on disconnect.

A request with ``n`` choices (times several prompts for /v1/completions) becomes
one engine stream per choice. Each stream is pumped by its own task into a shared
queue, so the choices progress independently inside the engine's continuous batch.
Until every stream has produced its first output nothing is sent to the client,
so rejections (bad prompt, full queue) still become proper 4xx responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar

from freetoken.engine.outputs import StreamDelta, TokenLogprob
from freetoken.engine.sampling_params import SamplingParams
from freetoken.server.errors import APIError
from freetoken.server.metrics import ServerMetrics, TokenTimer

logger = logging.getLogger(__name__)

T = TypeVar("T")

SEED_RANGE = 2**63


class ClientDisconnected(Exception):
    """The client went away before the response started."""


@dataclasses.dataclass
class ChoiceJob:
    """One engine stream: which choice it answers and what to feed the engine."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    #: builds this choice's token constraint (e.g. a forced tool call); None: unconstrained
    constraint: Optional[Callable[[], Any]] = None


@dataclasses.dataclass
class ChoiceResult:
    """Everything one finished choice produced."""

    index: int
    prompt_tokens: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache

    def add(self, delta: StreamDelta) -> None:
        self.cached_tokens = delta.cached_tokens
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        self.logprobs.extend(delta.logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason


def resolve_max_tokens(requested: Optional[int], prompt_len: int, max_model_len: int, prompt_param: str) -> int:
    """The number of tokens to generate; a prompt or request beyond the context is a 400."""
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has {prompt_len} "
            f"tokens, leaving no room for a completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            f"Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def build_params(
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    seed: Optional[int],
    presence_penalty: float,
    frequency_penalty: float,
    repetition_penalty: float,
    stop: list[str],
    ignore_eos: bool,
    logprobs: bool,
    top_logprobs: int,
    logit_bias: Optional[dict[int, float]] = None,
    vocab_size: Optional[int] = None,
) -> SamplingParams:
    bad = sorted(t for t in logit_bias or {} if vocab_size is not None and t >= vocab_size)
    if bad:
        raise APIError(400, f"logit_bias has token ids outside the vocabulary (size {vocab_size}): {bad[:5]}",
                       param="logit_bias", code="invalid_token_id")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=0 if top_k < 0 else top_k,
            min_p=min_p,
            seed=seed,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            stop=list(stop),
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            logit_bias=dict(logit_bias or {}),
        )
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None


def choice_seed(seed: Optional[int], choice: int) -> Optional[int]:
    """Seed of one choice: a seeded request with n > 1 gives distinct, reproducible choices.
    Any JSON integer is accepted; it is folded into the generator's 63-bit range."""
    return None if seed is None else (seed + choice) % SEED_RANGE


async def _wait_for_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


async def until_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]], awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` (body already read); cancel it if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(BaseException):
        await work
    raise ClientDisconnected()


_END = object()


def _as_api_error(exc: BaseException) -> BaseException:
    """The HTTP error of what an engine stream raised: a full queue is a 429, a rejected
    request a 400, a request the engine failed alone (out of memory) a 503 naming why;
    anything else stays as it is (an internal error, 500)."""
    from freetoken.engine.async_engine import QueueFull, RequestFailed, RequestRejected

    if isinstance(exc, QueueFull):
        return APIError(429, f"The server is busy: {exc or 'request queue is full'}. Retry later.", code="queue_full")
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc) or "request rejected by the engine", code="invalid_request")
    if isinstance(exc, RequestFailed):
        return APIError(503, exc.error.message, code=exc.error.code)
    return exc


class ChoiceStreams:
    """The engine streams of one request, merged into one async iterator of (index, delta)."""

    def __init__(self, engine: Any, jobs: list[ChoiceJob], request_id: str, metrics: ServerMetrics,
                 arrival: float, registry: Optional[set["ChoiceStreams"]] = None,
                 fault: Optional[str] = None) -> None:
        self._registry = registry if registry is not None else set()
        self._fault = fault  # a step fault for the engine to inject (server/faults.py)
        self._engine = engine
        self._jobs = jobs
        self._request_id = request_id
        self._metrics = metrics
        self._arrival = arrival
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._buffer: list[tuple[int, Any]] = []
        self._open = 0

    async def _pump(self, job: ChoiceJob) -> None:
        timer = TokenTimer(self._metrics, self._arrival)
        rid = f"{self._request_id}-{job.index}"
        extra: dict[str, Any] = {}
        if job.constraint is not None:
            extra["constraint"] = job.constraint()
        if self._fault is not None:
            extra["fault"] = self._fault
        stream = self._engine.stream(job.prompt_ids, job.params, request_id=rid, **extra)
        finished = False
        try:
            async for delta in stream:
                now = time.monotonic()
                timer.tokens(len(delta.token_ids), now)
                if delta.finished:
                    timer.finish(delta.finish_reason, now)
                self._queue.put_nowait((job.index, delta))
                if delta.finished:
                    finished = True
                    break
            else:
                raise RuntimeError(f"engine stream {self._request_id}-{job.index} ended without a finished delta")
        except asyncio.CancelledError:
            if not finished:
                self._metrics.cancelled.inc()
            raise
        except BaseException as exc:  # handed to the consumer, which decides what the client sees
            self._queue.put_nowait((job.index, exc))
            return
        finally:
            with contextlib.suppress(BaseException):
                await stream.aclose()  # aborts the engine request if it is still running
        self._queue.put_nowait((job.index, _END))

    async def start(self) -> None:
        """Start every stream and wait until each produced its first output (or failed)."""
        self._registry.add(self)
        for job in self._jobs:
            self._metrics.prompt_tokens.inc(len(job.prompt_ids))
            self._tasks.append(asyncio.create_task(self._pump(job)))
        self._open = len(self._jobs)
        started: set[int] = set()
        try:
            while len(started) < len(self._jobs):
                index, item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise _as_api_error(item) from None
                started.add(index)
                self._buffer.append((index, item))
        except BaseException:
            await self.aclose()
            raise

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        try:
            for index, item in self._buffer:
                if item is _END:
                    self._open -= 1
                    continue
                yield index, item
            self._buffer.clear()
            while self._open > 0:
                index, item = await self._queue.get()
                if item is _END:
                    self._open -= 1
                    continue
                if isinstance(item, BaseException):
                    raise _as_api_error(item) from None
                yield index, item
        finally:
            await self.aclose()

    def interrupt(self, error: BaseException) -> None:
        """End this request early with ``error`` (server shutdown): the consumer raises it."""
        self._queue.put_nowait((-1, error))

    async def aclose(self) -> None:
        self._registry.discard(self)
        for task in self._tasks:
            if not task.done():
                task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task


def cached_prompt_tokens(cached: dict[int, int], prompt_of_choice: Callable[[int], int]) -> int:
    """``usage.prompt_tokens_details.cached_tokens``: prompt tokens are counted once per
    prompt, so per prompt the fewest cached tokens among its choices (``cached``: per
    choice index; ``prompt_of_choice``: choice index -> prompt index)."""
    per_prompt: dict[int, int] = {}
    for index, n in cached.items():
        p = prompt_of_choice(index)
        per_prompt[p] = min(n, per_prompt.get(p, n))
    return sum(per_prompt.values())


async def collect(streams: ChoiceStreams, results: dict[int, ChoiceResult]) -> None:
    """Run the streams to the end, accumulating into ``results`` (keyed by choice index)."""
    async for index, delta in streams:
        results[index].add(delta)
        if delta.finished and delta.finish_reason == "error":
            raise RuntimeError(f"engine reported an error for choice {index}")
