"""pluggy hook specifications for FreeToken backend plugins.

A plugin distribution declares an entry point in the group ``freetoken.backends``
whose value is a module (or object) carrying a :data:`hookimpl`-marked function::

    # pyproject.toml
    [project.entry-points."freetoken.backends"]
    mygpu = "freetoken_mygpu.plugin"

    # freetoken_mygpu/plugin.py
    from freetoken.backends.hookspecs import hookimpl

    @hookimpl
    def freetoken_backend():
        from freetoken_mygpu.backend import MyGpuBackend
        return MyGpuBackend
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from freetoken.backends.contract import Backend

PROJECT_NAME = "freetoken"
ENTRY_POINT_GROUP = "freetoken.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def freetoken_backend() -> "type[Backend]":
    """Return the plugin's :class:`~freetoken.backends.contract.Backend` subclass.

    Keep the plugin module's import cheap and free of hardware access: heavy
    imports and native loads belong inside this function or the backend's
    ``probe()``, so a broken driver shows up as that plugin's error in
    ``freetoken doctor`` instead of breaking discovery.
    """
