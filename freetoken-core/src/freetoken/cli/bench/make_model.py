"""``freetoken bench make-model``: a synthetic GGUF with a real model's shapes.

Real weights cannot be downloaded here, and decode speed depends only on shapes and
formats, so benchmarks run on files of the real geometry filled with random but
valid blocks (random quantized bits, small finite fp16 scales, repeated from one pool
per format: gguf_writer.RandomBlockPool). gguf-py writes the header; the tensor data goes
out from the pools through several writer threads (``--threads``), so a 17 GB file costs
what the page cache and the disk cost. Its vocabulary has no text
(``tokenizer.ggml.model = "none"`` with ``{arch}.vocab_size``): FreeToken and llama.cpp
both load it and take token ids, so one file serves both in a benchmark.

The values are chosen so that routing behaves like a trained model's, not collapsed:
K-quant blocks are zero-mean (``RandomBlockPool``'s centered blocks), the q/k norms
sharpen attention (``QK_NORM_GAIN``: with near-uniform attention every position's
output is the context's mean value vector) and the matrices writing into the residual
stream are scaled down (``RESIDUAL_GAIN``). Without these the hidden states of all tokens
converge on one direction and the routers of the deeper layers send every token to the
same few experts, which makes an expert cache look perfect; with them, random tokens
spread over nearly all experts of every layer (tests/engine/test_make_model_gguf.py).

Q4_K_M follows llama.cpp's mix (llama_tensor_get_type): Q4_K everywhere, except the
output head Q6_K, and attn_v and ffn_down(_exps) Q6_K in the layers where
``use_more_bits(i, n)`` holds (i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2, n = the
file's layer count); norms and the router stay F32 (llama.cpp never quantizes
ffn_gate_inp). llama.cpp turns attn_k and attn_v to Q8_0 for models of exactly 8
experts only; no preset here has 8.

Qwen3.5-MoE files (``qwen35moe``) follow the same rules with llama.cpp's counting: its
"attn_v-like" tensors are attn_v of the full-attention layers and attn_qkv of the Gated
DeltaNet layers (one per layer, so ``use_more_bits(i, n)`` again picks them by layer),
and "ffn_down" covers both ffn_down_exps and the shared expert's ffn_down_shexp. The
DeltaNet's short-convolution kernel, ssm_a, ssm_dt, the norms and both routers stay F32.

GLM-4.5 files (``glm4moe``, llama.cpp's src/models/glm4-moe.cpp tensor set) have q/k/v biases,
a dense SwiGLU first layer, a shared expert and the routing's score-correction bias
(``exp_probs_b.bias``, F32 like the router). Rows whose length is no multiple of 256 (GLM-4.5-Air's
expert intermediate 1408 and dense intermediate 10944: every down projection) cannot be K-quants:
they are Q8_0, where llama.cpp's own Q4_K_M falls back to Q5_0 (not a format FreeToken runs).
Its files carry no next-token-prediction layer (``nextn_predict_layers`` 0).

GLM-4.5's tensor set: :mod:`freetoken.cli.bench.make_model_glm`; DeepSeek-V3 files (``deepseek2``):
:mod:`freetoken.cli.bench.make_model_deepseek`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Optional

import numpy as np

from freetoken.cli.bench import make_model_deepseek as deepseek
from freetoken.handoff import Fmt
from freetoken.models.deepseek_v3 import DeepseekConfig
from freetoken.cli.bench.tensor_plan import (
    MXFP4,
    QK_NORM_GAIN,
    QUANTS,
    RESIDUAL_GAIN,
    Planned,
    f32_values,
    packed_blocks,
    tensor_format,
    uniform_values,
)
from freetoken.models.gguf_writer import RandomBlockPool
from freetoken.models.config import ModelConfig
from freetoken.models.glm4_moe import Glm4MoeConfig
from freetoken.models.qwen_hybrid import FULL, LINEAR, HybridConfig, finish_config


def _hybrid_layers(n: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))


def _glm(**kw: object) -> Glm4MoeConfig:
    cfg = Glm4MoeConfig(architecture="glm4_moe", **kw)  # type: ignore[arg-type]
    cfg.mlp_only_layers = tuple(range(cfg.first_k_dense_replace))
    return cfg


PRESETS: dict[str, ModelConfig] = {
    "qwen3-30b-a3b": ModelConfig(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, top_k=8,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    # Qwen3-235B-A22B: 94 layers, 64 q / 4 kv heads of 128, 128 experts of 1536, top-8,
    # vocab 151936 (about 142 GB at Q4_K_M; cut it with --layers).
    "qwen3-235b-a22b": ModelConfig(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
        head_dim=128, intermediate_size=12288, moe_intermediate_size=1536, num_experts=128, top_k=8,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    # A few tens of MB with the same tensor set and Q4_K_M rules (every row a multiple of
    # 256 values, 16 experts): for tests and for checking that llama.cpp loads the files.
    "qwen3-moe-tiny": ModelConfig(
        architecture="qwen3_moe", vocab_size=32768, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
        head_dim=64, intermediate_size=1024, moe_intermediate_size=256, num_experts=16, top_k=4,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # GPT-OSS-20B: 24 layers alternating sliding-window (128) and full attention, 32 experts
    # of intermediate 2880, top-4; hidden 2880 is no multiple of 256, so its files are MXFP4
    # experts with Q8_0 elsewhere (as llama.cpp's converter writes them) or all Q8_0.
    "gpt-oss-20b": ModelConfig(
        architecture="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=24, num_heads=64, num_kv_heads=8,
        head_dim=64, intermediate_size=0, moe_intermediate_size=2880, num_experts=32, top_k=4,
        norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    # GPT-OSS-120B: the 20B's layer (alternating windows, 64 q / 8 kv heads of 64, experts of
    # 2880, top-4) with 36 layers and 128 experts (about 63 GB with MXFP4 experts).
    "gpt-oss-120b": ModelConfig(
        architecture="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=36, num_heads=64, num_kv_heads=8,
        head_dim=64, intermediate_size=0, moe_intermediate_size=2880, num_experts=128, top_k=4,
        norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    # Qwen3.5-35B-A3B (and Qwen3.6-35B-A3B, the same shapes), text model of the published
    # config.json: 40 layers, every 4th gated full attention (16 q / 2 kv heads of 256, a
    # quarter of each head rotated, RoPE base 1e7), the others Gated DeltaNet (16 key heads,
    # 32 value heads, head dims 128, conv kernel 4); 256 experts of 512, top-8, plus a shared
    # expert of 512; vocab 248320. The multi-token-prediction layer is left out (not run).
    "qwen3.5-35b-a3b": finish_config(HybridConfig(
        architecture="qwen3_5_moe", vocab_size=248320, hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=2,
        head_dim=256, intermediate_size=0, moe_intermediate_size=512, num_experts=256, top_k=8,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10_000_000.0, max_position_embeddings=262144,
        tie_word_embeddings=False, layer_types=_hybrid_layers(40), linear_key_heads=16, linear_value_heads=32,
        linear_key_dim=128, linear_value_dim=128, conv_kernel=4, rotary_dim=64, shared_expert_intermediate_size=512,
        value_heads_tiled=True,
    ), "qwen3.5-35b-a3b"),
    # The same tensor set at a few tens of MB (both layer types, every row a multiple of 256).
    "qwen3.5-moe-tiny": finish_config(HybridConfig(
        architecture="qwen3_5_moe", vocab_size=32768, hidden_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=128, intermediate_size=0, moe_intermediate_size=256, num_experts=16, top_k=4,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10_000_000.0, max_position_embeddings=4096,
        tie_word_embeddings=False, layer_types=_hybrid_layers(4), linear_key_heads=2, linear_value_heads=4,
        linear_key_dim=64, linear_value_dim=64, conv_kernel=4, rotary_dim=32, shared_expert_intermediate_size=256,
        value_heads_tiled=True,
    ), "qwen3.5-moe-tiny"),
    # GLM-4.5-Air (zai-org/GLM-4.5-Air config.json): 46 layers, the first a dense MLP of
    # 10944, then 128 routed experts of 1408 (top-8: sigmoid scores, one group, weights
    # renormalised, scale 1.0) plus one shared expert; 96 q / 8 kv heads of 128 with q/k/v
    # biases, no q/k norms, half of each head rotated; vocab 151552. The checkpoint's
    # next-token-prediction layer is left out (not run).
    "glm-4.5-air": _glm(
        vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96, num_kv_heads=8, head_dim=128,
        intermediate_size=10944, moe_intermediate_size=1408, num_experts=128, top_k=8, norm_topk_prob=True,
        rms_norm_eps=1e-5, rope_theta=1_000_000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rotary_dim=64, attention_bias=True, use_qk_norm=False, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, first_k_dense_replace=1,
    ),
    # The same tensor set at a few tens of MB (every row a multiple of 256).
    "glm-4.5-air-tiny": _glm(
        vocab_size=32768, hidden_size=512, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=64,
        intermediate_size=1024, moe_intermediate_size=256, num_experts=16, top_k=4, norm_topk_prob=True,
        rms_norm_eps=1e-5, rope_theta=1_000_000.0, max_position_embeddings=4096, tie_word_embeddings=False,
        rotary_dim=32, attention_bias=True, use_qk_norm=False, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, first_k_dense_replace=1,
    ),
    "gpt-oss-tiny": ModelConfig(
        architecture="gpt_oss", vocab_size=4096, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
        head_dim=32, intermediate_size=0, moe_intermediate_size=128, num_experts=8, top_k=2,
        norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    **deepseek.PRESETS,
}

#: GPT-OSS's hyper-parameters beyond ModelConfig (sliding window, YaRN factor and original context)
GPT_OSS_WINDOW, GPT_OSS_YARN_FACTOR, GPT_OSS_YARN_ORIGINAL = 128, 32.0, 4096


def skew_routers(tensors: list[Planned], skew: float) -> list[Planned]:
    """The plan with every router (``*ffn_gate_inp.weight``, ``[E, H]``) drawn as before and
    the row of the expert of rank ``r`` scaled by ``exp(-skew * r / E)``: a router logit's
    spread grows with its row's norm, so top-k picks the low-ranked experts more often (skew
    0: uniform routing; about 3: a few experts take most routes, like a trained model's hot
    experts). The ranks are a permutation of the experts drawn per router from its tensor
    name, so each layer has its own hot experts and they are not the lowest ids (an expert
    cache that starts with the lowest ids has to find them). Other tensors and the draws'
    order are unchanged."""
    if skew == 0:
        return tensors
    out = []
    for t in tensors:
        if t.name.endswith("ffn_gate_inp.weight") and len(t.shape) == 2:
            e = t.shape[0]
            rank = np.random.default_rng(zlib.crc32(t.name.encode())).permutation(e)
            scale = np.exp(-skew * rank.astype(np.float32) / e)[:, None]
            t = dataclasses.replace(t, make=lambda rng, pool, make=t.make, scale=scale: (make(rng, pool) * scale)
                                    .astype(np.float32))
        out.append(t)
    return out


def random_mxfp4(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` ggml MXFP4 rows: random codes, block exponents 2^-9..2^-5 (values O(0.01))."""
    nblk = rows * cols // 32
    b = rng.integers(0, 256, size=(nblk, 17), dtype=np.uint8)
    b[:, 0] = rng.integers(119, 124, size=nblk, dtype=np.uint8)
    return b.reshape(rows, -1)


