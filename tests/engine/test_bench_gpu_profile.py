"""``bench decode --gpu-profile``: the union of device intervals, and the report's phases
through the fake GPU plugin's session."""

from __future__ import annotations

import random

import numpy as np
import pytest

from freetoken.backends import registry
from freetoken.cli.bench.gpu_profile import _union_us


@pytest.mark.parametrize("seed", range(5))
def test_union_of_intervals_equals_a_covered_grid(seed):
    rng = random.Random(seed)
    spans = []
    for _ in range(rng.randrange(1, 40)):
        a = rng.randrange(0, 1000)
        spans.append((float(a), float(a + rng.randrange(0, 120))))
    grid = np.zeros(1200, dtype=bool)  # unit cells [t, t + 1) covered by some interval
    for a, b in spans:
        grid[int(a):int(b)] = True
    assert _union_us(spans) == pytest.approx(float(grid.sum()))


def test_gpu_profile_reports_both_phases_and_the_python_ranking(capsys):
    from freetoken.cli.main import main

    registry.reset()
    try:
        rc = main(["--log-level", "WARNING", "bench", "decode", "--backend", "fakegpu", "--moe-cpu-layers", "all",
                   "--batch", "1", "--prompt-len", "12", "--gen-len", "5", "--repeats", "1",
                   "--bandwidth-bytes", "4MiB", "--gpu-profile"])
    finally:
        registry.reset()
    assert rc == 0
    text = capsys.readouterr().out
    prompt = text[text.index("prompt of 12 tokens: 1 steps"):text.index("\ndecode: ")]
    decode = text[text.index("\ndecode: "):text.index("under cProfile")]
    # 5 tokens: the first comes with the prompt, the other 4 from decode steps
    assert decode.startswith("\ndecode: 4 steps, 4 tokens")
    for phase in (prompt, decode):
        rows = [line.split() for line in phase.splitlines() if line.strip().endswith("aten::mm")]
        assert rows and int(rows[0][1]) > 0, phase  # the fake device's matmuls are host ops
    assert "engine.py" in text[text.index("under cProfile"):]
