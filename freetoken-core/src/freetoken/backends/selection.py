"""Choosing the backend: the explicit rule, the automatic rule and their errors.

Explicit (``--backend NAME`` or ``FREETOKEN_BACKEND=NAME``; the flag wins): only
the plugins with that entry point name are imported; the choice fails loudly when
none is installed, when it fails to load, or when its probe says the hardware is
absent.

Automatic: :func:`freetoken.backends.platform.detect_platform` names the
hardware family (``rocm``, ``cuda`` or ``cpu``); every plugin is loaded and the
available ones whose ``Backend.hardware`` matches compete by ``priority`` (higher
wins; FreeToken's own backends use :data:`BUILTIN_PRIORITY`). A GPU machine whose
plugin is missing, broken or unavailable gets an error that says what to
install or fix, never a silent CPU run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Iterable, Mapping, Optional

from freetoken.backends import discovery
from freetoken.backends.contract import Backend, BackendError
from freetoken.backends.discovery import PluginRecord, PluginStatus
from freetoken.backends.platform import CPU, CUDA, ROCM, TorchPlatform, detect_platform

log = logging.getLogger(__name__)

#: Environment variable naming the backend (``--backend`` overrides it).
ENV_VAR = "FREETOKEN_BACKEND"

#: Priority of FreeToken's own backends; a third-party plugin that should win
#: over them on the same hardware declares a higher one.
BUILTIN_PRIORITY = 100

#: How to install the plugin of each built-in hardware family.
INSTALL_HINTS = {
    CUDA: "pip install 'freetoken[cuda]' (from built wheels or the repository, not the package index: see docs/install.md)",
    ROCM: "pip install 'freetoken[rocm]' (from built wheels or the repository, not the package index: see docs/install.md)",
    CPU: "pip install freetoken-cpu-moe (it provides the cpu backend; from a source checkout: "
    "pip install --no-deps ./freetoken-cpu-moe; see docs/install.md)",
}

_CPU_ESCAPE = f"(to run on the CPU anyway, choose it explicitly: --backend cpu or {ENV_VAR}=cpu)"


class BackendSelectionError(BackendError):
    """No backend could be selected; the message says what to install or fix."""


@dataclasses.dataclass
class Selection:
    """The outcome of selection: which backend, by which rule, and why."""

    backend: Backend
    record: PluginRecord
    rule: str
    """``"--backend"``, ``"FREETOKEN_BACKEND"``, or ``"auto"``."""
    reason: str
    platform: TorchPlatform
    candidates: list[PluginRecord]
    triggered_by: str = ""

    @property
    def name(self) -> str:
        return self.record.name

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "distribution": self.record.distribution,
            "version": self.record.version,
            "rule": self.rule,
            "reason": self.reason,
            "triggered_by": self.triggered_by,
        }


def requested_name(flag: Optional[str], environ: Optional[Mapping[str, str]] = None) -> tuple[Optional[str], str]:
    """The explicitly requested backend and where the request came from."""
    if flag:
        return flag, "--backend"
    env = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if env:
        return env, ENV_VAR
    return None, "auto"


def _load_error_text(record: PluginRecord) -> str:
    return f"backend plugin {record.label} {record.status.value.replace('_', ' ')}: {record.error}"


def _instantiate(record: PluginRecord) -> Backend:
    assert record.backend_cls is not None
    try:
        return record.backend_cls()
    except Exception as exc:
        raise BackendSelectionError(f"backend {record.label} could not be created: {type(exc).__name__}: {exc}") from exc


def _by_priority(records: list[PluginRecord], what: str) -> tuple[PluginRecord, str]:
    """The highest-priority record; an equal top priority is an error naming them."""
    ranked = sorted(records, key=lambda r: -(r.priority or 0))
    top = ranked[0]
    tied = [r for r in ranked if r.priority == top.priority]
    if len(tied) > 1:
        names = ", ".join(r.label for r in tied)
        raise BackendSelectionError(
            f"{len(tied)} {what} plugins share the top priority {top.priority}: {names}. Choose one with "
            f"--backend NAME or {ENV_VAR}=NAME, or give them different Backend.priority values."
        )
    if len(ranked) > 1:
        others = ", ".join(f"{r.name} (priority {r.priority})" for r in ranked[1:])
        return top, f"priority {top.priority} beats {others}"
    return top, ""


def select_explicit(
    name: str, source: str, eps: Optional[Iterable[Any]] = None, platform: Optional[TorchPlatform] = None
) -> Selection:
    """Load only the plugins called ``name`` and select one of them, or raise."""
    eps = list(eps) if eps is not None else None
    records = discovery.discover(eps, name=name)
    if not records:
        installed = sorted({r.name for r in discovery.discover(eps)})
        hint = INSTALL_HINTS.get(name)
        fix = f"Install it with: {hint}" if hint else f"Installed backends: {', '.join(installed) or 'none'}"
        raise BackendSelectionError(f"backend {name!r} requested by {source} is not installed. {fix}")
    for record in records:
        discovery.probe(record)
    usable = [r for r in records if r.status is PluginStatus.AVAILABLE]
    if not usable:
        details = "; ".join(
            f"{r.label}: hardware unavailable: {r.error}"
            if r.status is PluginStatus.UNAVAILABLE
            else _load_error_text(r)
            for r in records
        )
        raise BackendSelectionError(f"backend {name!r} requested by {source} cannot be used: {details}")
    chosen, tie = _by_priority(usable, f"{name!r}")
    reason = f"requested by {source}"
    if tie:
        reason += f"; {tie}"
    return Selection(_instantiate(chosen), chosen, source, reason, platform or detect_platform(), records)


def _missing_plugin_error(platform: TorchPlatform, records: list[PluginRecord]) -> BackendSelectionError:
    hardware = platform.hardware
    hint = INSTALL_HINTS.get(hardware, f"a plugin whose Backend.hardware is {hardware!r}")
    broken = [r for r in records if r.status in (PluginStatus.LOAD_ERROR, PluginStatus.VERSION_MISMATCH)]
    if broken:
        failures = "; ".join(_load_error_text(r) for r in broken)
        return BackendSelectionError(
            f"{platform.rule}, but no {hardware} backend plugin could be loaded. {failures}. Fix the plugin "
            f"above that drives {hardware}, or if none of them does, install it with: {hint}. {_CPU_ESCAPE}"
        )
    return BackendSelectionError(
        f"{platform.rule}, but no {hardware} backend plugin is installed. Install it with: {hint}. {_CPU_ESCAPE}"
    )


def select_auto(eps: Optional[Iterable[Any]] = None, platform: Optional[TorchPlatform] = None) -> Selection:
    """Apply the automatic rule over every installed plugin, or raise."""
    platform = platform or detect_platform()
    hardware = platform.hardware
    records = discovery.discover(eps)
    for record in records:
        discovery.load(record)
    candidates = [r for r in records if r.loaded and r.hardware == hardware]
    # A plugin that failed to load might have been the one for this hardware: name it in the error.
    if not candidates:
        raise _missing_plugin_error(platform, records)
    for record in candidates:
        discovery.probe(record)
    usable = [r for r in candidates if r.status is PluginStatus.AVAILABLE]
    if not usable:
        details = "; ".join(
            f"{r.label}: {r.error}" if r.status is PluginStatus.UNAVAILABLE else _load_error_text(r)
            for r in candidates
        )
        fix = " " + _CPU_ESCAPE if hardware != CPU else ""
        raise BackendSelectionError(f"{platform.rule}, but no {hardware} backend can run here: {details}.{fix}")
    chosen, tie = _by_priority(usable, hardware)
    reason = f"automatic: {platform.rule} -> {hardware}"
    if tie:
        reason += f"; {tie}"
    skipped = [r for r in candidates if r not in usable]
    if skipped:
        reason += "; skipped " + ", ".join(f"{r.name} ({r.status.value}: {r.error})" for r in skipped)
        log.warning("backend selection skipped unusable %s plugins: %s", hardware, reason)
    return Selection(_instantiate(chosen), chosen, "auto", reason, platform, candidates)


def select(
    flag: Optional[str] = None,
    environ: Optional[Mapping[str, str]] = None,
    eps: Optional[Iterable[Any]] = None,
    platform: Optional[TorchPlatform] = None,
) -> Selection:
    """Select a backend by the explicit rule when a name is given, else automatically.

    ``eps`` (entry points) and ``platform`` default to what is installed and what
    torch reports; passing them makes the rules checkable in isolation.
    """
    name, source = requested_name(flag, environ)
    if name is not None:
        return select_explicit(name, source, eps, platform)
    return select_auto(eps, platform)
