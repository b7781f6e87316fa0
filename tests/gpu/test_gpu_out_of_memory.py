"""A step that runs out of GPU memory on the cuda backend (run on the GPU machine): the
largest request of the step fails with the out_of_memory error naming the GPU, the other
ends with the tokens of a run without the failure, and the engine goes on with the same
results, its hand-off and decode graphs intact.

The failures are real: an allocation the CUDA caching allocator refuses, made before the
step (the engine's ``fault=``), or inside the step between a CPU layer's hand-off and the
wait for its result (the hand-off published, the CPU served it, nobody waited)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.sampling_params import SamplingParams
from freetoken.engine.step_faults import IMPOSSIBLE_BYTES
from helpers import run_with_faults

pytestmark = pytest.mark.gpu

LONG = [(11 * j) % 190 + 7 for j in range(60)]
SHORT = [(5 * j) % 170 + 9 for j in range(7)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(backend: Any, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(max_model_len=256, kv_cache_tokens=4096, dtype="bfloat16", cuda_graph_max_bs=8,
                                  enable_prefix_cache=False, **kw), backend=backend)


def _run(eng: LLMEngine, prompts: list[tuple[list[int], Any]]) -> list[Any]:
    return run_with_faults(eng, prompts, GREEDY, 300)


class _FailsOnceInWait:
    """Stands in for a hand-off's result path: the first wait of any wrapped layer (in the
    prefill step that follows the wrapping) makes an allocation the device refuses, after
    the hand-off was published; ``shots`` is shared by the layers' wrappers."""

    def __init__(self, inner: Any, method: str, shots: list[int]) -> None:
        self.inner, self.method, self.shots, self.fired = inner, method, shots, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        def failing(stream: Any, task: Any, *args: Any) -> Any:
            if self.shots[0] > 0:
                self.shots[0] -= 1
                self.fired += 1
                torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8, device="cuda")
            return attr(stream, task, *args)

        return failing


def _wrap_handoff(eng: LLMEngine) -> list[_FailsOnceInWait]:
    wrapped, shots = [], [1]
    for ex in eng.session.executors.values():
        if ex.kio is not None:
            ex.kio = w = _FailsOnceInWait(ex.kio, "combine", shots)
        else:
            ex.sync = w = _FailsOnceInWait(ex.sync, "wait", shots)
        wrapped.append(w)
    return wrapped


@pytest.mark.parametrize("fault", ["oom-prefill", "oom-decode", "in-handoff"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("placement", ["0-1", "all"])
def test_out_of_memory_fails_one_request_and_the_engine_goes_on(backend: Any, placement: str, eager: bool,
                                                                  fault: str) -> None:
    eng = _engine(backend, moe_cpu_layers=placement, enforce_eager=eager)
    try:
        assert eng.backend_info()["graphs"] is (not eager)
        short_alone = _run(eng, [(SHORT, None)])[0].output_ids
        pair = [r.output_ids for r in _run(eng, [(LONG, None), (SHORT, None)])]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        kv_base = eng.stats().kv_used_tokens  # (decode graphs keep a scratch block for padded rows)
        wrapped = _wrap_handoff(eng) if fault == "in-handoff" else []
        if fault == "in-handoff":
            assert wrapped, "no hand-off in this placement"
        failed, other = _run(eng, [(LONG, None if fault == "in-handoff" else fault), (SHORT, None)])
        if wrapped:
            assert sum(w.fired for w in wrapped) == 1
        assert failed.finish_reason == "error" and failed.error.code == "out_of_memory"
        assert "GPU ran out of memory" in failed.error.message and "CUDA out of memory" in failed.error.message
        assert other.finish_reason == "length" and other.output_ids == short_alone
        st = eng.stats()
        assert st.num_running == st.num_waiting == 0 and st.kv_used_tokens == kv_base
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= base + (16 << 20)
        for _ in range(2):  # the same pair as before the failure, with the same tokens
            assert [r.output_ids for r in _run(eng, [(LONG, None), (SHORT, None)])] == pair
    finally:
        eng.close()
