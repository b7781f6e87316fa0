"""freetoken_cpu_moe.step_profile.StepProfiler on a DeepSeek-V3 model (multi-head latent
attention, a dense MLP layer, a MoE layer with a shared expert): the latent attention's
projections, its up-projections (absorbed in decode, the context's expansion in a prompt),
its attention, the dense MLP and the shared expert are timed parts with the calls each step
makes, the tokens are those of the unprofiled engine, and on exit the parts are back."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")
pytest.importorskip("freetoken_cpu_moe")

from families import make_model, save  # noqa: E402
from freetoken import SamplingParams  # noqa: E402
from freetoken.models import mla  # noqa: E402
from freetoken_cpu_moe.step_profile import PARTS, StepProfiler  # noqa: E402
from helpers import engine_for  # noqa: E402


def _generate(eng, prompt: list[int], max_tokens: int) -> list[int]:
    req = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    return list(req.output_ids)


def _parts(eng) -> list[object]:
    out: list[object] = [mla.absorbed_attention, mla.expanded_attention]
    for L in eng.model.layers:
        out += [L.attn.proj_a, L.attn.q_b, L.attn.uk, L.attn.uv, L.attn.o, L.mlp, L.moe and L.moe.shared]
    return out


def test_latent_attention_and_dense_mlp_are_timed(tmp_path):
    seed = random.randrange(1 << 30)
    path = str(tmp_path / "hf")
    save(make_model("deepseek_v3", seed), path)  # one dense layer, then MoE layers with a shared expert
    eng = engine_for(path, enable_prefix_cache=False)
    try:
        layers = eng.model.layers
        dense = sum(1 for L in layers if L.mlp is not None)
        assert 0 < dense < len(layers) and all(L.moe is None or L.moe.shared is not None for L in layers)
        # a prompt longer than the chunks that attend in latent space: its context is expanded
        n_prompt = layers[0].attn.shape.absorb_max_queries + 3
        prompt = [random.Random(seed).randrange(160) for _ in range(n_prompt)]
        plain = _generate(eng, prompt, 5)
        before = _parts(eng)
        with StepProfiler(eng) as prof:
            profiled = _generate(eng, prompt, 5)
        assert profiled == plain, f"seed {seed}"
        assert all(a is b for a, b in zip(_parts(eng), before)), "the profiler left a wrapper in place"
        n = len(layers)
        for kind, steps in (("prefill", 1), ("decode", 4)):
            s = prof.splits[kind]
            assert s.steps == steps, kind
            # per layer: proj_a and q_b; up-projections: decode uk + uv, a prompt one expansion
            want = {"qkv": 2 * n, "kv_b": (2 if kind == "decode" else 1) * n, "attention": n, "o_proj": n,
                    "mlp": n, "experts": n - dense, "router": n - dense, "embed": 1, "lm_head": 1}  # fmt: skip
            for p in PARTS:
                assert s.calls[p] == steps * want[p], (kind, p, s.calls)
                assert s.part_s[p] > 0, (kind, p, s.part_s)
            assert sum(s.part_s.values()) <= s.step_s + s.part_s["lm_head"], kind
        report = prof.report(n)
        assert f"prefill: 1 steps, {n_prompt} tokens/step" in report and "kv_b" in report and "mlp" in report
    finally:
        eng.close()
