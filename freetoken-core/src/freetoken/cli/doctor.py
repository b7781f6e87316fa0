"""``freetoken doctor``: what is installed, what works, and which backend runs.

Reports the torch build (CUDA/HIP version, visible GPUs), the CPU's ISA, every
backend plugin with its distribution, version, status and error, the selected
backend with the rule that chose it, and that backend's capability probes.
``--json`` prints the same as one JSON object (the fields are a stable interface;
tests check them). Exit status 0 when a backend was selected, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import sys
from typing import Any, Optional

from freetoken import handoff
from freetoken._version import __version__
from freetoken.backends import registry
from freetoken.backends.contract import BackendError
from freetoken.backends.platform import detect_platform
from freetoken.cli.backend_option import add_backend_option
from freetoken.cpu_isa import detect_cpu
from freetoken.versioning import LOCKSTEP_DISTRIBUTIONS

#: Top-level keys of ``freetoken doctor --json``.
REPORT_KEYS = (
    "freetoken", "python", "torch", "cpu", "cpu_moe", "plugins", "selection", "capabilities", "qualification",
)


def _installed_versions() -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    for dist in sorted(LOCKSTEP_DISTRIBUTIONS):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _torch_report() -> dict[str, Any]:
    platform = detect_platform()
    report = platform.as_dict()
    devices: list[str] = []
    if platform.gpu_count:
        try:
            import torch

            devices = [torch.cuda.get_device_name(i) for i in range(platform.gpu_count)]
        except Exception as exc:
            report["device_error"] = f"{type(exc).__name__}: {exc}"
    report["devices"] = devices
    return report


def _cpu_report() -> dict[str, Any]:
    report = detect_cpu().as_dict()
    try:
        import torch

        report["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception as exc:
        report["torch_cpu_capability"] = None
        report["torch_error"] = f"{type(exc).__name__}: {exc}"
    return report


def _cpu_moe_report() -> dict[str, Any]:
    try:
        module = importlib.import_module("freetoken_cpu_moe")
    except Exception as exc:
        return {"importable": False, "version": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"importable": True, "version": getattr(module, "__version__", None), "error": None}


def build_report(backend: Optional[str] = None) -> dict[str, Any]:
    """Everything ``freetoken doctor`` shows, as plain JSON-able data."""
    report: dict[str, Any] = {
        "freetoken": {
            "version": __version__,
            "packages": _installed_versions(),
            "handoff_abi": handoff.ABI_VERSION,
        },
        "python": {"version": sys.version.split()[0], "executable": sys.executable},
        "torch": _torch_report(),
        "cpu": _cpu_report(),
        "cpu_moe": _cpu_moe_report(),
        "plugins": [r.as_dict() for r in registry.plugins(probe=True)],
    }
    selection: dict[str, Any] = {"backend": None, "error": None}
    capabilities: Optional[dict[str, Any]] = None
    qualification: Optional[dict[str, Any]] = None
    try:
        chosen = registry.get_backend(backend)
        current = registry.current_selection()
        assert current is not None
        selection.update(current.as_dict())
        try:
            capabilities = chosen.capabilities().as_dict()
        except Exception as exc:
            capabilities = {"error": f"{type(exc).__name__}: {exc}"}
        qualification = _qualification_report(chosen)
    except BackendError as exc:
        selection["error"] = str(exc)
    report["selection"] = selection
    report["capabilities"] = capabilities
    report["qualification"] = qualification
    return report


def _qualification_report(backend: Any) -> dict[str, Any]:
    """The startup check's outcome for BF16: IO path, graphs on/off and why."""
    try:
        from freetoken.moe.qualify import doctor_section
    except Exception as exc:
        return {"qualified": False, "error": f"qualification unavailable: {type(exc).__name__}: {exc}"}
    return doctor_section(backend)


def _mark(value: Any) -> str:
    return {True: "yes", False: "no", None: "unknown"}.get(value, str(value)) if isinstance(value, (bool, type(None))) else str(value)


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`build_report`."""
    lines = [f"FreeToken {report['freetoken']['version']} (hand-off ABI {report['freetoken']['handoff_abi']})"]
    pkgs = ", ".join(f"{k} {v or '-'}" for k, v in report["freetoken"]["packages"].items())
    lines.append(f"  packages: {pkgs}")
    lines.append(f"Python {report['python']['version']} ({report['python']['executable']})")
    t = report["torch"]
    lines.append(f"torch {t['torch_version']}: CUDA {t['cuda_version'] or '-'}, HIP {t['hip_version'] or '-'}, "
                 f"GPUs visible: {t['gpu_count']} {t['devices'] or ''}".rstrip())
    if t.get("error"):
        lines.append(f"  torch error: {t['error']}")
    c = report["cpu"]
    lines.append(f"CPU: {c['model'] or '?'} ({c['machine']}, {c['logical_cores']} logical cores)")
    lines.append(f"  ISA: {' '.join(c['isa']) or '(unknown)'}; torch CPU capability: {c['torch_cpu_capability']}")
    m = report["cpu_moe"]
    lines.append(f"freetoken-cpu-moe: {'importable, ' + str(m['version']) if m['importable'] else 'NOT importable: ' + str(m['error'])}")
    lines.append("Backend plugins:")
    for p in report["plugins"]:
        where = f"{p['distribution'] or '?'} {p['version'] or ''}".strip()
        extra = f", hardware {p['hardware']}, priority {p['priority']}" if p["hardware"] else ""
        lines.append(f"  {p['name']:<10} {p['status']:<16} [{where}{extra}]")
        if p["error"]:
            lines.append(f"  {'':<10} -> {p['error']}")
    s = report["selection"]
    if s["backend"]:
        lines.append(f"Selected backend: {s['backend']} ({s['reason']})")
    else:
        lines.append(f"Selected backend: NONE\n  {s['error']}")
    caps = report["capabilities"]
    if caps:
        lines.append("Capabilities:")
        for key, value in caps.items():
            if key == "extra":
                for k, v in value.items():
                    lines.append(f"  {k:<18} {v}")
            else:
                lines.append(f"  {key:<18} {_mark(value)}")
    q = report.get("qualification")
    if q:
        if q.get("qualified"):
            graphs = "on" if q.get("graphs") else "off"
            lines.append(f"Startup check (BF16): IO path {q.get('io_path')}, decode graphs {graphs}: {q.get('reason')}")
            for warning in q.get("warnings") or []:
                lines.append(f"  warning: {warning}")
        else:
            lines.append(f"Startup check (BF16): FAILED: {q.get('error') or q.get('note')}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = build_report(args.backend)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(report))
    # An explicitly requested backend that cannot be used is a failure; without a request the
    # report itself is the result (an install with no usable backend is a finding shown above).
    explicit = bool(args.backend or os.environ.get("FREETOKEN_BACKEND"))
    return 1 if explicit and not report["selection"]["backend"] else 0


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    parser = subparsers.add_parser("doctor", help="show the installation, the backends and which one is selected")
    add_backend_option(parser)
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.set_defaults(func=run)
