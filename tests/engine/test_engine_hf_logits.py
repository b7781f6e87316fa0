"""Engine logits against HF transformers' Qwen3MoeForCausalLM (FP32, eager attention)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from freetoken import SamplingParams
from helpers import LogitsRecorder, assert_close, engine_for, hf_logits, hf_logits_kv_rounded, make_hf

CONFIGS = {
    "base": dict(),
    # unnormalised top-k, tied embeddings, a dense-MLP layer, more experts per token
    "variant": dict(norm_topk_prob=False, tie_word_embeddings=True, mlp_only_layers=[1], num_experts_per_tok=3,
                    rope_theta=1_000_000.0),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"hf-{request.param}"))
    seed = random.randrange(1 << 30)
    model = make_hf(path, seed, **CONFIGS[request.param])
    return model, path, seed


def _prompt(rng: random.Random, n: int, vocab: int = 160) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def test_one_prompt_all_positions(checkpoint):
    model, path, seed = checkpoint
    rng = random.Random(seed)
    eng = engine_for(path)
    ids = _prompt(rng, 23)
    assert_close(eng.prompt_logits(ids), hf_logits(model, ids), f"seed {seed}")


def test_chunked_prefill_matches_full_forward(checkpoint):
    model, path, seed = checkpoint
    rng = random.Random(seed + 1)
    eng = engine_for(path, prefill_chunk=7)
    ids = _prompt(rng, 40)  # 6 chunks: 7,7,7,7,7,5 -- chunks straddle 16-token blocks
    assert_close(eng.prompt_logits(ids), hf_logits(model, ids), f"seed {seed}")


def _check_generation(model, eng, prompts, params, seed):
    with LogitsRecorder(eng) as rec:
        reqs = [eng.add_request(p, params) for p in prompts]
        while eng.has_work():
            eng.step()
    for p, r in zip(prompts, reqs):
        full = p + r.output_ids
        ref = hf_logits(model, full)[len(p) - 1 : len(full) - 1]
        got = torch.stack(rec[r.request_id])
        assert got.shape == ref.shape
        assert_close(got, ref, f"seed {seed} prompt len {len(p)}")
        # greedy: every chosen token is the argmax of the HF logits
        assert r.output_ids == ref.argmax(-1).tolist()


def test_batch_of_different_lengths_prefill_then_decode(checkpoint):
    model, path, seed = checkpoint
    rng = random.Random(seed + 2)
    eng = engine_for(path)
    prompts = [_prompt(rng, n) for n in (1, 5, 17, 33)]
    _check_generation(model, eng, prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), seed)


def test_chunked_prefill_while_others_decode(checkpoint):
    model, path, seed = checkpoint
    rng = random.Random(seed + 3)
    eng = engine_for(path, prefill_chunk=8, max_running_requests=3)
    prompts = [_prompt(rng, n) for n in (3, 50, 4, 29)]  # 4th waits for a slot
    _check_generation(model, eng, prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), seed)


def test_positions_past_a_few_hundred(checkpoint):
    model, path, seed = checkpoint
    rng = random.Random(seed + 4)
    eng = engine_for(path, prefill_chunk=128)
    prompts = [_prompt(rng, 330), _prompt(rng, 290)]
    _check_generation(model, eng, prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), seed)


def test_preemption_recomputes_exactly(checkpoint):
    """A KV budget too small for all requests forces preemption; results stay exact."""
    model, path, seed = checkpoint
    rng = random.Random(seed + 5)
    eng = engine_for(path, kv_cache_tokens=96, max_model_len=96, prefill_chunk=64)
    prompts = [_prompt(rng, n) for n in (30, 28, 26)]
    _check_generation(model, eng, prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), seed)
    assert eng.stats().num_preemptions > 0
    assert eng.stats().kv_used_tokens == 0


#: |logit error| / max |logit| against transformers in float32 with its keys and values
#: rounded to the cache's dtype (helpers.hf_logits_kv_rounded). All-dense layers: every
#: position within DENSE_TOL (measured at most 5.6e-4 / 1.7e-4 for bfloat16 / float16 over 15
#: seeds: a K or V value the two sides round to neighbouring 16-bit values). MoE layers: a
#: rounding like that can flip a routing choice, which moves a position's logits by up to a
#: fifth of their range (1 in ~40 checkpoints measured), so there the median position is held
#: to MOE_MEDIAN_TOL (measured at most 1.5e-4); a cache read in the wrong format or not
#: written moves every position.
DENSE_TOL = 2e-3
MOE_MEDIAN_TOL = 1e-3


def _kv_errors(model: Any, eng: Any, rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    """Per position |logit error| / max |logit| of a chunked 40-token prompt and of three
    requests' greedy decode steps (prompts of 1, 17 and 33 tokens)."""
    ids = _prompt(rng, 40)
    ref = hf_logits_kv_rounded(model, ids, dtype)
    errs = [(eng.prompt_logits(ids) - ref).abs().amax(-1) / ref.abs().max()]
    prompts = [_prompt(rng, n) for n in (1, 17, 33)]
    with LogitsRecorder(eng) as rec:
        reqs = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts]
        while eng.has_work():
            eng.step()
    for p, r in zip(prompts, reqs):
        full = p + r.output_ids
        ref = hf_logits_kv_rounded(model, full, dtype)[len(p) - 1 : len(full) - 1]
        errs.append((torch.stack(rec[r.request_id]) - ref).abs().amax(-1) / ref.abs().max())
    return torch.cat(errs)


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_kv_cache_in_a_16_bit_dtype(checkpoint, kv, tmp_path):
    """``kv_cache_dtype`` beside float32 activations: the cache holds the 16-bit dtype (half
    the bytes); chunked prefill and decode steps (native kernels, the native decode step of
    the MoE checkpoint, the torch paths) write and read it."""
    model, path, seed = checkpoint
    dtype = getattr(torch, kv)
    eng = engine_for(path, kv_cache_dtype=kv, prefill_chunk=7)
    f32 = engine_for(path)
    assert {t.dtype for layer in eng.kv.layers for t in layer} == {dtype}
    assert eng.kv.bytes * 2 * f32.kv.num_blocks == f32.kv.bytes * eng.kv.num_blocks
    median = float(_kv_errors(model, eng, random.Random(seed + 7), dtype).median())
    assert median < MOE_MEDIAN_TOL, f"median position {median:.3g} seed {seed}"
    dense_seed = seed + 11
    dense = make_hf(str(tmp_path), dense_seed, mlp_only_layers=[0, 1, 2])
    errs = _kv_errors(dense, engine_for(str(tmp_path), kv_cache_dtype=kv, prefill_chunk=7),
                      random.Random(dense_seed), dtype)  # fmt: skip
    assert float(errs.max()) < DENSE_TOL, f"all-dense checkpoint: {float(errs.max()):.3g} seed {dense_seed}"


def test_a_kv_cache_dtype_a_gpu_backend_cannot_read_is_refused():
    """On a GPU the attention kernels read a cache of the activation dtype: another one is
    refused, naming the flag (the engine asks before the weights load)."""
    import types

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine

    eng = LLMEngine.__new__(LLMEngine)
    eng.config = EngineConfig(kv_cache_dtype="float16")
    eng.backend = types.SimpleNamespace(name="cuda")
    eng.session = types.SimpleNamespace(weight_policy=types.SimpleNamespace(device="cuda:0"))
    with pytest.raises(ValueError, match="--kv-cache-dtype float16: the cuda backend keeps the KV cache in the "
                                         "activation dtype \\(bfloat16\\)"):
        eng._kv_dtype(torch.bfloat16)
    assert eng._kv_dtype(torch.float16) == torch.float16
    eng.session.weight_policy.device = "cpu"
    assert eng._kv_dtype(torch.float32) == torch.float16
    eng.config = EngineConfig()
    assert eng._kv_dtype(torch.float32) == torch.float32
