"""DeepSeek GGUF files (``deepseek2``) as llama.cpp's converter writes them, through our
writer (``write_deepseek2_metadata``), against transformers: the older layout (``attn_kv_b``,
per-head ``key_length``/``value_length``) and the newer one (``attn_k_b`` transposed per
head and ``attn_v_b``, one KV head of the latent's size plus ``key_length_mla``/
``value_length_mla``) in float formats, a K-quant/Q8_0 mix (compared with transformers
holding gguf-py's dequantization of the same blocks, within the kernels' activation
rounding), and a next-token-prediction layer skipped."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from families import assert_engine_matches_hf, DEEPSEEK_YARN, hf_logits, grouped_router_gaps, make_model
from freetoken.handoff import Fmt
from freetoken.models import deepseek_v3
from freetoken.models.gguf_writer import random_blocks, write_deepseek2_metadata
from helpers import assert_close, engine_for
from test_engine_gguf import _quantizing_experts, assert_close_rounding, quantize_activations

#: choice scores (sigmoid + correction bias) closer than this count as a routing near-tie
ROUTER_TIE = 1e-2
#: HF name (under model.layers.{i}.) -> GGUF name (under blk.{i}.) of the 2-D tensors
ATTN = {"self_attn.q_a_proj.weight": "attn_q_a", "self_attn.q_b_proj.weight": "attn_q_b",
        "self_attn.q_proj.weight": "attn_q", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa",
        "self_attn.o_proj.weight": "attn_output"}  # fmt: skip
NORMS = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
         "self_attn.q_a_layernorm.weight": "attn_q_a_norm",
         "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm"}  # fmt: skip


def _config(model) -> deepseek_v3.DeepseekConfig:
    d = model.config.to_dict()
    d["architectures"] = [type(model).__name__]
    return deepseek_v3.config_from_hf(d)


def write_gguf(model, path: str, *, split_kv_b: bool, formats: dict[str, int] | None = None, seed: int = 0,
               mtp: bool = False) -> list[str]:  # fmt: skip
    """The HF model as llama.cpp's converter lays it out, every tensor F32 except those
    ``formats`` names (GGUF names without ``blk.{i}.``/``.weight``: F16, or packed blocks
    drawn at random); the HF model is given the values the file holds (gguf-py's
    dequantization). With ``mtp``, a next-token-prediction layer ``blk.{n}`` of random
    tensors; returns its names."""
    import gguf
    from gguf.quants import dequantize

    formats = formats or {}
    rng = np.random.default_rng(seed)
    c = model.config
    cfg = _config(model)
    cfg.num_nextn_predict_layers = 1 if mtp else 0
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    w = gguf.GGUFWriter(path, "deepseek2")
    write_deepseek2_metadata(w, cfg, "tiny deepseek2", mla_lengths=split_kv_b)

    def add(name: str, hf: str, short: str, transform=None) -> None:
        t = params[hf].detach().float()
        fmt = formats.get(short, Fmt.F32)
        if fmt == Fmt.F32:
            w.add_tensor(name, t.numpy().copy())
            return
        if fmt == Fmt.F16:
            data = t.numpy().astype(np.float16)
            w.add_tensor(name, data)
            value = torch.from_numpy(data.astype(np.float32))
        else:
            shape = tuple(t.shape)
            data = random_blocks(fmt, int(np.prod(shape[:-1])), shape[-1], rng, scale=1e-3, centered=True)
            w.add_tensor(name, data.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType(int(fmt)))
            value = torch.from_numpy(dequantize(data, gguf.GGMLQuantizationType(int(fmt))).reshape(shape).copy())
        with torch.no_grad():
            params[hf].copy_(value)

    add("token_embd.weight", "model.embed_tokens.weight", "token_embd")
    add("output_norm.weight", "model.norm.weight", "output_norm")
    if not c.tie_word_embeddings:
        add("output.weight", "lm_head.weight", "output")
    H, nope, v, lora = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, g in {**NORMS, **ATTN}.items():
            if p + hf in params:
                add(b + g + ".weight", p + hf, g)
        kv_b = params[p + "self_attn.kv_b_proj.weight"].detach().float().numpy()
        if split_kv_b:  # converter: k_b [H, kv_lora, nope] (transposed per head), v_b [H, v, kv_lora]
            per_head = kv_b.reshape(H, nope + v, lora)
            w.add_tensor(b + "attn_k_b.weight", np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)))
            w.add_tensor(b + "attn_v_b.weight", np.ascontiguousarray(per_head[:, nope:]))
        else:
            w.add_tensor(b + "attn_kv_b.weight", kv_b)
        if i < c.first_k_dense_replace:
            for r in ("gate", "up", "down"):
                add(b + f"ffn_{r}.weight", p + f"mlp.{r}_proj.weight", f"ffn_{r}")
            continue
        add(b + "ffn_gate_inp.weight", p + "mlp.gate.weight", "ffn_gate_inp")
        if p + "mlp.gate.e_score_correction_bias" in params:
            add(b + "exp_probs_b.bias", p + "mlp.gate.e_score_correction_bias", "exp_probs_b")
        for r in ("gate", "up", "down"):
            add(b + f"ffn_{r}_shexp.weight", p + f"mlp.shared_experts.{r}_proj.weight", f"ffn_{r}_shexp")
        _add_experts(w, params, p, b, c.moe_intermediate_size, formats, rng)
    extra: list[str] = []
    if mtp:
        L, Hd = c.num_hidden_layers, c.hidden_size
        for n, shape in (("nextn.eh_proj.weight", (Hd, 2 * Hd)), ("nextn.enorm.weight", (Hd,)),
                         ("attn_norm.weight", (Hd,)), ("ffn_gate_inp.weight", (c.n_routed_experts, Hd))):  # fmt: skip
            extra.append(f"blk.{L}.{n}")
            w.add_tensor(extra[-1], rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return extra


def _add_experts(w, params, p: str, b: str, I: int, formats: dict[str, int], rng) -> None:
    """llama.cpp's stacked ``ffn_{gate,up,down}_exps`` from transformers' fused expert tensors."""
    import gguf
    from gguf.quants import dequantize

    gu, down = params[p + "mlp.experts.gate_up_proj"], params[p + "mlp.experts.down_proj"]
    parts = {"gate": gu[:, :I], "up": gu[:, I:], "down": down}
    for r, t in parts.items():
        fmt = formats.get(f"ffn_{r}_exps", Fmt.F32)
        if fmt == Fmt.F32:
            w.add_tensor(b + f"ffn_{r}_exps.weight", t.detach().float().numpy().copy())
            continue
        shape = tuple(t.shape)
        data = random_blocks(fmt, int(np.prod(shape[:-1])), shape[-1], rng, scale=1e-3, centered=True)
        w.add_tensor(b + f"ffn_{r}_exps.weight", data.reshape(*shape[:-1], -1),
                     raw_dtype=gguf.GGMLQuantizationType(int(fmt)))  # fmt: skip
        with torch.no_grad():
            t.copy_(torch.from_numpy(dequantize(data, gguf.GGMLQuantizationType(int(fmt))).reshape(shape).copy()))


#: YaRN as GGUF can carry it: mscale == mscale_all_dim (llama.cpp's rotary tables unscaled)
CASES = {
    "v3": ("deepseek_v3", dict(rope=dict(DEEPSEEK_YARN))),
    "v3-plain": ("deepseek_v3", dict(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
                                     tie_word_embeddings=True, rope={"rope_type": "default", "rope_theta": 10000.0})),
    "v2-grouped": ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                       n_routed_experts=16, routed_scaling_factor=1.5)),
}  # fmt: skip
FLOAT_FORMATS = {"attn_kv_a_mqa": Fmt.F16, "output": Fmt.F16, "attn_q_b": Fmt.F16, "ffn_down_shexp": Fmt.F16}


@pytest.mark.parametrize("split", [True, False], ids=["k_b-v_b", "kv_b"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_float_gguf_matches_transformers(case, split, tmp_path):
    family, over = CASES[case]
    seed = random.randrange(1 << 30)
    model = make_model(family, seed, **over)
    path = str(tmp_path / f"{case}.gguf")
    write_gguf(model, path, split_kv_b=split, formats=FLOAT_FORMATS, seed=seed)
    rng = random.Random(seed)
    eng = engine_for(path, prefill_chunk=16)
    c, want = eng.model.config, _config(model)
    for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "scoring",
              "n_group", "topk_group", "first_k_dense_replace", "n_shared_experts", "norm_topk_prob"):  # fmt: skip
        assert getattr(c, f) == getattr(want, f), f
    assert eng.model.scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-6)
    assert_engine_matches_hf(eng, model, rng, f"{case} seed {seed}", prompts=(4, 19), new_tokens=4)


def test_split_kv_b_equals_kv_b(tmp_path):
    """The same weights as ``attn_kv_b`` and as ``attn_k_b``/``attn_v_b``: the same up-projection."""
    seed = random.randrange(1 << 30)
    model = make_model("deepseek_v3", seed, rope=dict(DEEPSEEK_YARN))
    a, b = str(tmp_path / "kv_b.gguf"), str(tmp_path / "split.gguf")
    write_gguf(model, a, split_kv_b=False)
    write_gguf(model, b, split_kv_b=True)
    ea, eb = engine_for(a), engine_for(b)
    for La, Lb in zip(ea.model.layers, eb.model.layers):
        assert torch.equal(La.attn.kv_b, Lb.attn.kv_b)
    assert ea.model.config.kv_layout() == eb.model.config.kv_layout()
    rng = random.Random(seed)
    ids = [rng.randrange(160) for _ in range(13)]
    torch.testing.assert_close(ea.prompt_logits(ids), eb.prompt_logits(ids), atol=0, rtol=0)


#: the K-quant/Q8_0 mix (GGUF names without ``blk.{i}.``/``.weight``)
KQUANT_MIX = {"token_embd": Fmt.Q8_0, "output": Fmt.Q6_K, "attn_q_a": Fmt.Q8_0, "attn_kv_a_mqa": Fmt.Q5_K,
              "attn_output": Fmt.Q8_0, "attn_q_b": Fmt.F16, "ffn_gate_exps": Fmt.Q4_K, "ffn_up_exps": Fmt.Q5_K,
              "ffn_down_exps": Fmt.Q6_K, "ffn_gate_shexp": Fmt.Q4_K, "ffn_up_shexp": Fmt.Q8_0,
              "ffn_down_shexp": Fmt.Q6_K, "ffn_gate": Fmt.Q4_K, "ffn_up": Fmt.Q6_K, "ffn_down": Fmt.Q8_0}  # fmt: skip


def _kernel_rounding(model, formats: dict[str, int]) -> None:
    """The CPU kernels' int8 activation rounding in front of every packed matrix of the HF
    model (the embedding's rows are dequantized, the router is float32: neither rounds)."""

    def pre(fmt):
        return lambda mod, args: (quantize_activations(args[0], fmt),)

    def hook(module, short: str) -> None:
        fmt = formats.get(short, Fmt.F32)
        if fmt not in (Fmt.F32, Fmt.F16):
            module.register_forward_pre_hook(pre(fmt))

    hook(model.lm_head, "output")
    for L in model.model.layers:
        a = L.self_attn
        for mod, short in ((a.q_a_proj, "attn_q_a"), (a.kv_a_proj_with_mqa, "attn_kv_a_mqa"), (a.o_proj, "attn_output")):
            hook(mod, short)
        if hasattr(L.mlp, "experts"):
            for r in ("gate", "up", "down"):
                hook(getattr(L.mlp.shared_experts, f"{r}_proj"), f"ffn_{r}_shexp")
            _quantizing_experts(L.mlp.experts, *(formats[f"ffn_{r}_exps"] for r in ("gate", "up", "down")))
        else:
            for r in ("gate", "up", "down"):
                hook(getattr(L.mlp, f"{r}_proj"), f"ffn_{r}")


def test_kquant_mix_matches_dequantized_transformers(tmp_path):
    """Q4_K/Q5_K/Q6_K/Q8_0 blocks in the attention, experts, shared experts, dense MLP and
    head, against transformers holding gguf-py's dequantization of the same blocks and the
    kernels' activation rounding (what is left: rounding-boundary flips, see
    ``assert_close_rounding``)."""
    seed = random.randrange(1 << 30)
    model = make_model("deepseek_v3", seed, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                       v_head_dim=16, rope=dict(DEEPSEEK_YARN))  # fmt: skip
    path = str(tmp_path / "mix.gguf")
    write_gguf(model, path, split_kv_b=True, formats=KQUANT_MIX, seed=seed)
    _kernel_rounding(model, KQUANT_MIX)
    eng = engine_for(path, prefill_chunk=6)
    rng = random.Random(seed)
    # a prompt whose grouped routing has no near-tie (the k-th and next expert score, or the
    # chosen groups' last and the next group score, within ROUTER_TIE in some layer at some
    # position): the engine may take the other group or expert there, which moved a position
    # by 0.518 of the logit scale (seed 79175199: group scores 1.3e-3 apart) and by 0.312
    # (seed 397742186: 3.5e-3 apart), and through its keys and values moves every later one;
    # short prompts (16 tokens, 3 chunks) so that a draw finds one. One position may still
    # reach 0.5: a flip of a wider gap where activation-rounding flips in the layers before
    # add up (seed 420477512, 24 tokens, position 22 at 0.297: the last MoE layer's router
    # input 2.7% off, the 3rd and 4th expert scores 2.6e-2 apart, the engine took the 4th).
    # A wrong layout moves every position by 0.1..1 (the second-largest and the mean bounds).
    for _ in range(100):
        ids = [rng.randrange(160) for _ in range(16)]
        if float(grouped_router_gaps(model, ids).min()) >= ROUTER_TIE:
            break
    else:
        raise AssertionError(f"seed {seed}: no prompt of 100 without a routing near-tie")
    assert_close_rounding(eng.prompt_logits(ids), hf_logits(model, ids), f"seed {seed}", one_flip=0.5)


def test_nextn_layer_is_skipped_and_logged(tmp_path, caplog):
    seed = random.randrange(1 << 30)
    model = make_model("deepseek_v3", seed, rope=dict(DEEPSEEK_YARN))
    path = str(tmp_path / "mtp.gguf")
    extra = write_gguf(model, path, split_kv_b=True, mtp=True)
    with caplog.at_level(logging.INFO, logger="freetoken.models.tensor_names"):
        eng = engine_for(path)
    lines = [r.getMessage() for r in caplog.records if "next-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and all(n in lines[0] for n in extra), lines
    assert eng.model.config.num_layers == 3 and eng.model.skipped_tensors == sorted(extra)
    rng = random.Random(seed)
    ids = [rng.randrange(160) for _ in range(11)]
    assert_close(eng.prompt_logits(ids), hf_logits(model, ids), f"seed {seed}")


def test_mscale_other_than_mscale_all_dim_is_refused_by_the_writer(tmp_path):
    import gguf

    cfg = _config(make_model("deepseek_v3", 1))  # mscale 0.707, mscale_all_dim 1
    with pytest.raises(ValueError, match="mscale != mscale_all_dim"):
        write_deepseek2_metadata(gguf.GGUFWriter(str(tmp_path / "x.gguf"), "deepseek2"), cfg, "x")
