"""Compile the fused MoE kernels for sm_90 without a GPU and print what the PTX holds (JSON).

Run as a script in a process where TRITON_INTERPRET is unset (Triton decorates its own
standard library as interpreted or compiled when it is imported, so one process cannot do
both): ``python tests/gpu/triton_sm90_compile.py``. Used by test_triton_moe_compile.py.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from freetoken.kernels import moe_experts as tm

VARIANTS: dict[str, dict[str, Any]] = {
    "bf16_t16_k4": dict(block_t=16, block_k=4),
    "bf16_t64_k8": dict(block_t=64, block_k=8),
    "fp16x_i64ids_bf16w_gelu": dict(block_t=16, block_k=2, xdt="fp16", idt="i64", rwdt="bf16", act=1),
    "fp32_swiglu_ragged": dict(block_t=32, block_k=4, wdt="fp32", xdt="fp32", act=2, hidden=200, inter=72),
    "fp16w_fp32x_ragged": dict(block_t=16, block_k=8, wdt="fp16", xdt="fp32", hidden=200, inter=72),
    "bf16_blocks64": dict(block_t=16, block_k=4, cfg=tm.BlockConfig(block_i=64, block_h=64, block_n=64, block_r=64)),
    "bf16_w2_s4": dict(block_t=16, block_k=4, cfg=tm.BlockConfig(num_warps=2, num_stages=4)),
}


def compile_pair(block_t: int, block_k: int, wdt: str = "bf16", xdt: str = "bf16", idt: str = "i32",
                 rwdt: str = "fp32", act: int = 0, hidden: int = 2048, inter: int = 768,
                 cfg: Any = None) -> tuple[Any, Any]:  # fmt: skip
    """Both kernels for sm_90, specialised the way :func:`moe_experts.launch` specialises them."""
    cfg = cfg or tm.DEFAULT_CONFIG
    i_tiles = triton.cdiv(inter, cfg.block_i)
    zero_cols = triton.cdiv(triton.cdiv(hidden, i_tiles), cfg.block_h) * cfg.block_h
    precision = "ieee" if wdt == "fp32" else "tf32"
    target = GPUTarget("cuda", 90, 32)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    sig = {"x_ptr": f"*{xdt}", "ids_ptr": f"*{idt}", "gate_ptr": f"*{wdt}", "up_ptr": f"*{wdt}", "h_ptr": f"*{wdt}",
           "y_ptr": "*fp32", "T": "i32", "K": "i32"}  # fmt: skip
    consts = dict(H=hidden, I=inter, ZERO_COLS=zero_cols, ACT=act, ALPHA=1.702, LIMIT=7.0, PRECISION=precision,
                  BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_I=cfg.block_i, BLOCK_H=cfg.block_h)  # fmt: skip
    sig.update({k: "constexpr" for k in consts})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    gate_up = triton.compile(ASTSource(tm._gate_up_kernel, sig, consts, aligned), target=target, options=options)
    sig = {"h_ptr": f"*{wdt}", "ids_ptr": f"*{idt}", "w_ptr": f"*{rwdt}", "down_ptr": f"*{wdt}", "y_ptr": "*fp32",
           "T": "i32", "K": "i32"}  # fmt: skip
    consts = dict(H=hidden, I=inter, PRECISION=precision, BLOCK_T=block_t, BLOCK_K=block_k,
                  BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r)  # fmt: skip
    sig.update({k: "constexpr" for k in consts})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    down = triton.compile(ASTSource(tm._down_kernel, sig, consts, aligned), target=target, options=options)
    return gate_up, down


def describe(kernel: Any) -> dict[str, Any]:
    ptx = kernel.asm["ptx"]
    return {
        "cubin": bool(kernel.asm.get("cubin")),
        "mma_bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx or "wgmma.mma_async" in ptx,
        "mma_any": "mma.sync" in ptx or "wgmma.mma_async" in ptx,
        "cp_async": "cp.async" in ptx,
        "atomic_add": "atom.global.gpu.relaxed.add" in ptx,
        "shared_bytes": kernel.metadata.shared,
    }


def main() -> int:
    if triton.knobs.runtime.interpret:
        print("TRITON_INTERPRET is set: nothing to compile", file=sys.stderr)
        return 2
    report = {}
    for name, spec in VARIANTS.items():
        gate_up, down = compile_pair(**spec)
        report[name] = {"gate_up": describe(gate_up), "down": describe(down)}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
