"""Fixtures for the registry tests (the plugin builders live in plugin_distributions.py)."""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path
from typing import Any

import pytest

from freetoken.backends import registry
from plugin_distributions import PluginFactory


@pytest.fixture
def plugin_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    factory = PluginFactory(tmp_path, monkeypatch)
    yield factory
    factory.cleanup()
    importlib.invalidate_caches()


@pytest.fixture
def cpu_entry_point() -> Any:
    """The real, installed entry point of the built-in cpu backend."""
    (ep,) = importlib.metadata.entry_points(group="freetoken.backends").select(name="cpu")
    return ep


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch):
    """No test sees another test's selection or FREETOKEN_BACKEND."""
    monkeypatch.delenv("FREETOKEN_BACKEND", raising=False)
    registry.reset()
    yield
    registry.reset()
