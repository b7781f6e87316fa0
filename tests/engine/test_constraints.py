"""Per-request token constraints inside the sampler: honoured exactly, greedy equals the
argmax over the allowed tokens of an independent HF reference, sampling draws from
the renormalised allowed distribution, log-probabilities are the allowed-renormalised
model distribution, and unconstrained requests in the same batch are unaffected."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import pytest
import torch
from helpers import LogitsRecorder, engine_for, hf_logits, make_hf

from freetoken.engine.constraints import TokenConstraint
from freetoken.engine.engine import LLMEngine
from freetoken.engine.request import Request
from freetoken.engine.constraints import NoAllowedToken
from freetoken.engine.sampling import GREEDY_CANDIDATES, MAX_REDRAWS, constrained_pick, sample
from freetoken.engine.sampling_params import SamplingParams
from freetoken.loading.tokenizer import IdsOnlyTokenizer

V = 160  # the tiny checkpoint's vocabulary (helpers.tiny_config)


class SubsetConstraint:
    """Allows a fixed set of token ids; optionally complete after ``complete_after`` tokens."""

    def __init__(self, allowed: list[int], vocab: int = V, complete_after: Optional[int] = None) -> None:
        self.allowed = set(allowed)
        self.mask = torch.zeros(vocab, dtype=torch.bool)
        if allowed:
            self.mask[torch.tensor(sorted(self.allowed))] = True
        self.complete_after = complete_after
        self.seen: list[int] = []
        self.mask_calls = 0

    def restricts(self) -> bool:
        return True

    def allows(self, token_id: int, remaining: int) -> bool:
        return token_id in self.allowed

    def allowed_mask(self, vocab_size: int, remaining: int) -> torch.Tensor:
        self.mask_calls += 1
        return self.mask

    def fallback_token(self, remaining: int) -> Optional[int]:
        return None

    def advance(self, token_id: int) -> None:
        assert token_id in self.allowed, token_id
        self.seen.append(token_id)

    def is_complete(self) -> bool:
        return self.complete_after is not None and len(self.seen) >= self.complete_after


def random_subset(rng: random.Random, size: int) -> list[int]:
    return rng.sample(range(V), size)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "m")
    model = make_hf(path, seed=1234)
    return path, model


@pytest.fixture(scope="module")
def eng(tiny) -> LLMEngine:
    return engine_for(tiny[0], max_model_len=256)


def run(eng: LLMEngine, jobs: list[tuple[list[int], SamplingParams, Optional[TokenConstraint]]]) -> list[Request]:
    reqs = [eng.add_request(p, sp, constraint=c) for p, sp, c in jobs]
    while eng.has_work():
        eng.step()
    return reqs


PROMPTS = [[3, 17, 42, 99, 5], [150, 2, 2, 71], [8, 9, 10, 11, 12, 13, 14, 15]]


def test_protocol_is_runtime_checkable() -> None:
    assert isinstance(SubsetConstraint([1, 2]), TokenConstraint)


def test_greedy_is_argmax_over_allowed_of_hf_reference(tiny, eng) -> None:
    """Greedy constrained output = argmax over the allowed ids of HF's logits (an independent implementation) at
    every position; the small subsets force the fallback past the top candidates."""
    _, model = tiny
    rng = random.Random(random.randrange(1 << 30))
    sizes = [3, 8, 40, 120]  # 3 and 8 out of 160: the best allowed is mostly outside the top candidates
    jobs = []
    for k, size in enumerate(sizes):
        prompt = PROMPTS[k % len(PROMPTS)]
        if k == 0:
            # Draw the smallest subset from tokens outside HF's top GREEDY_CANDIDATES at the
            # first generated position, so at least that step needs the full mask. A plain
            # random subset often let the model settle on one allowed token that it then
            # ranks first, and no step went deep (about 1 run in 6).
            first = hf_logits(model, prompt)[-1]
            deep_ids = torch.argsort(first, descending=True)[GREEDY_CANDIDATES:].tolist()
            subset = rng.sample(deep_ids, size)
        else:
            subset = random_subset(rng, size)
        jobs.append((prompt, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
                     SubsetConstraint(subset)))
    reqs = run(eng, jobs)
    deep = 0
    for (prompt, _, con), r in zip(jobs, reqs):
        out = r.output_ids
        assert len(out) == 14 and r.finish_reason == "length"
        assert all(t in con.allowed for t in out)
        ref = hf_logits(model, prompt + out).double()
        allowed = torch.tensor(sorted(con.allowed))
        for k, tok in enumerate(out):
            row = ref[len(prompt) - 1 + k]
            best = int(allowed[torch.argmax(row[allowed])])
            assert tok == best or float(row[best] - row[tok]) < 1e-4, (k, tok, best)
            deep += int(torch.sum(row > row[best])) >= GREEDY_CANDIDATES
    assert deep > 0, "no step needed the full mask; the subsets were not small enough"


def test_greedy_lazy_path_equals_mask_path_and_logprobs(eng) -> None:
    """Greedy without logprobs tests candidates one by one; with logprobs it builds the
    mask. Same tokens; the log-probabilities are the model's log-softmax renormalised
    over the allowed ids (from the engine's own captured logits, in float64)."""
    rng = random.Random(random.randrange(1 << 30))
    subset = random_subset(rng, 12)
    lazy = SubsetConstraint(subset)
    masked = SubsetConstraint(subset)
    rec = LogitsRecorder(eng)
    try:
        a, b = run(eng, [
            (PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), lazy),
            (PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True,
                                        top_logprobs=5), masked),
        ])
        rows = rec[b.request_id]
    finally:
        rec.close()
    assert a.output_ids == b.output_ids
    assert masked.mask_calls == 10
    allowed = sorted(subset)
    for tok, lp, row in zip(b.output_ids, b.logprobs, rows):
        x = row.double().numpy()[allowed]
        ref = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        ref_of = dict(zip(allowed, ref))
        assert lp.token_id == tok and lp.logprob == pytest.approx(ref_of[tok], abs=1e-5)
        assert [t for t, _ in lp.top] == [allowed[i] for i in np.argsort(-ref, kind="stable")[:5]]
        assert all(v == pytest.approx(ref_of[t], abs=1e-5) for t, v in lp.top)


