"""Real plugin distributions on disk, for the registry tests.

A test plugin is a module plus a ``<dist>-<version>.dist-info`` directory with an
``entry_points.txt``; :mod:`importlib.metadata` reads it exactly as it reads an
installed wheel. "Installed" plugins sit on ``sys.path`` (so the real discovery
finds them next to cpu, cuda, rocm and fakegpu); the others are handed to the
selection functions as entry points, which keeps a test's plugin set exact.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

import pytest

_counter = itertools.count()


def backend_source(
    name: str,
    hardware: str = "cpu",
    priority: int = 0,
    available: bool = True,
    reason: str = "",
    probe_raises: Optional[str] = None,
    api_version: Optional[int] = None,
    import_raises: Optional[str] = None,
    prelude: str = "",
) -> str:
    """Source of a plugin module whose Backend has these properties."""
    probe = (
        f"raise RuntimeError({probe_raises!r})"
        if probe_raises
        else f"return ProbeResult(available={available!r}, reason={reason!r})"
    )
    api = f"api_version = {api_version}" if api_version is not None else ""
    boom = f"raise RuntimeError({import_raises!r})" if import_raises else ""
    return prelude + "\n" + boom + "\n" + textwrap.dedent(
        f"""
        from freetoken.backends.contract import Backend, Capabilities, ProbeResult
        from freetoken.backends.hookspecs import hookimpl

        class PluginBackend(Backend):
            name = {name!r}
            hardware = {hardware!r}
            priority = {priority}
            {api}

            @classmethod
            def probe(cls):
                {probe}

            def capabilities(self):
                return Capabilities(extra={{"plugin": {name!r}}})

            def device(self):
                return None

            def gpu_sync(self, mode=None):
                raise NotImplementedError

            def staging(self):
                raise NotImplementedError

            def open_model(self, options):
                raise NotImplementedError

        @hookimpl
        def freetoken_backend():
            return PluginBackend
        """
    )


class PluginFactory:
    """Writes plugin distributions under a temporary directory."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.modules_dir = root / "site"
        self.modules_dir.mkdir()
        monkeypatch.syspath_prepend(str(self.modules_dir))
        self.module_names: list[str] = []

    def make(
        self,
        name: str,
        source: Optional[str] = None,
        distribution: Optional[str] = None,
        version: str = "1.0.0",
        installed: bool = False,
        entry_point_value: Optional[str] = None,
        **backend: Any,
    ) -> Any:
        """Create one plugin; returns its entry point (read back from the dist-info)."""
        n = next(_counter)
        module = f"ft_test_plugin_{name.replace('-', '_')}_{n}"
        (self.modules_dir / f"{module}.py").write_text(source if source is not None else backend_source(name, **backend))
        self.module_names.append(module)
        dist = distribution or f"ft-test-plugin-{name}-{n}"
        dist_root = self.modules_dir if installed else self.root / f"dists{n}"
        dist_root.mkdir(exist_ok=True)
        info = dist_root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(
            f"[freetoken.backends]\n{name} = {entry_point_value or module}\n"
        )
        importlib.invalidate_caches()
        found = [
            ep
            for d in importlib.metadata.distributions(path=[str(dist_root)])
            if d.metadata["Name"] == dist
            for ep in d.entry_points
        ]
        assert len(found) == 1, found
        return found[0]

    def cleanup(self) -> None:
        for module in self.module_names:
            sys.modules.pop(module, None)
