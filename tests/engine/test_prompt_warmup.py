"""The engine prefills the session's warm-up lengths once at start (a GPU builds its prompt
kernels then, not in the first users' steps) and keeps nothing of them: no KV block, no
prefix-cache entry, no recurrent-state slot, no counted prompt token. Run through the
simulated GPU (host tensors) with the lengths a real GPU session would ask for."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from freetoken.backends import registry
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.sampling_params import SamplingParams
from freetoken.moe.session import gpu_session
from freetoken.moe.session.gpu_session import GpuModelSession


@pytest.fixture(autouse=True)
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


def _engine(**kw: Any) -> LLMEngine:
    cfg = dict(backend="fakegpu", dtype="float32", max_model_len=512, kv_cache_tokens=2048, seed=3)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def _spy_forward(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """(tokens, decode) of every step the session runs."""
    calls: list[tuple[int, bool]] = []
    original = GpuModelSession.forward

    def forward(self: GpuModelSession, input_ids: Any, positions: Any, meta: Any) -> Any:
        calls.append((int(input_ids.shape[0]), bool(meta.decode)))
        return original(self, input_ids, positions, meta)

    monkeypatch.setattr(GpuModelSession, "forward", forward)
    return calls


def _generate(eng: LLMEngine, prompt: list[int]) -> list[int]:
    rid = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)).request_id
    out: list[int] = []
    while eng.has_work():
        for d in eng.step():
            if d.request_id == rid:
                out.extend(d.token_ids)
    assert len(out) == 6
    return out


def test_a_gpu_session_asks_for_powers_of_two_up_to_the_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = _engine()
    try:
        session = eng.session
        assert session.warmup_prompt_lengths(2048) == []  # the simulated GPU's tensors are on the host
        monkeypatch.setattr(gpu_session, "on_gpu", lambda device: True)
        from freetoken.backends import triton_target

        monkeypatch.setattr(triton_target, "for_device", lambda device: type("T", (), {"usable": True})())
        assert session.warmup_prompt_lengths(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
        assert session.warmup_prompt_lengths(300) == [16, 32, 64, 128, 256, 300]
        assert session.warmup_prompt_lengths(8) == [8]
        monkeypatch.setattr(triton_target, "for_device", lambda device: type("T", (), {"usable": False})())
        assert session.warmup_prompt_lengths(2048) == []  # no JIT kernels to build
    finally:
        eng.close()


def test_the_warmup_prefills_each_length_once_and_keeps_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    prompt = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    cold = _engine()
    try:
        free_cold = cold.prefix_cache.num_available
        expected = _generate(cold, prompt)
    finally:
        cold.close()

    asked: list[int] = []

    def lengths(self: GpuModelSession, chunk: int) -> list[int]:
        asked.append(chunk)
        return [16, 100, 511, 512, 4096]  # the last two cannot be prefilled: no room in a 512-token context

    monkeypatch.setattr(GpuModelSession, "warmup_prompt_lengths", lengths)
    calls = _spy_forward(monkeypatch)
    with caplog.at_level(logging.INFO, logger="freetoken.engine.engine"):
        eng = _engine()
    try:
        assert asked == [eng.prefill_chunk]
        assert calls == [(16, False), (100, False), (511, False)]
        assert "prompt kernels ready: prefills of 16, 100, 511 tokens" in caplog.text
        # nothing kept: every block back, no cached prefix, no prompt token counted
        assert eng.prefix_cache.num_available == free_cold
        assert eng.stats().prefix_cache_queries == 0 and eng.stats().prompt_tokens_computed == 0
        calls.clear()
        assert _generate(eng, prompt) == expected
        assert calls[0] == (len(prompt), False)  # the whole prompt computed: no block cached by the warm-up
        assert eng.stats().prefix_cache_hits == 0
    finally:
        eng.close()


def test_a_warmup_that_runs_out_of_memory_ends_the_warmup(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(GpuModelSession, "warmup_prompt_lengths", lambda self, chunk: [16, 64, 128])
    original = GpuModelSession.forward

    def forward(self: GpuModelSession, input_ids: Any, positions: Any, meta: Any) -> Any:
        if input_ids.shape[0] == 64:
            raise torch.OutOfMemoryError("simulated: 64 tokens do not fit")
        return original(self, input_ids, positions, meta)

    monkeypatch.setattr(GpuModelSession, "forward", forward)
    calls = _spy_forward(monkeypatch)  # (around the failing forward: every attempt)
    with caplog.at_level(logging.WARNING, logger="freetoken.engine.engine"):
        eng = _engine()
    try:
        assert calls == [(16, False), (64, False)]  # the warm-up ends at the failure
        assert "warm-up prefill of 64 tokens ran out of memory" in caplog.text
        assert eng.prefix_cache.num_available * eng.kv.block_size >= 2048 - eng.kv.block_size
        _generate(eng, list(range(5, 30)))  # it serves
    finally:
        eng.close()


def test_a_fault_in_the_warmup_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GpuModelSession, "warmup_prompt_lengths", lambda self, chunk: [16])

    def forward(self: GpuModelSession, input_ids: Any, positions: Any, meta: Any) -> Any:
        raise RuntimeError("simulated kernel fault")

    monkeypatch.setattr(GpuModelSession, "forward", forward)
    with pytest.raises(RuntimeError, match="simulated kernel fault"):
        _engine()


def test_the_warmup_leaves_no_trace_in_the_expert_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streamed prefills and the statistics count from the first request, not the warm-up."""
    monkeypatch.setattr(GpuModelSession, "warmup_prompt_lengths", lambda self, chunk: [64, 128])
    calls = _spy_forward(monkeypatch)
    eng = _engine(moe_cpu_layers="all", moe_stream_prefill="on", moe_stream_min_tokens=32, moe_collect_stats=True)
    try:
        assert calls == [(64, False), (128, False)]
        report = eng.session.report()
        assert report["prefill_stream"]["streamed_layers"] == 0 and report["prefill_stream"]["streamed_bytes"] == 0
        assert report["moe_stats"]["steps"] == 0
        _generate(eng, list(range(7, 107)))  # a 100-token prompt: streamed
        report = eng.session.report()
        cpu_layers = len(eng.session.plan_result.cpu_layers)
        assert cpu_layers == eng.model_config.num_layers  # every layer's experts on the host: each one streamed
        assert report["prefill_stream"]["streamed_layers"] == cpu_layers  # one prompt chunk's, not the warm-up's
        assert report["moe_stats"]["steps"] == 4  # the decode steps but the last, whose routes are read next step
    finally:
        eng.close()
