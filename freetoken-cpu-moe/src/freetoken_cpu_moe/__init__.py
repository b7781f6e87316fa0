"""freetoken_cpu_moe: CPU Mixture-of-Experts kernels at memory bandwidth.

Expert weights are read in the checkpoint's own layout (F32/F16/BF16, FP8 E4M3
with 128x128 block scales, GGUF Q8_0/Q4_K/Q5_K/Q6_K) by kernels picked at run
time for this CPU (AVX-512, AVX2, scalar), on a persistent worker pool. The
:class:`Coordinator` serves GPU/CPU hand-off tasks (``freetoken/handoff.h``).
The benchmarks' timing harnesses are in :mod:`freetoken_cpu_moe.timing`.
See docs/cpu-moe.md.
"""

from __future__ import annotations

import atexit

__version__ = "0.1.0"

try:
    import freetoken as _freetoken
except ImportError as exc:  # pragma: no cover - packaging error
    raise ImportError(
        "freetoken_cpu_moe needs freetoken-core (import freetoken) of the same version; "
        f"install freetoken-core=={__version__}"
    ) from exc
if _freetoken.__version__ != __version__:
    raise ImportError(
        f"version skew: freetoken_cpu_moe {__version__} but freetoken (freetoken-core) {_freetoken.__version__}; "
        "install matching versions of freetoken-core and freetoken-cpu-moe"
    )

try:
    from freetoken_cpu_moe import _core
except ImportError as exc:  # pragma: no cover - build error
    raise ImportError(
        f"freetoken_cpu_moe: the native extension did not load ({exc}); rebuild with "
        "`pip install --no-deps --no-build-isolation -e ./freetoken-cpu-moe`"
    ) from exc

from freetoken_cpu_moe.coordinator import Coordinator, stop_all as _stop_all_coordinators
from freetoken_cpu_moe.formats import FORMATS, format_info
from freetoken_cpu_moe.ops import ISA_ENV, active_isa, isa_tiers, linear, moe_forward, run_task, set_isa, _check_env_isa
from freetoken_cpu_moe.pool import Pool, default_pool, physical_core_cpus, shutdown_default_pool
from freetoken_cpu_moe.weights import ACTIVATIONS, ExpertBank, Weights

__all__ = [
    "__version__",
    "ACTIVATIONS",
    "ISA_ENV",
    "Coordinator",
    "ExpertBank",
    "FORMATS",
    "Pool",
    "Weights",
    "active_isa",
    "default_pool",
    "format_info",
    "isa_tiers",
    "linear",
    "moe_forward",
    "physical_core_cpus",
    "run_task",
    "set_isa",
]

_check_env_isa()


@atexit.register
def _shutdown() -> None:
    _stop_all_coordinators()
    shutdown_default_pool()