def plan_gpt_oss(cfg: ModelConfig, quant: str) -> list[Planned]:
    """llama.cpp's gpt-oss tensor set: Q8_0 matrices (experts MXFP4 with ``mxfp4``), F32
    norms, biases, sinks and router."""
    if quant not in ("mxfp4", "q8_0"):
        raise ValueError(f"GPT-OSS files are mxfp4 or q8_0, as llama.cpp writes them (its K-quants need hidden "
                         f"sizes that are multiples of 256, and GPT-OSS's 2880 is not), not {quant}")
    H, D, E, I, L = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_layers
    out: list[Planned] = []

    f32 = f32_values

    def add(name: str, shape: tuple[int, ...], fmt: int, make=None) -> None:
        if make is None and fmt == MXFP4:
            rows = int(np.prod(shape[:-1]))
            make = lambda rng, pool: random_mxfp4(rows, shape[-1], rng).reshape(*shape[:-1], -1)  # noqa: E731
        elif make is None:
            rows = int(np.prod(shape[:-1]))
            make = lambda rng, pool: pool.blocks(fmt, rows, shape[-1]).reshape(*shape[:-1], -1)  # noqa: E731
        out.append(Planned(name, shape, fmt, make))

    experts = MXFP4 if quant == "mxfp4" else Fmt.Q8_0
    add("token_embd.weight", (cfg.vocab_size, H), Fmt.Q8_0)
    for i in range(L):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (H,), Fmt.F32, f32((H,), 1.0, 0.05))
        add(b + "post_attention_norm.weight", (H,), Fmt.F32, f32((H,), 1.0, 0.05))
        for n, rows in (("attn_q", cfg.num_heads * D), ("attn_k", cfg.num_kv_heads * D), ("attn_v", cfg.num_kv_heads * D)):
            add(b + n + ".weight", (rows, H), Fmt.Q8_0)
            add(b + n + ".bias", (rows,), Fmt.F32, f32((rows,), 0.0, 0.02))
        add(b + "attn_output.weight", (H, cfg.num_heads * D), Fmt.Q8_0)
        add(b + "attn_output.bias", (H,), Fmt.F32, f32((H,), 0.0, 0.02))
        add(b + "attn_sinks.weight", (cfg.num_heads,), Fmt.F32, f32((cfg.num_heads,), 0.0, 1.0))
        add(b + "ffn_gate_inp.weight", (E, H), Fmt.F32, f32((E, H), 0.0, 0.02))
        add(b + "ffn_gate_inp.bias", (E,), Fmt.F32, f32((E,), 0.0, 0.02))
        for r, shape in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I))):
            add(b + f"ffn_{r}_exps.weight", shape, experts)
            add(b + f"ffn_{r}_exps.bias", shape[:2], Fmt.F32, f32(shape[:2], 0.0, 0.02))
    add("output_norm.weight", (H,), Fmt.F32, f32((H,), 1.0, 0.05))
    add("output.weight", (cfg.vocab_size, H), Fmt.Q8_0)
    return out


