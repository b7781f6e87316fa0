"""Tiny random transformers models of the Mixtral, OLMoE, GPT-OSS, GLM-4.5 and DeepSeek-V3/V2
families (FP32, eager attention), saved as HF checkpoints for the engine to load."""

from __future__ import annotations

import random
from typing import Any

import torch


def randomize(model: Any, seed: int) -> None:
    """Fresh random weights: norms around 1, everything else N(0, 0.1^2) (sinks N(0, 1));
    GLM-4.5's score-correction biases N(0, 0.3^2) (sigmoid scores move by about that much)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "sinks" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


COMMON = dict(vocab_size=160, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False)


def mixtral_config(**over: Any) -> Any:
    from transformers import MixtralConfig

    kw = dict(COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16)
    kw.update(over)
    theta = kw.pop("rope_theta", 10000.0)
    cfg = MixtralConfig(**kw)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return cfg


def olmoe_config(**over: Any) -> Any:
    from transformers import OlmoeConfig

    kw = dict(COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)
    kw.update(over)
    theta = kw.pop("rope_theta", 10000.0)
    cfg = OlmoeConfig(**kw)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return cfg


def gpt_oss_config(**over: Any) -> Any:
    from transformers import GptOssConfig

    kw = dict(COMMON, num_hidden_layers=4, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
              head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2)
    kw.update(over)
    rope = kw.pop("rope_parameters", {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    cfg = GptOssConfig(**kw)
    cfg.rope_parameters = rope
    return cfg


def glm4_moe_config(**over: Any) -> Any:
    """Every feature on: head_dim 16 != 64/4 with half of it rotated, q/k/v biases, q/k norms,
    one dense first layer, a shared expert, 4 groups of 4 experts of which 2 groups are kept,
    top-3, renormalised weights scaled by 2.5, one next-token-prediction layer declared."""
    from transformers import Glm4MoeConfig

    kw = dict(COMMON, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=32, n_routed_experts=16,
              num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
              norm_topk_prob=True, routed_scaling_factor=2.5, head_dim=16, attention_bias=True, use_qk_norm=True,
              num_nextn_predict_layers=1, rms_norm_eps=1e-5)  # fmt: skip
    kw.update(over)
    theta = kw.pop("rope_theta", 10000.0)
    factor = kw.pop("partial_rotary_factor", 0.5)
    cfg = Glm4MoeConfig(**kw)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
    return cfg


#: a YaRN RoPE with DeepSeek-V3's mscale/mscale_all_dim, over a short original context so that
#: the tiny models' positions reach the interpolated frequencies
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def deepseek_v3_config(**over: Any) -> Any:
    """Every feature on: query LoRA, YaRN with mscale_all_dim (softmax scale and rotary tables
    both scaled: mscale 0.707 != mscale_all_dim 1), interleaved RoPE, one dense first layer,
    a shared expert, 4 groups of 4 experts of which 2 are kept, top-3, renormalised weights
    scaled by 2.5, one next-token-prediction layer declared."""
    from transformers import DeepseekV3Config

    kw = dict(COMMON, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=32, n_routed_experts=16,
              num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
              norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
              qk_rope_head_dim=8, v_head_dim=10, rope_interleave=True, num_nextn_predict_layers=1)  # fmt: skip
    rope = over.pop("rope", None) or dict(DEEPSEEK_YARN, mscale=0.707)
    kw.update(over)
    cfg = DeepseekV3Config(**kw)
    cfg.rope_parameters = rope
    return cfg


def deepseek_v2_config(**over: Any) -> Any:
    """DeepSeek-V2-Lite's shape in small: no query LoRA, softmax routing (``topk_method``
    "greedy" unless given), two shared experts, one dense first layer, YaRN with
    mscale = mscale_all_dim (tables unscaled, softmax scale scaled)."""
    from transformers import DeepseekV2Config

    kw = dict(COMMON, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=32, n_routed_experts=8,
              num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=False,
              routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
              v_head_dim=10, topk_method="greedy", n_group=None, topk_group=None)  # fmt: skip
    rope = over.pop("rope", None) or DEEPSEEK_YARN
    kw.update(over)
    cfg = DeepseekV2Config(**kw)
    cfg.rope_parameters = rope
    return cfg


def make_model(family: str, seed: int, **over: Any) -> Any:
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Glm4MoeForCausalLM, GptOssForCausalLM
    from transformers import MixtralForCausalLM, OlmoeForCausalLM

    cls, cfg = {"mixtral": (MixtralForCausalLM, mixtral_config), "olmoe": (OlmoeForCausalLM, olmoe_config),
                "gpt_oss": (GptOssForCausalLM, gpt_oss_config),
                "glm4_moe": (Glm4MoeForCausalLM, glm4_moe_config),
                "deepseek_v3": (DeepseekV3ForCausalLM, deepseek_v3_config),
                "deepseek_v2": (DeepseekV2ForCausalLM, deepseek_v2_config)}[family]
    config = cfg(**over)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    randomize(model, seed)
    return model


def save(model: Any, path: str) -> None:
    model.save_pretrained(path)


@torch.no_grad()
def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def _per_position_min(model: Any, ids: list[int], routers: list[Any], gaps_of: Any) -> torch.Tensor:
    """``[T]``: the smallest of ``gaps_of(router, inputs [T, H])`` over ``routers``."""
    gaps: list[torch.Tensor] = []

    def record(module: Any, inputs: Any, output: Any) -> None:
        gaps.append(gaps_of(module, inputs[0].reshape(-1, inputs[0].shape[-1]).float()))

    hooks = [r.register_forward_hook(record) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(gaps).amin(0)


def router_gaps(model: Any, ids: list[int], routers: list[Any], top_k: int) -> torch.Tensor:
    """Per position of ``ids`` (``[T]``), the smallest gap over the layers' routers (linear
    modules) between the ``top_k``-th and the next router logit in transformers' forward:
    where it is within the engine's rounding noise, the two may choose different experts (a
    routing flip is no error of the engine, but moves its position's logits by far more than
    rounding)."""

    def gaps_of(router: Any, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(router, "bias", None)  # (Qwen3-MoE's router module has none)
        logits = x @ router.weight.float().T + (0 if bias is None else bias.float())
        top = logits.topk(top_k + 1, dim=-1).values
        return top[:, top_k - 1] - top[:, top_k]

    return _per_position_min(model, ids, routers, gaps_of)


def grouped_router_gaps(model: Any, ids: list[int]) -> torch.Tensor:
    """:func:`router_gaps` for DeepSeek-V3's grouped routing (transformers'
    ``DeepseekV3TopkRouter``, every MoE layer's ``mlp.gate``), in the choice scores (sigmoid
    plus correction bias): per position, the smallest gap between the ``topk_group``-th and
    the next group score (each group's two best scores summed) and between the ``top_k``-th
    and the next expert score within the chosen groups."""

    def gaps_of(gate: Any, x: torch.Tensor) -> torch.Tensor:
        scores = (x @ gate.weight.float().T).sigmoid() + gate.e_score_correction_bias.float()
        per_group = gate.num_experts // gate.num_group
        groups = scores.view(-1, gate.num_group, per_group).topk(2, dim=-1).values.sum(-1)
        best = groups.topk(min(gate.topk_group + 1, gate.num_group), dim=-1)
        group_gap = (best.values[:, -2] - best.values[:, -1] if gate.topk_group < gate.num_group
                     else torch.full_like(groups[:, 0], float("inf")))  # fmt: skip
        chosen = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, best.indices[:, :gate.topk_group], True)
        top = scores.masked_fill(~chosen.repeat_interleave(per_group, dim=1), float("-inf")).topk(gate.top_k + 1, dim=-1)
        return torch.minimum(group_gap, top.values[:, -2] - top.values[:, -1])

    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    return _per_position_min(model, ids, routers, gaps_of)


def assert_engine_matches_hf(eng: Any, model: Any, rng: random.Random, what: str,
                             prompts: tuple[int, ...] = (3, 21), new_tokens: int = 5) -> None:
    """The engine's logits of a random 29-token prompt, then of requests with prompts of the
    given lengths prefilled and decoded together (greedy), against transformers' forward of
    the same ids."""
    from freetoken import SamplingParams
    from helpers import LogitsRecorder, assert_close

    ids = [rng.randrange(160) for _ in range(29)]
    assert_close(eng.prompt_logits(ids), hf_logits(model, ids), what)
    token_lists = [[rng.randrange(160) for _ in range(n)] for n in prompts]
    with LogitsRecorder(eng) as rec:
        reqs = [eng.add_request(p, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
                for p in token_lists]
        while eng.has_work():
            eng.step()
    for p, r in zip(token_lists, reqs):
        ref = hf_logits(model, p + r.output_ids)[len(p) - 1 : -1]
        assert_close(torch.stack(rec[r.request_id]), ref, f"{what} decode")


def fake_gpu_backend() -> Any:
    """The fake GPU backend of the qualification tests (tests/qualify/fake_backend.py): the
    GPU session's code and decode graphs (replays with capture semantics) on CPU tensors."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("ft_families_fake_backend",
                                                  Path(__file__).resolve().parents[1] / "qualify" / "fake_backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FakeGpuBackend()


def greedy_on_cpu_and_gpu_session(path: str, prompts: list[list[int]],
                                  new_tokens: int = 8) -> dict[str, tuple[list[list[int]], list[torch.Tensor]]]:
    """``prompts`` decoded greedily together by the CPU backend ("cpu") and by the GPU
    session's code in decode graphs ("gpu-session": :func:`fake_gpu_backend`, every layer's
    experts through the hybrid layer; the graphs must have been replayed): each run's output
    ids and logit rows per request."""
    from freetoken import SamplingParams
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine
    from helpers import LogitsRecorder

    runs = {}
    for name, kw, backend in (("cpu", dict(backend="cpu"), None),
                              ("gpu-session", dict(moe_cpu_layers="all", cuda_graph_max_bs=4), fake_gpu_backend())):
        eng = LLMEngine(EngineConfig(model=path, dtype="float32", max_model_len=128, kv_cache_tokens=1024,
                                     max_running_requests=4, **kw), **({"backend": backend} if backend else {}))
        try:
            if backend is not None:
                assert eng.backend_info()["graphs"] is True
            with LogitsRecorder(eng) as rec:
                reqs = [eng.add_request(p, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
                        for p in prompts]
                while eng.has_work():
                    eng.step()
            if backend is not None:
                assert eng.session.runner.replays > 0
            runs[name] = ([r.output_ids for r in reqs], [torch.stack(rec[r.request_id]) for r in reqs])
        finally:
            eng.close()
    return runs
