"""A step that runs out of memory between a CPU layer's hand-off and the wait for its
result, through the fakegpu plugin's GPU session (copy path, stream-ordered flags): the
largest request fails with the out_of_memory error, the other ends as it does alone, the
session closes the hand-off the step left open, and later steps compute the same results
as before the failure (a hand-off left open would let the next wait pass before the CPU's
new result)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from freetoken.backends import registry
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.sampling_params import SamplingParams

LONG = [(13 * j) % 240 + 3 for j in range(40)]
SHORT = [5, 9, 31, 7]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine():
    registry.reset()
    eng = LLMEngine(EngineConfig(backend="fakegpu", dtype="float32", max_model_len=128, kv_cache_tokens=1024,
                                 moe_cpu_layers="0-1", enable_prefix_cache=False, moe_stream_prefill="off"))
    yield eng
    eng.close()
    registry.reset()


def _run(eng: LLMEngine, prompts: list[list[int]]) -> list[Any]:
    reqs = [eng.add_request(p, GREEDY) for p in prompts]
    while eng.has_work():
        eng.step()
    return reqs


class _WaitFailsOnce:
    """The hand-off's sync with its first wait failing: a real allocation the host's
    allocator refuses (Python's MemoryError), after the hand-off was published."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.fired = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def wait(self, stream: Any, task: Any) -> None:
        if not self.fired:
            self.fired += 1
            bytearray(1 << 60)
        self.inner.wait(stream, task)


def test_out_of_memory_inside_a_handoff(engine: LLMEngine, caplog: Any) -> None:
    assert engine.backend_info()["io_path"] == "copy"
    short_alone = _run(engine, [SHORT])[0].output_ids
    long_alone = _run(engine, [LONG])[0].output_ids
    executors = list(engine.session.executors.values())
    assert executors
    ex = executors[0]
    ex.sync = wrapper = _WaitFailsOnce(ex.sync)
    with caplog.at_level(logging.INFO, logger="freetoken.moe.handoff.hybrid"):
        failed, other = _run(engine, [LONG, SHORT])
    assert wrapper.fired == 1
    assert failed.finish_reason == "error" and failed.error.code == "out_of_memory"
    assert "ran out of memory" in failed.error.message
    assert other.finish_reason == "length" and other.output_ids == short_alone
    assert any("closed the open hand-off" in r.getMessage() for r in caplog.records)
    assert engine.stats().kv_used_tokens == 0
    for _ in range(2):  # the same results as before the failure, step after step
        assert [r.output_ids for r in _run(engine, [LONG, SHORT])] == [long_alone, short_alone]


def test_prompt_chunks_share_a_task_per_power_of_two(engine: LLMEngine) -> None:
    """Prompts of many lengths leave a few hand-off tasks per layer, not one per length
    (prompt chunks go through the hand-off here: expert streaming is off)."""
    for n in range(65, 100, 3):
        _run(engine, [[(7 * j) % 200 + 3 for j in range(n)]])
    for ex in engine.session.executors.values():
        big = sorted(k for k in ex.tasks if k > 64)
        assert big == [128], big
        assert all(ex.tasks[k].max_tokens == k for k in ex.tasks)
