"""The GPU memory plan holds a prompt chunk's activations: a chunk whose activations would
take more than their share of the budget is lowered to a power of two that fits, the
engine schedules with the lowered chunk, and a refusal names the step reserve's parts.
Activation sizes are checked against a count of the tensors made from the config."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from freetoken.backends import registry
from freetoken.backends.contract import MemoryPlanError, ModelShape
from freetoken.backends.options import CPU_PREFILL_CHUNK, GPU_PREFILL_CHUNK, EngineOptions
from freetoken.models.config import ModelConfig
from freetoken.models.loader import activation_bytes_per_token
from freetoken.moe.session.gpu_memory_plan import (ACTIVATION_SHARE, MIN_ACTIVATION_BYTES, MIN_PREFILL_CHUNK,
                                                   WORKSPACE_BYTES)

GIB = 1 << 30


@pytest.fixture(autouse=True)
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


def _shape(per_token: int, layer_bytes: int = 256 << 20, layers: int = 8) -> ModelShape:
    return ModelShape(num_layers=layers, moe_layers=list(range(layers)), hidden=2048, num_experts=128,
                      moe_intermediate=768, top_k=8, dense_bytes=1 * GIB, kv_bytes_per_token=96 * 1024,
                      expert_file_bytes={i: layer_bytes for i in range(layers)},
                      activation_bytes_per_token=per_token)


def _plan(budget: Optional[int], chunk: Optional[int], shape: ModelShape, max_model_len: int = 4096, **kw):
    from freetoken_fakegpu.backend import FakeGpuBackend

    session = FakeGpuBackend().open_model(EngineOptions(act_dtype=torch.bfloat16, gpu_memory_limit=budget,
                                                        max_model_len=max_model_len, prefill_chunk=chunk, **kw))
    session.plan(shape)
    return session


@pytest.mark.parametrize("budget_gib,asked", [(16, 16384), (16, 2048), (12, 8192), (4, 4096), (64, 300)])
def test_the_chunk_is_lowered_to_what_its_share_holds(budget_gib: int, asked: int) -> None:
    per_token = 200_000  # ~ a 30B-A3B shape at BF16
    budget = budget_gib * GIB
    s = _plan(budget, asked, _shape(per_token))
    plan = s.plan_result
    allowed = max(MIN_ACTIVATION_BYTES, int(budget * ACTIVATION_SHARE))
    if asked * per_token <= allowed:
        assert plan.prefill_chunk == asked
    else:
        c = plan.prefill_chunk
        assert c & (c - 1) == 0 and MIN_PREFILL_CHUNK <= c < asked
        assert c * per_token <= allowed < 2 * c * per_token  # the largest power of two that fits
    assert plan.activations == plan.prefill_chunk * per_token
    assert plan.reserve == WORKSPACE_BYTES + plan.outside + plan.activations
    assert s.prefill_chunk(asked) == plan.prefill_chunk
    # everything the plan counts fits the budget, the KV cache taking the rest
    assert plan.reserve + plan.dense + plan.expert_bytes + plan.cache + plan.scratch + plan.kv_budget == budget


def test_a_refusal_names_the_step_reserve_and_the_flag() -> None:
    with pytest.raises(MemoryPlanError) as info:
        _plan(2 * GIB, 4096, _shape(200_000), moe_cpu_layers="0")
    msg = str(info.value)
    assert "step reserve" in msg and "prompt chunks of" in msg and "--prefill-chunk" in msg


def test_activation_bytes_per_token_follow_the_larger_block() -> None:
    """A MoE shape's routes dominate (twice the routes: about twice the bytes above the
    residual stream); a model with a wide dense MLP takes the MLP's three rows."""
    def cfg(top_k: int, inter: int = 0) -> ModelConfig:
        return ModelConfig(architecture="x", vocab_size=1000, hidden_size=2048, num_layers=4, num_heads=32,
                           num_kv_heads=4, head_dim=128, intermediate_size=inter, moe_intermediate_size=768,
                           num_experts=128, top_k=top_k)

    stream = 6 * 2048 * 4
    k4, k8 = (activation_bytes_per_token(cfg(k), 2) - stream for k in (4, 8))
    assert 1.8 < k8 / k4 < 2.0
    assert activation_bytes_per_token(cfg(8, inter=100_000), 2) == stream + 3 * 100_000 * 2


def test_the_engine_schedules_with_the_planned_chunk() -> None:
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(backend="fakegpu", dtype="float32", max_model_len=128, kv_cache_tokens=1024,
                                 gpu_memory_limit=2 * GIB, prefill_chunk=1 << 20))
    try:
        plan = eng.session.plan_result
        assert plan is not None and plan.prefill_chunk < (1 << 20)
        assert eng.prefill_chunk == eng.scheduler.prefill_chunk == plan.prefill_chunk
        assert eng.backend_info()["memory_plan"]["prefill_chunk"] == plan.prefill_chunk
    finally:
        eng.close()


