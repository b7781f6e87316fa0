"""``bench make-model`` presets of the DeepSeek family (GGUF ``deepseek2``, the tensor set
llama.cpp's converter writes today: ``kv_b`` split into ``attn_k_b``, transposed per head,
and ``attn_v_b``; one KV head of the latent's size in the metadata).

Q4_K_M follows :func:`freetoken.cli.bench.tensor_plan.tensor_format` (Q4_K, the output head
Q6_K, ``ffn_down_exps``/``ffn_down_shexp`` Q6_K in the ``use_more_bits`` layers); rows whose
length is no multiple of 256 are Q8_0 (``attn_k_b``'s rows of ``qk_nope_head_dim``), and so
is ``attn_v_b`` (the engine dequantizes both at load: the absorbed decode multiplies by them
as dense matrices). Norms, the router and the score-correction bias are F32. The query
LoRA's norm weights have mean :data:`~freetoken.cli.bench.tensor_plan.QK_NORM_GAIN` (sharper
attention, see there). The checkpoint's next-token-prediction layer is left out.
"""

from __future__ import annotations

import dataclasses
from freetoken.cli.bench.tensor_plan import QK_NORM_GAIN, RESIDUAL_GAIN, Planned, TensorList, f32_values
from freetoken.handoff import Fmt
from freetoken.models.deepseek_v3 import DeepseekConfig, yarn_mscale
from freetoken.models.rope import RopeScaling


def _deepseek(yarn: RopeScaling, **kw: object) -> DeepseekConfig:
    cfg = DeepseekConfig(architecture="deepseek_v3", **kw)  # type: ignore[arg-type]
    cfg.rope_scaling = yarn
    cfg.softmax_mscale = yarn_mscale(yarn.factor, 1.0) if yarn.kind == "yarn" else 1.0  # mscale_all_dim 1
    return finish(cfg)


def finish(cfg: DeepseekConfig) -> DeepseekConfig:
    """The fields the family's config parsers derive: per-head sizes, KV heads, dense layers."""
    cfg.head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    cfg.num_kv_heads = cfg.num_heads
    cfg.mlp_only_layers = tuple(i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i))
    return cfg


PRESETS: dict[str, DeepseekConfig] = {
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json; V3.1, R1 and Kimi-K2 share the
    # layer): 61 layers, the first 3 a dense MLP of 18432, then 256 routed experts of 2048
    # (top-8: sigmoid scores over 8 groups of which 4 are kept, weights renormalised and
    # scaled by 2.5) plus one shared expert; 128 heads of MLA with query LoRA 1536, KV LoRA
    # 512, 128 + 64 (RoPE) query/key dims and 128 value dims; YaRN x40 over 4096 positions
    # with mscale = mscale_all_dim = 1; vocab 129280. About 400 GB at Q4_K_M: cut it with --layers.
    "deepseek-v3": _deepseek(
        RopeScaling(kind="yarn", factor=40.0, original_max_positions=4096, beta_fast=32.0, beta_slow=1.0,
                    attention_factor=1.0),
        vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128, head_dim=192,
        intermediate_size=18432, moe_intermediate_size=2048, num_experts=256, top_k=8, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=163840, tie_word_embeddings=False,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        scoring="sigmoid", n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        first_k_dense_replace=3,
    ),  # fmt: skip
    # The same tensor set at a few tens of MB (every K-quant row a multiple of 256).
    "deepseek-v3-tiny": _deepseek(
        RopeScaling(kind="yarn", factor=4.0, original_max_positions=1024, beta_fast=32.0, beta_slow=1.0,
                    attention_factor=1.0),
        vocab_size=32768, hidden_size=512, num_layers=3, num_heads=8, num_kv_heads=8, head_dim=96,
        intermediate_size=1024, moe_intermediate_size=256, num_experts=16, top_k=4, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
        q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        scoring="sigmoid", n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        first_k_dense_replace=1,
    ),  # fmt: skip
}


def cut(cfg: DeepseekConfig, n: int) -> DeepseekConfig:
    """The preset with its first ``n`` layers (at most ``n`` dense leading layers)."""
    out = dataclasses.replace(cfg, num_layers=n, first_k_dense_replace=min(cfg.first_k_dense_replace, n))
    return finish(out)


def plan_deepseek2(cfg: DeepseekConfig, quant: str) -> "list[Planned]":
    """llama.cpp's deepseek2 tensor set, layer by layer as its converter writes it."""
    H, E, I, L = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_layers
    Hq, nope, rope, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    lora, q_lora = cfg.kv_lora_rank, cfg.q_lora_rank
    S = I * cfg.n_shared_experts
    plan = TensorList(quant, L)
    add, q = plan.add, plan.fmt

    def norm(name: str, n: int, mean: float = 1.0) -> None:
        add(name, (n,), Fmt.F32, f32_values((n,), mean, 0.05))

    add("token_embd.weight", (cfg.vocab_size, H), q("token_embd", 0))
    for i in range(L):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", H)
        if q_lora:
            add(b + "attn_q_a.weight", (q_lora, H), q("attn_q", i))
            norm(b + "attn_q_a_norm.weight", q_lora, QK_NORM_GAIN)
            add(b + "attn_q_b.weight", (Hq * (nope + rope), q_lora), q("attn_q", i))
        else:
            add(b + "attn_q.weight", (Hq * (nope + rope), H), q("attn_q", i))
        add(b + "attn_kv_a_mqa.weight", (lora + rope, H), q("attn_k", i))
        norm(b + "attn_kv_a_norm.weight", lora)
        add(b + "attn_k_b.weight", (Hq, lora, nope), Fmt.Q8_0)
        add(b + "attn_v_b.weight", (Hq, v, lora), Fmt.Q8_0)
        add(b + "attn_output.weight", (H, Hq * v), q("attn_output", i), gain=RESIDUAL_GAIN)
        norm(b + "ffn_norm.weight", H)
        if not cfg.is_moe_layer(i):
            F = cfg.intermediate_size
            add(b + "ffn_gate.weight", (F, H), q("ffn_gate", i))
            add(b + "ffn_up.weight", (F, H), q("ffn_up", i))
            add(b + "ffn_down.weight", (H, F), q("ffn_down_shexp", i), gain=RESIDUAL_GAIN)
            continue
        add(b + "ffn_gate_inp.weight", (E, H), Fmt.F32, f32_values((E, H), 0.0, 0.02))
        if cfg.scoring == "sigmoid":
            add(b + "exp_probs_b.bias", (E,), Fmt.F32, f32_values((E,), 0.0, 0.01))
        add(b + "ffn_gate_exps.weight", (E, I, H), q("ffn_gate_exps", i))
        add(b + "ffn_up_exps.weight", (E, I, H), q("ffn_up_exps", i))
        add(b + "ffn_down_exps.weight", (E, H, I), q("ffn_down_exps", i), gain=RESIDUAL_GAIN)
        if S:
            add(b + "ffn_gate_shexp.weight", (S, H), q("ffn_gate_shexp", i))
            add(b + "ffn_up_shexp.weight", (S, H), q("ffn_up_shexp", i))
            add(b + "ffn_down_shexp.weight", (H, S), q("ffn_down_shexp", i), gain=RESIDUAL_GAIN)
    norm("output_norm.weight", H)
    add("output.weight", (cfg.vocab_size, H), q("output", L))
    return plan.tensors
