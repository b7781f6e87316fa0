"""``freetoken doctor``: what is installed, what works, and which backend runs.

Reports the torch build (CUDA/HIP version, visible GPUs), the CPU's ISA, every
backend plugin with its distribution, version, status and error, the selected
backend with the rule that chose it, and that backend's capability probes.
``--json`` prints the same as one JSON object (the fields are a stable interface;
tests check them). Exit status 0 when a backend was selected, 1 otherwise.

``--model PATH`` (with the engine options of ``serve``: ``--dtype``, ``--moe-cpu-layers``,
``--gpu-memory-limit`` ...) also loads that model on the selected backend as ``serve``
would and reports the startup decision (IO path, sync mode, decode graphs, why,
warnings), the memory plan and the weights policy, under the key ``model``; a model
that cannot start is reported with its error and exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import sys
import time
from typing import Any, Optional

from freetoken import handoff
from freetoken._version import __version__
from freetoken.backends import registry
from freetoken.backends.contract import BackendError
from freetoken.backends.platform import detect_platform
from freetoken.cli.backend_option import add_backend_option
from freetoken.cli.engine_options import (
    FLAGS,
    add_engine_arguments,
    engine_config_from_args,
    engine_options_given,
    usage_error,
)
from freetoken.cpu_isa import detect_cpu
from freetoken.versioning import LOCKSTEP_DISTRIBUTIONS

#: Top-level keys of ``freetoken doctor --json``.
REPORT_KEYS = (
    "freetoken", "python", "torch", "cpu", "cpu_moe", "memory_lock", "plugins", "selection", "capabilities",
    "qualification",
)
#: The key ``--model`` adds after them.
MODEL_KEY = "model"

#: Engine options doctor does not take: ``--backend`` is its own flag, and the seed and the
#: prefill chunk change nothing at startup.
DOCTOR_EXCLUDED_OPTIONS = ("backend", "seed", "prefill_chunk")


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
    report: dict[str, Any] = {"importable": True, "version": getattr(module, "__version__", None), "error": None}
    try:
        from freetoken_cpu_moe.attention import attention_mode

        report.update(isa_tiers=module.isa_tiers(), active_isa=module.active_isa(),
                      isa_cap=os.environ.get(module.ISA_ENV) or None, attention=attention_mode())
    except Exception as exc:
        report["kernel_error"] = f"{type(exc).__name__}: {exc}"
    return report


def _memory_lock_report() -> dict[str, Any]:
    """Whether the host expert banks can be page-locked (--moe-lock-host, --moe-locked-fetch,
    fast prompt streaming): RLIMIT_MEMLOCK and what it allows."""
    from freetoken.moe.handoff.host_pinning import lock_limit

    lim = lock_limit()
    return {"soft_bytes": lim.soft, "hard_bytes": lim.hard, "can_lock": lim.can_lock, "reason": lim.reason}


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
        "memory_lock": _memory_lock_report(),
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
        from freetoken.moe.qualify.startup import doctor_section
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
    if m.get("active_isa"):
        cap = f" (capped by FREETOKEN_CPU_MOE_ISA={m['isa_cap']})" if m.get("isa_cap") else ""
        lines.append(f"  kernel tier: {m['active_isa']}{cap}; tiers available: {' '.join(m['isa_tiers'])}; "
                     f"attention: {m['attention']}")
    elif m.get("kernel_error"):
        lines.append(f"  kernel tier unknown: {m['kernel_error']}")
    lock = report.get("memory_lock")
    if lock:
        lines.append(f"Page-locking host expert banks: {'possible' if lock['can_lock'] else 'limited'} "
                     f"({lock['reason']}); used by --moe-lock-host, --moe-locked-fetch and prompt streaming, which "
                     "report at startup whether the driver accepted them")
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


def model_report(config: Any) -> dict[str, Any]:
    """Load ``config.model`` as ``freetoken serve`` would (an :class:`LLMEngine` on the
    selected backend) and return its startup decision; a model that cannot start gives
    ``ok: False`` and the error message instead of raising."""
    out: dict[str, Any] = {"path": config.model, "ok": False, "error": None, "error_type": None}
    start = time.monotonic()
    try:
        from freetoken.engine.engine import LLMEngine

        engine = LLMEngine(config)
    except Exception as exc:  # noqa: BLE001 - doctor reports, never raises
        out["error"] = str(exc) or type(exc).__name__
        out["error_type"] = type(exc).__name__
        return out
    try:
        out.update({
            "ok": True,
            "name": engine.model_name,
            "load_seconds": round(time.monotonic() - start, 2),
            "max_model_len": engine.max_model_len,
            "kv_cache_tokens": engine.kv.total_tokens,
            "kv_cache_bytes": engine.kv.bytes,
            "backend_info": engine.backend_info(),
        })
    finally:
        engine.close()
    return out


def _gib(n: Any) -> str:
    return f"{n / 2**30:.2f} GiB" if isinstance(n, (int, float)) else "-"


def format_model(m: dict[str, Any]) -> list[str]:
    """The human-readable form of :func:`model_report`."""
    if not m["ok"]:
        return [f"Model {m['path']}: FAILED to start", f"  {m['error']}"]
    info = m["backend_info"]
    lines = [f"Model {m['path']} ({m['name']}): loaded in {m['load_seconds']:.1f} s on backend {info.get('backend')}"]
    graphs = "on" if info.get("graphs") else "off"
    if info.get("graphs") and info.get("graph_batch_sizes"):
        graphs += f" (batch sizes {','.join(map(str, info['graph_batch_sizes']))})"
    lines.append(f"  startup decision: IO path {info.get('io_path')}, sync mode {info.get('sync_mode') or 'none'}, "
                 f"decode graphs {graphs}")
    lines.append(f"  why: {info.get('reason') or '-'}")
    for warning in info.get("warnings") or []:
        lines.append(f"  warning: {warning}")
    if "act_dtype" in info:
        lines.append(f"  activations: {info['act_dtype']}")
    placement = f"  MoE experts: CPU layers {info.get('moe_cpu_layers', '-')}"
    if info.get("moe_gpu_layers") is not None:
        placement += f", {info['moe_gpu_layers']} layers on the GPU"
    if info.get("cpu_threads") is not None:
        placement += f"; {info['cpu_threads']} CPU expert threads"
    lines.append(placement)
    plan = info.get("memory_plan")
    if plan:
        lines.append(f"  memory plan: budget {_gib(plan.get('budget'))}, dense {_gib(plan.get('dense'))}, "
                     f"routed experts {_gib(plan.get('expert_layer_bytes'))} per layer "
                     f"({plan.get('gpu_layers')} layers on the GPU, CPU layers {plan.get('cpu_layers')}), "
                     f"KV budget {_gib(plan.get('kv_budget'))}, step reserve {_gib(plan.get('reserve'))} "
                     f"(prompt chunks of {plan.get('prefill_chunk')} tokens {_gib(plan.get('activations'))}, "
                     f"outside the allocator {_gib(plan.get('outside'))}, workspaces {_gib(plan.get('workspace'))})")
    else:
        lines.append("  memory plan: none (the backend plans no device memory)")
    lines.append(f"  KV cache: {m['kv_cache_tokens']} tokens ({_gib(m['kv_cache_bytes'])}), "
                 f"context {m['max_model_len']} tokens")
    weights = info.get("weights")
    if isinstance(weights, dict):
        lines.append("  weights: " + "; ".join(f"{k}: {v}" for k, v in weights.items()))
    elif weights:
        lines.append(f"  weights: {weights}")
    if info.get("attention"):
        lines.append(f"  attention: {info['attention']}")
    lines.extend(_traffic_lines(info))
    return lines


def _traffic_lines(info: dict[str, Any]) -> list[str]:
    """The expert cache, long-prompt streaming and page-locking of a GPU session."""
    lines = []
    plan = info.get("memory_plan") or {}
    if plan.get("packed_layers"):
        lines.append(f"  GPU experts: {plan['packed_layers']} layers kept packed (the file's block formats, "
                     f"FP8 in rows of scaled blocks; {_gib(plan.get('expert_bytes'))})")
    cache = info.get("expert_cache")
    if cache:
        lines.append(f"  expert cache: {cache['slots']} slots ({_gib(cache['bytes'])}) for {cache['layers']} CPU layers, "
                     f"up to {cache['max_fetch']} fetches per layer and step")
    stream = info.get("prefill_stream")
    if stream:
        p = stream.get("profile") or {}
        how = (f"measured: one layer {p.get('layer_bytes', 0) / 2**20:.0f} MiB over PCIe at {p.get('pcie_gb_s')} GB/s "
               f"against {p.get('cpu_us_per_token')} us of CPU experts per token" if p.get("source") == "measured"
               else "given")
        lines.append(f"  long prompts: {stream['mode']}; prefill chunks of >= {stream['min_tokens']} tokens stream the "
                     f"CPU layers' experts to the GPU ({how})")
    if info.get("host_locked_bytes"):
        lines.append(f"  page-locked host banks: {_gib(info['host_locked_bytes'])}")
    locked = info.get("locked_fetch")
    if locked and locked["fraction"] > 0:
        lines.append(f"  locked fetch ({locked['setting']}): {locked['fraction']} of missed routes, at most "
                     f"{locked['max_fetch']} per layer")
    elif locked:
        lines.append(f"  locked fetch: {locked['setting']}")
    profile = (locked or {}).get("profile")
    if profile:
        steps = ", ".join(f"{n}: {t}" for n, t in profile["step_us"].items())
        lines.append(f"    measured at start, a CPU layer's batch-1 step in us by fetched routes: {steps}")
    return lines


def run(args: argparse.Namespace) -> int:
    config = None
    if getattr(args, "model", None):
        config = engine_config_from_args(args, backend=args.backend)
    else:
        from freetoken.engine.config import EngineConfig

        defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
        changed = [FLAGS[f] for f, v in engine_options_given(args).items() if f != "model" and v != defaults[f]]
        if changed:
            usage_error(args, f"{', '.join(changed)} {'applies' if len(changed) == 1 else 'apply'} to a model: "
                              "give --model PATH")
    report = build_report(args.backend)
    if config is not None:
        report[MODEL_KEY] = model_report(config)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        text = format_report(report)
        if MODEL_KEY in report:
            text += "\n" + "\n".join(format_model(report[MODEL_KEY]))
        print(text)
    if MODEL_KEY in report and not report[MODEL_KEY]["ok"]:
        return 1
    # An explicitly requested backend that cannot be used is a failure; without a request the
    # report itself is the result (an install with no usable backend is a finding shown above).
    explicit = bool(args.backend or os.environ.get("FREETOKEN_BACKEND"))
    return 1 if explicit and not report["selection"]["backend"] else 0


def add_parser(subparsers: "argparse._SubParsersAction") -> None:
    parser = subparsers.add_parser(
        "doctor", help="show the installation, the backends and which one is selected",
        description="Show the installation, the backend plugins and which one is selected. With --model, also "
                    "load that model on the selected backend as 'freetoken serve' would and show the startup "
                    "decision (IO path, sync mode, decode graphs, why), the memory plan and the weights policy.",
    )
    add_backend_option(parser)
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_engine_arguments(parser, exclude=DOCTOR_EXCLUDED_OPTIONS,
                         default_text={"model": "none: report the installation only"})
    parser.set_defaults(func=run)
