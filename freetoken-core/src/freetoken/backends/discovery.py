"""Finding, loading and probing backend plugins, one record per plugin.

Every plugin is an entry point in the group ``freetoken.backends``. Discovery only
reads installed metadata (cheap, imports nothing); :func:`load` imports one plugin
and asks its pluggy hook for the :class:`~freetoken.backends.contract.Backend`
class; :func:`probe` asks that class whether its hardware is here. Each step
catches everything a plugin can throw and keeps it on the plugin's
:class:`PluginRecord`, so one broken plugin never breaks another, nor
``import freetoken``, nor ``freetoken doctor``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
import inspect
import logging
import traceback
from typing import Any, Iterable, Optional

import pluggy

from freetoken.backends import hookspecs
from freetoken.backends.contract import BACKEND_API_VERSION, Backend, ProbeResult
from freetoken.versioning import VersionMismatchError, lockstep_error

log = logging.getLogger(__name__)


class PluginStatus(str, enum.Enum):
    """Where a plugin got to. Only ``AVAILABLE`` can be selected."""

    DISCOVERED = "discovered"
    """Installed; not imported (explicit selection of another backend loads only that one)."""
    LOAD_ERROR = "load_error"
    """Import, hook call or validation of the Backend class failed."""
    VERSION_MISMATCH = "version_mismatch"
    """Package version differs from freetoken-core's, or the contract version differs."""
    LOADED = "loaded"
    """Imported and valid; not probed yet."""
    PROBE_ERROR = "probe_error"
    """``probe()`` raised (a bug or a broken driver; absent hardware must not raise)."""
    UNAVAILABLE = "unavailable"
    """``probe()`` says the hardware is absent or unusable; ``reason`` says why."""
    AVAILABLE = "available"
    """``probe()`` says the hardware is present."""


@dataclasses.dataclass
class PluginRecord:
    """One installed backend plugin and everything learnt about it."""

    name: str
    entry_point: str
    distribution: Optional[str]
    version: Optional[str]
    ep: Any = dataclasses.field(repr=False, default=None)
    status: PluginStatus = PluginStatus.DISCOVERED
    error: Optional[str] = None
    error_traceback: Optional[str] = dataclasses.field(repr=False, default=None)
    backend_cls: Optional[type[Backend]] = dataclasses.field(repr=False, default=None)
    probe_result: Optional[ProbeResult] = None

    @property
    def hardware(self) -> Optional[str]:
        return getattr(self.backend_cls, "hardware", None) if self.backend_cls else None

    @property
    def priority(self) -> Optional[int]:
        return getattr(self.backend_cls, "priority", None) if self.backend_cls else None

    @property
    def api_version(self) -> Optional[int]:
        return getattr(self.backend_cls, "api_version", None) if self.backend_cls else None

    @property
    def loaded(self) -> bool:
        return self.backend_cls is not None

    @property
    def label(self) -> str:
        """``name (distribution version)`` for messages."""
        if self.distribution:
            return f"{self.name} ({self.distribution} {self.version})"
        return f"{self.name} ({self.entry_point})"

    def as_dict(self) -> dict[str, Any]:
        probe = self.probe_result
        return {
            "name": self.name,
            "entry_point": self.entry_point,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status.value,
            "error": self.error,
            "hardware": self.hardware,
            "priority": self.priority,
            "api_version": self.api_version,
            "probe": None
            if probe is None
            else {
                "available": probe.available,
                "reason": probe.reason,
                "device_name": probe.device_name,
                "details": probe.details,
            },
        }


def entry_points(name: Optional[str] = None) -> list[Any]:
    """Installed entry points of the group, optionally only those called ``name``."""
    eps = importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
    if name is not None:
        eps = eps.select(name=name)
    return sorted(eps, key=lambda ep: (ep.name, ep.value))


def record_for(ep: Any) -> PluginRecord:
    """A :class:`PluginRecord` for an entry point (reads metadata only)."""
    dist = getattr(ep, "dist", None)
    dist_name = dist_version = None
    if dist is not None:
        try:
            dist_name = dist.metadata["Name"]
            dist_version = dist.version
        except Exception:  # unreadable metadata is not fatal for discovery
            pass
    return PluginRecord(name=ep.name, entry_point=ep.value, distribution=dist_name, version=dist_version, ep=ep)


