"""The DeepSeek family (HF ``DeepseekV3ForCausalLM``/``DeepseekV2ForCausalLM``) on the CPU
backend against transformers: prompt logits and decode steps of several requests (batched
decode in latent space, chunked prompts through the expanded path) for query LoRA or not,
YaRN with mscale/mscale_all_dim, grouped sigmoid and softmax routing, dense first layers and
shared experts; the KV cache's latent width; absorbed against expanded attention; the
next-token-prediction layer skipped and logged; config errors naming the key."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch

from families import fake_gpu_backend, hf_logits, make_model, save
from freetoken import SamplingParams
from freetoken.loading.hf import CheckpointError
from freetoken.models import deepseek_v3
from helpers import LogitsRecorder, assert_close, engine_for

LOGGER = "freetoken.models.tensor_names"  # the next-token-prediction layers' log line

#: (family, overrides of families.deepseek_*_config)
CASES = {
    # query LoRA, YaRN (mscale 0.707, mscale_all_dim 1), interleaved RoPE, 4 groups of 4, one dense layer
    "v3": ("deepseek_v3", {}),
    # no query LoRA, rotate-half RoPE as stored, plain RoPE, no groups, two dense layers, weights not renormalised
    "v3-plain": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                                     first_k_dense_replace=2, num_hidden_layers=4, norm_topk_prob=False,
                                     routed_scaling_factor=1.0, tie_word_embeddings=True,
                                     rope={"rope_type": "default", "rope_theta": 50000.0})),  # fmt: skip
    # V2-Lite's shape: no query LoRA, softmax greedy routing, two shared experts
    "v2": ("deepseek_v2", {}),
    # V2's shape: query LoRA, softmax routing over the 2 best of 4 groups (ranked by their best expert)
    "v2-grouped": ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                       routed_scaling_factor=1.5, n_routed_experts=16)),  # fmt: skip
}


def _run(eng, prompts: list[list[int]], max_tokens: int) -> tuple[list, dict]:
    with LogitsRecorder(eng) as rec:
        reqs = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                for p in prompts]  # fmt: skip
        while eng.has_work():
            eng.step()
    return reqs, rec.rows


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_matches_transformers(case, tmp_path):
    family, over = CASES[case]
    seed = random.randrange(1 << 30)
    model = make_model(family, seed, **over)
    path = str(tmp_path / case)
    save(model, path)
    rng = random.Random(seed)
    eng = engine_for(path, prefill_chunk=16)
    c = eng.model.config
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim) == (model.config.q_lora_rank or 0, 16, 8)
    assert eng.model.scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-6)
    ids = [rng.randrange(160) for _ in range(29)]
    assert_close(eng.prompt_logits(ids), hf_logits(model, ids), f"{case} seed {seed}")
    # three requests decoded together (batched latent-space decode), the longest prompt in two chunks
    prompts = [[rng.randrange(160) for _ in range(n)] for n in (3, 21, 30)]
    reqs, rows = _run(eng, prompts, 5)
    for p, r in zip(prompts, reqs):
        ref = hf_logits(model, p + r.output_ids)[len(p) - 1 : -1]
        assert_close(torch.stack(rows[r.request_id]), ref, f"{case} seed {seed} decode")


def test_prompt_chunks_absorb_or_expand_by_length(tmp_path, monkeypatch):
    """A prompt chunk of up to ``absorb_max_queries`` queries attends in latent space, a longer
    one over its context expanded to per-head K/V; both give transformers' logits."""
    from freetoken.models import mla

    seed = random.randrange(1 << 30)
    model = make_model("deepseek_v3", seed)
    path = str(tmp_path / "hf")
    save(model, path)
    eng = engine_for(path)
    expanded: list[int] = []
    expand = mla.MlaAttention.expand
    monkeypatch.setattr(mla.MlaAttention, "expand",
                        lambda self, lat: expanded.append(lat.shape[0]) or expand(self, lat))  # fmt: skip
    most = eng.model.layers[0].attn.shape.absorb_max_queries
    rng = random.Random(seed)
    for n, expands in ((most, False), (most + 1, True)):
        ids = [rng.randrange(160) for _ in range(n)]
        expanded.clear()
        assert_close(eng.prompt_logits(ids), hf_logits(model, ids), f"seed {seed}, {n} tokens")
        assert expanded == ([n] * len(eng.model.layers) if expands else []), n


