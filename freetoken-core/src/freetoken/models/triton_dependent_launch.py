"""The device side of programmatic dependent launch for the Triton kernels that take part
(:mod:`freetoken.backends.dependent_launch` decides, per launch, through the constant ``GDC``).

triton is optional: import this module lazily, only when a Triton kernel runs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_prior_grids(GDC: tl.constexpr):
    """Under programmatic dependent launch (``GDC``): wait for the kernel before this one
    (its writes visible), then let the next one be scheduled. Without it: nothing."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
