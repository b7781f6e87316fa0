"""freetoken-cuda's kernels as nvcc compiled them, read without a GPU: no kernel keeps a
local-memory stack or local loads and stores (registers spilled), on any architecture the
extension was built for. A spill in a decode kernel costs far more than the weights it reads
(the Triton byte tiles that spilled ran GPT-OSS-120B's experts at ~4 ms a layer against ~12
us of reads: docs/benchmarks.md). Read with the cuobjdump that Triton ships; skipped where
freetoken-cuda was installed without its extension (no nvcc) or Triton has no cuobjdump.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

pytest.importorskip("triton")

from packed_sm90_spills import CUOBJDUMP  # noqa: E402  (Triton's cuobjdump)

#: one kernel's lines of ``cuobjdump -res-usage``: its (mangled) name, then its resources
_FUNCTION = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")
#: Stacks known and left: (architecture, a piece of the kernel's name) -> bytes. On sm_120,
#: the Q4_K-gate/Q6_K-up gate/up kernel (at its 128-register bound) keeps five values in 24
#: bytes of stack, stored before its pass loop and loaded once a pass, outside the loop over
#: the rows' items (its SASS: 5 STL, 5 LDL). Everything else: none.
KNOWN_STACKS = {("sm_120", "moe_gate_up_kernelILi12ELi14E"): 24}


def _extension_path() -> str:
    try:
        import freetoken_cuda._C as ext
    except ImportError as exc:
        pytest.skip(f"freetoken-cuda's extension is not built here: {exc}")
    return str(ext.__file__)


def _resources(text: str) -> list[tuple[str, str, int, int, int]]:
    """(architecture, kernel, registers, stack bytes, local bytes) of every kernel listed."""
    rows = []
    for section in re.split(r"\n(?=Fatbin elf code:)", text):
        arch = re.search(r"arch = (sm_\d+)", section)
        for name, reg, stack, local in _FUNCTION.findall(section):
            rows.append((arch.group(1) if arch else "?", name, int(reg), int(stack), int(local)))
    return rows


def test_no_native_kernel_spills_registers():
    """Every kernel of every architecture in the extension: STACK 0 and LOCAL 0 but the known
    stacks above (at most their size); the decode kernels (the one-token GEMVs and the routed
    experts, MXFP4 among their formats) are among them, on sm_90 (the GPU machine's) too."""
    if not os.path.exists(CUOBJDUMP):
        pytest.skip(f"no cuobjdump at {CUOBJDUMP}")
    out = subprocess.run([CUOBJDUMP, "-res-usage", _extension_path()], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    kernels = _resources(out.stdout)
    on_sm90 = {name for arch, name, *_ in kernels if arch == "sm_90"}
    for family in ("packed_gemv_kernel", "moe_gate_up_kernel", "moe_down_kernel", "moe_gate_up_kernelILi39ELi39E"):
        assert any(family in n for n in on_sm90), f"no sm_90 {family} in the extension: {sorted(on_sm90)[:8]}"

    def allowed(arch: str, name: str) -> int:
        return max((b for (a, piece), b in KNOWN_STACKS.items() if a == arch and piece in name), default=0)

    spilled = [k for k in kernels if k[4] or k[3] > allowed(k[0], k[1])]
    assert not spilled, f"kernels with a local-memory stack (arch, name, registers, stack, local): {spilled}"
