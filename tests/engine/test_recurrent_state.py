"""Per-request recurrent state of the hybrid models: slots are taken at admission and
released on finish, abort and preemption; nothing is left behind."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from freetoken import SamplingParams
from helpers import engine_for
from qwen35_helpers import VOCAB, make_hf


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf-qwen35-state"))
    seed = random.randrange(1 << 30)
    make_hf("qwen3_5_moe", path, seed)
    return path, seed


def test_32_interleaved_requests_with_aborts_leave_nothing(hybrid):
    path, seed = hybrid
    rng = random.Random(seed)
    # a small KV cache so that preemption happens too
    eng = engine_for(path, kv_cache_tokens=256, max_model_len=128, max_running_requests=6, prefill_chunk=40)
    pool = eng.states
    assert pool is not None and pool.num_slots == 7
    reqs = []
    aborted = 0
    for i in range(32):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60))]
        reqs.append(eng.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 30), temperature=0.0,
                                                           ignore_eos=True)))  # fmt: skip
        for _ in range(rng.randrange(0, 3)):
            eng.step()
            assert pool.used_slots == len(eng.scheduler.running)  # a slot per running request, no more
        if i % 3 == 1:  # abort a random live request: waiting, prefilling or decoding
            live = [r for r in reqs if r.request_id in eng.requests]
            if live and eng.abort(rng.choice(live).request_id):
                aborted += 1
    while eng.has_work():
        eng.step()
        assert pool.used_slots == len(eng.scheduler.running)
    assert aborted >= 8
    assert pool.used_slots == 0 and pool.free_slots == pool.num_slots
    assert eng.kv.used_blocks == 0 and eng.prefix_cache.num_referenced == 0
    assert all(r.state_slot is None for r in reqs)
    assert not eng.requests


def test_a_reused_slot_starts_from_zero_state(hybrid):
    """The same prompt gives the same logits whether its slot is fresh or was just used by
    another request (allocation clears the conv window and the SSM state)."""
    path, seed = hybrid
    rng = random.Random(seed + 1)
    eng = engine_for(path, max_running_requests=1)
    prompt = [rng.randrange(VOCAB) for _ in range(20)]
    first = eng.prompt_logits(prompt)
    other = eng.add_request([rng.randrange(VOCAB) for _ in range(30)], SamplingParams(max_tokens=5, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert other.output_ids and eng.states.used_slots == 0
    torch.testing.assert_close(eng.prompt_logits(prompt), first, atol=0, rtol=0)


def test_prefix_cache_is_off_for_hybrids(hybrid, caplog):
    path, seed = hybrid
    with caplog.at_level(logging.INFO, logger="freetoken.engine.engine"):
        eng = engine_for(path, enable_prefix_cache=True)
    assert not eng.prefix_cache.enabled
    assert any("prefix cache off" in r.getMessage() for r in caplog.records)
    rng = random.Random(seed + 2)
    prompt = [rng.randrange(VOCAB) for _ in range(40)]  # two full KV blocks, asked twice
    for _ in range(2):
        r = eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        while eng.has_work():
            eng.step()
        assert r.cached_tokens == 0
    assert eng.stats().prefix_cache_hits == 0 and eng.stats().kv_cached_tokens == 0