def test_prefix_cache_reuses_cached_latents(tmp_path):
    """A second request whose first 32 tokens (two blocks) a finished one computed reads their
    latents from the prefix cache and computes only its own tokens; its logits are still
    transformers'."""
    seed = random.randrange(1 << 30)
    model = make_model("deepseek_v3", seed)
    path = str(tmp_path / "hf")
    save(model, path)
    rng = random.Random(seed)
    prefix = [rng.randrange(160) for _ in range(32)]
    eng = engine_for(path, enable_prefix_cache=True)
    first, _ = _run(eng, [prefix + [rng.randrange(160) for _ in range(3)]], 2)
    second_prompt = prefix + [rng.randrange(160) for _ in range(5)]
    reqs, rows = _run(eng, [second_prompt], 4)
    assert reqs[0].cached_tokens == 32
    ref = hf_logits(model, second_prompt + reqs[0].output_ids)[len(second_prompt) - 1 : -1]
    assert_close(torch.stack(rows[reqs[0].request_id]), ref, f"seed {seed}")


def test_kv_cache_holds_the_compressed_latent(tmp_path):
    """One latent of kv_lora_rank + qk_rope_head_dim values per token and layer, no V: the
    cache's tensors, its bytes, the config's bytes per token and the memory plan's."""
    from freetoken.models.loader import model_shape

    model = make_model("deepseek_v3", 5)
    path = str(tmp_path / "hf")
    save(model, path)
    eng = engine_for(path, kv_cache_tokens=256)
    c = eng.model.config
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    assert latent == 24 and c.num_layers == 3
    assert len(eng.kv.layers) == 3
    for k, v in eng.kv.layers:
        assert tuple(k.shape[1:]) == (eng.kv.block_size, 1, latent) and v.numel() == 0
    assert eng.kv.bytes == 3 * eng.kv.total_tokens * latent * 4
    assert c.kv_bytes_per_token(4) == 3 * latent * 4 == model_shape(c, torch.float32).kv_bytes_per_token
    # expanded per-head K/V would take heads x (nope + rope + v) = 4 x 30 values per token and layer
    assert c.kv_layout().values_per_token() == latent < 4 * (12 + 8 + 10)


def test_absorbed_decode_equals_expanded_attention(tmp_path):
    """A query's attention with kv_b absorbed (latent space) against the same query over the
    context's latents expanded to per-head K/V, on a loaded layer and random latents."""
    from freetoken.models.attention import AttentionMetadata, SeqSlice
    from freetoken.models.mla import expanded_attention

    seed = random.randrange(1 << 30)
    model = make_model("deepseek_v3", seed)
    path = str(tmp_path / "hf")
    save(model, path)
    eng = engine_for(path, kv_cache_tokens=256)
    attn = eng.model.layers[1].attn
    s = attn.shape
    g = torch.Generator().manual_seed(seed)
    bs, ctx = 16, 37
    cache = torch.full((4, bs, 1, s.latent), float("nan"))  # poisoned: only the context's slots are written
    blocks = torch.tensor([2, 0, 3])
    slots = torch.cat([b * bs + torch.arange(bs) for b in blocks.tolist()])[:ctx]
    cache.view(-1, s.latent)[slots] = torch.randn(ctx, s.latent, generator=g)
    q_nope, q_pe = torch.randn(1, s.heads, s.nope, generator=g), torch.randn(1, s.heads, s.rope, generator=g)
    meta = AttentionMetadata(slots[-1:], [SeqSlice(0, 1, ctx, blocks)], bs, decode=True)
    got = attn.absorbed(q_nope, q_pe, cache, meta, eng.model.scale)
    k, v = attn.expand(cache.view(-1, s.latent)[slots])
    want = expanded_attention(q_nope, q_pe, k, v, meta, eng.model.scale)
    assert got.shape == (1, s.heads, s.v_dim)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    # and in float64 from the checkpoint's own kv_b_proj (an independent expansion)
    lat = cache.view(-1, s.latent)[slots].double()
    w = model.model.layers[1].self_attn.kv_b_proj.weight.detach().double().view(s.heads, s.nope + s.v_dim, -1)
    k = torch.cat([torch.einsum("hdl,tl->htd", w[:, : s.nope], lat[:, : s.kv_lora_rank]),
                   lat[:, s.kv_lora_rank :].expand(s.heads, ctx, s.rope)], dim=-1)  # fmt: skip
    v = torch.einsum("hdl,tl->htd", w[:, s.nope :], lat[:, : s.kv_lora_rank])
    q = torch.cat([q_nope, q_pe], dim=-1).double()[0]  # [H, D]
    p = torch.softmax(torch.einsum("hd,htd->ht", q, k) * eng.model.scale, dim=-1)
    ref = torch.einsum("ht,htd->hd", p, v).float().unsqueeze(0)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5, msg=lambda m: f"seed {seed} float64: {m}")