@pytest.mark.parametrize("ctx", [2048, 16900, 32768])
def test_the_kv_cache_of_the_longest_context_is_planned(ctx: int) -> None:
    """The engine allocates one request of --max-model-len (in whole blocks) whatever the
    budget: the plan counts it before it places the experts."""
    shape = _shape(200_000, layers=40)
    plan = _plan(16 * GIB, 2048, shape, max_model_len=ctx).plan_result
    need = -(-ctx // 16) * 16 * shape.kv_bytes_per_token
    assert plan.kv_budget >= need
    assert plan.reserve + plan.dense + plan.expert_bytes + plan.scratch + plan.kv_budget == 16 * GIB


def test_a_context_that_is_not_whole_blocks_starts() -> None:
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(backend="fakegpu", dtype="float32", max_model_len=130, max_running_requests=1,
                                 gpu_memory_limit=2 * GIB))
    try:
        assert eng.max_model_len == 130 and eng.kv.total_tokens >= 144
    finally:
        eng.close()


def _on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake GPU's tensors live on the host: plan as a GPU device would."""
    from freetoken.moe.session import gpu_memory_plan, gpu_session

    monkeypatch.setattr(gpu_memory_plan, "on_gpu", lambda device: True)
    monkeypatch.setattr(gpu_session, "on_gpu", lambda device: True)


def test_the_default_chunk_is_the_devices() -> None:
    assert EngineOptions().prompt_chunk(gpu=True) == GPU_PREFILL_CHUNK == 2048
    assert EngineOptions().prompt_chunk(gpu=False) == CPU_PREFILL_CHUNK == 256
    assert EngineOptions(prefill_chunk=300).prompt_chunk(gpu=True) == 300


@pytest.mark.parametrize("budget_mib", [2900, 3700, 4800, 4900, 9000])
def test_the_default_chunk_grows_only_into_what_the_placement_leaves(monkeypatch: pytest.MonkeyPatch,
                                                                     budget_mib: int) -> None:
    """Without --prefill-chunk, a budgeted plan places the experts as for 256-token chunks
    and then doubles the chunk while the added activations fit beside them: never fewer
    expert layers on the device than with 256, the KV cache's minimum kept, at most 2048."""
    _on_a_gpu(monkeypatch)
    per_token = 200_000
    shape = _shape(per_token)
    budget = budget_mib << 20
    small = _plan(budget, 256, shape).plan_result
    default = _plan(budget, None, shape)
    plan = default.plan_result
    kv_min = 4096 * shape.kv_bytes_per_token  # max_model_len 4096 in 16-token blocks
    spare = small.kv_budget - kv_min
    expected = 256  # the largest doubling whose added activations fit the spare and the share
    while (expected * 2 <= 2048 and (2 * expected - 256) * per_token <= spare
           and 2 * expected * per_token <= max(MIN_ACTIVATION_BYTES, int(budget * ACTIVATION_SHARE))):
        expected *= 2
    assert plan.prefill_chunk == expected
    assert plan.gpu_layers == small.gpu_layers and plan.dense == small.dense
    assert plan.kv_budget == small.kv_budget - (expected - 256) * per_token >= kv_min
    assert plan.reserve == WORKSPACE_BYTES + plan.outside + expected * per_token
    assert default.prefill_chunk(None) == expected
    assert plan.reserve + plan.dense + plan.expert_bytes + plan.cache + plan.scratch + plan.kv_budget == budget


@pytest.mark.parametrize("budget_mib", [3700, 4800])
def test_a_tight_budget_keeps_the_layer_a_fixed_2048_chunk_would_cost(monkeypatch: pytest.MonkeyPatch,
                                                                     budget_mib: int) -> None:
    _on_a_gpu(monkeypatch)
    shape = _shape(200_000)  # the fake GPU's experts are dequantized: 1.2 GiB a layer
    budget = budget_mib << 20
    fixed = _plan(budget, 2048, shape).plan_result
    default = _plan(budget, None, shape).plan_result
    assert len(default.gpu_layers) > len(fixed.gpu_layers)
    assert 256 <= default.prefill_chunk < 2048


def test_without_a_budget_the_default_chunk_is_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _plan(None, None, _shape(200_000)).prefill_chunk(None) == 256  # the fake GPU's host tensors
    _on_a_gpu(monkeypatch)
    assert _plan(None, None, _shape(200_000)).prefill_chunk(None) == 2048
