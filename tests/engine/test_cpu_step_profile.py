"""freetoken_cpu_moe.step_profile.StepProfiler (what `freetoken bench decode --cpu-profile`
prints): on a Qwen3.5 hybrid (Gated DeltaNet and gated attention layers) every layer's
projections are timed, the split holds the steps it saw, and the model is left unwrapped."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")
pytest.importorskip("freetoken_cpu_moe")

from helpers import engine_for  # noqa: E402
from qwen35_helpers import VOCAB, make_hf  # noqa: E402

from freetoken import SamplingParams  # noqa: E402
from freetoken_cpu_moe.step_profile import PARTS, StepProfiler  # noqa: E402


def test_hybrid_layers_projections_are_timed(tmp_path):
    path = str(tmp_path)
    make_hf("qwen3_5_moe", path, seed=random.randrange(1 << 30))
    eng = engine_for(path)
    try:
        layers = eng.model.layers
        before = [(L.qkvg, L.linear and L.linear.proj, L.linear and L.linear.out) for L in layers]
        with StepProfiler(eng) as prof:
            req = eng.add_request([random.randrange(VOCAB) for _ in range(9)],
                                  SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
            while eng.has_work():
                eng.step()
        assert len(req.output_ids) == 5
        deltanet = sum(1 for L in layers if L.linear is not None)
        attention = len(layers) - deltanet
        assert deltanet and attention
        decode = prof.splits["decode"]
        assert decode.steps == 4 and decode.tokens == 4
        # per decode step: one input projection per layer, one output projection per layer
        assert decode.calls["qkv"] == 4 * len(layers) and decode.calls["o_proj"] == 4 * len(layers)
        assert decode.calls["attention"] == 4 * attention
        assert 0 < sum(decode.part_s[p] for p in PARTS) <= decode.step_s + decode.part_s["lm_head"]
        report = prof.report(len(layers))
        assert "decode: 4 steps" in report and "qkv" in report
        # the wrappers are gone
        assert [(L.qkvg, L.linear and L.linear.proj, L.linear and L.linear.out) for L in layers] == before
    finally:
        eng.close()
