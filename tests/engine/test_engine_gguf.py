"""GGUF: a tiny qwen3moe file with packed tensors gives the logits of an HF model
built from the same tensors dequantized by gguf-py."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import pytest
import torch

from freetoken import SamplingParams
from freetoken.handoff import Fmt
from freetoken.models.gguf_writer import random_blocks, write_qwen3moe_metadata
from freetoken.models.config import ModelConfig
from helpers import LogitsRecorder, engine_for, hf_logits, tiny_config

H, HEADS, KVH, HD, I, E, K, V, LAYERS = 256, 4, 2, 64, 256, 4, 2, 300, 2

# Per layer: the format of each matrix (all K-quants, Q8_0, F16, BF16 covered).
MIX = [
    {"attn_q": Fmt.Q8_0, "attn_k": Fmt.F16, "attn_v": Fmt.Q6_K, "attn_output": Fmt.Q4_K,
     "ffn_gate_exps": Fmt.Q4_K, "ffn_up_exps": Fmt.Q5_K, "ffn_down_exps": Fmt.Q6_K},
    {"attn_q": Fmt.Q4_K, "attn_k": Fmt.BF16, "attn_v": Fmt.Q8_0, "attn_output": Fmt.Q6_K,
     "ffn_gate_exps": Fmt.F16, "ffn_up_exps": Fmt.Q6_K, "ffn_down_exps": Fmt.Q8_0},
]
OUTPUT_FMT = Fmt.Q6_K
SHAPES = {"attn_q": (HEADS * HD, H), "attn_k": (KVH * HD, H), "attn_v": (KVH * HD, H), "attn_output": (H, HEADS * HD),
          "ffn_gate_exps": (E, I, H), "ffn_up_exps": (E, I, H), "ffn_down_exps": (E, H, I)}


def _packed(fmt, shape, rng):
    rows = int(np.prod(shape[:-1]))
    if fmt == Fmt.F16:
        return (rng.standard_normal(shape) * 0.05).astype(np.float16)
    if fmt == Fmt.BF16:
        import gguf
        from gguf.quants import quantize

        return quantize((rng.standard_normal(shape) * 0.05).astype(np.float32), gguf.GGMLQuantizationType.BF16)
    return random_blocks(fmt, rows, shape[-1], rng).reshape(*shape[:-1], -1)


def _deq(fmt, data, shape):
    import gguf
    from gguf.quants import dequantize

    if fmt == Fmt.F16:
        return torch.from_numpy(data.astype(np.float32))
    return torch.from_numpy(dequantize(data, gguf.GGMLQuantizationType(int(fmt))).astype(np.float32)).reshape(shape)


def write_tiny_gguf(path: str, seed: int, tokenizer: bool = False,
                    mix: list[dict[str, Fmt]] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Write the file, each layer's tensors in the formats of ``mix`` (default ``MIX``);
    return the dequantized tensors by GGUF name."""
    import gguf

    rng = np.random.default_rng(seed)
    cfg = ModelConfig("qwen3_moe", V, H, LAYERS, HEADS, KVH, HD, 0, I, E, K, rope_theta=1e6, max_position_embeddings=1024)
    w = gguf.GGUFWriter(path, "qwen3moe")
    write_qwen3moe_metadata(w, cfg, "tiny")
    ref: dict[str, torch.Tensor] = {}

    def add(name, fmt, data, shape):
        if fmt in (Fmt.F32, Fmt.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(int(fmt)))
        ref[name] = _deq(fmt, data, shape) if fmt != Fmt.F32 else torch.from_numpy(data.copy())

    add("token_embd.weight", Fmt.Q8_0, _packed(Fmt.Q8_0, (V, H), rng), (V, H))
    add("output_norm.weight", Fmt.F32, (1 + 0.1 * rng.standard_normal(H)).astype(np.float32), (H,))
    add("output.weight", OUTPUT_FMT, _packed(OUTPUT_FMT, (V, H), rng), (V, H))
    for i, layer_mix in enumerate(MIX if mix is None else mix):
        for n in ("attn_norm", "ffn_norm"):
            add(f"blk.{i}.{n}.weight", Fmt.F32, (1 + 0.1 * rng.standard_normal(H)).astype(np.float32), (H,))
        for n in ("attn_q_norm", "attn_k_norm"):
            add(f"blk.{i}.{n}.weight", Fmt.F32, (1 + 0.1 * rng.standard_normal(HD)).astype(np.float32), (HD,))
        add(f"blk.{i}.ffn_gate_inp.weight", Fmt.F32, (0.5 * rng.standard_normal((E, H))).astype(np.float32), (E, H))
        for n, fmt in layer_mix.items():
            add(f"blk.{i}.{n}.weight", fmt, _packed(fmt, SHAPES[n], rng), SHAPES[n])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