def plan_qwen35(cfg: HybridConfig, quant: str) -> list[Planned]:
    """llama.cpp's qwen35moe tensor set (src/models/qwen35moe.cpp), layer by layer as its
    converter writes it: gated full attention (attn_q holds each head's query and output
    gate) or Gated DeltaNet (attn_qkv, attn_gate, ssm_*), then the routed and shared experts.
    Decay rates ``ssm_a = -exp(A_log)`` in (-16, -1), positive ``ssm_dt`` biases."""
    H, D, E, I, L = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_layers
    hk, hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    if dk != dv:
        raise ValueError(f"llama.cpp's qwen35moe needs equal key and value head dims (got {dk} and {dv})")
    S = cfg.shared_expert_intermediate_size
    out: list[Planned] = []

    def add(name: str, shape: tuple[int, ...], fmt: int, make=None) -> None:
        out.append(Planned(name, shape, fmt, make or packed_blocks(shape, fmt)))

    def q(role: str, i: int) -> int:
        return tensor_format(quant, role, i, L)

    add("token_embd.weight", (cfg.vocab_size, H), q("token_embd", 0))
    for i in range(L):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (H,), Fmt.F32, f32_values((H,), 1.0, 0.05))
        if cfg.layer_types[i] == FULL:
            add(b + "attn_q.weight", (2 * cfg.num_heads * D, H), q("attn_q", i))
            add(b + "attn_k.weight", (cfg.num_kv_heads * D, H), q("attn_k", i))
            add(b + "attn_v.weight", (cfg.num_kv_heads * D, H), q("attn_v", i))
            add(b + "attn_output.weight", (H, cfg.num_heads * D), q("attn_output", i))
            add(b + "attn_q_norm.weight", (D,), Fmt.F32, f32_values((D,), 1.0, 0.05))
            add(b + "attn_k_norm.weight", (D,), Fmt.F32, f32_values((D,), 1.0, 0.05))
        else:
            conv_dim = 2 * hk * dk + hv * dv
            add(b + "attn_qkv.weight", (conv_dim, H), q("attn_qkv", i))
            add(b + "attn_gate.weight", (hv * dv, H), q("attn_gate", i))
            conv = (conv_dim, cfg.conv_kernel)
            add(b + "ssm_conv1d.weight", conv, Fmt.F32, f32_values(conv, 0.0, 0.3))
            add(b + "ssm_dt.bias", (hv,), Fmt.F32, uniform_values((hv,), 0.5, 2.0))
            add(b + "ssm_a", (hv,), Fmt.F32, uniform_values((hv,), -16.0, -1.0))
            add(b + "ssm_beta.weight", (hv, H), q("ssm_beta", i))
            add(b + "ssm_alpha.weight", (hv, H), q("ssm_alpha", i))
            add(b + "ssm_norm.weight", (dv,), Fmt.F32, f32_values((dv,), 1.0, 0.05))
            add(b + "ssm_out.weight", (H, hv * dv), q("ssm_out", i))
        add(b + "post_attention_norm.weight", (H,), Fmt.F32, f32_values((H,), 1.0, 0.05))
        add(b + "ffn_gate_inp.weight", (E, H), Fmt.F32, f32_values((E, H), 0.0, 0.02))
        add(b + "ffn_gate_exps.weight", (E, I, H), q("ffn_gate_exps", i))
        add(b + "ffn_up_exps.weight", (E, I, H), q("ffn_up_exps", i))
        add(b + "ffn_down_exps.weight", (E, H, I), q("ffn_down_exps", i))
        add(b + "ffn_gate_inp_shexp.weight", (H,), Fmt.F32, f32_values((H,), 0.0, 0.02))
        add(b + "ffn_gate_shexp.weight", (S, H), q("ffn_gate_shexp", i))
        add(b + "ffn_up_shexp.weight", (S, H), q("ffn_up_shexp", i))
        add(b + "ffn_down_shexp.weight", (H, S), q("ffn_down_shexp", i))
    add("output_norm.weight", (H,), Fmt.F32, f32_values((H,), 1.0, 0.05))
    add("output.weight", (cfg.vocab_size, H), q("output", L))
    return out


