"""``bench make-model``'s GLM-4.5 files (GGUF ``glm4moe``): the tensor set; the presets and
the format rules are in :mod:`freetoken.cli.bench.tensor_plan`."""

from __future__ import annotations

from freetoken.cli.bench.tensor_plan import QK_NORM_GAIN, RESIDUAL_GAIN, Planned, TensorList, f32_values
from freetoken.handoff import Fmt
from freetoken.models.glm4_moe import Glm4MoeConfig


def plan_glm4moe(cfg: Glm4MoeConfig, quant: str) -> "list[Planned]":
    """llama.cpp's glm4moe tensor set (src/models/glm4-moe.cpp), layer by layer as its converter
    writes it: attention with q/k/v biases (q/k norms where ``use_qk_norm``), the post-attention
    norm, then a dense MLP (the first ``first_k_dense_replace`` layers) or the router, its
    score-correction bias, the routed experts and the shared expert."""
    H, D, E, I, L = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_layers
    S = I * cfg.n_shared_experts
    plan = TensorList(quant, L)
    add, q = plan.add, plan.fmt

    add("token_embd.weight", (cfg.vocab_size, H), q("token_embd", 0))
    for i in range(L):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (H,), Fmt.F32, f32_values((H,), 1.0, 0.05))
        for n, rows in (("attn_q", cfg.num_heads * D), ("attn_k", cfg.num_kv_heads * D), ("attn_v", cfg.num_kv_heads * D)):
            add(b + n + ".weight", (rows, H), q(n, i))
            if cfg.attention_bias:
                add(b + n + ".bias", (rows,), Fmt.F32, f32_values((rows,), 0.0, 0.02))
        add(b + "attn_output.weight", (H, cfg.num_heads * D), q("attn_output", i), gain=RESIDUAL_GAIN)
        if cfg.use_qk_norm:
            add(b + "attn_q_norm.weight", (D,), Fmt.F32, f32_values((D,), QK_NORM_GAIN, 0.05))
            add(b + "attn_k_norm.weight", (D,), Fmt.F32, f32_values((D,), QK_NORM_GAIN, 0.05))
        add(b + "post_attention_norm.weight", (H,), Fmt.F32, f32_values((H,), 1.0, 0.05))
        if i < cfg.first_k_dense_replace:
            F = cfg.intermediate_size
            add(b + "ffn_gate.weight", (F, H), q("ffn_gate", i))
            add(b + "ffn_up.weight", (F, H), q("ffn_up", i))
            add(b + "ffn_down.weight", (H, F), q("ffn_down_shexp", i), gain=RESIDUAL_GAIN)
            continue
        add(b + "ffn_gate_inp.weight", (E, H), Fmt.F32, f32_values((E, H), 0.0, 0.02))
        add(b + "exp_probs_b.bias", (E,), Fmt.F32, f32_values((E,), 0.0, 0.01))
        add(b + "ffn_gate_exps.weight", (E, I, H), q("ffn_gate_exps", i))
        add(b + "ffn_up_exps.weight", (E, I, H), q("ffn_up_exps", i))
        add(b + "ffn_down_exps.weight", (E, H, I), q("ffn_down_exps", i), gain=RESIDUAL_GAIN)
        if S:
            add(b + "ffn_gate_shexp.weight", (S, H), q("ffn_gate_shexp", i))
            add(b + "ffn_up_shexp.weight", (S, H), q("ffn_up_shexp", i))
            add(b + "ffn_down_shexp.weight", (H, S), q("ffn_down_shexp", i), gain=RESIDUAL_GAIN)
    add("output_norm.weight", (H,), Fmt.F32, f32_values((H,), 1.0, 0.05))
    add("output.weight", (cfg.vocab_size, H), q("output", L))
    return plan.tensors
