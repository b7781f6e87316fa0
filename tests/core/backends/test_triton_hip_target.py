"""Triton on AMD GPUs without one: which gfx targets run the engine's Triton kernels and with
which launch options (:mod:`freetoken.backends.triton_target`), and every kernel compiled
ahead of time for CDNA and RDNA targets with the installed Triton's AMD backend (its own
LLVM and device libraries: no ROCm installation, no GPU).

The compilation runs in a subprocess without TRITON_INTERPRET (triton_hip_compile.py): a
process that interprets Triton kernels cannot compile them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from freetoken.backends import triton_target as tt

#: the kernels that multiply with tl.dot (matrix instructions where the target has them)
DOT_KERNELS = ("moe.gate_up", "moe.down", "attention.partial", "attention.partial_window_sinks",
               "attention.partial.d80v48", "attention.partial.mla",
               "grouped.gate_up.Q4_K", "grouped.down.Q4_K", "grouped.gate_up.BF16", "grouped.down.BF16")


@pytest.mark.parametrize(
    "arch,family,warp",
    [("gfx90a:sramecc+:xnack-", "CDNA2", 64), ("gfx942", "CDNA3", 64), ("gfx950", "CDNA4", 64),
     ("gfx1100", "RDNA3", 32), ("gfx1101", "RDNA3", 32), ("gfx1151", "RDNA3.5", 32), ("gfx1200", "RDNA4", 32),
     ("gfx1201", "RDNA4", 32)],
)  # fmt: skip
def test_supported_gfx_targets_run_triton(arch, family, warp):
    pytest.importorskip("triton")
    t = tt.hip_target(arch)
    assert (t.backend, t.arch, t.warp_size, t.usable) == ("hip", arch.split(":")[0], warp, True)
    assert family in t.reason and t.arch in t.reason


@pytest.mark.parametrize(
    "arch,family,why",
    [("gfx1030", "RDNA2", "no matrix or BF16 dot-product instructions"),
     ("gfx1036", "RDNA2", "no matrix or BF16 dot-product instructions"),
     ("gfx1010:xnack-", "RDNA1", "no matrix or BF16 dot-product instructions"),
     ("gfx908", "CDNA1", "outside the targets"), ("gfx906", "GCN5/Vega", "outside the targets")],
)  # fmt: skip
def test_other_gfx_targets_fall_back_naming_the_target(arch, family, why):
    t = tt.hip_target(arch)
    assert not t.usable and t.backend == "hip"
    assert t.reason.startswith(f"{arch.split(':')[0]} ({family}): {why}")
    assert "torch implementations run here" in t.reason


@pytest.mark.parametrize("bad", ["sm_90", "8.9", "(9, 0)", ""])
def test_a_compute_capability_is_no_gfx_target(bad):
    with pytest.raises(ValueError, match="not an AMD gfx target"):
        tt.hip_target(bad)


def test_hip_without_the_amd_backend_says_what_to_install(monkeypatch):
    monkeypatch.setattr(tt, "_triton_backends", lambda: (frozenset({"nvidia"}), None))
    t = tt.hip_target("gfx942")
    assert not t.usable and "no AMD backend" in t.reason and "pytorch-triton-rocm" in t.reason
    monkeypatch.setattr(tt, "_triton_backends", lambda: (frozenset(), "triton is not importable: No module"))
    assert tt.hip_target("gfx1100").reason == "triton is not importable: No module"


def test_nvidia_rule_is_unchanged():
    pytest.importorskip("triton")
    assert tt.cuda_target((9, 0)).usable and tt.cuda_target((8, 0)).reason == "triton on compute capability (8, 0)"
    old = tt.cuda_target((7, 5))
    assert not old.usable and old.reason == "compute capability (7, 5) < (8, 0)"


def test_launch_options_keep_nvidia_tuning_and_adapt_it_on_amd():
    cuda = tt.cuda_target((9, 0))
    assert cuda.launch_options(4, 3) == {"num_warps": 4, "num_stages": 3}
    assert cuda.launch_options(8) == {"num_warps": 8}
    assert cuda.launch_options(4, 3, waves_per_eu=2, maxnreg=128) == {"num_warps": 4, "num_stages": 3, "maxnreg": 128}
    cdna = tt.hip_target("gfx942")  # wave64: the same threads per program in half the warps
    assert cdna.launch_options(4, 3) == {"num_warps": 2, "num_stages": 2}
    assert cdna.launch_options(8) == {"num_warps": 4} and cdna.launch_options(1) == {"num_warps": 1}
    assert cdna.launch_options(4, 1, maxnreg=128, ptx_version=84, waves_per_eu=2) == {
        "num_warps": 2, "num_stages": 1, "waves_per_eu": 2}  # fmt: skip
    rdna = tt.hip_target("gfx1201")  # wave32: the warps as tuned
    assert rdna.launch_options(4, 3) == {"num_warps": 4, "num_stages": 2}
    cpu = tt.for_device("cpu")  # Triton's interpreter: the options as written
    assert not cpu.usable and cpu.launch_options(4, 3) == {"num_warps": 4, "num_stages": 3}


def test_dot_precision_is_ieee_on_amd():
    assert tt.cuda_target((9, 0)).dot_precision(False) == "tf32"
    assert tt.cuda_target((9, 0)).dot_precision(True) == "ieee"
    for arch in ("gfx942", "gfx1100"):
        assert tt.hip_target(arch).dot_precision(False) == tt.hip_target(arch).dot_precision(True) == "ieee"


def test_compile_targets():
    pytest.importorskip("triton")
    t = tt.hip_target("gfx942").compile_target()
    assert (t.backend, t.arch, t.warp_size) == ("hip", "gfx942", 64)
    t = tt.cuda_target((9, 0)).compile_target()
    assert (t.backend, t.arch, t.warp_size) == ("cuda", 90, 32)
    with pytest.raises(ValueError, match="no GPU target: device cpu is not a GPU"):
        tt.for_device("cpu").compile_target()


def _compile(*args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_hip_compile.py")
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(arch: str, report: dict[str, Any]) -> None:
    cdna = arch.startswith("gfx9")
    assert report["usable"], report["reason"]
    for name, info in report["kernels"].items():
        assert "error" not in info, f"{arch} {name}: {info.get('error')}"
        assert info["hsaco_bytes"] > 0 and info["wavefront64"] == cdna, f"{arch} {name}: {info}"
        if name in DOT_KERNELS:  # bf16 dots on the matrix cores
            assert info["mfma" if cdna else "wmma"], f"{arch} {name}: no {'MFMA' if cdna else 'WMMA'} instructions"
    if "moe.down" in report["kernels"]:  # the top-k reduction: float32 atomic adds (or a CAS loop)
        assert report["kernels"]["moe.down"]["atomics"], f"{arch} moe.down: no atomic"


@pytest.mark.slow
def test_every_kernel_compiles_for_cdna3_and_rdna3():
    """gfx942 (wave64, MFMA) and gfx1100 (wave32, WMMA): every kernel of the engine."""
    pytest.importorskip("triton.backends.amd")
    report = _compile("gfx942", "gfx1100")
    for arch in ("gfx942", "gfx1100"):
        kernels = report[arch]["kernels"]
        # MoE, packed x formats (Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, FP8 rows), dense ops (q/k norm +
        # RoPE at head sizes 128, 24 and 192/128, bias + RoPE at GPT-OSS's 64, the experts' down
        # biases, the fused grouped routing), attention (and a head of 80 with a v head of 48, and
        # MLA's latents), grouped (Q4_K_M and BF16), expert traffic (gather, route slots, locked
        # fetch's route split at its smallest and largest blocks)
        assert len(kernels) == 4 + 3 * 6 + 10 + 6 + 4 + 4, sorted(kernels)
        _check(arch, report[arch])
    # why HIP launches take ieee dots: tf32 is refused on every AMD target but CDNA3
    assert report["gfx942"]["tf32_accepted"] and not report["gfx1100"]["tf32_accepted"]


@pytest.mark.slow
def test_matrix_kernels_compile_for_cdna2_cdna4_rdna4():
    pytest.importorskip("triton.backends.amd")
    report = _compile("gfx90a", "gfx950", "gfx1201",
                      "--only=moe.gate_up,moe.down,attention.partial,packed.down.Q4_K,grouped.gate_up.Q4_K")
    for arch in ("gfx90a", "gfx950", "gfx1201"):
        _check(arch, report[arch])
        assert not report[arch]["tf32_accepted"]
