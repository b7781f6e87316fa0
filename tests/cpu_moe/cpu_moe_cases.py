"""Banks of random experts in every format for the freetoken_cpu_moe tests.

(A module of its own, not conftest.py, so that test modules can import it by a
name no other test directory uses.)
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

cm = pytest.importorskip("freetoken_cpu_moe")

from cpu_moe_reference import RawWeights, make_weights  # noqa: E402

E, H = 8, 256
#: intermediate size per format: K-quant rows must hold whole 256-blocks; FP8 uses
#: 192 so gate/up end in a partial 128-row scale block and down in a partial column block
INTERMEDIATE = {"q4_k": 256, "q5_k": 256, "q6_k": 256, "fp8_e4m3_b128": 192}


class BankCase:
    """A bank built from raw weights, with the raw weights kept for the reference."""

    def __init__(self, fmts: tuple[str, str, str], activation: str = "silu", seed: int | None = None) -> None:
        self.seed = secrets.randbits(32) if seed is None else seed
        rng = np.random.default_rng(self.seed)
        I = max(INTERMEDIATE.get(f, 128) for f in fmts)
        self.fmts, self.E, self.H, self.I, self.activation = fmts, E, H, I, activation
        self.raw: list[RawWeights] = [
            make_weights(fmts[0], E, I, H, rng, 0.1),
            make_weights(fmts[1], E, I, H, rng, 0.1),
            make_weights(fmts[2], E, H, I, rng, 0.1),
        ]
        ws = [
            cm.Weights(r.data, r.fmt, E, r.dense.shape[1], r.dense.shape[2], scale=r.scale) for r in self.raw
        ]
        self.bank = cm.ExpertBank(*ws, activation=activation)