#: tiers whose K-quant kernels quantize the activation with one scale per 256 (the
#: AVX2 tiers, csrc/act_prepare.h; tests/cpu_moe/cpu_moe_reference.py act_quant_block)
KQUANT_PER_256_TIERS = ("avx2", "avx_vnni")


def quantize_activations(x: torch.Tensor, fmt: int) -> torch.Tensor:
    """What the CPU kernels do to activations before an integer dot product with
    packed weights (freetoken-cpu-moe csrc/act_prepare.h, the llama.cpp scheme):
    symmetric int8 with one float scale amax/127 per 32 values (per 256 for the
    K-quants on the AVX2 tiers, as llama.cpp's Q8_K), round half away from zero.
    Float weights see the FP32 activations."""
    if fmt in (Fmt.F32, Fmt.F16, Fmt.BF16):
        return x
    blk = 32
    if fmt in (Fmt.Q4_K, Fmt.Q5_K, Fmt.Q6_K):
        import freetoken_cpu_moe

        if freetoken_cpu_moe.active_isa() in KQUANT_PER_256_TIERS:
            blk = 256
    xb = x.float().reshape(*x.shape[:-1], -1, blk)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    v = xb * inv
    q = torch.where(v >= 0, v + 0.5, v - 0.5).trunc().clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(x.shape)


def _quantizing_experts(experts, f_gate: int, f_up: int, f_down: int):
    """HF's expert loop with the kernels' activation quantization in front of each matrix."""
    import types

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        I = self.down_proj.shape[-1]
        for t in range(hidden_states.shape[0]):
            for k in range(top_k_index.shape[1]):
                e = int(top_k_index[t, k])
                x = hidden_states[t]
                g = torch.nn.functional.linear(quantize_activations(x, f_gate), self.gate_up_proj[e, :I])
                u = torch.nn.functional.linear(quantize_activations(x, f_up), self.gate_up_proj[e, I:])
                h = self.act_fn(g) * u
                out[t] += top_k_weights[t, k] * torch.nn.functional.linear(quantize_activations(h, f_down), self.down_proj[e])
        return out

    experts.forward = types.MethodType(forward, experts)


def hf_from_gguf_tensors(ref: dict[str, torch.Tensor], model_kernel_rounding: bool = False):
    from transformers import Qwen3MoeForCausalLM

    cfg = tiny_config(vocab_size=V, hidden_size=H, moe_intermediate_size=I, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KVH, head_dim=HD, num_experts=E,
                      num_experts_per_tok=K, norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=1024,
                      rms_norm_eps=1e-6)
    m = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        m.model.embed_tokens.weight.copy_(ref["token_embd.weight"])
        m.model.norm.weight.copy_(ref["output_norm.weight"])
        m.lm_head.weight.copy_(ref["output.weight"])
        for i, L in enumerate(m.model.layers):
            g = lambda n: ref[f"blk.{i}.{n}.weight"]  # noqa: E731
            L.input_layernorm.weight.copy_(g("attn_norm"))
            L.post_attention_layernorm.weight.copy_(g("ffn_norm"))
            a = L.self_attn
            a.q_proj.weight.copy_(g("attn_q"))
            a.k_proj.weight.copy_(g("attn_k"))
            a.v_proj.weight.copy_(g("attn_v"))
            a.o_proj.weight.copy_(g("attn_output"))
            a.q_norm.weight.copy_(g("attn_q_norm"))
            a.k_norm.weight.copy_(g("attn_k_norm"))
            L.mlp.gate.weight.copy_(g("ffn_gate_inp"))
            L.mlp.experts.gate_up_proj.copy_(torch.cat([g("ffn_gate_exps"), g("ffn_up_exps")], dim=1))
            L.mlp.experts.down_proj.copy_(g("ffn_down_exps"))
    if model_kernel_rounding:
        def pre(fmt):
            return lambda mod, args: (quantize_activations(args[0], fmt),)

        m.lm_head.register_forward_pre_hook(pre(OUTPUT_FMT))
        for i, L in enumerate(m.model.layers):
            mix = MIX[i]
            for proj, n in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                getattr(L.self_attn, proj).register_forward_pre_hook(pre(mix[n]))
            _quantizing_experts(L.mlp.experts, mix["ffn_gate_exps"], mix["ffn_up_exps"], mix["ffn_down_exps"])
    return m


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    seed = random.randrange(1 << 30)
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    ref = write_tiny_gguf(path, seed)
    return path, hf_from_gguf_tensors(ref, model_kernel_rounding=True), hf_from_gguf_tensors(ref), seed, ref


