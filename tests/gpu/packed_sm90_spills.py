"""Compile the packed expert kernels and the packed dense GEMV for sm_90 without a GPU and
print, per format and shape, each kernel's registers and local-memory stack per thread (JSON
on the last line).

The kernels are specialised as :func:`freetoken.kernels.moe_packed.launch` specialises them
on an NVIDIA GPU: :data:`~freetoken.kernels.moe_packed.NVIDIA_CONFIG` through
:func:`~freetoken.kernels.moe_packed.gate_up_tiles` and
:func:`~freetoken.kernels.moe_packed.down_tiles`, ``h`` quantized where
:func:`~freetoken.kernels.moe_packed.quantized_h` says. The stack comes from the cubin
(``cuobjdump -res-usage`` of the Triton installation's CUDA tools): a kernel whose values do
not fit its registers keeps them there, in memory, and runs many times slower.

Run as a script in a process where TRITON_INTERPRET is unset:
``python tests/gpu/packed_sm90_spills.py``. Used by test_triton_moe_compile.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from freetoken.kernels import moe_packed as mp
from freetoken.kernels import packed_linear as pl
from freetoken.kernels.moe_experts import ACT_CODES
from freetoken.moe.experts.gpu_packed_experts import FMT_FP8_ROWS

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

#: (name, gate/up format, down format, hidden, intermediate, top-k, activation): the decode
#: shapes of the presets (GPT-OSS's hidden with its 32 bias columns) in the formats their files use
CASES = [
    ("qwen3_q4k_q6k", mp.FMT_Q4_K, mp.FMT_Q6_K, 2048, 768, 8, "silu"),
    ("qwen3_q5k", mp.FMT_Q5_K, mp.FMT_Q5_K, 2048, 768, 8, "silu"),
    ("qwen3_q6k", mp.FMT_Q6_K, mp.FMT_Q6_K, 2048, 768, 8, "silu"),
    ("qwen3_q8_0", mp.FMT_Q8_0, mp.FMT_Q8_0, 2048, 768, 8, "silu"),
    ("gpt_oss_mxfp4", mp.FMT_MXFP4, mp.FMT_MXFP4, 2912, 2880, 4, "swiglu_oai"),
    ("gpt_oss_q8_0", mp.FMT_Q8_0, mp.FMT_Q8_0, 2912, 2880, 4, "swiglu_oai"),
    ("deepseek_fp8_rows", FMT_FP8_ROWS, FMT_FP8_ROWS, 7168, 2048, 8, "silu"),  # the official FP8 checkpoints
]


def _row_bytes(fmt: int, cols: int) -> int:
    per, nbytes, _ = mp.FORMATS[fmt]
    return cols // per * nbytes


def _f16(fmt: int) -> str:
    return "*u8" if fmt == mp.FMT_MXFP4 else "*fp16"  # (PackedStack.views: MXFP4 has no 16-bit field)


def compile_case(gu_fmt: int, d_fmt: int, hidden: int, inter: int, top_k: int, act: str) -> dict[str, Any]:
    base = mp.NVIDIA_CONFIG  # (for_target keeps its int8 dots on NVIDIA)
    h_int8 = mp.quantized_h(base, d_fmt)
    cfg = mp.gate_up_tiles(base, gu_fmt, gu_fmt, "cuda")
    group = mp.FORMATS[gu_fmt][2]
    consts = dict(K=top_k, H=hidden, I=inter, GATE_FMT=gu_fmt, GATE_RB=_row_bytes(gu_fmt, hidden), GATE_G=group,
                  UP_FMT=gu_fmt, UP_RB=_row_bytes(gu_fmt, hidden), UP_G=group, ACT=ACT_CODES[act], ALPHA=1.702,
                  LIMIT=7.0, BLOCK_I=cfg.block_i, BLOCK_H=cfg.block_h, SLOTS=False, INT8=cfg.int8_dot,
                  DP4A=cfg.int8_dot, H_INT8=h_int8)  # fmt: skip
    sig = {"x_ptr": "*bf16", "ids_ptr": "*i32", "table_ptr": "*i32", "g_u8": "*u8", "g_i8": "*i8",
           "g_f16": _f16(gu_fmt), "u_u8": "*u8", "u_i8": "*i8", "u_f16": _f16(gu_fmt), "h_ptr": "*fp32", "T": "i32",
           **{k: "constexpr" for k in consts}}  # fmt: skip
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(10)}
    gate_up = triton.compile(ASTSource(mp._gate_up_packed_kernel, sig, consts, aligned), target=TARGET,
                             options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    d_group = mp.FORMATS[d_fmt][2]
    dcfg = mp.down_tiles(base, d_fmt, top_k, "cuda")
    consts = dict(K=top_k, H=hidden, I=inter, DOWN_FMT=d_fmt, DOWN_RB=_row_bytes(d_fmt, inter), DOWN_G=d_group,
                  BLOCK_N=dcfg.block_n, BLOCK_R=dcfg.block_r, KP=triton.next_power_of_2(top_k),
                  ROUTES_TILE=dcfg.down_routes_tile, SLOTS=False, H_ONCE=dcfg.down_h_once,
                  INT8=dcfg.int8_dot and dcfg.down_routes_tile, DP4A=dcfg.int8_dot, H_INT8=h_int8)  # fmt: skip
    sig = {"h_ptr": "*fp32", "ids_ptr": "*i32", "table_ptr": "*i32", "w_ptr": "*fp32", "d_u8": "*u8", "d_i8": "*i8",
           "d_f16": _f16(d_fmt), "y_ptr": "*bf16", "T": "i32", **{k: "constexpr" for k in consts}}  # fmt: skip
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(8)}
    down = triton.compile(ASTSource(mp._down_packed_kernel, sig, consts, aligned), target=TARGET,
                          options={"num_warps": dcfg.down_num_warps or dcfg.num_warps, "num_stages": dcfg.num_stages})
    return {"gate_up": {**resources(gate_up), "tiles": [cfg.block_i, cfg.block_h, cfg.num_warps]},
            "down": {**resources(down), "tiles": [dcfg.block_n, dcfg.block_r, dcfg.down_num_warps or dcfg.num_warps]}}


#: (name, format, rows, columns): one token through packed dense matrices (GPT-OSS's attention
#: and head in Q8_0, Q5_K and Q6_K projections), with the tiles an NVIDIA GPU gives them
GEMV_CASES = [
    ("gemv_q8_0_qkv", mp.FMT_Q8_0, 4096, 2880),
    ("gemv_q8_0_head", mp.FMT_Q8_0, 201088, 2880),
    ("gemv_q5k_o", mp.FMT_Q5_K, 2048, 4096),
    ("gemv_q5k_head", mp.FMT_Q5_K, 151936, 2048),
    ("gemv_q6k_head", mp.FMT_Q6_K, 151936, 2048),
]


def compile_gemv(fmt: int, rows: int, cols: int) -> dict[str, Any]:
    nvidia = pl.NVIDIA_WIDE_CONFIG if rows >= pl.WIDE_ROWS else pl.NVIDIA_CONFIG  # config_for on NVIDIA
    cfg = pl.one_token_tiles(nvidia, fmt, "cuda")
    per, nbytes, group = mp.FORMATS[fmt]
    int8 = cfg.int8_dot and fmt in (mp.FMT_Q4_K, mp.FMT_Q6_K)
    consts = dict(N=rows, K=cols, FMT=fmt, RB=cols // per * nbytes, G=group, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.step_columns(1, cols), BLOCK_T=1, INT8=int8, DP4A=int8)  # fmt: skip
    sig = {"x_ptr": "*bf16", "w_u8": "*u8", "w_i8": "*i8", "w_f16": "*fp16", "y_ptr": "*bf16", "T": "i32",
           **{k: "constexpr" for k in consts}}  # fmt: skip
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    kernel = triton.compile(ASTSource(pl._packed_gemv_kernel, sig, consts, aligned), target=TARGET,
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return {"gemv": {**resources(kernel), "tiles": [cfg.block_n, cfg.block_k, cfg.num_warps]}}


def resources(kernel: Any) -> dict[str, int]:
    """Registers and local-memory stack (bytes) per thread of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG/STACK line: {out[-400:]}")
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2))}


def cannot_compile() -> int:
    """0 where this process compiles for sm_90 and reads cubins; else the exit status of the
    scripts (2: TRITON_INTERPRET is set, 3: no cuobjdump), with a message on stderr."""
    if triton.knobs.runtime.interpret:
        print("TRITON_INTERPRET is set: nothing to compile", file=sys.stderr)
        return 2
    if not os.path.exists(CUOBJDUMP):
        print(f"no cuobjdump at {CUOBJDUMP}", file=sys.stderr)
        return 3
    return 0


def spill_report(script: str) -> dict[str, Any]:
    """The report of ``script`` (this file or another of tests/gpu that prints one), run in a
    subprocess without TRITON_INTERPRET; a pytest skip where Triton lacks its CUDA tools."""
    import subprocess

    import pytest

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
    proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    status = cannot_compile()
    if status:
        return status
    report = {name: compile_case(*spec) for name, *spec in CASES}
    report.update({name: compile_gemv(*spec) for name, *spec in GEMV_CASES})
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