def discover(eps: Optional[Iterable[Any]] = None, name: Optional[str] = None) -> list[PluginRecord]:
    """Records for every installed plugin (or for ``eps`` when given), unloaded."""
    if eps is None:
        eps = entry_points(name)
    elif name is not None:
        eps = [ep for ep in eps if ep.name == name]
    return [record_for(ep) for ep in eps]


def _fail(record: PluginRecord, status: PluginStatus, message: str, exc: Optional[BaseException] = None) -> None:
    record.status = status
    record.error = message
    if exc is not None:
        record.error_traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    log.debug("backend plugin %s: %s: %s", record.label, status.value, message)


def _backend_class_from(obj: Any, record: PluginRecord) -> Any:
    """Call the plugin's ``freetoken_backend`` hook (or accept a Backend class as is)."""
    if inspect.isclass(obj) and issubclass(obj, Backend):
        return obj
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    manager.register(obj, name=record.name)
    manager.check_pending()
    if not manager.hook.freetoken_backend.get_hookimpls():
        raise TypeError(
            f"entry point {record.entry_point!r} has no @hookimpl freetoken_backend() "
            "(see freetoken.backends.hookspecs)"
        )
    results = manager.hook.freetoken_backend()
    if len(results) != 1:
        raise TypeError(f"entry point {record.entry_point!r} returned {len(results)} backends; expected one")
    return results[0]


def _validate(cls: Any, record: PluginRecord) -> Optional[tuple[PluginStatus, str]]:
    """Why ``cls`` cannot be this plugin's backend, or None when it can."""
    if not (inspect.isclass(cls) and issubclass(cls, Backend)):
        return PluginStatus.LOAD_ERROR, f"freetoken_backend() returned {cls!r}, not a Backend subclass"
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        return PluginStatus.LOAD_ERROR, f"{cls.__qualname__} does not implement: {missing}"
    if getattr(cls, "name", None) != record.name:
        return (
            PluginStatus.LOAD_ERROR,
            f"{cls.__qualname__}.name is {getattr(cls, 'name', None)!r} but its entry point is named "
            f"{record.name!r}; they must match (selection is by entry point name)",
        )
    if cls.api_version != BACKEND_API_VERSION:
        return (
            PluginStatus.VERSION_MISMATCH,
            f"{cls.__qualname__} implements backend contract version {cls.api_version} but this "
            f"freetoken-core speaks version {BACKEND_API_VERSION}; install a {record.distribution or record.name} "
            "built for this freetoken-core",
        )
    if not isinstance(cls.priority, int) or not isinstance(cls.hardware, str):
        return PluginStatus.LOAD_ERROR, f"{cls.__qualname__}: priority must be an int and hardware a str"
    return None


def load(record: PluginRecord) -> PluginRecord:
    """Import one plugin and resolve its Backend class. Never raises; idempotent."""
    if record.status is not PluginStatus.DISCOVERED:
        return record
    if record.distribution and record.version:
        skew = lockstep_error(record.distribution, record.version)
        if skew:
            _fail(record, PluginStatus.VERSION_MISMATCH, skew)
            return record
    try:
        obj = record.ep.load()
        cls = _backend_class_from(obj, record)
    except VersionMismatchError as exc:
        _fail(record, PluginStatus.VERSION_MISMATCH, str(exc), exc)
        return record
    except Exception as exc:  # anything a plugin throws stays with the plugin
        _fail(record, PluginStatus.LOAD_ERROR, f"{type(exc).__name__}: {exc}", exc)
        return record
    problem = _validate(cls, record)
    if problem:
        _fail(record, *problem)
        return record
    record.backend_cls = cls
    record.status = PluginStatus.LOADED
    return record


def probe(record: PluginRecord) -> PluginRecord:
    """Load (if needed) and run the plugin's ``probe()``. Never raises; runs once."""
    load(record)
    if record.status is not PluginStatus.LOADED:
        return record
    assert record.backend_cls is not None
    try:
        result = record.backend_cls.probe()
        if not isinstance(result, ProbeResult):
            raise TypeError(f"probe() returned {type(result).__name__}, not ProbeResult")
    except Exception as exc:
        _fail(record, PluginStatus.PROBE_ERROR, f"{type(exc).__name__}: {exc}", exc)
        return record
    record.probe_result = result
    record.status = PluginStatus.AVAILABLE if result.available else PluginStatus.UNAVAILABLE
    if not result.available:
        record.error = result.reason or "probe() reported the hardware unavailable without a reason"
    return record
