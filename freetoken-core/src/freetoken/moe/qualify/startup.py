"""Startup qualification of the hybrid MoE hand-off (backend-agnostic).

Before serving, run a small hybrid MoE layer through the backend's IO paths with random
activations and routes, eagerly and under graph replay (several replays with new inputs
and routes, empty CPU routes, all-CPU and split routes), in the model's activation dtype,
and compare with the oracle: synchronous CPU execution (:meth:`CpuExperts.run`)
of the CPU routes plus a float64 torch reference of the GPU routes. Policy:

1. Prefer KernelIO when its probe passes and activations are BF16; FP16/FP32 use copies.
   The copy path orders its hand-off with the first of the backend's
   :meth:`~freetoken.backends.contract.Backend.copy_sync_modes` (on HIP: the
   system-release event; never a plain memop ready write).
2. A numerical failure of BF16 KernelIO retries the copy path and checks again.
3. Eager correct but graph replay wrong, or the chosen path cannot be captured: warn and
   turn decode graphs off on every rank (clear explicit batch sizes and the max batch size).
4. Eager wrong, or any capture/runtime API error: refuse to start (QualificationError).
5. Graphs configured off: eager check only.

Decisions that must match across tensor-parallel ranks go through ``group.all_true``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Protocol

from freetoken.backends.contract import Backend, CpuExperts

from freetoken.backends.handoff_io import IOPath, SyncMode
from freetoken.moe.qualify.checks import CheckFailure, QualLayer

log = logging.getLogger(__name__)


class QualificationError(RuntimeError):
    """The hand-off cannot be trusted on this machine: startup must stop."""


class RankGroup(Protocol):
    """What qualification needs from a tensor-parallel group."""

    def all_true(self, value: bool) -> bool:
        """Logical AND of ``value`` over every rank (every rank gets the same answer)."""


class SingleRankGroup:
    """The trivial group of one rank."""

    rank = 0
    world_size = 1

    def all_true(self, value: bool) -> bool:
        return bool(value)


@dataclasses.dataclass
class GraphSettings:
    """The engine's decode-graph settings; qualification turns them off when unsafe."""

    enabled: bool = True
    batch_sizes: Optional[list[int]] = None
    max_batch_size: Optional[int] = None

    def disable(self) -> None:
        self.enabled = False
        self.batch_sizes = []
        self.max_batch_size = 0


@dataclasses.dataclass
class QualifyConfig:
    hidden: int = 256
    intermediate: int = 128
    num_experts: int = 8
    top_k: int = 4
    batch_sizes: tuple[int, ...] = (1, 3)
    eager_steps: int = 5
    replays: int = 6
    cpu_threads: int = 2
    watchdog_ms: float = 2000.0
    tolerance: float = 2e-2
    seed: Optional[int] = None


@dataclasses.dataclass
class QualificationResult:
    backend: str
    act_dtype: str
    io_path: str
    sync_mode: Optional[str]
    graphs: bool
    reason: str
    warnings: list[str] = dataclasses.field(default_factory=list)
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: The last result per backend name in this process (shown by ``freetoken doctor``/health).
LAST_RESULTS: dict[str, QualificationResult] = {}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _choose_candidates(backend: Backend, act_dtype: Any, reasons: list[str]) -> list[IOPath]:
    import torch

    if act_dtype != torch.bfloat16:
        reasons.append(f"{_dtype_name(act_dtype)} activations take the copy path (KernelIO carries BF16 only)")
        return [IOPath.COPY]
    kio = backend.kernel_io()
    if kio is None:
        reasons.append("the backend has no KernelIO")
        return [IOPath.COPY]
    try:
        ok = bool(kio.probe())
    except Exception as exc:  # noqa: BLE001 - a failed probe only rules KernelIO out
        ok = False
        reasons.append(f"KernelIO probe raised {type(exc).__name__}: {exc}")
    if not ok:
        detail = kio.probe_details
        reasons.append(f"KernelIO probe failed{f' ({detail})' if detail else ''}")
        return [IOPath.COPY]
    reasons.append("KernelIO probe passed and activations are BF16")
    return [IOPath.KERNEL_IO, IOPath.COPY]


def _copy_sync_mode(backend: Backend, graphs: bool, reasons: list[str]) -> Optional[SyncMode]:
    """The sync mode the copy path is checked (and served) with; None: the backend's default."""
    modes = backend.copy_sync_modes(graphs)
    if not modes:
        return None
    reasons.append(f"copy path ordered by {modes[0].value}")
    return modes[0]


