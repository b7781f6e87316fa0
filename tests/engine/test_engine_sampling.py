"""Sampling: the distribution each knob produces against a numpy reference, seeded
draws, penalties, and log-probabilities."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from freetoken.engine.request import Request
from freetoken.engine.sampling import (apply_penalties, argmax_rows, plain_greedy, plain_sampled, sample,
                                       sampling_probs)
from freetoken.engine.sampling_params import SamplingParams
from freetoken.loading.tokenizer import IdsOnlyTokenizer


def np_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Reference written from the definitions, in float64."""
    x = logits.astype(np.float64) / temperature
    V = len(x)
    keep = np.ones(V, bool)
    if 0 < top_k < V:
        kth = np.sort(x)[::-1][top_k - 1]
        keep &= x >= kth
    p = np.exp(x - x[keep].max()) * keep
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = 0.0
        nucleus = np.zeros(V, bool)
        for i in order:  # smallest prefix whose mass reaches top_p
            nucleus[i] = True
            cum += p[i]
            if cum >= top_p:
                break
        p = p * nucleus
    if min_p > 0:
        p = p * (p >= min_p * p.max())
    return p / p.sum()


def np_penalties(logits: np.ndarray, prompt: list[int], out: list[int], rep: float, pres: float, freq: float) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    for t in set(prompt) | set(out):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(out):
        c = out.count(t)
        x[t] -= freq * c + pres
    return x


CASES = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    dict(temperature=0.5, top_k=20, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_distribution_matches_numpy(case):
    rng = np.random.default_rng(random.randrange(1 << 30))
    for _ in range(5):
        logits = (rng.standard_normal(64) * 2).astype(np.float32)
        got = sampling_probs(torch.from_numpy(logits), SamplingParams(**case)).double().numpy()
        ref = np_probs(logits, **case)
        np.testing.assert_allclose(got, ref, atol=2e-6)  # float32 softmax vs float64
        assert np.array_equal(got > 0, ref > 0)  # the same tokens survive


def _penalty_case(rng: np.random.Generator) -> tuple[np.ndarray, list[int], list[int], dict[int, int]]:
    """Random logits over 50 tokens, a prompt, the output so far and its token counts."""
    logits = (rng.standard_normal(50) * 3).astype(np.float32)
    prompt = [int(t) for t in rng.integers(0, 50, 10)]
    out = [int(t) for t in rng.integers(0, 50, 12)]
    counts: dict[int, int] = {}
    for t in out:
        counts[t] = counts.get(t, 0) + 1
    return logits, prompt, out, counts


def test_penalties_match_numpy():
    rng = np.random.default_rng(random.randrange(1 << 30))
    logits, prompt, out, counts = _penalty_case(rng)
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(torch.from_numpy(logits), p, prompt, counts).double().numpy()
    np.testing.assert_allclose(got, np_penalties(logits, prompt, out, 1.3, 0.5, 0.25), atol=1e-5)


def test_logit_bias_is_added_after_the_penalties():
    rng = np.random.default_rng(random.randrange(1 << 30))
    logits, prompt, out, counts = _penalty_case(rng)
    bias = {int(t): float(b) for t, b in zip(rng.choice(50, 6, replace=False), rng.uniform(-100, 100, 6))}
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25,
                       logit_bias={**bias, 60: 5.0})  # 60: beyond the row, left out
    got = apply_penalties(torch.from_numpy(logits), p, prompt, counts).double().numpy()
    ref = np_penalties(logits, prompt, out, 1.3, 0.5, 0.25)
    for t, b in bias.items():
        ref[t] += b
    np.testing.assert_allclose(got, ref, atol=1e-4)
    alone = apply_penalties(torch.from_numpy(logits), SamplingParams(logit_bias=bias), prompt, counts)
    ref = logits.astype(np.float64)
    for t, b in bias.items():
        ref[t] += b
    np.testing.assert_allclose(alone.double().numpy(), ref, atol=1e-4)