# The reference applies the kernels' int8 activation rounding (above), so what is
# left is FP32 summation order (~1e-6 relative): positions without a rounding flip agree
# to 3e-7..5e-6 of the logit scale. That tiny noise occasionally moves an activation
# across an int8 rounding boundary (100-270 elements per forward sit within 1e-3 of a
# step from one; about a third of random files flip at least one), shifting it by one
# step (1/127 of its block's max). Measured over ~70 random files: one flip moves the
# logits of its position by 1e-3..4e-2 of their scale (largest seen 3.97e-2), and a
# flip that lands in the cached K/V moves every later position too. A fixed bound
# between that and a bug's size is the only end-to-end criterion that is not flaky:
# every position within 8e-2 of the logit scale (2x the largest flip seen), the mean
# within 3e-2. The errors this test exists to catch -- a wrong tensor, layout or format
# id in the GGUF path -- move logits by 1e-1..1 of their scale (one attention output
# matrix with its rows rolled by one: 1.3). It does NOT catch a uniform 5% scale error
# on one expert matrix (checked: passes), which is why each format's
# kernel is checked tightly (1e-4, boundary flips forgiven element by element) in
# tests/cpu_moe, and why test_gguf_tensors_as_the_engine_runs_them below checks every
# tensor of the file as the engine runs it, layer by layer, so that no flip propagates.
#
# ``one_flip`` raises the bound of the single worst position for a family whose one flip moves
# its position further (every other position keeps 8e-2, the mean 3e-2).
#
# ``near_ties`` (bool per position) marks positions where a router's choice is within the
# rounding noise of another (tests/models_moe_families/families.router_gaps): the engine may
# take the other expert there, which moves the position by up to ROUTING_FLIP of the scale;
# those positions are held to that bound alone.
ROUTING_FLIP = 0.6


