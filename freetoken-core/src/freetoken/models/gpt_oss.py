"""GPT-OSS (HF ``GptOssForCausalLM``, GGUF architecture ``gpt-oss``).

Layers alternate sliding-window and full attention (``layer_types``; GGUF: even layers
slide), every attention has per-head sinks, q/k/v/o projections have biases, RoPE is NeoX
with YaRN scaling. The router has a bias; the top-k logits go through a softmax. Experts
have biases on their gate, up and down projections and the clamped SwiGLU
``(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, l)`` (the kernels'
``swiglu_oai`` activation); HF stores gate and up interleaved (``gate_up_proj[..., ::2]``
is the gate) and transposed (``[E, H, 2I]``).

The expert kernels take no biases: the gate/up biases become one more weight block per
row that multiplies a constant appended to the activations
(:class:`~freetoken.models.moe_decoder.BiasedMoELayer`; experts of hidden ``H + 32``, 1.1%
more expert bytes for GPT-OSS-20B), the down bias is added after the experts. MXFP4
experts (the official checkpoints, and llama.cpp's GGUF files) stay MXFP4: the CPU kernels
read ggml's ``block_mxfp4`` (HF ``*_blocks``/``*_scales`` are rewritten in that layout at
load, the same bytes). GPU-resident experts stay MXFP4 too (the packed GPU kernels of
:mod:`freetoken.kernels.moe_packed` decode it; ``--moe-gpu-experts dequantized``
dequantizes them to the activation dtype).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import numpy as np
import torch

from freetoken.handoff import Fmt
from freetoken.loading.dequant import MXFP4_KVALUES, mxfp4_ggml_from_hf
from freetoken.loading.hf import CheckpointError
from freetoken.loading.host_pages import huge_empty
from freetoken.loading.tensors import RawTensor, fmt_name
from freetoken.models.config import ModelConfig, gguf_config_fields, hf_config_fields, hf_eos_ids
from freetoken.models.moe_block import BIAS_PAD
from freetoken.models.moe_decoder import Arch, MoeDecoderModel, Names
from freetoken.models.rope import RopeScaling, scaling_from_hf
from freetoken.models.tensor_names import GGUF_ATTENTION_ROLES, HF_ATTENTION_ROLES, gguf_names, hf_names
from freetoken.models.moe_layer import ExpertWeights

logger = logging.getLogger(__name__)

ARCHITECTURE = "gpt_oss"
HF_ARCHITECTURES = ("GptOssForCausalLM",)
GGUF_ARCHITECTURES = ("gpt-oss",)
#: columns appended to the experts' input for the gate/up biases (one 32-value block)
PAD = BIAS_PAD
#: the kernels' swiglu_oai constants
ALPHA, LIMIT = 1.702, 7.0


@dataclasses.dataclass
class GptOssConfig(ModelConfig):
    windows: tuple[Optional[int], ...] = ()
    rope_scaling: RopeScaling = RopeScaling()
    attention_bias: bool = True


def config_from_hf(cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> GptOssConfig:
    qc = cfg.get("quantization_config")
    if qc and qc.get("quant_method") != "mxfp4":
        raise CheckpointError(f"GPT-OSS: quantization method {qc.get('quant_method')!r} is not supported "
                              "(BF16/FP16/FP32 or the official MXFP4 experts)")
    limit = float(cfg.get("swiglu_limit", LIMIT))
    alpha = float(cfg.get("swiglu_alpha", ALPHA))
    if limit != LIMIT or alpha != ALPHA:
        raise CheckpointError(f"GPT-OSS with swiglu_limit={limit}, swiglu_alpha={alpha} is not supported "
                              f"(the expert kernels use {LIMIT} and {ALPHA})")
    theta, scaling = scaling_from_hf(cfg)
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise CheckpointError(f"GPT-OSS layer_types {unknown} are not supported (sliding_attention, full_attention)")
    window = int(cfg.get("sliding_window") or 0)
    return GptOssConfig(
        architecture=ARCHITECTURE,
        **hf_config_fields(cfg, hf_eos_ids(cfg, generation_config), rms_norm_eps=1e-5, max_positions=131072),
        intermediate_size=0,
        moe_intermediate_size=int(cfg["intermediate_size"]),
        num_experts=int(cfg["num_local_experts"]),
        top_k=int(cfg.get("num_experts_per_tok") or cfg["experts_per_token"]),
        norm_topk_prob=True,  # softmax over the top-k logits
        rope_theta=theta,
        windows=tuple(window if t == "sliding_attention" and window else None for t in types),
        rope_scaling=scaling,
        attention_bias=bool(cfg.get("attention_bias", True)),
    )


def config_from_gguf(meta: dict[str, Any], has_output: bool) -> GptOssConfig:
    from freetoken.loading.gguf import gguf_float, gguf_int

    a = meta.get("general.architecture", "gpt-oss")
    layers = gguf_int(meta, f"{a}.block_count")
    window = gguf_int(meta, f"{a}.attention.sliding_window", 0)
    kind = meta.get(f"{a}.rope.scaling.type", "none")
    if kind == "yarn":
        scaling = RopeScaling(kind="yarn", factor=gguf_float(meta, f"{a}.rope.scaling.factor"),
                              original_max_positions=gguf_int(meta, f"{a}.rope.scaling.original_context_length"),
                              truncate=True)  # llama.cpp rounds the correction range outwards  # fmt: skip
    elif kind in ("none", None):
        scaling = RopeScaling()
    else:
        raise CheckpointError(f"{a}: RoPE scaling {kind!r} is not supported (yarn or none)")
    return GptOssConfig(
        architecture=ARCHITECTURE,
        **gguf_config_fields(meta, a, has_output, rms_norm_eps=1e-5, rope_theta=150000.0, max_positions=131072),
        intermediate_size=0,
        moe_intermediate_size=gguf_int(meta, f"{a}.expert_feed_forward_length"),
        num_experts=gguf_int(meta, f"{a}.expert_count"),
        top_k=gguf_int(meta, f"{a}.expert_used_count"),
        norm_topk_prob=True,
        windows=tuple(window if i % 2 == 0 and window else None for i in range(layers)),
        rope_scaling=scaling,
    )


_HF_ROLES = {
    **HF_ATTENTION_ROLES,
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",
    "sinks": "self_attn.sinks",
    "router": "mlp.router.weight", "router_bias": "mlp.router.bias",
}  # fmt: skip
_GGUF_ROLES = {
    **GGUF_ATTENTION_ROLES,
    "post_norm": "post_attention_norm.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias", "o_bias": "attn_output.bias",
    "sinks": "attn_sinks.weight",
    "router": "ffn_gate_inp.weight", "router_bias": "ffn_gate_inp.bias",
}  # fmt: skip

HF_NAMES = hf_names(_HF_ROLES)
GGUF_NAMES = gguf_names(_GGUF_ROLES)


# ------------------------------------------------------------------ experts


def _mxfp4_sum_codes() -> np.ndarray:
    """For each n in 0..179: 16 MXFP4 codes (magnitudes) whose values add up to n (12s,
    then at most two codes for the remainder)."""
    code = {v: MXFP4_KVALUES.index(v) for v in (1, 2, 3, 4, 6, 8, 12)}
    rest = {0: (), 1: (1,), 2: (2,), 3: (3,), 4: (4,), 5: (4, 1), 6: (6,), 7: (6, 1), 8: (8,), 9: (8, 1),
            10: (8, 2), 11: (8, 3)}  # fmt: skip
    table = np.zeros((180, 16), dtype=np.uint8)
    for n in range(180):
        vals = (12,) * (n // 12) + rest[n % 12]
        table[n, : len(vals)] = [code[v] for v in vals]
    return table


_SUM_CODES = _mxfp4_sum_codes()


def mxfp4_bias_blocks(bias: torch.Tensor) -> torch.Tensor:
    """One MXFP4 block per value of ``bias`` (float ``[...]`` -> uint8 ``[..., 17]``) that,
    against the bias constant of :class:`BiasedMoELayer` (``BIAS_ONES`` ones, then
    ``BIAS_FINE`` = 1/127), gives the value: with ``|b| = 2^k v``, ``v`` in [64, 128), the
    first 16 codes add up to ``floor(v)`` and the next 16 to ``round(127 frac(v))``, at
    exponent ``k + 128`` (relative error <= 0.5 / 127 / 64 = 6.2e-5; |b| < 2^-120 gives 0;
    float32's largest values need exponents up to 249 of 254)."""
    b = bias.detach().double().numpy()
    a = np.abs(b)
    k = np.floor(np.log2(np.where(a > 0, a, 1.0))) - 6
    e = k + 128
    zero = (a == 0) | (e < 2)
    v = np.where(zero, 0.0, a / np.exp2(k))
    n1 = np.floor(v)
    n2 = np.rint((v - n1) * 127)
    carry = n2 >= 127
    n1, n2 = np.where(carry, n1 + 1, n1).astype(np.int64), np.where(carry, 0, n2).astype(np.int64)
    sign = np.where(b < 0, 8, 0).astype(np.uint8)[..., None]
    lo = np.where(_SUM_CODES[n1] > 0, _SUM_CODES[n1] | sign, 0)
    hi = np.where(_SUM_CODES[n2] > 0, _SUM_CODES[n2] | sign, 0)
    out = np.zeros((*b.shape, 17), dtype=np.uint8)
    out[..., 0] = np.where(zero, 0, e).astype(np.uint8)
    out[..., 1:] = lo | (hi << 4)
    return torch.from_numpy(out)


def q8_0_bias_blocks(bias: torch.Tensor) -> torch.Tensor:
    """One Q8_0 block per value of ``bias`` (float ``[...]`` -> uint8 ``[..., 34]``) that
    holds the value in its first element (zeros after; the bias constant's first element is
    1): of the quants 64..127, the one whose fp16 scale ``bias / q`` gives the closest
    product (relative error <= 2^-12)."""
    b = bias.float().unsqueeze(-1)
    q = torch.arange(64, 128, dtype=torch.float32)
    d = (b / q).to(torch.float16)
    err = (d.float() * q - b).abs()
    best = err.argmin(-1, keepdim=True)
    d = d.gather(-1, best).squeeze(-1)
    qv = torch.where(d != 0, q[best.squeeze(-1)], 0.0).to(torch.int8)
    out = torch.zeros(*bias.shape, 34, dtype=torch.uint8)
    out[..., 0:2] = d.view(torch.uint8).reshape(*bias.shape, 2)
    out[..., 2] = qv.view(torch.uint8)
    return out


_BIAS_BLOCKS = {int(Fmt.Q8_0): q8_0_bias_blocks, int(Fmt.MXFP4): mxfp4_bias_blocks}


def _with_bias(name: str, source: str, fmt: int, rows: Any, bias: torch.Tensor, E: int, R: int, H: int) -> RawTensor:
    """``[E, R, H]`` weights (float tensor, or Q8_0/MXFP4 bytes ``[E, R, row bytes]``) with
    the bias as columns ``H .. H + PAD`` (float formats: column ``H``, whose constant is 1)."""
    if int(fmt) in _BIAS_BLOCKS:
        body, tail = rows.reshape(E, R, -1), _BIAS_BLOCKS[int(fmt)](bias)
    else:
        body, tail = rows, torch.zeros(E, R, PAD, dtype=rows.dtype)
        tail[..., 0] = bias.to(rows.dtype)
    data = huge_empty((E, R, body.shape[-1] + tail.shape[-1]), body.dtype)  # streamed every token
    data[..., : body.shape[-1]] = body
    data[..., body.shape[-1] :] = tail
    return RawTensor(name, (E, R, H + PAD), fmt, data, source)


def _with_zero_rows(name: str, source: str, fmt: int, rows: Any, E: int, H: int, I: int) -> RawTensor:
    """``[E, H, I]`` down weights with ``PAD`` zero rows appended (outputs that are dropped)."""
    rows = rows.reshape(E, H, -1)
    data = huge_empty((E, H + PAD, rows.shape[-1]), rows.dtype)  # streamed every token
    data[:, :H] = rows
    data[:, H:] = 0
    return RawTensor(name, (E, H + PAD, I), fmt, data, source)


_FLOAT_FMTS = (int(Fmt.F32), int(Fmt.F16), int(Fmt.BF16))


_EXPERT_FMTS = (int(Fmt.MXFP4), int(Fmt.Q8_0)) + _FLOAT_FMTS


def _gguf_rows(raw: RawTensor) -> torch.Tensor:
    """The rows of a GGUF expert tensor in its own format (bytes, or BF16 as bfloat16)."""
    fmt = int(raw.fmt)
    if fmt not in _EXPERT_FMTS:
        raise CheckpointError(f"{raw.source}: GPT-OSS expert tensor {raw.name} is {fmt_name(fmt)}; supported expert "
                              "formats: MXFP4, Q8_0, F32, F16, BF16 (their biases need 32-value blocks)")  # fmt: skip
    t = raw.raw_torch()
    if fmt == Fmt.BF16 and t.dtype != torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t


def _experts(i: int, source: Any, names: Names, c: ModelConfig) -> tuple[ExpertWeights, torch.Tensor]:
    E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
    if H % 32 or I % 32:
        raise CheckpointError(f"GPT-OSS experts need hidden ({H}) and intermediate ({I}) sizes that are multiples of 32")
    if names.fmt == "gguf":
        b = f"blk.{i}."
        gb, ub, db = (source.get(b + f"ffn_{r}_exps.bias").to_float(torch.float32) for r in ("gate", "up", "down"))
        out = []
        for r, bias in (("gate", gb), ("up", ub)):
            raw = source.get(b + f"ffn_{r}_exps.weight")
            out.append(_with_bias(raw.name, raw.source, raw.fmt, _gguf_rows(raw), bias, E, I, H))
        raw = source.get(b + "ffn_down_exps.weight")
        down = _with_zero_rows(raw.name, raw.source, raw.fmt, _gguf_rows(raw), E, H, I)
        gate, up = out
    else:
        p = f"model.layers.{i}.mlp.experts."
        gub = source.get(p + "gate_up_proj_bias").to_float(torch.float32)  # [E, 2I], interleaved
        db = source.get(p + "down_proj_bias").to_float(torch.float32)
        gb, ub = gub[:, 0::2], gub[:, 1::2]
        if source.has(p + "gate_up_proj_blocks"):  # MXFP4: rows are outputs, blocks along the input
            blocks = source.get(p + "gate_up_proj_blocks")  # [E, 2I, H/32, 16]
            mx = mxfp4_ggml_from_hf(source.get(p + "gate_up_proj_scales").raw_torch(), blocks.raw_torch())
            gate = _with_bias(p + "gate_proj", blocks.source, Fmt.MXFP4, mx[:, 0::2], gb, E, I, H)
            up = _with_bias(p + "up_proj", blocks.source, Fmt.MXFP4, mx[:, 1::2], ub, E, I, H)
            dmx = mxfp4_ggml_from_hf(source.get(p + "down_proj_scales").raw_torch(),
                                     source.get(p + "down_proj_blocks").raw_torch())  # fmt: skip
            down = _with_zero_rows(p + "down_proj", blocks.source, Fmt.MXFP4, dmx, E, H, I)
        else:
            gu = source.get(p + "gate_up_proj")  # [E, H, 2I]
            t = gu.raw_torch()
            if int(gu.fmt) == Fmt.BF16 and t.dtype != torch.bfloat16:
                t = t.view(torch.bfloat16)
            if tuple(gu.shape) != (E, H, 2 * I):
                raise CheckpointError(f"{gu.source}: {gu.name} has shape {tuple(gu.shape)}, expected {(E, H, 2 * I)}")
            gate = _with_bias(p + "gate_proj", gu.source, gu.fmt, t[:, :, 0::2].transpose(1, 2), gb, E, I, H)
            up = _with_bias(p + "up_proj", gu.source, gu.fmt, t[:, :, 1::2].transpose(1, 2), ub, E, I, H)
            d = source.get(p + "down_proj")  # [E, I, H]
            dt = d.raw_torch()
            if int(d.fmt) == Fmt.BF16 and dt.dtype != torch.bfloat16:
                dt = dt.view(torch.bfloat16)
            down = _with_zero_rows(d.name, d.source, d.fmt, dt.transpose(1, 2), E, H, I)
    return ExpertWeights(gate, up, down, E, H + PAD, I), db


class GptOssModel(MoeDecoderModel):
    @classmethod
    def arch_for(cls, config: ModelConfig) -> Arch:
        cfg: GptOssConfig = config  # type: ignore[assignment]
        bias = getattr(cfg, "attention_bias", True)
        return Arch(experts=_experts, qkv_bias=bias, o_bias=bias, sinks=True, router_bias=True,
                    activation="swiglu_oai", windows=cfg.windows, rope=cfg.rope_scaling, expert_pad=PAD)
