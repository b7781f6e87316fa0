"""json_object mode as an engine constraint, in process on the demo model: the masks
found by the trie walk equal a brute-force check of every token, ``allows`` agrees
with the mask, and every budget ends in a parseable object with finish_reason "stop"."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.server import json_grammar as g
from freetoken.server.json_mode import JsonObjectConstraint, check_supported, vocab_for


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(backend="cpu", kv_cache_tokens=8192, max_model_len=1024)


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([True, False, None, -0.25, 12, 3e-7])
    if kind in (1, 2, 3):
        return "".join(rng.choice('ab "\\\n/é€ ') for _ in range(rng.randrange(5)))
    if kind in (4, 5):
        return {f"k{i}": _value(rng, depth + 1) for i in range(rng.randrange(3))}
    return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]


def _states(seed: int, count: int) -> list[g.State]:
    """Distinct automaton states met along random serialized objects."""
    rng = random.Random(seed)
    seen: dict[g.State, None] = {g.START: None}
    while len(seen) < count:
        obj = {"a": _value(rng, 0), "b": _value(rng, 0)}
        text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, separators=rng.choice([(",", ":"), (", ", ": ")]))
        state = g.START
        for ch in text:
            state = g.step(state, ch)
            assert state is not None, text
            seen[state] = None
    return list(seen)[:count]


def test_masks_equal_brute_force_over_the_vocabulary(llm: LLM) -> None:
    vocab = vocab_for(llm.tokenizer)
    texts = [vocab.text(t) for t in range(vocab.size)]
    for state in _states(random.randrange(1 << 30), 60):
        entry = vocab.masks(state)
        for t, text in enumerate(texts):
            new = g.feed(state, text) if text is not None else None
            assert bool(entry.mask[t]) == (new is not None), (state, t, text)
            if new is not None:
                assert int(entry.close[t]) == len(g.closing(new)), (state, t, text)


def test_allows_agrees_with_the_mask_at_every_budget(llm: LLM) -> None:
    vocab = vocab_for(llm.tokenizer)
    V = llm.engine.model_config.vocab_size
    rng = random.Random(random.randrange(1 << 30))
    for state in _states(rng.randrange(1 << 30), 30):
        con = JsonObjectConstraint(vocab)
        con.state, con._close = state, vocab.close_len(state)
        for remaining in (1, 2, 3, 5, 8, 1000):
            vocab._masks.pop(state, None)  # the uncached path of allows() ...
            sample = rng.sample(range(V), 200)
            uncached = [con.allows(t, remaining) for t in sample]
            mask = con.allowed_mask(V, remaining)  # ... and the cached one
            assert uncached == [bool(mask[t]) for t in sample] == [con.allows(t, remaining) for t in sample]
            assert bool(mask.any()) != g.is_done(state), (state, remaining)  # never stuck before the end


def test_every_budget_closes_the_object(llm: LLM) -> None:
    assert check_supported(llm.tokenizer) is None
    vocab = vocab_for(llm.tokenizer)
    prompts = ["Give me a JSON object.", "name, age"]
    for max_tokens in [2, 3, 4, 5, 6, 7, 9, 12, 20, 45]:
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=max_tokens)
            outs = llm.generate(prompts, params, constraints=[JsonObjectConstraint(vocab) for _ in prompts])
            for o in outs:
                assert o.finish_reason == "stop", (max_tokens, o.text)
                assert isinstance(json.loads(o.text), dict), (max_tokens, o.text)
                assert len(o.token_ids) <= max_tokens
                assert o.text == llm.tokenizer.decode(o.token_ids)
    one = llm.generate(prompts[0], SamplingParams(max_tokens=1, temperature=0.0),
                       constraints=[JsonObjectConstraint(vocab)])[0]
    assert (one.text, one.finish_reason) == ("{", "length")


def test_greedy_candidates_path_equals_mask_path(llm: LLM) -> None:
    """Greedy without logprobs never builds a mask when a top candidate is valid; with
    logprobs it always does. Both give the same tokens, and the reported log-probabilities
    are renormalised over the valid tokens (they sum to at most 1 over the top list)."""
    vocab = vocab_for(llm.tokenizer)
    prompt = "Describe a cat as JSON."
    a = llm.generate(prompt, SamplingParams(max_tokens=60, temperature=0.0),
                     constraints=[JsonObjectConstraint(vocab)])[0]
    b = llm.generate(prompt, SamplingParams(max_tokens=60, temperature=0.0, logprobs=True, top_logprobs=50),
                     constraints=[JsonObjectConstraint(vocab)])[0]
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "stop"
    for lp in b.logprobs:
        assert lp.top[0][0] == lp.token_id  # greedy: the chosen token is the best valid one
        assert float(torch.tensor([v for _, v in lp.top]).exp().sum()) <= 1 + 1e-5
    first = b.logprobs[0]  # the first token must open the object
    assert all((vocab.text(t) or "").startswith("{") for t, _ in first.top)