def cut_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """The preset with only its first ``n`` layers (hybrids keep their layer pattern, GLM-4.5
    at most ``n`` dense leading layers)."""
    if isinstance(cfg, DeepseekConfig):
        return deepseek.cut(cfg, n)
    out = dataclasses.replace(cfg, num_layers=n)
    if isinstance(out, Glm4MoeConfig):
        out.first_k_dense_replace = min(out.first_k_dense_replace, n)
        out.mlp_only_layers = tuple(range(out.first_k_dense_replace))
    if isinstance(out, HybridConfig):
        out.layer_types = tuple(cfg.layer_types[:n])
        out = finish_config(out, f"{cfg.architecture} cut to {n} layers")
    return out


def plan(cfg: ModelConfig, quant: str) -> list[Planned]:
    if cfg.architecture == "gpt_oss":
        return plan_gpt_oss(cfg, quant)
    if quant == "mxfp4":
        raise ValueError("mxfp4 is for GPT-OSS presets (its experts); use q4_k_m, q8_0, q4_k or q6_k")
    if cfg.architecture == "qwen3_5_moe":
        return plan_qwen35(cfg, quant)  # type: ignore[arg-type]
    if cfg.architecture == "glm4_moe":
        from freetoken.cli.bench.make_model_glm import plan_glm4moe

        return plan_glm4moe(cfg, quant)  # type: ignore[arg-type]
    if cfg.architecture == "deepseek_v3":
        return deepseek.plan_deepseek2(cfg, quant)  # type: ignore[arg-type]
    packed, f32 = packed_blocks, f32_values
    H, D, E, I, L = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_layers
    out: list[Planned] = []

    def add(name: str, shape: tuple[int, ...], fmt: int, make=None, gain: float = 1.0) -> None:
        out.append(Planned(name, shape, fmt, make or packed(shape, fmt, gain), gain))

    add("token_embd.weight", (cfg.vocab_size, H), tensor_format(quant, "token_embd", 0, L))
    for i in range(L):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (H,), Fmt.F32, f32((H,), 1.0, 0.05))
        add(b + "attn_q.weight", (cfg.num_heads * D, H), tensor_format(quant, "attn_q", i, L))
        add(b + "attn_k.weight", (cfg.num_kv_heads * D, H), tensor_format(quant, "attn_k", i, L))
        add(b + "attn_v.weight", (cfg.num_kv_heads * D, H), tensor_format(quant, "attn_v", i, L))
        add(b + "attn_output.weight", (H, cfg.num_heads * D), tensor_format(quant, "attn_output", i, L),
            gain=RESIDUAL_GAIN)
        add(b + "attn_q_norm.weight", (D,), Fmt.F32, f32((D,), QK_NORM_GAIN, 0.05))
        add(b + "attn_k_norm.weight", (D,), Fmt.F32, f32((D,), QK_NORM_GAIN, 0.05))
        add(b + "ffn_norm.weight", (H,), Fmt.F32, f32((H,), 1.0, 0.05))
        add(b + "ffn_gate_inp.weight", (E, H), Fmt.F32, f32((E, H), 0.0, 0.02))
        add(b + "ffn_gate_exps.weight", (E, I, H), tensor_format(quant, "ffn_gate_exps", i, L))
        add(b + "ffn_up_exps.weight", (E, I, H), tensor_format(quant, "ffn_up_exps", i, L))
        add(b + "ffn_down_exps.weight", (E, H, I), tensor_format(quant, "ffn_down_exps", i, L), gain=RESIDUAL_GAIN)
    add("output_norm.weight", (H,), Fmt.F32, f32((H,), 1.0, 0.05))
    add("output.weight", (cfg.vocab_size, H), tensor_format(quant, "output", L, L))
    return out


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> int:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
    return data.nbytes


