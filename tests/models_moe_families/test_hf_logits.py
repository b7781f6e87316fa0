"""Engine logits of the Mixtral, OLMoE, GPT-OSS and GLM-4.5 families against transformers' models
built from tiny random configs (FP32, eager attention): one prompt, chunked prefill, a
batch of different lengths through prefill and paged decode, positions past the sliding
window."""

from __future__ import annotations

import random

import pytest
import torch

from families import hf_logits, make_model, save
from freetoken import SamplingParams
from helpers import LogitsRecorder, assert_close, engine_for

CASES = {
    "mixtral": ("mixtral", dict()),
    # a sliding window on every layer, shorter than the prompts
    "mixtral-window": ("mixtral", dict(sliding_window=6, num_experts_per_tok=3, rope_theta=1e6)),
    "olmoe": ("olmoe", dict()),
    "olmoe-clip": ("olmoe", dict(clip_qkv=0.3, norm_topk_prob=True, tie_word_embeddings=True)),
    # sliding (window 8) and full layers, sinks, YaRN, biases everywhere
    "gpt_oss": ("gpt_oss", dict()),
    # partial RoPE, biases, q/k norms, a dense first layer, a shared expert, 2 of 4 groups,
    # renormalised weights scaled by 2.5, random score-correction biases
    "glm4_moe": ("glm4_moe", dict()),
    # no q/k norms or biases, unnormalised weights, two shared experts, two dense layers, a
    # quarter of each head rotated, one group
    "glm4_moe-plain": ("glm4_moe", dict(use_qk_norm=False, attention_bias=False, norm_topk_prob=False,
                                        n_shared_experts=2, first_k_dense_replace=2, partial_rotary_factor=0.25,
                                        n_group=1, topk_group=1, routed_scaling_factor=0.7, rope_theta=1e6)),
    # GLM-4.5-Air's switches: biases without q/k norms, one group, half of each head rotated
    "glm4_moe-air": ("glm4_moe", dict(use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                                      tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    family, over = CASES[request.param]
    path = str(tmp_path_factory.mktemp(f"hf-{request.param}"))
    seed = random.randrange(1 << 30)
    model = make_model(family, seed, **over)
    save(model, path)
    return model, path, seed


def _prompt(rng: random.Random, n: int, vocab: int = 160) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def check_generation(model, eng, prompts, params, seed):
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
        assert r.output_ids == ref.argmax(-1).tolist()
    assert eng.stats().kv_used_tokens == 0


def test_one_prompt_all_positions(checkpoint):
    model, path, seed = checkpoint
    rng = random.Random(seed)
    ids = _prompt(rng, 23)
    assert_close(engine_for(path).prompt_logits(ids), hf_logits(model, ids), f"seed {seed}")


def test_chunked_prefill(checkpoint):
    model, path, seed = checkpoint
    rng = random.Random(seed + 1)
    ids = _prompt(rng, 40)  # chunks of 7 straddle the 16-token blocks and the window
    assert_close(engine_for(path, prefill_chunk=7).prompt_logits(ids), hf_logits(model, ids), f"seed {seed}")


def test_batch_of_different_lengths_prefill_then_decode(checkpoint):
    model, path, seed = checkpoint
    rng = random.Random(seed + 2)
    eng = engine_for(path, prefill_chunk=16)
    prompts = [_prompt(rng, n) for n in (1, 5, 17, 41)]
    check_generation(model, eng, prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), seed)
