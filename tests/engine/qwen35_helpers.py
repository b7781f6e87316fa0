"""Tiny random Qwen3.5-MoE / Qwen3-Next checkpoints (transformers models) and their GGUF
form written the way llama.cpp's converter lays these architectures out."""

from __future__ import annotations

import copy
import weakref
from typing import Any

import numpy as np
import torch

from helpers import randomize

VOCAB = 160

# both layer types (3 linear-attention + 1 full attention per 4), 2 key heads serving 4 value
# heads, partial RoPE, shared experts
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=512,
)  # fmt: skip

FAMILIES = ("qwen3_5_moe", "qwen3_next")


def make_hf(family: str, path: str, seed: int) -> Any:
    """A random FP32 transformers model of the family, saved to ``path``."""
    torch.manual_seed(seed)
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        cfg = Qwen3_5MoeTextConfig(**COMMON, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True})  # fmt: skip
        model = Qwen3_5MoeForCausalLM(cfg)
    else:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        # unnormalised top-k, a dense-MLP layer, half the head rotated, tied embeddings
        cfg = Qwen3NextConfig(**COMMON, intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[1],
                              tie_word_embeddings=True, rope_parameters={
                                  "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})  # fmt: skip
        model = Qwen3NextForCausalLM(cfg)
    model = model.float().eval()
    randomize(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rates of a trained model: A in (1, 16)
                p.copy_(torch.empty(p.shape).uniform_(0.0, 2.7))
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(path)
    return model


# ------------------------------------------------------------------------- GGUF


#: The smallest gap between a position's k-th and (k+1)-th router logit at which an FP32
#: forward is compared with float64 over a whole prompt. Summing in another order moves router
#: logits by ~1e-5, which flips a closer pair to the other expert and moves that position's
#: logits by ~1e-1 (qwen3_next seed 856945039: a gap of 2.5e-6 at position 66 of layer 2, the
#: engine's prefill pieces routed the other way, 0.59 at that position, ~1e-2 after it).
ROUTE_GAP = 1e-3


#: float64 copies of the models (a model's weights do not change after make_hf)
_FLOAT64: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def hf_forward64_gaps(model: Any, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits of ``ids`` from a float64 copy of ``model`` (its experts through
    the eager loop: the grouped matmul takes no float64): the reference both FP32
    forwards are measured against; and, per position, the smallest gap between the k-th and
    (k+1)-th router logit over every MoE layer (how close a routing choice came to a tie)."""
    m64 = _FLOAT64.get(model)
    if m64 is None:
        m64 = _FLOAT64[model] = copy.deepcopy(model).double()
        for module in m64.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_experts_implementation"):
                config._experts_implementation = "eager"
    k = model.config.num_experts_per_tok
    gaps: list[torch.Tensor] = []

    def record(module: Any, inputs: Any, out: Any) -> None:
        top = out[0].topk(k + 1, dim=-1).values  # (router logits, scores, indices)
        gaps.append(top[:, k - 1] - top[:, k])

    hooks = [m.register_forward_hook(record) for name, m in m64.named_modules() if name.endswith("mlp.gate")]
    try:
        logits = m64(torch.tensor([ids])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    assert gaps, "no router seen: the model's MoE gates are not named mlp.gate"
    return logits, torch.stack(gaps).min(0).values


def hf_forward64(model: Any, ids: list[int]) -> tuple[torch.Tensor, float]:
    """:func:`hf_forward64_gaps` with the smallest gap over every position."""
    logits, gaps = hf_forward64_gaps(model, ids)
    return logits, float(gaps.min())


def first_route_tie(model: Any, ids: list[int]) -> int:
    """The first position of ``ids`` whose float64 routing comes within :data:`ROUTE_GAP` of a
    tie (``len(ids)`` if none): from there on FP32 rounding may pick other experts."""
    _, gaps = hf_forward64_gaps(model, ids)
    close = (gaps < ROUTE_GAP).nonzero()
    return int(close[0, 0]) if len(close) else len(ids)


def prompt_without_route_ties(model: Any, rng: Any, n: int, tries: int = 20) -> tuple[list[int], torch.Tensor]:
    """A random prompt of ``n`` tokens whose float64 forward routes every position of every
    MoE layer at least :data:`ROUTE_GAP` away from a tie, and that forward's logits: the
    comparisons of whole prompts are then about the engine's forms, not about which way
    FP32 rounding tips a tie."""
    widest = 0.0
    for _ in range(tries):
        ids = [rng.randrange(VOCAB) for _ in range(n)]
        logits, gap = hf_forward64(model, ids)
        if gap >= ROUTE_GAP:
            return ids, logits
        widest = max(widest, gap)
    raise AssertionError(f"{tries} random prompts of {n} tokens all route within {ROUTE_GAP} of a tie "
                         f"(the widest of their closest gaps {widest:.3g}): this model's router is degenerate")


def _tile_v(t: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    """Value heads grouped by key head -> tiled (llama.cpp's Qwen3.5 order)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], hk, r, d, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def gguf_tensors(family: str, model: Any) -> dict[str, torch.Tensor]:
    """The model's weights under llama.cpp's GGUF names and conventions: zero-centred
    norms stored as ``1 + w``, ``ssm_a = -exp(A_log)``, the conv kernel squeezed, Qwen3-Next's
    ``in_proj_qkvz`` split into ``attn_qkv`` + ``attn_gate``, Qwen3.5's value heads tiled."""
    c = model.config
    sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = hv // hk
    out: dict[str, torch.Tensor] = {"token_embd.weight": sd["model.embed_tokens.weight"],
                                    "output_norm.weight": sd["model.norm.weight"] + 1}  # fmt: skip
    if not c.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"] + 1
        out[b + "post_attention_norm.weight"] = sd[p + "post_attention_layernorm.weight"] + 1
        if c.layer_types[i] == "full_attention":
            for src, dst in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                out[b + dst + ".weight"] = sd[p + f"self_attn.{src}.weight"]
            out[b + "attn_q_norm.weight"] = sd[p + "self_attn.q_norm.weight"] + 1
            out[b + "attn_k_norm.weight"] = sd[p + "self_attn.k_norm.weight"] + 1
        else:
            la = p + "linear_attn."
            if family == "qwen3_next":
                w = sd[la + "in_proj_qkvz.weight"].view(hk, 2 * dk + 2 * r * dv, -1)
                q, k, v, z = w.split([dk, dk, r * dv, r * dv], dim=1)
                out[b + "attn_qkv.weight"] = torch.cat([x.reshape(-1, c.hidden_size) for x in (q, k, v)])
                out[b + "attn_gate.weight"] = z.reshape(-1, c.hidden_size)
                out[b + "ssm_ba.weight"] = sd[la + "in_proj_ba.weight"]
                conv = sd[la + "conv1d.weight"].squeeze(1)
                a_log, dt = sd[la + "A_log"], sd[la + "dt_bias"]
                o = sd[la + "out_proj.weight"]
            else:
                qkv = sd[la + "in_proj_qkv.weight"]
                kd = hk * dk
                out[b + "attn_qkv.weight"] = torch.cat([qkv[: 2 * kd], _tile_v(qkv[2 * kd :], 0, hk, r, dv)])
                out[b + "attn_gate.weight"] = _tile_v(sd[la + "in_proj_z.weight"], 0, hk, r, dv)
                out[b + "ssm_beta.weight"] = _tile_v(sd[la + "in_proj_b.weight"], 0, hk, r, 1)
                out[b + "ssm_alpha.weight"] = _tile_v(sd[la + "in_proj_a.weight"], 0, hk, r, 1)
                conv = sd[la + "conv1d.weight"].squeeze(1)
                conv = torch.cat([conv[: 2 * kd], _tile_v(conv[2 * kd :], 0, hk, r, dv)])
                a_log, dt = (_tile_v(x, 0, hk, r, 1) for x in (sd[la + "A_log"], sd[la + "dt_bias"]))
                o = _tile_v(sd[la + "out_proj.weight"], 1, hk, r, dv)
            out[b + "ssm_conv1d.weight"] = conv
            out[b + "ssm_a"] = -a_log.exp()
            out[b + "ssm_dt.bias"] = dt
            out[b + "ssm_norm.weight"] = sd[la + "norm.weight"]
            out[b + "ssm_out.weight"] = o
        m = p + "mlp."
        if m + "gate.weight" in sd:
            out[b + "ffn_gate_inp.weight"] = sd[m + "gate.weight"]
            gate_up = sd[m + "experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
            inter = gate_up.shape[1] // 2
            out[b + "ffn_gate_exps.weight"] = gate_up[:, :inter]
            out[b + "ffn_up_exps.weight"] = gate_up[:, inter:]
            out[b + "ffn_down_exps.weight"] = sd[m + "experts.down_proj"]
            for part in ("gate", "up", "down"):
                out[b + f"ffn_{part}_shexp.weight"] = sd[m + f"shared_expert.{part}_proj.weight"]
            out[b + "ffn_gate_inp_shexp.weight"] = sd[m + "shared_expert_gate.weight"].reshape(-1)
        else:
            for part in ("gate", "up", "down"):
                out[b + f"ffn_{part}.weight"] = sd[m + f"{part}_proj.weight"]
    return out


def write_gguf(family: str, model: Any, path: str) -> None:
    """Write the model as a GGUF file through gguf-py and our metadata writer (F32 vectors,
    F16 matrices: the caller rounds the HF model's weights to F16 first)."""
    import gguf

    from freetoken.models.gguf_writer import write_hybrid_metadata, write_ids_only_vocab
    from freetoken.models.registry import family_for_hf

    arch = {"qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}[family]
    mod = family_for_hf(model.config.architectures[0] if model.config.architectures else
                        type(model).__name__).load()  # fmt: skip
    cfg = mod.config_from_hf(model.config.to_dict())
    w = gguf.GGUFWriter(path, arch)
    write_hybrid_metadata(w, cfg, "tiny")
    write_ids_only_vocab(w, cfg.vocab_size)
    for name, t in gguf_tensors(family, model).items():
        a = t.numpy()
        w.add_tensor(name, a.astype(np.float16) if a.ndim >= 2 else a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def round_to_f16(model: Any) -> None:
    """Round every matrix of the model through float16 (what the GGUF file stores)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(p.half().float())