def test_hf_nextn_layer_is_skipped_and_logged(tmp_path, caplog):
    from safetensors.torch import save_file

    seed = random.randrange(1 << 30)
    model = make_model("deepseek_v3", seed)
    path = str(tmp_path / "hf")
    save(model, path)
    n, H = model.config.num_hidden_layers, model.config.hidden_size
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.randn(H, 2 * H), f"model.layers.{n}.enorm.weight": torch.ones(H),
           f"model.layers.{n}.shared_head.head.weight": torch.randn(160, H),
           f"model.layers.{n}.self_attn.kv_b_proj.weight": torch.randn(88, 16)}  # fmt: skip
    save_file(mtp, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        eng = engine_for(path)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and f"[{n}]" in lines[0] and all(k in lines[0] for k in mtp), lines
    assert eng.model.skipped_tensors == sorted(mtp)
    rng = random.Random(seed)
    ids = [rng.randrange(160) for _ in range(17)]
    assert_close(eng.prompt_logits(ids), hf_logits(model, ids), f"seed {seed}")


# ------------------------------------------------------------------------ errors

BASE = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=160, hidden_size=64, num_hidden_layers=3,
            num_attention_heads=4, intermediate_size=48, moe_intermediate_size=32, n_routed_experts=16,
            num_experts_per_tok=3, n_group=4, topk_group=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
            qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, topk_method="noaux_tc",
            scoring_func="sigmoid")  # fmt: skip


@pytest.mark.parametrize("over,field", [
    (dict(topk_method="bogus"), "topk_method='bogus'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' with topk_method='noaux_tc'"),
    (dict(topk_method="greedy", scoring_func="sigmoidal"), "scoring_func='sigmoidal'"),
    (dict(n_group=3), "n_group=3"),
    (dict(first_k_dense_replace=4), "first_k_dense_replace=4"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim=7"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling type='linear'"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(kv_lora_rank=None), "kv_lora_rank is missing"),
])  # fmt: skip
def test_bad_hf_config_names_the_field(over, field):
    deepseek_v3.config_from_hf(BASE)  # the base is fine
    with pytest.raises(CheckpointError, match=field):
        deepseek_v3.config_from_hf({**BASE, **over})


