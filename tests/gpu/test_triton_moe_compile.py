"""The fused MoE kernels compile for the H200 (sm_90) with the installed Triton, without a
GPU: Triton's compiler and its bundled ptxas need no device. Catches what the interpreter
cannot (types, layouts, shared memory, unsupported ops) before the kernels meet the GPU.

The compilation runs in a subprocess without TRITON_INTERPRET (triton_sm90_compile.py):
CPU CI interprets the kernels in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_sm90_compile.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) >= 6
    for name, kernels in report.items():
        for kernel, info in kernels.items():
            assert info["cubin"], f"{name}/{kernel}: no cubin"
            if not name.startswith("fp32"):  # float32 weights take exact (ieee) FMA dots, by design
                assert info["mma_any"], f"{name}/{kernel}: no tensor-core MMA"
            if name.startswith("bf16"):  # the decode shapes (H=2048, I=768: loops of several steps)
                assert info["mma_bf16"], f"{name}/{kernel}: no bf16 MMA with fp32 accumulation"
                assert info["cp_async"], f"{name}/{kernel}: weight loads not pipelined"
        assert kernels["down"]["atomic_add"], f"{name}: top-k reduction is not a relaxed atomic add"
