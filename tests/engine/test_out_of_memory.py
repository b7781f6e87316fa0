"""A step that runs out of memory fails its largest request with an ``out_of_memory`` error
and the engine goes on: the other requests of the step are recomputed and end with the
same tokens as a run without the failure, nothing stays allocated, and later requests run.

The failures are real allocation failures (an allocation no host can satisfy, raised by
torch's allocator), injected before a step (``fault=``) or inside the model's forward."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from freetoken import SamplingParams
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.step_faults import IMPOSSIBLE_BYTES
from helpers import run_with_faults

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from freetoken.models.demo import ensure_demo_model

    return ensure_demo_model(str(tmp_path_factory.mktemp("cache") / "demo"))


@pytest.fixture(scope="module")
def engine(demo) -> LLMEngine:
    return LLMEngine(EngineConfig(model=demo.hf_dir, backend="cpu", kv_cache_tokens=2048, max_model_len=512))


def _prompts(seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    long = torch.randint(10, 1000, (120,), generator=g).tolist()
    short = torch.randint(10, 1000, (9,), generator=g).tolist()
    return long, short


def _run(engine: LLMEngine, requests: list[tuple[list[int], Any]]) -> list[Any]:
    return run_with_faults(engine, requests, GREEDY, 500)


def _reference(engine: LLMEngine, ids: list[int]) -> list[int]:
    (req,) = _run(engine, [(ids, None)])
    assert req.finish_reason == "length"
    return list(req.output_ids)


def _assert_clean(engine: LLMEngine) -> None:
    st = engine.stats()
    assert st.num_running == st.num_waiting == 0 and st.kv_used_tokens == 0
    assert not engine.requests


def _assert_memory_error(req: Any) -> None:
    assert req.finish_reason == "error"
    assert req.error is not None and req.error.code == "out_of_memory"
    msg = req.error.message
    assert "ran out of memory" in msg and "--prefill-chunk" in msg and "can't allocate memory" in msg


def test_out_of_memory_in_a_prefill_fails_the_largest_request_only(engine: LLMEngine) -> None:
    long, short = _prompts(1)
    expected = _reference(engine, short)
    before = engine.stats().num_preemptions
    failed, other = _run(engine, [(long, "oom-prefill"), (short, None)])
    _assert_memory_error(failed)
    assert failed.output_ids == [] and f"computing {len(long)} tokens" in failed.error.message
    assert other.finish_reason == "length" and other.output_ids == expected
    assert engine.stats().num_preemptions == before + 1  # the short one shared the failed step
    _assert_clean(engine)
    assert _reference(engine, long)  # the engine goes on, the long prompt runs on its own


def test_out_of_memory_mid_decode(engine: LLMEngine) -> None:
    long, short = _prompts(2)
    expected = _reference(engine, short)
    failed, other = _run(engine, [(long, "oom-decode"), (short, None)])
    _assert_memory_error(failed)
    assert len(failed.output_ids) == 2  # it had streamed two tokens; the longer context fails
    assert other.finish_reason == "length" and other.output_ids == expected
    _assert_clean(engine)


class _FailsOnce:
    """Wraps a layer's MoE block: its first call over more than one token (a prompt chunk)
    makes an allocation torch's host allocator refuses, mid-forward; later calls pass."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fired = 0

    def add_norm_forward(self, h: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.fired and h.reshape(-1, h.shape[-1]).shape[0] > 1:
            self.fired += 1
            torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8)
        return self.inner.add_norm_forward(h, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_out_of_memory_inside_the_forward(engine: LLMEngine) -> None:
    long, short = _prompts(3)
    expected = _reference(engine, short)  # (the long prompt is kept out of the prefix cache)
    layer = next(L for L in engine.model.layers if L.moe is not None)
    layer.moe = wrapper = _FailsOnce(layer.moe)
    try:
        failed, other = _run(engine, [(long, None), (short, None)])
    finally:
        layer.moe = wrapper.inner
    assert wrapper.fired == 1
    _assert_memory_error(failed)
    assert f"computing {len(long)} tokens" in failed.error.message
    assert other.output_ids == expected
    _assert_clean(engine)
    again = _run(engine, [(long, None), (short, None)])  # the same pair, nothing failing now
    assert [r.output_ids for r in again] == [_reference(engine, long), expected]


def test_out_of_memory_in_the_logits_after_the_positions_advanced(engine: LLMEngine) -> None:
    """compute_logits runs after the step's positions were counted computed: the
    preempted request is recomputed from the start all the same."""
    long, short = _prompts(4)
    expected = _reference(engine, short)
    real = engine.model.compute_logits
    calls = {"n": 0}

    def fails_first(h: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8)
        return real(h)

    engine.model.compute_logits = fails_first
    try:
        failed, other = _run(engine, [(long, None), (short, None)])
    finally:
        del engine.model.compute_logits
    assert calls["n"] > 1
    _assert_memory_error(failed)
    assert other.output_ids == expected
    _assert_clean(engine)


def test_an_unknown_fault_is_refused(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="unknown step fault 'oom-never'"):
        engine.add_request([5, 6, 7], GREEDY, fault="oom-never")


def test_async_engine_fails_one_stream_and_serves_the_other(demo) -> None:
    from freetoken.engine.async_engine import AsyncEngine, RequestFailed

    long, short = _prompts(5)

    async def main() -> tuple[list[int], list[int], str]:
        eng = AsyncEngine(EngineConfig(model=demo.hf_dir, backend="cpu", kv_cache_tokens=2048, max_model_len=512))
        await eng.start()
        try:
            alone = [t for d in [d async for d in eng.stream(short, GREEDY)] for t in d.token_ids]

            async def collect(ids: list[int], fault: Any) -> Any:
                try:
                    return [t for d in [d async for d in eng.stream(ids, GREEDY, fault=fault)] for t in d.token_ids]
                except RequestFailed as exc:
                    return exc

            failed, other = await asyncio.gather(collect(long, "oom-prefill"), collect(short, None))
            assert isinstance(failed, RequestFailed) and failed.error.code == "out_of_memory"
            assert eng.stats().kv_used_tokens == 0
            return alone, other, str(failed)
        finally:
            await eng.shutdown()

    alone, other, message = asyncio.run(main())
    assert other == alone and len(other) == GREEDY.max_tokens
    assert "ran out of memory" in message