def test_bad_gguf_gating_names_the_key():
    a = "deepseek2"
    meta = {"general.architecture": a, f"{a}.embedding_length": 64, f"{a}.attention.head_count": 4,
            f"{a}.block_count": 3, f"{a}.expert_feed_forward_length": 32, f"{a}.expert_count": 16,
            f"{a}.expert_used_count": 3, f"{a}.feed_forward_length": 48, f"{a}.leading_dense_block_count": 1,
            f"{a}.attention.kv_lora_rank": 16, f"{a}.attention.key_length": 20, f"{a}.attention.value_length": 10,
            f"{a}.rope.dimension_count": 8, f"{a}.expert_gating_func": 3}  # fmt: skip
    with pytest.raises(CheckpointError, match=f"{a}.expert_gating_func=3"):
        deepseek_v3.config_from_gguf(meta, has_output=True)
    meta[f"{a}.expert_gating_func"] = 1
    c = deepseek_v3.config_from_gguf(meta, has_output=True)
    assert (c.scoring, c.qk_nope_head_dim, c.v_head_dim, c.q_lora_rank, c.norm_topk_prob) == ("softmax", 12, 10, 0,
                                                                                              False)
    meta[f"{a}.rope.scaling.type"] = "longrope"
    with pytest.raises(CheckpointError, match=f"{a}.rope.scaling.type='longrope'"):
        deepseek_v3.config_from_gguf(meta, has_output=True)


# ------------------------------------------------------------------ GPU session


@pytest.mark.parametrize("case", ["v3", "v2-grouped"])
@pytest.mark.parametrize("session", ["fakegpu", "graphs"])
def test_gpu_session_equals_the_cpu_backend(case, session, tmp_path):
    """Three requests through the GPU session's code -- the fakegpu plugin (eager, experts
    handed to the CPU workers over its simulated stream) or the qualification tests' fake
    backend with decode graphs (latent attention over the static block tables, captured and
    replayed) -- against the CPU backend: the same greedy tokens, logits within 1e-4."""
    from freetoken.backends import registry
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine

    family, over = CASES[case]
    seed = random.randrange(1 << 30)
    path = str(tmp_path / "hf")
    save(make_model(family, seed, **over), path)
    rng = random.Random(seed)
    prompts = [[rng.randrange(160) for _ in range(n)] for n in (7, 30, 12)]
    other = (dict(backend="fakegpu"), None) if session == "fakegpu" else (
        dict(moe_cpu_layers="all", cuda_graph_max_bs=4), fake_gpu_backend())
    runs = {}
    for name, (kw, backend) in (("cpu", (dict(backend="cpu"), None)), (session, other)):
        registry.reset()
        eng = LLMEngine(EngineConfig(model=path, dtype="float32", max_model_len=128, kv_cache_tokens=1024,
                                     max_running_requests=4, **kw), **({"backend": backend} if backend else {}))
        try:
            if name == "graphs":
                assert eng.backend_info()["graphs"] is True
            reqs, rows = _run(eng, prompts, 8)
            if name == "graphs":
                assert eng.session.runner.replays > 0
            runs[name] = ([r.output_ids for r in reqs], [torch.stack(rows[r.request_id]) for r in reqs])
        finally:
            eng.close()
    registry.reset()
    (want_ids, want_rows), (got_ids, got_rows) = runs["cpu"], runs[session]
    assert got_ids == want_ids, f"{case} seed {seed}"
    for g, w in zip(got_rows, want_rows):
        assert_close(g, w, f"{case} seed {seed}: {session} vs CPU backend")


# ------------------------------------------------------------------ tokenizer


class _FakeGguf:
    def __init__(self, meta: dict) -> None:
        self.metadata, self.path = meta, "fake.gguf"

    def field(self, key: str):
        return self.metadata.get(key)


