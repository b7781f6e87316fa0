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
