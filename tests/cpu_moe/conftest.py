"""Fixtures of the freetoken_cpu_moe tests: random banks in every format."""

from __future__ import annotations

import secrets
from typing import Callable

import numpy as np
import pytest

from cpu_moe_cases import BankCase

@pytest.fixture(scope="session")
def bank_for() -> Callable[..., BankCase]:
    cache: dict[tuple, BankCase] = {}

    def get(fmts: "str | tuple[str, str, str]", activation: str = "silu") -> BankCase:
        key = ((fmts,) * 3 if isinstance(fmts, str) else tuple(fmts), activation)
        if key not in cache:
            cache[key] = BankCase(key[0], activation)
        return cache[key]

    return get


@pytest.fixture
def rng() -> np.random.Generator:
    seed = secrets.randbits(32)
    print(f"rng seed {seed}")  # shown by pytest on failure
    return np.random.default_rng(seed)
