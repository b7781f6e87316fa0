"""Decode graphs through the real engine start, with the fake GPU backend's capture
(tests/qualify/fake_backend.py: a "graph" records the step's function and re-runs it on
replay with capture semantics, on CPU tensors): bucket bookkeeping, padded rows, equality
with eager steps, recapture."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("freetoken_cpu_moe")

from freetoken.engine.config import EngineConfig  # noqa: E402
from freetoken.engine.engine import LLMEngine  # noqa: E402
from freetoken.engine.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [5, 6], [77] * 12]


def _fake_backend():
    path = Path(__file__).resolve().parents[2] / "qualify" / "fake_backend.py"
    spec = importlib.util.spec_from_file_location("ft_graphs_fake_backend", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FakeGpuBackend()


def _engine(**kw):
    return LLMEngine(EngineConfig(dtype="float32", max_model_len=128, kv_cache_tokens=1024, max_running_requests=4,
                                  moe_cpu_layers="all", **kw), backend=_fake_backend())


def _decode(eng, prompts, tokens=6):
    rows: dict[str, list[torch.Tensor]] = {}
    remove = eng.add_logits_observer(
        lambda ids, logits: [rows.setdefault(r, []).append(logits[i].clone()) for i, r in enumerate(ids)])
    reqs = [eng.add_request(p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)) for p in prompts]
    while eng.has_work():
        eng.step()
    remove()
    return [r.output_ids for r in reqs], [torch.stack(rows[r.request_id]) for r in reqs]


def test_graph_replays_equal_eager_steps_and_recapture_keeps_them():
    eager = _engine(enforce_eager=True)
    try:
        assert eager.backend_info()["graphs"] is False
        want_ids, want_logits = _decode(eager, PROMPTS)
    finally:
        eager.close()

    eng = _engine(cuda_graph_max_bs=4)
    try:
        info = eng.backend_info()
        assert info["graphs"] is True and info["graph_batch_sizes"] == [1, 2, 4], info
        runner = eng.session.runner
        free_before = eng.kv.free_blocks
        got_ids, got_logits = _decode(eng, PROMPTS)
        # three requests decode together (bucket 4, one padded row), then fewer as they finish
        assert runner.replays > 0
        assert got_ids == want_ids
        for g, w in zip(got_logits, want_logits):
            assert float((g - w).abs().max() / w.abs().max()) < 1e-5
        eng.session.recapture_graphs()
        assert eng.session.runner is not runner and eng.session.runner.scratch_block == runner.scratch_block
        again_ids, again_logits = _decode(eng, PROMPTS)
        assert again_ids == want_ids and eng.session.runner.replays > 0
        for g, w in zip(again_logits, want_logits):
            assert float((g - w).abs().max() / w.abs().max()) < 1e-5
        # blocks the prefix cache keeps (no request uses them) are not leaks
        free_after = eng.kv.free_blocks + eng.prefix_cache.num_cached_free
        assert free_after == free_before, "recapture leaked a cache block"
    finally:
        eng.close()


def test_recapture_without_graphs_is_refused():
    eng = _engine(enforce_eager=True)
    try:
        with pytest.raises(RuntimeError, match="eager only"):
            eng.session.recapture_graphs()
    finally:
        eng.close()


def _drive(eng, plan, observe: bool):
    """Run ``plan``: (step index, action) pairs, the action ``("add", prompt, params)`` or
    ``("abort", index of an added request)``, applied before that step; then steps until no
    work is left. Returns each request's (ids, finish reason) and, with ``observe``, its
    logits per step."""
    rows: dict[str, list[torch.Tensor]] = {}
    remove = eng.add_logits_observer(
        lambda ids, logits: [rows.setdefault(r, []).append(logits[i].clone()) for i, r in enumerate(ids)]) \
        if observe else None
    reqs = []
    step = 0
    while True:
        for when, action in plan:
            if when == step:
                if action[0] == "add":
                    reqs.append(eng.add_request(action[1], action[2]))
                else:
                    eng.abort(reqs[action[1]].request_id)
        if not eng.has_work() and step > max(w for w, _ in plan):
            break
        eng.step()
        step += 1
    if remove is not None:
        remove()
    return [(r.output_ids, r.finish_reason) for r in reqs], [torch.stack(rows[r.request_id]) for r in reqs
                                                             if r.request_id in rows]


def _drive_counting(monkeypatch, eager: bool, ahead: bool, plan, observe: bool):
    """:func:`_drive` on a new engine with decode ahead on or off: (its result, the number of
    steps launched ahead); checks that no KV block is left taken."""
    eng = _engine(enforce_eager=eager, cuda_graph_max_bs=4, decode_ahead=ahead)
    launched = []
    real = eng.session.decode_ahead
    monkeypatch.setattr(eng.session, "decode_ahead", lambda *a: launched.append(1) or real(*a))
    try:
        free = eng.kv.free_blocks + eng.prefix_cache.num_cached_free
        out = _drive(eng, plan, observe)
        assert eng.backend_info()["graphs"] is (not eager)
        assert eng.kv.free_blocks + eng.prefix_cache.num_cached_free == free, "a block launched ahead leaked"
    finally:
        eng.close()
    return out, len(launched)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("observe", [False, True], ids=["tokens", "observed"])
def test_decode_ahead_equals_steps_read_back(monkeypatch, eager, observe):
    """``--decode-ahead``: each greedy decode step is launched from the previous step's
    tokens on the device before they are read back. Against the same engine reading every
    token back first: the same tokens, finish reasons and logits, through a request stopped
    by a stop token (its step launched ahead is dropped), one aborted between steps, one
    added while the others decode (admitted a step later), max_tokens ends, positions across
    KV block boundaries (16 tokens) and batch buckets that shrink as requests finish; no KV
    block is left taken."""
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    probe = _engine(enforce_eager=eager, cuda_graph_max_bs=4)
    try:
        (first, _), = _drive(probe, [(0, ("add", PROMPTS[0], greedy))], False)[0]
    finally:
        probe.close()
    stop = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[first[6]])
    plan = [(0, ("add", PROMPTS[0], stop)), (0, ("add", PROMPTS[1], greedy)),
            (0, ("add", PROMPTS[2], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))),
            (5, ("add", [9, 8, 7, 6, 5], greedy)), (8, ("abort", 1))]
    runs = {}
    for ahead in (False, True):
        runs[ahead], launched = _drive_counting(monkeypatch, eager, ahead, plan, observe)
        assert (launched > 10) == ahead, launched
    (want, want_logits), (got, got_logits) = runs[False], runs[True]
    assert got == want
    assert [reason for _, reason in got] == ["stop", "abort", "length", "length"]
    assert len(got[0][0]) <= 7 and len(got[1][0]) < 20
    # the added request joins a step later, so some steps batch differently: float32
    # summation order only
    for g, w in zip(got_logits, want_logits):
        assert g.shape == w.shape and float((g - w).abs().max() / w.abs().max()) < 1e-5


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_decode_ahead_with_requests_sampled_on_the_device(monkeypatch, eager):
    """Plain sampled requests (temperature, top-k) go ahead too where their draws are made on
    the device (:func:`~freetoken.engine.sampling.draws_on_device`, made true here for the
    fake backend's CPU tensors, so both engines draw with the Gumbel picks): the same tokens as
    the engine reading every token back first, for seeded requests beside greedy ones, one
    stopped by a stop token; with draws on the host (the CPU's default) sampled requests do
    not go ahead and their tokens come from the host sampler as before."""
    from freetoken.engine import sampling

    greedy = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    hot = [SamplingParams(max_tokens=14, temperature=t, top_k=k, seed=s, ignore_eos=True)
           for t, k, s in ((0.9, 0, 11), (1.3, 12, 12))]
    plan = [(0, ("add", PROMPTS[0], hot[0])), (0, ("add", PROMPTS[1], greedy)), (0, ("add", PROMPTS[2], hot[1]))]

    def run(ahead: bool) -> tuple[list, int]:
        (got, _), launched = _drive_counting(monkeypatch, eager, ahead, plan, False)
        return got, launched

    host_ref, _ = run(False)
    host_ahead, host_launched = run(True)
    assert host_launched == 0 and host_ahead == host_ref, "drawn on the host: no step goes ahead"

    monkeypatch.setattr(sampling, "draws_on_device", lambda logits: True)
    want, _ = run(False)
    got, launched = run(True)
    assert launched > 10, launched
    assert got == want
    assert [len(ids) for ids, _ in got] == [14, 14, 14] and got != host_ref, "the Gumbel draws ran"
    # a stop token drawn by a sampled request ends it; its step launched ahead is dropped
    stop_at = want[0][0][5]
    plan[0] = (0, ("add", PROMPTS[0], SamplingParams(max_tokens=14, temperature=0.9, seed=11, stop_token_ids=[stop_at],
                                                     ignore_eos=True)))
    want, _ = run(False)
    got, launched = run(True)
    assert got == want and want[0][1] == "stop" and len(want[0][0]) <= 6 and launched > 5


@pytest.mark.parametrize("running,buckets", [(16, [1, 2, 4, 8, 16]), (32, [1, 2, 4, 8, 16, 24, 32]),
                                             (3, [1, 2, 3]), (20, [1, 2, 4, 8, 16, 20])])
def test_default_buckets_cover_the_running_requests(running: int, buckets: list[int]) -> None:
    """Without --cuda-graph-max-bs (64), every decode batch up to --max-running-requests
    replays a graph: powers of two, multiples of 8, and the running count itself."""
    eng = LLMEngine(EngineConfig(dtype="float32", max_model_len=128, kv_cache_tokens=1024, moe_cpu_layers="all",
                                 max_running_requests=running), backend=_fake_backend())
    try:
        assert eng.session.runner.buckets == buckets
    finally:
        eng.close()
