"""Shared test helpers: tiny random Qwen3-MoE checkpoints and HF references."""

from __future__ import annotations

from typing import Any

import torch

# FP32 everywhere. The engine and HF differ only in summation order (SDPA vs eager
# attention, GEMM blocking, per-expert accumulation order); each op contributes
# ~1e-7 relative error, a few layers of it stay well below 1e-4 on logits of size
# O(1). A real bug (rope, norm, routing, cache slot) moves logits by >1e-2.
ATOL = 2e-4
RTOL = 1e-4


def tiny_config(**over: Any) -> Any:
    from transformers import Qwen3MoeConfig

    kw = dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, norm_topk_prob=True, rope_theta=10000.0, tie_word_embeddings=False,
        attn_implementation="eager",
    )
    kw.update(over)
    theta = kw.pop("rope_theta")
    cfg = Qwen3MoeConfig(**kw)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return cfg


def randomize(model: Any, seed: int) -> None:
    """Fresh random weights (norm weights around 1, everything else N(0, 0.1^2))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_hf(path: str, seed: int, **over: Any) -> Any:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_config(**over)).float().eval()
    randomize(model, seed)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(path)
    return model


@torch.no_grad()
def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_logits_kv_rounded(model: Any, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """:func:`hf_logits` with every attention's keys (after RoPE) and values rounded to
    ``dtype`` first, as a KV cache of that dtype holds them (the eager attention of
    transformers' Qwen3-MoE module wrapped for the call)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    eager = m.eager_attention_forward

    def rounded(module: Any, query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
        return eager(module, query, key.to(dtype).float(), value.to(dtype).float(), *args, **kw)

    m.eager_attention_forward = rounded
    try:
        return model(torch.tensor([ids])).logits[0].float()
    finally:
        m.eager_attention_forward = eager


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def engine_for(path: str, **kw: Any) -> Any:
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine

    kw.setdefault("kv_cache_tokens", 4096)
    return LLMEngine(EngineConfig(model=path, backend="cpu", **kw))


class LogitsRecorder:
    """Every sampled row of logits per request id, through the engine's public
    ``add_logits_observer`` hook (``with LogitsRecorder(eng) as rec: ... rec[rid]``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.rows: dict[str, list[torch.Tensor]] = {}
        self._remove = engine.add_logits_observer(self._observe)

    def _observe(self, request_ids: list[str], logits: torch.Tensor) -> None:
        for i, rid in enumerate(request_ids):
            self.rows.setdefault(rid, []).append(logits[i].detach().float().cpu().clone())

    def __getitem__(self, request_id: str) -> list[torch.Tensor]:
        return self.rows[request_id]

    def close(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None

    def __enter__(self) -> "LogitsRecorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_random_greedy(eng: Any, seed: int, lens: list[tuple[int, int]]) -> list[Any]:
    """One greedy request per ``(prompt tokens, max tokens)`` of ``lens``, random prompt ids
    from ``seed``, all added at once and run to completion; the requests."""
    import random

    from freetoken.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    V = eng.model_config.vocab_size
    reqs = [eng.add_request([rng.randrange(V) for _ in range(n)],
                            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)) for n, m in lens]
    while eng.has_work():
        eng.step()
    return reqs


def run_with_faults(eng: Any, requests: list[tuple[list[int], Any]], params: Any, max_steps: int) -> list[Any]:
    """Add one request per ``(prompt ids, fault)`` (``fault`` as ``LLMEngine.add_request``
    takes it, None for none) with ``params``, step until nothing is left (at most
    ``max_steps`` steps); the requests in order."""
    reqs = [eng.add_request(ids, params, fault=fault) for ids, fault in requests]
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        assert steps < max_steps, f"still working after {steps} steps"
    return reqs