def assert_close_rounding(got: torch.Tensor, ref: torch.Tensor, what: str, one_flip: float = 8e-2,
                          near_ties: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    assert got.shape == ref.shape, what
    scale = max(1.0, float(ref.abs().max()))
    row_err = (got - ref).abs().amax(-1) / scale
    if near_ties is not None:
        tied = row_err[near_ties]
        assert bool((tied <= ROUTING_FLIP).all()), f"{what}: a routing near-tie's position off by {tied.tolist()}"
        row_err = row_err[~near_ties]
    worst, second = (sorted(row_err.tolist(), reverse=True) + [0.0])[:2]
    assert worst <= one_flip, f"{what}: max error {worst:.3g} of scale: {row_err.tolist()}"
    assert second <= 8e-2, f"{what}: second-largest error {second:.3g} of scale: {row_err.tolist()}"
    assert float(row_err.mean()) <= 3e-2, f"{what}: mean error {float(row_err.mean()):.3g} of scale: {row_err.tolist()}"


def test_gguf_logits_match_dequantized_hf(tiny_gguf):
    path, model, _, seed, _ = tiny_gguf
    rng = random.Random(seed)
    eng = engine_for(path, prefill_chunk=9)
    ids = [rng.randrange(V) for _ in range(30)]
    got = eng.prompt_logits(ids)
    ref = hf_logits(model, ids)
    assert_close_rounding(got, ref, f"seed {seed}")


#: a router's k-th and next logit closer than this in transformers' forward: a routing near-tie
#: (the engine's rounding may choose the other expert; seen at 1.0e-2 moving a decode position
#: by 9.2e-2 of the logits' scale)
ROUTER_TIE = 2e-2


def test_gguf_decode_through_cache(tiny_gguf):
    """Greedy decode through the KV cache against transformers on the full sequence; positions
    at a routing near-tie held to the routing-flip bound alone."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models_moe_families"))
    from families import router_gaps

    path, model, _, seed, _ = tiny_gguf
    rng = random.Random(seed + 1)
    eng = engine_for(path)
    rec = LogitsRecorder(eng)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (7, 19)]
    reqs = [eng.add_request(p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)) for p in prompts]
    while eng.has_work():
        eng.step()
    for p, r in zip(prompts, reqs):
        full = p + r.output_ids
        ref = hf_logits(model, full)[len(p) - 1 : -1]
        gaps = router_gaps(model, full, [L.mlp.gate for L in model.model.layers], model.config.num_experts_per_tok)
        assert_close_rounding(torch.stack(rec[r.request_id]), ref, f"seed {seed}",
                              near_ties=gaps[len(p) - 1 : -1] < ROUTER_TIE)  # fmt: skip


def test_gguf_without_tokenizer_rejects_text(tiny_gguf):
    from freetoken.loading.tokenizer import NoTokenizerError

    path = tiny_gguf[0]
    eng = engine_for(path)
    assert eng.tokenizer.has_text is False
    with pytest.raises(NoTokenizerError, match="token ids only"):
        eng.tokenizer.encode("hello")
    from freetoken.engine.llm import LLM

    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = eng, eng.tokenizer
    with pytest.raises(NoTokenizerError, match="--prompt-ids"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 2 and out[0].text == ""


def _cpu_moe_reference():
    """tests/cpu_moe's quantization-aware float64 MoE reference (gguf-py free: it takes
    dequantized matrices)."""
    import importlib.util
    import sys
    from pathlib import Path

    if "cpu_moe_reference" in sys.modules:  # tests/cpu_moe ran in this session
        return sys.modules["cpu_moe_reference"]
    path = Path(__file__).resolve().parents[1] / "cpu_moe" / "cpu_moe_reference.py"
    spec = importlib.util.spec_from_file_location("cpu_moe_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["cpu_moe_reference"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_FMT_NAME = {Fmt.Q8_0: "q8_0", Fmt.Q4_K: "q4_k", Fmt.Q5_K: "q5_k", Fmt.Q6_K: "q6_k", Fmt.F16: "f16", Fmt.BF16: "bf16"}


def test_gguf_tensors_as_the_engine_runs_them(tiny_gguf):
    """Every tensor of the file as the engine runs it, layer by layer against gguf-py's
    dequantization, so no int8 rounding flip carries from one op to the next:

    * each projection (fused q/k/v, o, output head) applied to the identity: a unit row
      quantizes to int8 exactly, so row j of the result is column j of the matrix the
      kernels hold, to float32 rounding (1e-5);
    * each layer's experts on random tokens and routes against the quantization-aware
      float64 MoE of tests/cpu_moe, boundary cases forgiven element by element (1e-4);
    * router, norms and embedding rows.
    A uniform 5% scale error on one expert matrix, which the end-to-end bound above lets
    through, fails here."""
    import freetoken_cpu_moe as cm
    from freetoken_cpu_moe.host_experts import HostExperts

    path, _, _, seed, ref = tiny_gguf
    reference = _cpu_moe_reference()
    rng = np.random.default_rng(seed)
    model = engine_for(path).model

    def close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
        err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
        assert err <= rtol, f"seed {seed}: {what}: max error {err:.3g} of its scale"

    eye = torch.eye(H, dtype=torch.float32)
    close(model.lm_head(eye), ref["output.weight"].T, "output head")
    ids = torch.from_numpy(rng.integers(0, V, 12))
    close(model.embed(ids).float(), ref["token_embd.weight"][ids], "embedding rows")
    close(model.norm.float(), ref["output_norm.weight"], "output norm", 0.0)
    for i, L in enumerate(model.layers):
        g = lambda n: ref[f"blk.{i}.{n}.weight"]  # noqa: E731
        q, k, v = L.qkv(eye)
        close(q, g("attn_q").T, f"layer {i} attn_q")
        close(k, g("attn_k").T, f"layer {i} attn_k")
        close(v, g("attn_v").T, f"layer {i} attn_v")
        close(L.o(torch.eye(HEADS * HD, dtype=torch.float32)), g("attn_output").T, f"layer {i} attn_output")
        close(L.in_norm.float(), g("attn_norm"), f"layer {i} attn_norm", 0.0)
        close(L.post_norm.float(), g("ffn_norm"), f"layer {i} ffn_norm", 0.0)
        close(L.q_norm.float(), g("attn_q_norm"), f"layer {i} attn_q_norm", 0.0)
        close(L.k_norm.float(), g("attn_k_norm"), f"layer {i} attn_k_norm", 0.0)
        # router: top-k of softmax(x @ router.T), renormalized (norm_topk_prob)
        x = rng.standard_normal((6, H)).astype(np.float32)
        got_ids, got_w = L.moe.route(torch.from_numpy(x))
        probs = torch.softmax(torch.from_numpy(x).double() @ g("ffn_gate_inp").double().T, dim=-1)
        want_w, want_ids = probs.topk(K, dim=-1)
        assert torch.equal(got_ids.long(), want_ids), f"seed {seed}: layer {i} routes"
        close(got_w, want_w / want_w.sum(-1, keepdim=True), f"layer {i} route weights")
        # experts, fed directly (the same routes as a decode step would give them)
        mix = MIX[i]
        raws = [reference.RawWeights(_FMT_NAME[mix[n]], None, None, g(n).double().numpy())
                for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]  # fmt: skip
        perm = rng.permutation(E)  # every expert serves some token
        route_ids = np.array([[perm[(t + j) % E] for j in range(K)] for t in range(6)], dtype=np.int32)
        route_w = rng.random((6, K)).astype(np.float32)
        y = cm.moe_forward(HostExperts().bank(L.moe.experts, L.moe.activation), x, route_ids, route_w)
        err = reference.moe_error(np.asarray(y, dtype=np.float64), raws, x.astype(np.float64), route_ids, route_w)
        assert err < 1e-4, f"seed {seed}: layer {i} experts: error {err:.3g}"
