"""Shared experts computed beside a hybrid layer's CPU experts, through the fakegpu session.

A MoE layer's shared expert does not depend on its routed experts, so a CPU-placed layer
hands it to its experts function as ``beside`` work, which the hybrid executor runs on the
GPU after the hand-off to the CPU and before it awaits the CPU's result. The engine's
logits must stay those of the cpu backend (which adds the shared expert after the routed
ones), and on every CPU layer the beside work must run between the publish and the wait.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import pytest
import torch

from freetoken.backends import registry
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.sampling_params import SamplingParams
from freetoken.moe.handoff.hybrid import HybridMoEExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models_moe_families"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "engine"))

PROMPTS = [[(11 * i + 5 * j) % 150 + 5 for j in range(n)] for i, n in enumerate((6, 19, 3))]
SEED = random.SystemRandom().randrange(1 << 30)


@pytest.fixture(scope="module", params=["glm4_moe", "deepseek_v3", "qwen3_next"])
def shared_expert_checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"shared-{request.param}"))
    if request.param == "qwen3_next":  # a gated shared expert (SharedExpertMoELayer)
        from qwen35_helpers import make_hf

        make_hf(request.param, path, SEED % 10000)
    else:  # ungated shared experts (GroupedTopKMoELayer)
        from families import make_model, save

        save(make_model(request.param, SEED % 10000), path)
    return request.param, path


def _run(backend: str, path: str, **kw: Any) -> list[tuple[list[int], torch.Tensor]]:
    from helpers import LogitsRecorder

    registry.reset()
    eng = LLMEngine(EngineConfig(model=path, backend=backend, dtype="float32", max_model_len=128,
                                 kv_cache_tokens=1024, **kw))  # fmt: skip
    try:
        with LogitsRecorder(eng) as rec:
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            reqs = [eng.add_request(p, params) for p in PROMPTS]
            while eng.has_work():
                eng.step()
            return [(r.output_ids, torch.stack(rec[r.request_id])) for r in reqs]
    finally:
        eng.close()


class _Events:
    """What each hybrid forward of the engine's steps did, in order: publish, beside, wait
    (the CPU's result); the startup qualification's own hand-offs are left out."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[str]]] = []
        self.stepping = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        forward, publish, step = HybridMoEExecutor.forward, HybridMoEExecutor._publish_copies, LLMEngine.step
        events = self

        def traced_step(eng: Any) -> Any:
            events.stepping = True
            try:
                return step(eng)
            finally:
                events.stepping = False

        def traced_forward(ex: Any, x: Any, ids: Any, w: Any, cpu_mask: Any = None, beside: Any = None) -> Any:
            seen: list[str] = []
            if not events.stepping:
                return forward(ex, x, ids, w, cpu_mask, beside)
            events.calls.append((ex.layer, seen))
            sync = ex.sync

            class Waits:
                def __getattr__(self, name: str) -> Any:
                    return getattr(sync, name)

                def wait(self, *a: Any) -> Any:
                    seen.append("wait")
                    return sync.wait(*a)

            def traced_beside() -> Any:
                seen.append("beside")
                return beside()

            ex.sync = Waits()
            try:
                return forward(ex, x, ids, w, cpu_mask, None if beside is None else traced_beside)
            finally:
                ex.sync = sync

        def traced_publish(ex: Any, *a: Any) -> Any:
            if events.stepping:
                events.calls[-1][1].append("publish")
            return publish(ex, *a)

        monkeypatch.setattr(LLMEngine, "step", traced_step)
        monkeypatch.setattr(HybridMoEExecutor, "forward", traced_forward)
        monkeypatch.setattr(HybridMoEExecutor, "_publish_copies", traced_publish)


@pytest.mark.parametrize("placement", ["all", "1"])  # 1: the first MoE layer on the CPU, the others on the "device"
def test_shared_experts_beside_the_cpu_match_the_cpu_backend(shared_expert_checkpoint, placement, monkeypatch):
    family, path = shared_expert_checkpoint
    want = _run("cpu", path)
    events = _Events()
    events.install(monkeypatch)
    got = _run("fakegpu", path, moe_cpu_layers=placement)
    monkeypatch.undo()
    registry.reset()

    assert events.calls, f"{family}: no hybrid layer ran"
    if placement == "1":  # GLM-4.5's and DeepSeek's layer 0 is dense
        assert {layer for layer, _ in events.calls} == {0 if family == "qwen3_next" else 1}
    # every hybrid call of a layer with shared experts ran them after the publish, before the wait
    assert {seen.count("beside") for _, seen in events.calls} == {1}, f"{family}: {events.calls}"
    for layer, seen in events.calls:
        assert seen == ["publish", "beside", "wait"], f"{family} layer {layer}: {seen}"
    for (ids, logits), (ref_ids, ref_logits) in zip(got, want):
        assert ids == ref_ids, f"{family} (seed {SEED}): greedy tokens differ: {ids} vs {ref_ids}"
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"{family} (seed {SEED}): {m}")  # fmt: skip
