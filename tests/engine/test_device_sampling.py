"""Sampling where the logits are (freetoken.engine.sampling): the Gumbel-max draw
``gumbel_pick`` against softmax probabilities computed in float64 numpy, its seeds, which
rows ``sample`` draws on the device, and (GPU machine only) ``sample`` on CUDA logits.

The device path is taken for logits off the CPU only; ``gumbel_pick`` itself runs on any
device, so its statistics are checked here on CPU tensors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from freetoken.engine import sampling
from freetoken.engine.constraints import TokenConstraint
from freetoken.engine.request import Request
from freetoken.engine.sampling import (
    device_generator,
    device_rows,
    gumbel_pick,
    picked_on_device,
    plain_greedy,
    plain_sampled,
    sample,
)
from freetoken.engine.sampling_params import SamplingParams
from freetoken.loading.tokenizer import IdsOnlyTokenizer

#: chi-square bound: its tail beyond 40 is below 2e-7 for up to 5 degrees of freedom (V = 6),
#: so a correct sampler fails about once in five million runs
CHI2_BOUND = 40.0


def np_softmax(logits: np.ndarray, temperature: float, top_k: int = 0) -> np.ndarray:
    """softmax(logits / T) over the tokens at least as large as the k-th largest, in float64."""
    x = logits.astype(np.float64) / temperature
    keep = np.ones(len(x), bool)
    if 0 < top_k < len(x):
        keep = x >= np.sort(x)[::-1][top_k - 1]
    p = np.exp(x - x[keep].max()) * keep
    return p / p.sum()


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's statistic over the cells ``probs`` gives mass to (inf if a draw fell elsewhere)."""
    if counts[probs == 0].any():
        return float("inf")
    n = counts.sum()
    keep = probs > 0
    return float((((counts - n * probs) ** 2)[keep] / (n * probs[keep])).sum())


def _logits(seed: int, V: int = 6) -> np.ndarray:
    """Well-spread logits (a shuffled -2..2 ramp plus noise): every temperature gives a
    distinct distribution."""
    rng = np.random.default_rng(seed)
    return (rng.permutation(np.linspace(-2.0, 2.0, V)) + 0.1 * rng.standard_normal(V)).astype(np.float32)


def _draw_counts(logits: np.ndarray, temperature: float, top_k: int, n: int, seed: int, rows: int = 1000) -> np.ndarray:
    V = len(logits)
    x = torch.from_numpy(logits).expand(rows, V)
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(V)
    for _ in range(n // rows):
        np.add.at(counts, gumbel_pick(x, [temperature] * rows, [top_k] * rows, [g] * rows), 1)
    return counts


@pytest.mark.parametrize("top_k", [0, 3])
def test_gumbel_pick_follows_softmax_at_each_temperature(top_k):
    """30k draws per temperature: the chi-square against softmax(logits / T) (top-k masked)
    is small, against the other temperatures' and the unmasked distribution huge, and the
    masked tokens are never drawn."""
    seed = random.randrange(1 << 30)
    logits = _logits(seed)
    n = 30_000
    temps = (0.5, 1.0, 2.0)
    counts = {t: _draw_counts(logits, t, top_k, n, seed + i) for i, t in enumerate(temps)}
    for t in temps:
        ref = np_softmax(logits, t, top_k)
        assert chi2(counts[t], ref) < CHI2_BOUND, (seed, t, counts[t], n * ref)
        for other in temps:
            if other != t:  # a sampler ignoring the temperature fails here
                assert chi2(counts[t], np_softmax(logits, other, top_k)) > 10 * CHI2_BOUND, (seed, t, other)
        if top_k:
            masked = np_softmax(logits, t, top_k) == 0
            assert masked.sum() == len(logits) - top_k
            assert not counts[t][masked].any(), (seed, t, counts[t])
            # the unmasked distribution gives the masked tokens mass: the same counts fail against it
            assert chi2(counts[t], np_softmax(logits, t)) > CHI2_BOUND, (seed, t)


def test_gumbel_pick_applies_each_rows_temperature():
    """One batch alternating T = 0.5 and T = 2 (each row its own generator): 10k draws per
    temperature, each against its own softmax."""
    seed = random.randrange(1 << 30)
    logits = _logits(seed)
    x = torch.from_numpy(logits).expand(200, -1)
    temps = [0.5, 2.0] * 100
    gens = [torch.Generator().manual_seed(seed + i) for i in range(200)]
    counts = np.zeros((2, len(logits)))
    for _ in range(50):
        for i, t in enumerate(gumbel_pick(x, temps, [0] * 200, gens)):
            counts[i % 2, t] += 1
    for j, t in enumerate((0.5, 2.0)):
        assert chi2(counts[j], np_softmax(logits, t)) < CHI2_BOUND, (seed, t, counts[j])
        assert chi2(counts[j], np_softmax(logits, 2.5 - t)) > 10 * CHI2_BOUND, (seed, t)


def test_gumbel_pick_keeps_top_k_ties_and_mixes_rows():
    """Ties with the k-th value stay drawable (as sampling_probs); a batch mixes temperatures,
    top-k and greedy rows (temperature 0: the first largest value, no generator)."""
    tied = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0])
    g = torch.Generator().manual_seed(1)
    seen = set(gumbel_pick(tied.expand(4000, 5), [1.0] * 4000, [2] * 4000, [g] * 4000))
    assert seen == {1, 2, 3}
    rows = torch.tensor([[0.0, 5.0, 1.0], [2.0, 2.0, 0.0], [0.0, 0.0, 9.0]])
    picks = gumbel_pick(rows, [0.0, 0.0, 1e-3], [0, 0, 0], [None, None, torch.Generator().manual_seed(2)])
    assert picks == [1, 0, 2]