def qualify(
    backend: Backend,
    act_dtype: Any,
    graph_settings: Optional[GraphSettings] = None,
    group: Optional[RankGroup] = None,
    config: Optional[QualifyConfig] = None,
    cpu_experts: Optional[CpuExperts] = None,
) -> QualificationResult:
    """Choose and verify the hand-off path; may turn graphs off; raises QualificationError."""
    group = group or SingleRankGroup()
    settings = graph_settings if graph_settings is not None else GraphSettings()
    config = config or QualifyConfig()
    dtype_name = _dtype_name(act_dtype)
    if not backend.hands_off:
        result = QualificationResult(
            backend.name, dtype_name, IOPath.SYNCHRONOUS.value, "synchronous", False,
            "no GPU: CPU experts run synchronously inside the layer; nothing to hand off",
        )  # fmt: skip
        settings.disable()
        LAST_RESULTS[backend.name] = result
        return result

    reasons: list[str] = []
    warnings: list[str] = []
    checks: list[dict[str, Any]] = []
    candidates = _choose_candidates(backend, act_dtype, reasons)

    layer: Optional[QualLayer] = None
    chosen: Optional[IOPath] = None
    failure: Optional[str] = None
    try:
        cpu = cpu_experts if cpu_experts is not None else backend.cpu_experts()
        if cpu is None:
            raise RuntimeError(f"backend {backend.name!r} provides no CPU experts (Backend.cpu_experts) to hand off to")
        copy_sync = _copy_sync_mode(backend, settings.enabled, reasons) if IOPath.COPY in candidates else None
        layer = QualLayer(backend, act_dtype, config, cpu, copy_sync=copy_sync)
        for path in candidates:
            try:
                checks.append(layer.check(path, graph=False))
                chosen = path
                break
            except CheckFailure as exc:  # numerically wrong
                checks.append(exc.record)
                if path == IOPath.KERNEL_IO:
                    mode = layer.sync_mode(IOPath.COPY)
                    msg = f"BF16 KernelIO gave wrong results eagerly ({exc}); retrying with copy + {mode}"
                    log.warning(msg)
                    warnings.append(msg)
                    continue
                failure = f"{path.value} hand-off gives wrong results eagerly: {exc}"
                break
            except Exception as exc:  # noqa: BLE001 - API/runtime error: rule 4
                failure = f"{path.value} hand-off raised {type(exc).__name__} eagerly: {exc}"
                break
    except Exception as exc:  # noqa: BLE001 - could not even build the check layer
        failure = f"could not set up the qualification layer: {type(exc).__name__}: {exc}"

    eager_ok = group.all_true(chosen is not None and failure is None)
    if not eager_ok:
        if layer is not None:
            layer.close()
        raise QualificationError(
            f"refusing to start on backend {backend.name!r} ({dtype_name}): "
            f"{failure or 'another tensor-parallel rank failed the eager hand-off check'}"
        )
    assert chosen is not None and layer is not None
    if chosen == IOPath.COPY and IOPath.KERNEL_IO in candidates:
        reasons.append(f"KernelIO failed its numerical check; using copy + {layer.sync_mode(IOPath.COPY)}")

    graph_ok = False
    graph_error: Optional[str] = None
    sync_mode = layer.sync_mode(chosen)
    if not settings.enabled:
        reasons.append("decode graphs are configured off: eager check only")
    elif backend.graph_capture() is None:
        reasons.append(f"backend {backend.name} cannot capture graphs: eager only")
    elif not layer.graph_capable(chosen):
        msg = f"{chosen.value} with {sync_mode} cannot be captured here: decode graphs turned off"
        log.warning(msg)
        warnings.append(msg)
        reasons.append(msg)
    else:
        try:
            checks.append(layer.check(chosen, graph=True))
            graph_ok = True
        except CheckFailure as exc:
            checks.append(exc.record)
            msg = f"graph replay of the {chosen.value} hand-off is wrong ({exc}): decode graphs turned off"
            log.warning(msg)
            warnings.append(msg)
        except Exception as exc:  # noqa: BLE001 - capture/replay API error: rule 4
            graph_error = f"{type(exc).__name__}: {exc}"
    layer.close()

    if not group.all_true(graph_error is None):
        raise QualificationError(
            f"refusing to start on backend {backend.name!r}: graph capture/replay of the hand-off failed: "
            f"{graph_error or 'on another tensor-parallel rank'}"
        )
    graphs = group.all_true(graph_ok) if settings.enabled else False
    if settings.enabled and not graphs:
        if graph_ok:  # this rank was fine, another was not
            warnings.append("another tensor-parallel rank found graph replay unsafe: decode graphs turned off")
        settings.disable()
    elif graphs:
        reasons.append("graph replay verified")
    result = QualificationResult(
        backend.name, dtype_name, chosen.value, sync_mode, graphs, "; ".join(reasons), warnings, checks
    )
    LAST_RESULTS[backend.name] = result
    log.info("hand-off qualified: %s, graphs %s (%s)", chosen.value, "on" if graphs else "off", result.reason)
    return result


def doctor_section(backend: Backend, run: bool = True) -> dict[str, Any]:
    """What ``freetoken doctor`` shows: the chosen path, graphs on/off and why.

    Uses this process's last qualification of ``backend``; otherwise runs one for BF16
    (when ``run``), reporting a failure instead of raising."""
    import torch

    result = LAST_RESULTS.get(backend.name)
    if result is None and run:
        try:
            result = qualify(backend, torch.bfloat16)
        except QualificationError as exc:
            return {"qualified": False, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - doctor reports, never raises
            return {"qualified": False, "error": f"{type(exc).__name__}: {exc}"}
    if result is None:
        return {"qualified": False, "note": "qualification runs at engine start"}
    out = {"qualified": True}
    out.update({k: v for k, v in result.as_dict().items() if k != "checks"})
    out["checks"] = [{k: c.get(k) for k in ("path", "mode", "ok", "max_rel_error", "steps")} for c in result.checks]
    return out
