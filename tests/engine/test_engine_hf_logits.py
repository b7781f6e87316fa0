"""Engine logits against HF transformers' Qwen3MoeForCausalLM (FP32, eager attention)."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken import SamplingParams
from helpers import LogitsRecorder, assert_close, engine_for, hf_logits, make_hf

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
