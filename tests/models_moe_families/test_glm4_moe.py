"""GLM-4.5 beyond the HF logits cases of test_hf_logits.py: the GGUF file as llama.cpp's
converter writes it (``glm4moe``: block_count counting the next-token-prediction layer,
``exp_probs_b.bias``, ``post_attention_norm``, shared-expert and dense-layer names) against
transformers; the next-token-prediction layers skipped and logged in both formats; the
config and tensor errors; the ``glm4`` pre-tokenizer; the GPU session's code (fake GPU
backend, decode graphs) against the CPU backend."""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import pytest
import torch

from families import assert_engine_matches_hf, greedy_on_cpu_and_gpu_session, hf_logits, make_model, save
from freetoken.loading.hf import CheckpointError
from freetoken.models import glm4_moe
from freetoken.models.gguf_writer import write_glm4moe_metadata
from helpers import assert_close, engine_for

LOGGER = "freetoken.models.tensor_names"  # where the next-token-prediction layers are skipped


def _config(model) -> glm4_moe.Glm4MoeConfig:
    return glm4_moe.config_from_hf(model.config.to_dict())


def write_gguf(model, path: str, mtp: bool = True) -> list[str]:
    """llama.cpp's converter layout of the HF model (F32, the head and k in F16), with a
    next-token-prediction layer ``blk.{n}`` of random tensors when ``mtp``; returns its names."""
    import gguf

    c = model.config
    cfg = _config(model)
    if not mtp:
        cfg.num_nextn_predict_layers = 0
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    L, I = c.num_hidden_layers, c.moe_intermediate_size
    w = gguf.GGUFWriter(path, "glm4moe")
    write_glm4moe_metadata(w, cfg, "tiny glm4moe")
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"].astype(np.float16))
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(b + "post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for n, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            t = sd[p + f"self_attn.{hf}.weight"]
            w.add_tensor(b + n + ".weight", t.astype(np.float16) if n == "attn_k" else t)
            if c.attention_bias:
                w.add_tensor(b + n + ".bias", sd[p + f"self_attn.{hf}.bias"])
        w.add_tensor(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        if c.use_qk_norm:
            w.add_tensor(b + "attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            w.add_tensor(b + "attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        if i < c.first_k_dense_replace:
            for r in ("gate", "up", "down"):
                w.add_tensor(b + f"ffn_{r}.weight", sd[p + f"mlp.{r}_proj.weight"])
            continue
        w.add_tensor(b + "ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])
        w.add_tensor(b + "exp_probs_b.bias", sd[p + "mlp.gate.e_score_correction_bias"])
        gu = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H]
        w.add_tensor(b + "ffn_gate_exps.weight", np.ascontiguousarray(gu[:, :I]))
        w.add_tensor(b + "ffn_up_exps.weight", np.ascontiguousarray(gu[:, I:]))
        w.add_tensor(b + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
        for r in ("gate", "up", "down"):
            w.add_tensor(b + f"ffn_{r}_shexp.weight", sd[p + f"mlp.shared_experts.{r}_proj.weight"])
    extra: list[str] = []
    if mtp:  # what the converter writes for the next-token-prediction layer (never read)
        H = c.hidden_size
        rng = np.random.default_rng(0)
        for n, shape in (("nextn.eh_proj.weight", (H, 2 * H)), ("nextn.enorm.weight", (H,)),
                         ("nextn.hnorm.weight", (H,)), ("attn_norm.weight", (H,)),
                         ("ffn_gate_inp.weight", (c.n_routed_experts, H)), ("exp_probs_b.bias", (c.n_routed_experts,))):  # fmt: skip
            extra.append(f"blk.{L}.{n}")
            w.add_tensor(extra[-1], rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return extra


def _as_written(model) -> None:
    """The HF model with the values the file holds (k and the head in F16)."""
    with torch.no_grad():
        if not model.config.tie_word_embeddings:
            model.lm_head.weight.copy_(model.lm_head.weight.half().float())
        for L in model.model.layers:
            L.self_attn.k_proj.weight.copy_(L.self_attn.k_proj.weight.half().float())


GGUF_CASES = {
    "all": dict(),
    "air": dict(use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0, tie_word_embeddings=True),
    "no-bias": dict(attention_bias=False, norm_topk_prob=False, first_k_dense_replace=0),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_matches_transformers_and_skips_nextn_layer(case, tmp_path, caplog):
    seed = random.randrange(1 << 30)
    model = make_model("glm4_moe", seed, **GGUF_CASES[case])
    path = str(tmp_path / f"{case}.gguf")
    extra = write_gguf(model, path)
    _as_written(model)
    rng = random.Random(seed)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        eng = engine_for(path, prefill_chunk=16)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and "next-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and all(n in lines[0] for n in extra), lines
    assert eng.model.skipped_tensors == sorted(extra)
    c = eng.model.config
    assert c.num_layers == model.config.num_hidden_layers and c.num_nextn_predict_layers == 1
    assert (c.rotary_dim, c.n_group, c.topk_group) == (8, model.config.n_group, model.config.topk_group)
    assert c.routed_scaling_factor == pytest.approx(model.config.routed_scaling_factor)
    assert_engine_matches_hf(eng, model, rng, f"{case} seed {seed}")


def test_gguf_plan_leaves_the_nextn_layer_out(tmp_path):
    from freetoken.models.loader import gguf_model_shape

    model = make_model("glm4_moe", 3)
    with_mtp, without = str(tmp_path / "mtp.gguf"), str(tmp_path / "plain.gguf")
    write_gguf(model, with_mtp)
    write_gguf(model, without, mtp=False)
    a, b = gguf_model_shape(with_mtp, torch.float32), gguf_model_shape(without, torch.float32)
    assert (a.num_layers, a.moe_layers, a.dense_file_bytes) == (b.num_layers, b.moe_layers, b.dense_file_bytes)
    assert a.moe_layers == [1, 2] and a.expert_formats == b.expert_formats


def test_hf_nextn_layer_is_skipped_and_logged(tmp_path, caplog):
    from safetensors.torch import save_file

    seed = random.randrange(1 << 30)
    model = make_model("glm4_moe", seed)
    path = str(tmp_path / "hf")
    save(model, path)
    n, H = model.config.num_hidden_layers, model.config.hidden_size
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.randn(H, 2 * H), f"model.layers.{n}.enorm.weight": torch.ones(H),
           f"model.layers.{n}.shared_head.norm.weight": torch.ones(H),
           f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.randn(32, H)}  # fmt: skip
    save_file(mtp, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        eng = engine_for(path)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and f"[{n}]" in lines[0] and all(k in lines[0] for k in mtp), lines
    ids = [random.Random(seed).randrange(160) for _ in range(17)]
    assert_close(eng.prompt_logits(ids), hf_logits(model, ids), f"seed {seed}")


# ------------------------------------------------------------------------ errors

BASE = dict(architectures=["Glm4MoeForCausalLM"], vocab_size=160, hidden_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48, moe_intermediate_size=32,
            n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, partial_rotary_factor=0.5)  # fmt: skip


@pytest.mark.parametrize("over,field", [
    (dict(topk_method="greedy"), "topk_method='greedy'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(n_group=3), "n_group=3"),
    (dict(topk_group=1, num_experts_per_tok=5), "num_experts_per_tok=5"),
    (dict(first_k_dense_replace=4), "first_k_dense_replace=4"),
    (dict(partial_rotary_factor=0.03), "partial_rotary_factor"),
    (dict(hidden_act="gelu"), "hidden_act"),
])  # fmt: skip
def test_bad_hf_config_names_the_field(over, field):
    glm4_moe.config_from_hf({**BASE, "topk_method": "noaux_tc", "scoring_func": "sigmoid"})  # the base is fine
    with pytest.raises(CheckpointError, match=field):
        glm4_moe.config_from_hf({**BASE, **over})


def test_bad_gguf_gating_names_the_key():
    meta = {"general.architecture": "glm4moe", "glm4moe.embedding_length": 64, "glm4moe.attention.head_count": 4,
            "glm4moe.block_count": 3, "glm4moe.expert_feed_forward_length": 32, "glm4moe.expert_count": 16,
            "glm4moe.expert_used_count": 3, "glm4moe.feed_forward_length": 48, "glm4moe.expert_gating_func": 1}  # fmt: skip
    with pytest.raises(CheckpointError, match="glm4moe.expert_gating_func=1"):
        glm4_moe.config_from_gguf(meta, has_output=True)
    meta["glm4moe.expert_gating_func"] = 2
    assert glm4_moe.config_from_gguf(meta, has_output=True).rotary_dim == 8  # llama.cpp's default: half


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_missing_tensor_is_named(fmt, tmp_path):
    from safetensors.torch import load_file, save_file

    model = make_model("glm4_moe", 11)
    if fmt == "gguf":
        path = str(tmp_path / "m.gguf")
        write_gguf(model, path)
        import gguf

        r = gguf.GGUFReader(path)  # rewrite without blk.2.exp_probs_b.bias
        w = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "glm4moe")
        write_glm4moe_metadata(w, _config(model), "cut")
        for t in r.tensors:
            if t.name != "blk.2.exp_probs_b.bias":
                w.add_tensor(t.name, np.array(t.data).reshape([int(x) for x in reversed(t.shape.tolist())]))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        path, name = str(tmp_path / "cut.gguf"), "blk.2.exp_probs_b.bias"
    else:
        path = str(tmp_path / "hf")
        save(model, path)
        f = os.path.join(path, "model.safetensors")
        sd = load_file(f)
        name = "model.layers.2.mlp.gate.e_score_correction_bias"
        del sd[name]
        save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"missing tensor {name}"):
        engine_for(path)


# ------------------------------------------------------------------ tokenizer


class _FakeGguf:
    def __init__(self, meta: dict) -> None:
        self.metadata, self.path = meta, "fake.gguf"

    def field(self, key: str):
        return self.metadata.get(key)


@pytest.mark.parametrize("pre", ["glm4", "gpt2"])
def test_glm4_pre_tokenizer_splits_digits_in_threes_without_bos(pre):
    """llama.cpp's glm4 rule is Llama 3's regex (numbers in runs of at most three digits) and
    gives the vocabulary no BOS; GPT-2's rule keeps the number whole, so a merge across the
    third digit shows the difference."""
    from freetoken.loading.tokenizer import load_gguf_tokenizer

    chars = [chr(c) for c in range(33, 127)]
    tokens = chars + ["34", "12", "123", "45", "[gMASK]"]
    merges = ["3 4", "1 2", "12 3", "4 5"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
            "tokenizer.ggml.bos_token_id": len(tokens) - 1, "tokenizer.ggml.add_bos_token": True}  # fmt: skip
    tok = load_gguf_tokenizer(_FakeGguf(meta), len(tokens))
    ids = tok.encode("12345", add_special_tokens=True)
    pieces = [tokens[i] for i in ids]
    assert pieces == (["123", "45"] if pre == "glm4" else ["[gMASK]", "12", "34", "5"])


# ------------------------------------------------------------------ GPU session


@pytest.mark.parametrize("case", ["all", "air"])
def test_gpu_session_decode_graphs_equal_the_cpu_backend(case, tmp_path):
    """Three requests decoded by the GPU session's code in decode graphs (fake GPU backend:
    the routing's torch ops captured and replayed, the experts through the hybrid layer)
    against the CPU backend: the same greedy tokens, logits within 1e-4."""
    seed = random.randrange(1 << 30)
    path = str(tmp_path / "hf")
    save(make_model("glm4_moe", seed, **GGUF_CASES[case]), path)
    rng = random.Random(seed)
    prompts = [[rng.randrange(160) for _ in range(n)] for n in (7, 30, 12)]
    runs = greedy_on_cpu_and_gpu_session(path, prompts)
    (want_ids, want_rows), (got_ids, got_rows) = runs["cpu"], runs["gpu-session"]
    assert got_ids == want_ids, f"{case} seed {seed}"
    for g, w in zip(got_rows, want_rows):
        assert_close(g, w, f"{case} seed {seed}: GPU session vs CPU backend")


def test_model_shape_counts_the_shared_experts():
    import dataclasses

    from freetoken.cli.bench.make_model import PRESETS
    from freetoken.models.loader import model_shape

    c = PRESETS["glm-4.5-air"]
    a, b = model_shape(c, torch.bfloat16), model_shape(dataclasses.replace(c, n_shared_experts=0), torch.bfloat16)
    assert a.moe_layers == list(range(1, 46))
    assert a.dense_bytes - b.dense_bytes == 45 * 3 * 4096 * 1408 * 2
