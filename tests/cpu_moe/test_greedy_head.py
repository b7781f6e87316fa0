"""Greedy picks in the output head's pool call (``_core.linear_argmax``,
freetoken_cpu_moe.greedy_head): the index equals numpy's argmax of the logits the same
projection stores (ties: the first; NaN: the first NaN), with planted ties and NaNs across
the workers' row pieces; whole engines whose greedy tokens with the head equal those read
from the logits; the requests and models that keep the logits path."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import freetoken_cpu_moe as cm
from freetoken_cpu_moe import _core
from freetoken_cpu_moe.dense import ACT_FMT as FMT
from freetoken_cpu_moe.pool import Pool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from helpers import LogitsRecorder, engine_for, make_hf  # noqa: E402
from test_engine_gguf import write_tiny_gguf  # noqa: E402

R, C = 1003, 64  # rows not a multiple of the 16-value lanes nor of the workers' pieces


@pytest.fixture(scope="module", params=[1, 2, 3])
def pool(request):
    p = Pool(request.param, pin=False)
    yield p
    p.close()


def _head_and_argmax(w: np.ndarray, x: torch.Tensor, out_dtype: torch.dtype, pool: Pool) -> tuple[torch.Tensor, list[int]]:
    """The projection's stored logits (``_core.linear``) and linear_argmax's indices, each into
    a poisoned buffer; linear_argmax's stored values must equal linear's bit for bit."""
    weights = cm.Weights(w, "f32", 1, w.shape[0], w.shape[1])
    T = x.shape[0]
    fmt, out_fmt = FMT[x.dtype], FMT[out_dtype]
    want = torch.full((T, w.shape[0]), float("nan"), dtype=out_dtype)
    _core.linear(weights.address, x.data_ptr(), fmt, T, want.data_ptr(), out_fmt, False, pool._core, "")
    stored = torch.full_like(want, float("nan"))
    ids = _core.linear_argmax(weights.address, x.data_ptr(), fmt, T, stored.data_ptr(), out_fmt, pool._core, "")
    bits = torch.int16 if want.element_size() == 2 else torch.int32
    assert torch.equal(stored.view(bits), want.view(bits))  # NaNs included
    assert len(ids) == T and all(type(i) is int for i in ids)
    again = _core.linear_argmax(weights.address, x.data_ptr(), fmt, T, 0, out_fmt, pool._core, "")  # not stored
    assert again == ids
    return want, ids


@pytest.mark.parametrize("T", [1, 3, 9])  # 9: linear_forward's many-token split
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_logits(rng, pool, T, out_dtype):
    w = rng.standard_normal((R, C)).astype(np.float32)
    x = torch.from_numpy(rng.standard_normal((T, C)).astype(np.float32))
    logits, ids = _head_and_argmax(w, x, out_dtype, pool)
    assert ids == np.argmax(logits.float().numpy(), axis=-1).tolist()


# rows holding the largest value: within one 16-value block, 16 apart, across the workers'
# pieces, the last rows (the tail beyond the 16-value blocks), first and last
@pytest.mark.parametrize("rows", [(33, 34), (17, 33), (70, 700), (1001, 1002), (0, 1002), (5, 400, 999)])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_ties_take_the_first(rng, pool, rows, T):
    """Small integers: every logit is exact whatever the summation order, so the planted rows
    tie exactly (and random rows may tie them)."""
    w = rng.integers(-3, 3, (R, C)).astype(np.float32)
    w[list(rows)] = 3.0
    x = torch.from_numpy(rng.integers(0, 4, (T, C)).astype(np.float32))
    x[:, 0] = 1.0  # the planted rows are never all-zero dots
    logits, ids = _head_and_argmax(w, x, torch.float32, pool)
    want = np.argmax(logits.numpy(), axis=-1).tolist()
    assert ids == want
    assert all(i <= rows[0] for i in ids)  # the first planted row, or a random row tying it before


@pytest.mark.parametrize("nan_rows, big_row", [((500,), 20), ((20,), 500), ((900, 40), 10), ((1002,), 0)])
def test_nan_counts_as_largest(rng, pool, nan_rows, big_row):
    w = rng.standard_normal((R, C)).astype(np.float32)
    w[big_row] = 50.0
    for r in nan_rows:
        w[r, 7] = np.nan
    x = torch.from_numpy(np.abs(rng.standard_normal((2, C))).astype(np.float32))
    logits, ids = _head_and_argmax(w, x, torch.float32, pool)
    assert ids == np.argmax(logits.numpy(), axis=-1).tolist() == [min(nan_rows)] * 2


def test_null_input_refused():
    w = cm.Weights(np.ones((16, 8), dtype=np.float32), "f32", 1, 16, 8)
    with pytest.raises(ValueError, match="null buffer"):
        _core.linear_argmax(w.address, 0, 0, 1, 0, 0, cm.default_pool()._core, "")
    assert _core.linear_argmax(w.address, 0, 0, 0, 0, 0, cm.default_pool()._core, "") == []


# ------------------------------------------------------------------ engines


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    hf_dir = str(tmp_path_factory.mktemp("hf-greedy-head"))
    make_hf(hf_dir, seed)
    gguf_path = str(tmp_path_factory.mktemp("gguf-greedy-head") / "tiny.gguf")
    write_tiny_gguf(gguf_path, seed)  # its output head is Q6_K
    return {"hf": hf_dir, "gguf": gguf_path}, seed


def _greedy_run(eng, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from freetoken import SamplingParams

    reqs = [eng.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
            for p, m in zip(prompts, max_tokens)]
    while eng.has_work():
        eng.step()
    return [r.output_ids for r in reqs]


def _counting(eng) -> list[int]:
    """Rows of every greedy_tokens call the session answered."""
    calls: list[int] = []
    orig = eng.session.greedy_tokens

    def greedy_tokens(hidden):
        out = orig(hidden)
        if out is not None:
            calls.append(len(out))
        return out

    eng.session.greedy_tokens = greedy_tokens
    return calls


@pytest.mark.parametrize("kind", ["hf", "gguf"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_equal_the_logits_path(checkpoints, kind, dtype):
    """Greedy requests (1-3 sampled rows per step): the same tokens with the head's picks as
    with the logits (the head turned off), and the head answered every step. No prefix cache:
    the second run would take the 21-token prompt's first block from the first run's cache and
    compute a prompt chunk of other rows; in bfloat16 that rounds some values differently, and
    logits one unit apart become a tie the two runs break differently."""
    paths, seed = checkpoints
    eng = engine_for(paths[kind], dtype=dtype, prefill_chunk=64, max_running_requests=3,
                     enable_prefix_cache=False)
    rng = random.Random(seed)
    V = eng.model_config.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 21, 12)]
    lens = [8, 4, 11]
    try:
        head = eng.session.greedy_head
        assert head is not None
        calls = _counting(eng)
        got = _greedy_run(eng, prompts, lens)
        assert sum(calls) == sum(lens) and max(calls) == 3, calls
        eng.session.greedy_head = None
        assert _greedy_run(eng, prompts, lens) == got, f"seed {seed}"
    finally:
        eng.close()


def test_other_requests_read_the_logits(checkpoints):
    """A batch with a log-probability request, a logits observer, or a replaced
    ``compute_logits`` takes the logits path; plain greedy steps use the head again after."""
    from freetoken import SamplingParams

    paths, seed = checkpoints
    eng = engine_for(paths["gguf"], max_running_requests=2)
    try:
        calls = _counting(eng)
        r = eng.add_request([3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0, logprobs=True))
        g = eng.add_request([6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        while eng.has_work():
            eng.step()
        assert calls == [] and len(r.logprobs) == len(r.output_ids) and len(g.output_ids) == 3
        with LogitsRecorder(eng) as rec:
            g = eng.add_request([6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            while eng.has_work():
                eng.step()
        assert calls == [] and len(rec[g.request_id]) == 3
        seen: list[int] = []
        orig = eng.model.compute_logits

        def compute_logits(h):
            seen.append(int(h.shape[0]))
            return orig(h)

        eng.model.compute_logits = compute_logits
        assert not eng.session.greedy_head.intact()
        assert _greedy_run(eng, [[6, 7]], [3]) == [g.output_ids]
        assert seen == [1, 1, 1] and calls == []
        del eng.model.compute_logits
        assert _greedy_run(eng, [[6, 7]], [3]) == [g.output_ids]
        assert calls == [1, 1, 1]
    finally:
        eng.close()


def test_declined_head(tmp_path):
    """A head the kernels do not run (a torch linear) keeps the logits path."""
    from freetoken.models.layers import TorchLinear
    from freetoken_cpu_moe.greedy_head import GreedyHead

    path = str(tmp_path / "hf")
    make_hf(path, 5)
    eng = engine_for(path)
    try:
        assert eng.session.greedy_head is not None
        eng.model.lm_head = TorchLinear(torch.zeros(eng.model_config.vocab_size, eng.model_config.hidden_size))
        assert not eng.session.greedy_head.intact()
        head, why = GreedyHead.build(eng.model, eng.session.pool)
        assert head is None and why == "the output head is not a kernel projection"
    finally:
        eng.close()


def test_turned_off(checkpoints, monkeypatch):
    """CpuModelSession.greedy_head_picks off (the tests' way to the logits path): no head picks."""
    from freetoken_cpu_moe.backend import CpuModelSession

    paths, _ = checkpoints
    monkeypatch.setattr(CpuModelSession, "greedy_head_picks", False)
    eng = engine_for(paths["gguf"])
    try:
        assert eng.session.greedy_head is None
        assert eng.session.greedy_tokens(torch.zeros(1, eng.model_config.hidden_size)) is None
    finally:
        eng.close()