@pytest.mark.parametrize("bias", [{"3": 1.0}, {-1: 1.0}, {True: 1.0}, {3: float("nan")}, {3: float("inf")}])
def test_logit_bias_refuses_what_is_no_token_id_or_number(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_requests_are_sampled_with_their_bias():
    """A greedy request whose best token is biased by -100 takes the second best; a sampled one
    biased +100 to a token takes it; the unbiased greedy request beside them keeps its argmax;
    none of the biased ones is decided by the plain (argmax or on-device) paths."""
    logits = torch.randn(3, 100) * 3
    order = torch.argsort(logits, dim=-1, descending=True)
    ban = int(order[0, 0])
    reqs = [_req(SamplingParams(temperature=0.0, logit_bias={ban: -100.0})),
            _req(SamplingParams(temperature=0.0)),
            _req(SamplingParams(temperature=1.0, seed=4, logit_bias={int(order[2, -1]): 100.0}))]
    assert not plain_greedy(reqs[0]) and plain_greedy(reqs[1]) and not plain_sampled(reqs[2])
    got = [t for t, _ in sample(logits, reqs, torch.Generator().manual_seed(1))]
    assert got == [int(order[0, 1]), int(order[1, 0]), int(order[2, -1])]


def _req(params: SamplingParams, gen=None, prompt=(1,)) -> Request:
    return Request("r", list(prompt), params, IdsOnlyTokenizer([], 64, "test"), [], 10_000, gen)


def test_draws_follow_the_distribution():
    """10k seeded draws: empirical frequencies within 5 sigma of the probabilities."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    logits = torch.from_numpy((rng.standard_normal(12) * 1.5).astype(np.float32))
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95, seed=123)
    probs = np_probs(logits.numpy(), 0.8, 8, 0.95, 0.0)
    g = torch.Generator().manual_seed(7)
    n = 10_000
    counts = np.zeros(12)
    reqs = [_req(params, g) for _ in range(100)]
    for _ in range(n // 100):
        toks = sample(logits.expand(100, -1), reqs, g)
        for t, _ in toks:
            counts[t] += 1
    sigma = np.sqrt(n * probs * (1 - probs)) + 1e-9
    assert np.all(np.abs(counts - n * probs) <= 5 * sigma + 1), (counts, n * probs)
    assert np.all(counts[probs == 0] == 0)


def test_seeded_draws_reproducible_and_seed_dependent():
    logits = torch.randn(4, 200)
    def draws(seed):
        g = torch.Generator().manual_seed(seed)
        reqs = [_req(SamplingParams(temperature=1.0, seed=seed), g)]
        return [sample(logits[i % 4 : i % 4 + 1], reqs, torch.Generator())[0][0] for i in range(40)]
    assert draws(5) == draws(5)
    assert draws(5) != draws(6)


def test_logprobs_are_model_log_softmax_with_top_n():
    logits = torch.randn(3, 100) * 3
    reqs = [_req(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=4)) for _ in range(3)]
    out = sample(logits, reqs, torch.Generator())
    ref = np.log(np.exp(logits.double().numpy()) / np.exp(logits.double().numpy()).sum(-1, keepdims=True))
    for i, (tok, lp) in enumerate(out):
        assert tok == int(np.argmax(ref[i]))
        assert lp.token_id == tok and abs(lp.logprob - ref[i, tok]) < 1e-5
        top_ids = [t for t, _ in lp.top]
        assert top_ids == list(np.argsort(-ref[i])[:4])
        assert all(abs(v - ref[i, t]) < 1e-5 for t, v in lp.top)


def test_argmax_rows_is_the_first_largest_value_per_row():
    """The greedy pick against a plain Python scan: first index of the row's maximum, a NaN
    counting as the largest (torch's rule), for float32 host rows (numpy's path), other
    dtypes and non-contiguous views (torch's path)."""
    rng = np.random.default_rng()

    def scan(row: list[float]) -> int:
        nan = [i for i, v in enumerate(row) if v != v]
        if nan:
            return nan[0]
        best = max(row)
        return next(i for i, v in enumerate(row) if v == best)

    x = rng.standard_normal((5, 151_936)).astype(np.float32)
    x[1, [17, 90_000, 151_935]] = 1e4  # ties: the first wins
    x[2, [5, 123_456]] = np.nan  # a NaN: the first NaN wins
    x[3] = -np.inf
    x[3, 77_777] = -1e30
    x[4, -1] = np.inf
    t = torch.from_numpy(x)
    want = [scan(r) for r in x.tolist()]
    assert want[1] == 17 and want[2] == 5 and want[3] == 77_777 and want[4] == 151_935
    assert argmax_rows(t) == want
    assert argmax_rows(t[1:3]) == want[1:3]
    assert argmax_rows(t[:, ::2]) == [scan(r) for r in x[:, ::2].tolist()]
    assert argmax_rows(t.to(torch.bfloat16))[2] == 5  # torch's path, same NaN rule
    assert argmax_rows(t.double()) == want
