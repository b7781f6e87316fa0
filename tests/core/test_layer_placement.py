"""Which MoE layers' experts the memory plan puts on the device (``layers_that_fit``):
against an exhaustive search over every subset of layers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from freetoken.moe.placement import layers_that_fit


def _best(per_layer: dict[int, int], room: int) -> tuple[int, int]:
    """(layers, bytes) of the best subset that fits: the most layers, then the most bytes."""
    best = (0, 0)
    layers = list(per_layer)
    for r in range(len(layers) + 1):
        for subset in itertools.combinations(layers, r):
            used = sum(per_layer[i] for i in subset)
            if used <= room:
                best = max(best, (r, used))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_two_sizes_match_the_exhaustive_search(seed):
    """Layers of two sizes (a K-quant mix: some layers' down projections in a larger format):
    the most layers that fit, and of those the most bytes, exactly."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    small, large = 100, int(rng.integers(101, 180))
    per_layer = {i: int(rng.choice([small, large])) for i in range(n)}
    room = int(rng.integers(0, sum(per_layer.values()) + 50))
    got = layers_that_fit(per_layer, room)
    assert got == sorted(set(got))
    used = sum(per_layer[i] for i in got)
    assert used <= room
    assert (len(got), used) == _best(per_layer, room), (per_layer, room, got)


@pytest.mark.parametrize("seed", range(20))
def test_any_sizes_fit_the_most_layers(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 11))
    per_layer = {i: int(rng.integers(50, 200)) for i in range(n)}
    room = int(rng.integers(0, sum(per_layer.values()) + 50))
    got = layers_that_fit(per_layer, room)
    assert sum(per_layer[i] for i in got) <= room
    assert len(got) == _best(per_layer, room)[0]


def test_equal_layers_last_first_and_the_qwen3_mix():
    """Equal layers: the last ones, as llama.cpp's ``-ncmoe`` leaves the first on the CPU.
    The 48 layers of a Q4_K_M Qwen3-30B-A3B (every third layer's down projections, and the
    first and last six layers', in Q6_K) with room for layers 7-47 and three times the two
    sizes' difference: 41 layers still, with three more of the larger ones among them than
    the first-layers-on-the-CPU rule keeps (the CPU layers read that much less per token)."""
    assert layers_that_fit({i: 10 for i in range(6)}, 35) == [3, 4, 5]
    assert layers_that_fit({i: 10 for i in range(6)}, 5) == []
    assert layers_that_fit({}, 100) == []

    def more_bits(i: int, n: int = 48) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    q4, q6 = 128 * 3 * 1152 * 768 // 2, 128 * (2 * 1152 + 1680) * 768 // 2  # a layer's experts
    per_layer = {i: q6 if more_bits(i) else q4 for i in range(48)}
    assert sum(more_bits(i) for i in range(48)) == 24 and [more_bits(i) for i in range(8)] == [True] * 6 + [False] * 2
    room = sum(per_layer[i] for i in range(7, 48)) + 3 * (q6 - q4)
    got = layers_that_fit(per_layer, room)
    cpu = sorted(set(range(48)) - set(got))
    assert len(cpu) == 7 and sum(per_layer[i] == q6 for i in cpu) == 3, cpu
    assert sum(per_layer[i] for i in cpu) == sum(per_layer[i] for i in range(7)) - 3 * (q6 - q4)