def test_gumbel_pick_is_reproducible_from_the_seed():
    logits = torch.randn(4, 200)

    def draws(seed: int) -> list[int]:
        gens = [torch.Generator().manual_seed(seed + i) for i in range(4)]
        return [t for _ in range(20) for t in gumbel_pick(logits, [1.0, 0.7, 1.3, 2.0], [0, 50, 0, 10], gens)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)


def _req(params: SamplingParams, gen=None, constraint=None) -> Request:
    return Request("r", [1], params, IdsOnlyTokenizer([], 64, "test"), [], 10_000, gen, constraint=constraint)


class _AllowAll(TokenConstraint):
    def allows(self, token: int, remaining: int) -> bool:
        return True

    def allowed_mask(self, vocab_size: int, remaining: int):
        return None

    def advance(self, token: int) -> None:
        pass

    def is_complete(self) -> bool:
        return False

    def fallback_token(self, remaining: int):
        return None


def test_device_generator_follows_the_request_seed():
    """Made once per request, seeded from its own generator (the engine's for an unseeded one)."""
    dev = torch.device("cpu")
    a = _req(SamplingParams(seed=3), torch.Generator().manual_seed(3))
    b = _req(SamplingParams(seed=3), torch.Generator().manual_seed(3))
    c = _req(SamplingParams(seed=4), torch.Generator().manual_seed(4))
    default = torch.Generator().manual_seed(0)
    ga = device_generator(a, dev, default)
    assert device_generator(a, dev, default) is ga is a.device_generator
    states = [device_generator(r, dev, default).get_state() for r in (b, c)]
    assert torch.equal(ga.get_state(), states[0]) and not torch.equal(ga.get_state(), states[1])
    before = default.get_state()
    u = _req(SamplingParams())
    device_generator(u, dev, default)
    assert not torch.equal(before, default.get_state())  # one draw from the engine's generator
    assert u.device_generator is not None


PLAIN = SamplingParams(temperature=0.8, top_k=40)
NOT_PLAIN = {
    "repetition penalty": SamplingParams(temperature=0.8, repetition_penalty=1.1),
    "presence penalty": SamplingParams(temperature=0.8, presence_penalty=0.5),
    "frequency penalty": SamplingParams(temperature=0.8, frequency_penalty=0.5),
    "logprobs": SamplingParams(temperature=0.8, logprobs=True),
    "top_logprobs": SamplingParams(temperature=0.8, top_logprobs=2),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "min_p": SamplingParams(temperature=0.8, min_p=0.05),
    "greedy": SamplingParams(temperature=0.0),
}


class _Idle(_AllowAll):
    """A constraint that restricts nothing yet (a budget not spent)."""

    def restricts(self) -> bool:
        return False


def test_a_constraint_that_restricts_nothing_keeps_the_fast_paths():
    """Plain greedy / plain sampled with a constraint that does not restrict the next token:
    picked where the logits are (and so launched ahead); restricting: on the host."""
    off_cpu = torch.empty(2, 10, device="meta")
    for params, plain in ((SamplingParams(temperature=0.0), plain_greedy), (PLAIN, plain_sampled)):
        idle, restricting = _req(params, constraint=_Idle()), _req(params, constraint=_AllowAll())
        assert plain(idle) and not idle.constrained
        assert not plain(restricting) and restricting.constrained
        assert picked_on_device(off_cpu, [idle, _req(params)])
        assert not picked_on_device(off_cpu, [restricting, _req(params)])