def write(path: str, cfg: ModelConfig, quant: str, seed: int = 0, progress: bool = True,
          threads: Optional[int] = None, router_skew: float = 0.0, vocab: str = "ids") -> int:
    """Write the file; return its size. gguf-py writes the header and the tensor infos; the
    data section is written by ``threads`` threads with ``pwrite`` straight from the block
    pools (no copy in user space): on VMs, filling the page cache costs kernel time per core,
    so one writer thread is the bottleneck (about 0.4 GB/s; the blocks themselves cost ~0).
    The bytes do not depend on ``threads``: every random draw happens in this thread, in
    tensor order, exactly as ``Planned.make`` draws them. ``vocab``: "ids" (token ids only,
    no texts) or "bpe" (:mod:`freetoken.cli.bench.synthetic_vocab`, for servers)."""
    import gguf

    from freetoken.models.gguf_writer import ARCH, write_ids_only_vocab, write_qwen3moe_metadata

    tensors = skew_routers(plan(cfg, quant), router_skew)
    name = f"synthetic {cfg.architecture} {quant} ({cfg.num_layers} layers, random weights)"
    if cfg.architecture == "gpt_oss":
        from freetoken.models.gguf_writer import write_gpt_oss_metadata, write_moe_metadata

        w = gguf.GGUFWriter(path, "gpt-oss")
        write_moe_metadata(w, cfg, name)
        write_gpt_oss_metadata(w, GPT_OSS_WINDOW, GPT_OSS_YARN_FACTOR, GPT_OSS_YARN_ORIGINAL)
    elif cfg.architecture == "qwen3_5_moe":
        from freetoken.models.gguf_writer import write_hybrid_metadata

        w = gguf.GGUFWriter(path, "qwen35moe")
        write_hybrid_metadata(w, cfg, name)
    elif cfg.architecture == "glm4_moe":
        from freetoken.models.gguf_writer import write_glm4moe_metadata

        w = gguf.GGUFWriter(path, "glm4moe")
        write_glm4moe_metadata(w, cfg, name)
    elif cfg.architecture == "deepseek_v3":
        from freetoken.models.gguf_writer import write_deepseek2_metadata

        w = gguf.GGUFWriter(path, "deepseek2")
        write_deepseek2_metadata(w, cfg, name)
    else:
        w = gguf.GGUFWriter(path, ARCH)
        write_qwen3moe_metadata(w, cfg, name)
    if vocab == "bpe":
        from freetoken.cli.bench.synthetic_vocab import write_synthetic_bpe

        write_synthetic_bpe(w, cfg.vocab_size, seed)
    else:
        write_ids_only_vocab(w, cfg.vocab_size)
    w.add_uint32("general.file_type", {"q4_k_m": 15, "q8_0": 7, "q4_k": 14, "q6_k": 18, "mxfp4": 38}[quant])
    w.add_string("general.description", "random but valid blocks, written by freetoken bench make-model")
    for t in tensors:
        raw = None if t.fmt in (Fmt.F32, Fmt.F16) else gguf.GGMLQuantizationType(int(t.fmt))
        dt = np.dtype(np.float32) if t.fmt == Fmt.F32 else np.dtype(np.uint8)
        shape = t.shape if raw is None else (*t.shape[:-1], t.nbytes // max(1, int(np.prod(t.shape[:-1]))))  # bytes
        w.add_tensor_info(t.name, shape, dt, t.nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    align = int(w.data_alignment)
    assert w.fout is not None
    data_start = gguf.GGUFWriter.ggml_pad(w.fout[0].tell(), align)
    w.close()

    rng = np.random.default_rng(seed)
    pool = RandomBlockPool(rng)
    total = sum(t.nbytes for t in tensors)
    t0 = time.time()
    tty = sys.stderr.isatty()
    done = 0
    next_line = 0.1  # without a terminal: one progress line per tenth of the file
    fd = os.open(path, os.O_WRONLY)
    try:
        with ThreadPoolExecutor(max_workers=threads or default_threads()) as ex:
            futures = []
            offset = data_start  # the tensor offsets write_ti_data_to_file wrote: each padded to `align`
            for t in tensors:
                if t.fmt in (Fmt.F32, Fmt.F16, MXFP4):
                    segs = [np.ascontiguousarray(t.make(rng, pool))]
                else:
                    segs = pool.segments(t.fmt, int(np.prod(t.shape[:-1])), t.shape[-1], t.gain)
                if sum(a.nbytes for a in segs) != t.nbytes:
                    raise AssertionError(f"{t.name}: made {sum(a.nbytes for a in segs)} bytes, planned {t.nbytes}")
                pos = offset
                for a in segs:
                    futures.append(ex.submit(_pwrite_all, fd, a, pos))
                    pos += a.nbytes
                offset += gguf.GGUFWriter.ggml_pad(t.nbytes, align)
            for f in as_completed(futures):
                done += f.result()
                if progress and tty:
                    sys.stderr.write(f"\r{done / 2**30:.2f} / {total / 2**30:.2f} GiB  {time.time() - t0:.0f}s")
                elif progress and done >= next_line * total:
                    sys.stderr.write(f"{done / 2**30:.2f} / {total / 2**30:.2f} GiB  {time.time() - t0:.1f}s\n")
                    next_line = done / total + 0.1
        os.ftruncate(fd, offset)  # the padding after the last tensor (gaps between tensors read as zeros)
    finally:
        os.close(fd)
    if progress and tty:
        sys.stderr.write("\n")
    return os.path.getsize(path)


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser("make-model", help="write a synthetic GGUF of a real model's shapes (random weights)")
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    p.add_argument("--quant", default=None, choices=QUANTS,
                   help="weight format (default: mxfp4 for the GPT-OSS presets, as their published files are, "
                        "q4_k_m for the others)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help=f"writer threads (default min(8, cores) = {default_threads()}); the file does not depend on it")
    p.add_argument("--router-skew", type=float, default=0.0, metavar="S",
                   help="scale router row e by exp(-S * rank(e) / E), the ranks a per-layer permutation of the "
                        "experts, so routing concentrates on some experts, as a trained model's does (default 0: "
                        "random weights route uniformly); for expert-cache runs")
    p.add_argument("--vocab", default="ids", choices=("ids", "bpe"),
                   help="ids: token ids only, no texts (engines and llama-bench); bpe: a byte-level BPE vocabulary "
                        "of the model's size with texts, which servers (llama-server too) need to stream text "
                        "(default: ids)")
    p.add_argument("--out", required=True, help="output .gguf path")
    p.set_defaults(func=run)


def default_quant(cfg: ModelConfig) -> str:
    """The format a preset is written in without ``--quant``: GPT-OSS's published GGUF files
    keep the experts MXFP4; the other families' are commonly Q4_K_M."""
    return "mxfp4" if cfg.architecture == "gpt_oss" else "q4_k_m"


def run(args: argparse.Namespace) -> int:
    cfg = dataclasses.replace(PRESETS[args.preset])
    if args.quant is None:
        args.quant = default_quant(cfg)
    if args.threads is not None and args.threads < 1:
        print("--threads must be at least 1", file=sys.stderr)
        return 2
    if args.layers is not None:
        if not 1 <= args.layers <= cfg.num_layers:
            print(f"--layers must be in 1..{cfg.num_layers}", file=sys.stderr)
            return 2
        cfg = cut_layers(cfg, args.layers)
    try:
        need = sum(t.nbytes for t in plan(cfg, args.quant))
    except ValueError as exc:  # a format the preset's family is not written in
        print(f"--preset {args.preset} --quant {args.quant}: {exc}", file=sys.stderr)
        return 2
    d = os.path.dirname(os.path.abspath(args.out))
    free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
    if need > free:
        print(f"not enough disk space in {d}: need {need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free", file=sys.stderr)
        return 1
    t0 = time.time()
    if not args.router_skew >= 0:
        print("--router-skew must be >= 0", file=sys.stderr)
        return 2
    size = write(args.out, cfg, args.quant, args.seed, threads=args.threads, router_skew=args.router_skew,
                 vocab=args.vocab)
    dt = time.time() - t0
    print(f"wrote {args.out}: {size / 2**30:.2f} GiB, {cfg.num_layers} layers, {args.quant}, "
          f"in {dt:.1f}s ({size / 1e9 / max(dt, 1e-9):.2f} GB/s)")
    return 0