@pytest.mark.parametrize("knobs", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=3, top_p=0.9),
    dict(temperature=1.5, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
], ids=["plain", "topk-topp", "minp-penalties"])
def test_sampled_tokens_are_always_allowed(eng, knobs) -> None:
    rng = random.Random(random.randrange(1 << 30))
    jobs = [(PROMPTS[k % 3], SamplingParams(max_tokens=30, ignore_eos=True, seed=rng.randrange(1 << 30), **knobs),
             SubsetConstraint(random_subset(rng, size))) for k, size in enumerate([1, 5, 30, 100])]
    for (_, _, con), r in zip(jobs, run(eng, jobs)):
        assert len(r.output_ids) == 30
        assert set(r.output_ids) <= con.allowed
        assert con.seen == r.output_ids


def test_unconstrained_requests_in_the_batch_are_unaffected(eng) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=77, ignore_eos=True)
    alone = [run(eng, [(p, greedy, None)])[0].output_ids for p in PROMPTS]
    alone_seeded = run(eng, [(PROMPTS[1], seeded, None)])[0].output_ids
    rng = random.Random(5)
    mixed = run(eng, [
        (PROMPTS[0], greedy, None),
        (PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), SubsetConstraint(random_subset(rng, 4))),
        (PROMPTS[1], greedy, None),
        (PROMPTS[1], seeded, None),
        (PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
         SubsetConstraint(random_subset(rng, 9))),
        (PROMPTS[2], greedy, None),
    ])
    assert [mixed[0].output_ids, mixed[2].output_ids, mixed[5].output_ids] == alone
    assert mixed[3].output_ids == alone_seeded


def test_complete_constraint_stops_and_empty_constraint_errors(eng) -> None:
    done_after = SubsetConstraint(list(range(0, V, 2)), complete_after=4)
    nothing = SubsetConstraint([])
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    a, b, c = run(eng, [(PROMPTS[0], params, done_after), (PROMPTS[1], params, nothing), (PROMPTS[2], params, None)])
    assert a.finish_reason == "stop" and len(a.output_ids) == 4
    assert b.finish_reason == "error" and b.output_ids == []
    assert c.finish_reason == "length" and len(c.output_ids) == 20
    assert not eng.requests and eng.stats().kv_used_tokens == 0  # blocks only the prefix cache keeps are not in use


