"""The process-wide backend: resolved lazily on first use, and recorded.

``import freetoken`` imports no plugin. The first call of :func:`get_backend`
runs selection (:mod:`freetoken.backends.selection`) once, keeps the result and
remembers which code triggered it; later calls return the same backend.
:func:`plugins` lists every installed plugin with its load and probe outcome (what
``freetoken doctor`` shows) without selecting anything.

    from freetoken.backends import registry
    backend = registry.get_backend()            # automatic rule / FREETOKEN_BACKEND
    backend = registry.get_backend("cuda")      # as --backend cuda
    registry.current_selection().reason         # why, and who asked first
"""

from __future__ import annotations

import sys
import threading
from typing import Optional

from freetoken.backends import discovery
from freetoken.backends.contract import Backend, BackendError
from freetoken.backends.discovery import PluginRecord, PluginStatus
from freetoken.backends.selection import ENV_VAR, BackendSelectionError, Selection, requested_name, select

__all__ = [
    "ENV_VAR",
    "BackendError",
    "BackendSelectionError",
    "PluginRecord",
    "PluginStatus",
    "Selection",
    "current_selection",
    "get_backend",
    "plugins",
    "reset",
]

_lock = threading.Lock()
_selection: Optional[Selection] = None


def _caller() -> str:
    """``module:function:line`` of the first frame outside this package."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("freetoken.backends"):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_name}:{frame.f_lineno}"


def get_backend(name: Optional[str] = None) -> Backend:
    """The selected backend, resolving it on the first call.

    ``name`` is the ``--backend`` value (None: ``FREETOKEN_BACKEND`` or the
    automatic rule). Asking for a different backend than the one already resolved
    in this process is an error rather than a silent switch.
    """
    global _selection
    with _lock:
        if _selection is None:
            chosen = select(flag=name)
            chosen.triggered_by = _caller()
            _selection = chosen
            return chosen.backend
        wanted, source = requested_name(name)
        if name is not None and wanted != _selection.name:
            raise BackendSelectionError(
                f"backend {_selection.name!r} was already selected in this process ({_selection.reason}; "
                f"first used by {_selection.triggered_by}); {source} now asks for {wanted!r}. Pass the "
                "backend before anything uses it."
            )
        return _selection.backend


def current_selection() -> Optional[Selection]:
    """The recorded selection, or None when nothing has asked for a backend yet."""
    return _selection


def reset() -> None:
    """Forget the selection (the next :func:`get_backend` selects again)."""
    global _selection
    with _lock:
        _selection = None


def plugins(probe: bool = True) -> list[PluginRecord]:
    """Every installed plugin, loaded and (by default) probed; nothing is selected."""
    records = discovery.discover()
    for record in records:
        if probe:
            discovery.probe(record)
        else:
            discovery.load(record)
    return records