def test_device_rows_selects_plain_sampled_requests_off_the_cpu():
    off_cpu = torch.empty(3, 10, device="meta")  # any device but the CPU: only its type is read
    assert plain_sampled(_req(PLAIN)) and plain_sampled(_req(SamplingParams(temperature=1000.0)))
    assert not plain_sampled(_req(PLAIN, constraint=_AllowAll()))
    for name, params in NOT_PLAIN.items():
        assert not plain_sampled(_req(params)), name
        # a batch without a plain sampled request keeps today's path (greedy argmax or the host)
        assert device_rows(off_cpu, [_req(params)] * 3) == [], name
    assert device_rows(off_cpu, [_req(PLAIN, constraint=_AllowAll())] * 3) == []
    assert device_rows(off_cpu, [_req(PLAIN)] * 3) == [0, 1, 2]
    # beside a plain sampled request: plain greedy rows too; penalties, logprobs... stay on the host
    batch = [_req(NOT_PLAIN["greedy"]), _req(NOT_PLAIN["top_p"]), _req(PLAIN)]
    assert device_rows(off_cpu, batch) == [0, 2]
    assert device_rows(off_cpu, [_req(NOT_PLAIN["logprobs"]), _req(PLAIN)]) == [1]
    # logits on the CPU: exactly today's path
    assert device_rows(torch.zeros(3, 10), [_req(PLAIN)] * 3) == []


def test_sample_splits_a_mixed_batch(monkeypatch):
    """``sample``'s device branch, run on CPU tensors by letting device_rows accept them:
    plain rows are drawn by gumbel_pick from their device generators, the other rows get
    exactly what the host path gives them."""
    monkeypatch.setattr(sampling, "device_rows",
                        lambda logits, reqs: [i for i, r in enumerate(reqs)
                                              if sampling.plain_sampled(r) or sampling.plain_greedy(r)])
    logits = torch.randn(4, 50) * 2

    def batch():
        return [_req(PLAIN, torch.Generator().manual_seed(11)), _req(NOT_PLAIN["top_p"], torch.Generator().manual_seed(12)),
                _req(NOT_PLAIN["greedy"]), _req(NOT_PLAIN["logprobs"], torch.Generator().manual_seed(13))]

    reqs = batch()
    got = sample(logits, reqs, torch.Generator().manual_seed(0))
    ref_reqs = batch()
    host = sampling._sample_host(logits[[1, 3]], [ref_reqs[1], ref_reqs[3]], torch.Generator().manual_seed(0))
    assert [got[1], got[3]] == host
    assert got[2] == (int(torch.argmax(logits[2])), None)
    gen = device_generator(ref_reqs[0], torch.device("cpu"), torch.Generator())
    assert got[0] == (gumbel_pick(logits[:1], [0.8], [40], [gen])[0], None)
    assert reqs[0].device_generator is not None and reqs[1].device_generator is None


@pytest.mark.gpu
def test_sample_on_cuda_logits_follows_softmax():
    """``sample`` on CUDA logits, plain temperature requests (seeded and not, with and
    without top-k): 20k draws each against float64 softmax; seeded draws reproducible."""
    seed = random.randrange(1 << 30)
    logits = _logits(seed)
    dev = torch.device("cuda")
    x = torch.from_numpy(logits).to(dev)
    for t, k in ((0.5, 0), (2.0, 0), (1.0, 3)):
        params = SamplingParams(temperature=t, top_k=k)
        reqs = [_req(params, torch.Generator().manual_seed(seed + i) if i % 2 else None) for i in range(50)]
        counts = np.zeros(len(logits))
        for _ in range(400):
            np.add.at(counts, [tok for tok, _ in sample(x.expand(50, -1), reqs, torch.Generator().manual_seed(seed))], 1)
        assert all(r.device_generator is not None and r.device_generator.device.type == "cuda" for r in reqs)
        assert chi2(counts, np_softmax(logits, t, k)) < CHI2_BOUND, (seed, t, k, counts)

    def draws(s: int) -> list[int]:
        reqs = [_req(SamplingParams(temperature=1.0, seed=s), torch.Generator().manual_seed(s))]
        return [sample(x[None], reqs, torch.Generator())[0][0] for _ in range(40)]

    assert draws(5) == draws(5) and draws(5) != draws(6)