def _reference_probs(logits: np.ndarray, allowed: list[int], temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Float64, from the definitions: mask, then temperature, top-k, top-p."""
    x = np.full_like(logits, -np.inf, dtype=np.float64)
    x[allowed] = logits[allowed].astype(np.float64) / temperature
    if top_k:
        kth = np.sort(x)[::-1][top_k - 1]
        x[x < kth] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    cum = 0.0
    for i in order:
        keep[i] = True
        cum += p[i]
        if cum >= top_p:
            break
    p = p * keep
    return p / p.sum()


def test_draws_follow_the_renormalised_allowed_distribution() -> None:
    rng = np.random.default_rng(random.randrange(1 << 30))
    n_vocab = 40
    logits = torch.from_numpy((rng.standard_normal(n_vocab) * 1.5).astype(np.float32))
    allowed = sorted(int(t) for t in rng.choice(n_vocab, 12, replace=False))
    probs = _reference_probs(logits.numpy(), allowed, 0.8, 8, 0.95)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    tok = IdsOnlyTokenizer([], n_vocab, "test")
    reqs = [Request("r", [1], SamplingParams(temperature=0.8, top_k=8, top_p=0.95), tok, [], 10_000, g,
                    constraint=SubsetConstraint(allowed, n_vocab)) for _ in range(100)]
    n = 10_000
    counts = np.zeros(n_vocab)
    for _ in range(n // 100):
        for t, _ in sample(logits.expand(100, -1), reqs, g):
            counts[t] += 1
    sigma = np.sqrt(n * probs * (1 - probs)) + 1e-9
    assert np.all(np.abs(counts - n * probs) <= 5 * sigma + 1), (counts, n * probs)
    assert np.all(counts[probs == 0] == 0)


class SupersetMaskConstraint(SubsetConstraint):
    """Its mask holds every token; ``allows`` accepts only the subset (a mask that cannot be
    made exact cheaply), and its fallback is one token of the subset."""

    def __init__(self, allowed: list[int], vocab: int, fallback: Optional[int]) -> None:
        super().__init__(allowed, vocab)
        self.mask = torch.ones(vocab, dtype=torch.bool)
        self.fallback = fallback
        self.checks = 0

    def allows(self, token_id: int, remaining: int) -> bool:
        self.checks += 1
        return token_id in self.allowed

    def fallback_token(self, remaining: int) -> Optional[int]:
        return self.fallback


def test_picks_the_mask_allows_not_are_redrawn_from_the_rest() -> None:
    """Rejected picks are redrawn: the draws follow the distribution renormalised over the
    tokens ``allows`` accepts (the float64 reference), as with an exact mask."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    n_vocab = 40
    logits = torch.from_numpy((rng.standard_normal(n_vocab) * 1.5).astype(np.float32))
    allowed = sorted(int(t) for t in rng.choice(n_vocab, 20, replace=False))
    probs = _reference_probs(logits.numpy(), allowed, 1.0, 0, 1.0)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    params = SamplingParams(temperature=1.0)
    c = SupersetMaskConstraint(allowed, n_vocab, allowed[0])
    n = 4000
    counts = np.zeros(n_vocab)
    for _ in range(n):
        tok, _ = constrained_pick(logits, logits, params, c, 100, g)
        counts[tok] += 1
    sigma = np.sqrt(n * probs * (1 - probs)) + 1e-9
    assert np.all(np.abs(counts - n * probs) <= 5 * sigma + 1), (counts, n * probs)
    assert np.all(counts[probs == 0] == 0) and c.checks > n
    # greedy: the best token allows accepts, unless more than MAX_REDRAWS better ones were rejected
    best = max(allowed, key=lambda t: float(logits[t]))
    rank = int((logits > logits[best]).sum())
    tok, _ = constrained_pick(logits, logits, SamplingParams(temperature=0.0, logprobs=True), c, 100, g)
    assert tok == (best if rank <= MAX_REDRAWS else allowed[0])


def test_fallback_after_too_many_rejections() -> None:
    n_vocab = 64
    logits = torch.arange(n_vocab, dtype=torch.float32)  # the lowest id is the least likely
    g = torch.Generator().manual_seed(0)
    c = SupersetMaskConstraint([0], n_vocab, 0)
    tok, _ = constrained_pick(logits, logits, SamplingParams(temperature=0.0, logprobs=True), c, 100, g)
    assert tok == 0 and c.checks == MAX_REDRAWS + 1
    with pytest.raises(NoAllowedToken):
        constrained_pick(logits, logits, SamplingParams(temperature=0.0, logprobs=True),
                         SupersetMaskConstraint([0], n_vocab, None), 100, g)