@pytest.mark.parametrize("pre", ["deepseek-v3", "gpt2"])
def test_deepseek_v3_pre_tokenizer(pre):
    """llama.cpp's deepseek-v3 rule splits numbers in runs of at most three digits and CJK
    ideographs from the letters before them; GPT-2's rule keeps both whole, so merges across
    those boundaries show the difference."""
    from tokenizers import pre_tokenizers

    from freetoken.loading.tokenizer import load_gguf_tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    zhong = "".join(byte[b] for b in "中".encode())  # three byte-level symbols
    tokens = alphabet + ["34", "12", "123", "45", "a" + byte["中".encode()[0]], byte[0xB8] + byte[0xAD]]
    merges = ["3 4", "1 2", "12 3", "4 5", "a " + byte["中".encode()[0]], f"{byte[0xB8]} {byte[0xAD]}"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": [1] * len(tokens)}  # fmt: skip
    tok = load_gguf_tokenizer(_FakeGguf(meta), len(tokens))
    pieces = [tokens[i] for i in tok.encode("12345 a中", add_special_tokens=False)]
    if pre == "deepseek-v3":
        assert pieces == ["123", "45", byte[ord(" ")], "a", zhong[0], zhong[1:]]
    else:
        assert pieces == ["12", "34", "5", byte[ord(" ")], "a" + zhong[0], zhong[1:]]
    assert tok.decode(tok.encode("12345 a中", add_special_tokens=False)) == "12345 a中"


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet in byte order (byte b -> its printable stand-in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


# ------------------------------------------------------------------ FP8 checkpoints


def _fp8_blockwise(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as FP8 E4M3 with one float32 scale per ``block x block`` tile (DeepSeek-V3's
    published checkpoints' ``weight_scale_inv``)."""
    rows, cols = w.shape
    sr, sc = -(-rows // block), -(-cols // block)
    pad = torch.zeros(sr * block, sc * block)
    pad[:rows, :cols] = w
    tiles = pad.view(sr, block, sc, block)
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(sr * block, sc * block)[:rows, :cols].contiguous(), scale.float()


def _fp8_decoded(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    return q.float() * scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


def test_rope_row_order_keeps_fp8_blocks():
    """Reordering rows within their 128-row scale blocks (a head's RoPE rows) keeps FP8 as
    stored; a reordering across blocks falls back to float32. Both give the permuted rows of
    the decoded matrix."""
    from freetoken.handoff import Fmt
    from freetoken.loading.tensors import RawTensor
    from freetoken.models.hybrid_weights import take_rows
    from freetoken.models.mla import MlaShape, _rope_rows

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    w = torch.randn(3 * 192, 256, generator=g)
    q, scale = _fp8_blockwise(w)
    raw = RawTensor("q_b", tuple(w.shape), int(Fmt.FP8_E4M3_B128), q, "test", scale)
    rows, _ = _rope_rows(MlaShape(3, 256, 512, 128, 64, 128), interleaved=True)
    kept = take_rows(raw, rows, "q_b")
    assert kept.fmt == Fmt.FP8_E4M3_B128 and kept.scale is scale
    torch.testing.assert_close(kept.to_float(), _fp8_decoded(q, scale)[rows], atol=0, rtol=0)
    across = torch.arange(w.shape[0]).roll(1)
    moved = take_rows(raw, across, "q_b")
    assert moved.fmt == Fmt.F32
    torch.testing.assert_close(moved.to_float(), _fp8_decoded(q, scale)[across], atol=0, rtol=0)


def test_fp8_block_quantized_checkpoint(tmp_path):
    """DeepSeek-V3's published form: the attention projections, shared experts and dense MLP
    in FP8 with 128 x 128 block scales (heads of 128 + 64 dims: the RoPE rows reordered
    inside their blocks), against transformers holding the decoded values."""
    import json

    from safetensors.torch import load_file, save_file

    seed = random.randrange(1 << 30)
    model = make_model("deepseek_v3", seed, hidden_size=256, qk_nope_head_dim=64, qk_rope_head_dim=64,
                       v_head_dim=32, q_lora_rank=128, kv_lora_rank=64)  # fmt: skip
    src = str(tmp_path / "f32")
    save(model, src)
    sd = load_file(os.path.join(src, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for name, t in sd.items():
        if name.endswith("_proj.weight") and t.dim() == 2 and ".experts." not in name:
            q, s = _fp8_blockwise(t)
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = q, s
            with torch.no_grad():
                params[name].copy_(_fp8_decoded(q, s))
        else:
            out[name] = t
    assert sum(t.dtype == torch.float8_e4m3fn for t in out.values()) >= 3 * 5
    dst = tmp_path / "fp8"
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    json.dump(cfg, open(dst / "config.json", "w"))
    eng = engine_for(str(dst))
    rng = random.Random(seed)
    ids = [rng.randrange(160) for _ in range(19)]
    assert_close(eng.prompt_logits(ids), hf_logits(model, ids), f"seed {seed}")
