"""Compile every Triton kernel of the engine for AMD GPU targets without a GPU and print
what the code objects hold (JSON, one line).

Triton's AMD backend carries its own LLVM (AMDGPU target, assembler, linker) and the ROCm
device libraries it links (ocml, ockl): nothing of ROCm needs to be installed. The launch
options and dot precision come from :func:`freetoken.backends.triton_target.hip_target`,
as the launches on an AMD GPU take them.

Run as a script in a process where TRITON_INTERPRET is unset (Triton decorates its own
standard library as interpreted or compiled when it is imported, so one process cannot do
both): ``python tests/core/backends/triton_hip_compile.py gfx942 gfx1100 [--only=moe.,attention.]``.
Used by test_triton_hip_target.py.
"""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Any, Callable

import triton
from triton.compiler import ASTSource

from freetoken.backends.triton_target import TritonTarget, hip_target
from freetoken.kernels import decode_attention as dat
from freetoken.kernels import dense_ops as dot
from freetoken.moe.experts import expert_gather as eg
from freetoken.kernels import moe_experts as tm
from freetoken.kernels import moe_grouped as tg
from freetoken.kernels import moe_packed as tp
from freetoken.kernels import route_slots as rs
from freetoken.moe.experts import route_split as rsp

# Qwen3-30B-A3B's expert shapes (hidden 2048, expert intermediate 768), top-8 routing
HIDDEN, INTER, TOP_K = 2048, 768, 8


def compile_kernel(fn: Any, target: TritonTarget, types: dict[str, str], consts: dict[str, Any],
                   num_warps: int, num_stages: int | None = None, **extra: Any) -> Any:  # fmt: skip
    """``fn`` for ``target``: runtime arguments typed by ``types`` (every other argument a
    constexpr of ``consts``), 16-byte aligned pointers, launched with ``target``'s options
    (and ``extra`` launch options)."""
    names = fn.arg_names
    missing = [n for n in names if n not in types and n not in consts]
    if missing:
        raise ValueError(f"{fn.__name__}: no type or constant for {missing}")
    sig = {n: types.get(n, "constexpr") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(fn, sig, {n: consts[n] for n in names if n not in types}, aligned)
    opts = target.launch_options(num_warps, num_stages, **extra)
    return triton.compile(src, target=target.compile_target(), options=opts)


def moe_kernels(target: TritonTarget) -> dict[str, Callable[[], Any]]:
    """The fused MoE kernels as :func:`moe_experts.launch` runs them (BF16 experts)."""
    cfg = tm.DEFAULT_CONFIG
    i_tiles = triton.cdiv(INTER, cfg.block_i)
    zero_cols = triton.cdiv(triton.cdiv(HIDDEN, i_tiles), cfg.block_h) * cfg.block_h
    prec = target.dot_precision(False)
    act = dict(ACT=0, ALPHA=1.702, LIMIT=7.0)
    x = {"x_ptr": "*bf16", "ids_ptr": "*i32", "gate_ptr": "*bf16", "up_ptr": "*bf16", "h_ptr": "*bf16"}
    d = {"h_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": "*fp32", "down_ptr": "*bf16", "y_ptr": "*fp32"}
    w, s = cfg.num_warps, cfg.num_stages
    return {
        "moe.gate_up": lambda: compile_kernel(
            tm._gate_up_kernel, target, {**x, "y_ptr": "*fp32", "T": "i32", "K": "i32"},
            dict(H=HIDDEN, I=INTER, ZERO_COLS=zero_cols, PRECISION=prec, BLOCK_T=16, BLOCK_K=TOP_K,
                 BLOCK_I=cfg.block_i, BLOCK_H=cfg.block_h, **act), w, s),
        "moe.down": lambda: compile_kernel(
            tm._down_kernel, target, {**d, "T": "i32", "K": "i32"},
            dict(H=HIDDEN, I=INTER, PRECISION=prec, BLOCK_T=16, BLOCK_K=TOP_K, BLOCK_N=cfg.block_n,
                 BLOCK_R=cfg.block_r), w, s),
        "moe.gate_up_routes": lambda: compile_kernel(
            tm._gate_up_routes_kernel, target, {**x, "T": "i32"},
            dict(K=TOP_K, H=HIDDEN, I=INTER, BLOCK_I=cfg.route_block_i, BLOCK_H=cfg.route_block_h, **act), w, s),
        "moe.down_routes": lambda: compile_kernel(
            tm._down_routes_kernel, target, {**d, "T": "i32"},
            dict(K=TOP_K, H=HIDDEN, I=INTER, BLOCK_N=cfg.route_block_n, BLOCK_R=cfg.route_block_r), w, s),
    }  # fmt: skip


def packed_kernels(target: TritonTarget) -> dict[str, Callable[[], Any]]:
    """The packed-expert kernels (also those of the expert cache and locked fetch) for each
    block format, as :func:`moe_packed.launch` runs them (int8 dots do not run on AMD:
    ``moe_packed.for_target``), and the dequantization."""
    cfg = tp.DEFAULT_CONFIG
    out: dict[str, Callable[[], Any]] = {}
    views = ("u8", "i8", "fp16")
    for fmt, name in tp.FORMAT_NAMES.items():
        per, nbytes, group = tp.FORMATS[fmt]
        rb_h, rb_i = HIDDEN // per * nbytes, INTER // per * nbytes
        gate_types = {f"{p}_{v}": f"*{t}" for p in ("g", "u") for v, t in zip(("u8", "i8", "f16"), views)}
        out[f"packed.gate_up.{name}"] = lambda fmt=fmt, rb=rb_h, g=group, gt=gate_types: compile_kernel(
            tp._gate_up_packed_kernel, target,
            {"x_ptr": "*bf16", "ids_ptr": "*i32", "table_ptr": "*i32", **gt, "h_ptr": "*fp32", "T": "i32"},
            dict(K=TOP_K, H=HIDDEN, I=INTER, GATE_FMT=fmt, GATE_RB=rb, GATE_G=g, UP_FMT=fmt, UP_RB=rb, UP_G=g,
                 ACT=0, ALPHA=1.702, LIMIT=7.0, BLOCK_I=cfg.block_i, BLOCK_H=cfg.block_h, SLOTS=True,
                 INT8=False, DP4A=False, H_INT8=False),
            cfg.num_warps, cfg.num_stages)  # fmt: skip
        down_types = {f"d_{v}": f"*{t}" for v, t in zip(("u8", "i8", "f16"), views)}
        out[f"packed.down.{name}"] = lambda fmt=fmt, rb=rb_i, g=group, dt=down_types: compile_kernel(
            tp._down_packed_kernel, target,
            {"h_ptr": "*fp32", "ids_ptr": "*i32", "table_ptr": "*i32", "w_ptr": "*fp32", **dt, "y_ptr": "*bf16",
             "T": "i32"},
            dict(K=TOP_K, H=HIDDEN, I=INTER, DOWN_FMT=fmt, DOWN_RB=rb, DOWN_G=g, BLOCK_N=cfg.block_n,
                 BLOCK_R=cfg.block_r, KP=TOP_K, ROUTES_TILE=cfg.down_routes_tile, SLOTS=True,
                 H_ONCE=cfg.down_h_once, INT8=False, DP4A=False, H_INT8=False),
            cfg.down_num_warps or cfg.num_warps, cfg.num_stages)  # fmt: skip
        out[f"packed.dequant_rows.{name}"] = lambda fmt=fmt, rb=rb_h, g=group: compile_kernel(
            tp.dequant_rows_kernel, target,
            {"u8": "*u8", "i8": "*i8", "f16": "*fp16", "out_ptr": "*bf16", "first_row": "i32", "ROWS": "i32"},
            dict(NCOLS=HIDDEN, FMT=fmt, RB=rb, G=g, BLOCK_R=16, BLOCK_C=256), 4)  # fmt: skip
    return out


def dense_kernels(target: TritonTarget) -> dict[str, Callable[[], Any]]:
    """The fused dense ops as :mod:`dense_kernels` launches them (BF16 activations)."""
    d, hq, hkv, experts = 128, 32, 4, 128
    return {
        "dense.add_rms_norm": lambda: compile_kernel(
            dot._add_rms_norm_kernel, target,
            {"h_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*bf16", "h_out_ptr": "*bf16", "x_out_ptr": "*bf16",
             "N": "i32", "eps": "fp32"}, dict(HAS_DELTA=True, BLOCK=HIDDEN), 8 if HIDDEN >= 2048 else 4),
        **{name: lambda hd=hd, vd=vd: compile_kernel(
            dot._qk_norm_rope_kernel, target,
            {"q_ptr": "*bf16", "q_stride": "i32", "k_ptr": "*bf16", "k_stride": "i32", "v_ptr": "*bf16",
             "v_stride": "i32", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
             "pos_ptr": "*i64", "slot_ptr": "*i64", "q_out_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16",
             "eps": "fp32"},
            dict(HQ=hq, HKV=hkv, D=hd, DV=vd, BLOCK_D=triton.next_power_of_2(hd), BLOCK_DV=triton.next_power_of_2(vd)),
            1 if max(hd, vd) <= 128 else 2)
           # head sizes that are not a power of two: tiles padded and masked
           for name, hd, vd in (("dense.qk_norm_rope", d, d), ("dense.qk_norm_rope.d24", 24, 24),
                                ("dense.qk_norm_rope.d192v128", 192, 128))},
        "dense.router_top_k": lambda: compile_kernel(
            dot._router_top_k_kernel, target, {"logits_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": "*fp32", "E": "i32"},
            dict(K=TOP_K, KP=TOP_K, NORM=True, BLOCK=experts), 1 if experts <= 256 else 4),
        "dense.bias_rope": lambda: compile_kernel(
            dot._bias_rope_kernel, target,
            {"q_ptr": "*bf16", "q_stride": "i32", "k_ptr": "*bf16", "k_stride": "i32", "v_ptr": "*bf16",
             "v_stride": "i32", "qb_ptr": "*fp32", "kb_ptr": "*fp32", "vb_ptr": "*fp32", "cos_ptr": "*fp32",
             "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "q_out_ptr": "*bf16", "kc_ptr": "*bf16",
             "vc_ptr": "*bf16"},
            dict(HQ=hq, HKV=hkv, D=64, DV=64, BLOCK_D=64, BLOCK_DV=64, HAS_BIAS=True), 1),
        "dense.moe_bias_add": lambda: compile_kernel(
            dot._moe_bias_add_kernel, target,
            {"y_ptr": "*bf16", "y_stride": "i32", "ids_ptr": "*i32", "w_ptr": "*fp32", "bias_ptr": "*fp32",
             "out_ptr": "*bf16", "H": "i32"}, dict(K=4, BLOCK=1024), 4),
        "dense.add_norm_grouped_route": lambda: compile_kernel(
            dot._add_norm_grouped_route_kernel, target,
            {"h_ptr": "*bf16", "d_ptr": "*bf16", "nw_ptr": "*bf16", "rw_ptr": "*fp32", "h_out_ptr": "*bf16",
             "x_out_ptr": "*bf16", "logits_ptr": "*fp32", "count_ptr": "*i32", "cb_ptr": "*fp32", "ids_ptr": "*i32",
             "w_ptr": "*fp32", "N": "i32", "eps": "fp32", "scale": "fp32"},
            dict(E=256, GROUPS=8, PER=32, GP=8, PP=32, TOPK_GROUP=4, K=TOP_K, KP=TOP_K, SIGMOID=True, NORM=True,
                 BLOCK=HIDDEN, BLOCK_E=dot.ROUTE_BLOCK_E), 8 if HIDDEN >= 2048 else 4),
        "dense.router_logits": lambda: compile_kernel(
            dot._router_logits_kernel, target, {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32"},
            dict(H=HIDDEN, E=experts, BLOCK_E=dot.ROUTER_BLOCK_E, BLOCK_H=512), 4),
        "dense.add_norm_route": lambda: compile_kernel(
            dot._add_norm_route_kernel, target,
            {"h_ptr": "*bf16", "d_ptr": "*bf16", "nw_ptr": "*bf16", "rw_ptr": "*fp32", "rb_ptr": "*fp32",
             "h_out_ptr": "*bf16", "x_out_ptr": "*bf16", "logits_ptr": "*fp32", "count_ptr": "*i32", "ids_ptr": "*i32",
             "w_ptr": "*fp32", "N": "i32", "E": "i32", "eps": "fp32"},
            dict(K=TOP_K, KP=TOP_K, NORM=True, BLOCK=HIDDEN, BLOCK_E=dot.ROUTE_BLOCK_E, EP=experts, HAS_BIAS=False),
            8 if HIDDEN >= 2048 else 4),
    }  # fmt: skip


def attention_kernels(target: TritonTarget) -> dict[str, Callable[[], Any]]:
    """Decode attention's kernels as :func:`kernels.decode_attention.launch` runs them (BF16
    cache, 32 query heads over 4 KV heads of 128, blocks of 16 tokens)."""
    cfg = dat.DEFAULT_CONFIG
    g, d, bs = 8, 128, 16
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    ptrs.update({"bt_ptr": "*i32", "ctx_ptr": "*i32", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "count_ptr": "*i32"})
    ints = {n: "i32" for n in ("P", "max_tokens", "stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh",
                               "stride_vb", "stride_vt", "stride_vh", "stride_btb", "stride_ob")}  # fmt: skip
    partial = {**ptrs, **ints, "scale_log2": "fp32"}
    consts = dat.kernel_constants(g, d, d, bs, True, target.dot_precision(False), cfg)
    # a head size that is not a power of two (tiles of 128, masked) with a v head of its own
    d80 = dat.kernel_constants(g, 80, 48, bs, True, target.dot_precision(False), cfg)
    # MLA's latent queries with the up-projections absorbed: 128 heads over one latent of
    # 512 + 64 values whose first 512 are the value
    mla = dat.kernel_constants(128, 576, 512, bs, True, target.dot_precision(False), cfg, shared_kv=True)
    red = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "ctx_ptr": "*i32", "out_ptr": "*bf16", "P": "i32",
           "max_tokens": "i32", "stride_ob": "i32"}  # fmt: skip
    rconsts = dict(D=d, BLOCK_D=d, BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n, MIN_PART=cfg.min_part)
    return {
        "attention.partial": lambda: compile_kernel(dat._partial_kernel, target, partial, consts, cfg.num_warps,
                                                    cfg.num_stages),
        "attention.partial_window_sinks": lambda: compile_kernel(
            dat._partial_window_sinks_kernel, target, {**partial, "sink_ptr": "*fp32"},
            {**consts, "WINDOW": 128, "HAS_SINKS": True}, cfg.num_warps, cfg.num_stages),
        "attention.partial.d80v48": lambda: compile_kernel(dat._partial_kernel, target, partial, d80, cfg.num_warps,
                                                           cfg.num_stages),
        "attention.partial.mla": lambda: compile_kernel(dat._partial_kernel, target, partial, mla, cfg.num_warps,
                                                        cfg.num_stages),
        "attention.reduce": lambda: compile_kernel(dat._reduce_kernel, target, red, rconsts, 4),
        "attention.reduce_sinks": lambda: compile_kernel(dat._reduce_sinks_kernel, target,
                                                         {**red, "sink_ptr": "*fp32"}, rconsts, 4),
    }  # fmt: skip


def grouped_kernels(target: TritonTarget) -> dict[str, Callable[[], Any]]:
    """The prompt-sized kernels grouped by expert, as :func:`moe_grouped.launch` runs
    them: Q4_K gate/up with a Q6_K down (a Q4_K_M layer), and plain BF16 weights."""
    cfg = tg.DEFAULT_CONFIG
    blocks = dict(BLOCK_M=32, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    out: dict[str, Callable[[], Any]] = {}
    for name, (gfmt, dfmt) in {"Q4_K": (tp.FMT_Q4_K, tp.FMT_Q6_K), "BF16": (tg.PLAIN, tg.PLAIN)}.items():
        def rb(fmt: int, cols: int) -> int:
            return cols if fmt == tg.PLAIN else cols // tp.FORMATS[fmt][0] * tp.FORMATS[fmt][1]

        def grp(fmt: int) -> int:
            return 1 if fmt == tg.PLAIN else tp.FORMATS[fmt][2]

        def views(prefix: str, fmt: int) -> dict[str, str]:
            first = "*bf16" if fmt == tg.PLAIN else "*u8"
            return {f"{prefix}_u8": first, f"{prefix}_i8": "*bf16" if fmt == tg.PLAIN else "*i8",
                    f"{prefix}_f16": "*bf16" if fmt == tg.PLAIN else "*fp16"}

        route = {"routes_ptr": "*i32", "block_expert_ptr": "*i32"}
        out[f"grouped.gate_up.{name}"] = lambda f=gfmt: compile_kernel(
            tg._gate_up_grouped_kernel, target,
            {"x_ptr": "*bf16", **route, **views("g", f), **views("u", f), "h_ptr": "*bf16"},
            dict(K=TOP_K, H=HIDDEN, I=INTER, GATE_FMT=f, GATE_RB=rb(f, HIDDEN), GATE_G=grp(f), UP_FMT=f,
                 UP_RB=rb(f, HIDDEN), UP_G=grp(f), ACT=0, ALPHA=1.702, LIMIT=7.0, **blocks),
            cfg.num_warps, cfg.num_stages)  # fmt: skip
        out[f"grouped.down.{name}"] = lambda f=dfmt: compile_kernel(
            tg._down_grouped_kernel, target,
            {"h_ptr": "*bf16", **route, "w_ptr": "*fp32", **views("d", f), "y_ptr": "*fp32"},
            dict(H=HIDDEN, I=INTER, DOWN_FMT=f, DOWN_RB=rb(f, INTER), DOWN_G=grp(f), **blocks),
            cfg.num_warps, cfg.num_stages)  # fmt: skip
    return out


def traffic_kernels(target: TritonTarget) -> dict[str, Callable[[], Any]]:
    """The expert-traffic kernels: the routed experts' gather from mapped host banks (one
    Q4_K gate stack's expert bytes), the cache's route -> slot map and locked fetch's split
    of a step's routes (int64 ids; one token's block, one warp, and the largest)."""
    per = INTER * (HIDDEN // tp.FORMATS[tp.FMT_Q4_K][0]) * tp.FORMATS[tp.FMT_Q4_K][1]

    def route_split(routes: int) -> Any:
        block, warps = rsp.launch_shape(routes)
        return compile_kernel(
            rsp._route_split_kernel, target,
            {"ids_ptr": "*i64", "resident_ptr": "*i1", "cpu_ptr": "*i1", "locked_ptr": "*i1", "n": "i32",
             "fraction": "fp32", "max_fetch": "fp32"}, dict(BLOCK=block), warps, enable_fp_fusion=False)

    return {
        "traffic.gather": lambda: compile_kernel(
            eg._gather_kernel, target, {"src_ptr": "*u8", "dst_ptr": "*u8", "counts_ptr": "*i32"},
            dict(EXPERT_BYTES=per, CHUNK=eg.CHUNK_BYTES), 4, 1),
        "traffic.route_slots": lambda: compile_kernel(
            rs._route_slots_kernel, target, {"ids_ptr": "*i32", "table_ptr": "*i32", "out_ptr": "*i32", "n": "i32"},
            dict(BLOCK=rs.BLOCK), 4),
        "traffic.route_split": lambda: route_split(TOP_K),
        "traffic.route_split.max": lambda: route_split(rsp.MAX_ROUTES),
    }


def describe(kernel: Any) -> dict[str, Any]:
    asm = kernel.asm["amdgcn"]
    return {
        "hsaco_bytes": len(kernel.asm.get("hsaco") or b""),
        "mfma": "v_mfma_" in asm,
        "wmma": "v_wmma_" in asm,
        # a float32 atomic add: one instruction, or a compare-and-swap loop where the target has none
        "atomics": sorted(set(re.findall(r"\b(global_atomic_\w+)", asm))),
        "wavefront64": kernel.metadata.warp_size == 64,
        "num_warps": kernel.metadata.num_warps,
        "shared_bytes": kernel.metadata.shared,
    }


def tf32_accepted(target: TritonTarget) -> bool:
    """Whether the fused MoE gate/up kernel compiles with ``tf32`` dots (the NVIDIA launch's
    precision for 16-bit inputs) on ``target``."""
    cfg = tm.DEFAULT_CONFIG
    try:
        compile_kernel(
            tm._gate_up_kernel, target, {"x_ptr": "*bf16", "ids_ptr": "*i32", "gate_ptr": "*bf16", "up_ptr": "*bf16",
                                         "h_ptr": "*bf16", "y_ptr": "*fp32", "T": "i32", "K": "i32"},
            dict(H=256, I=64, ZERO_COLS=128, PRECISION="tf32", BLOCK_T=16, BLOCK_K=TOP_K, BLOCK_I=cfg.block_i,
                 BLOCK_H=cfg.block_h, ACT=0, ALPHA=1.702, LIMIT=7.0), cfg.num_warps, cfg.num_stages)  # fmt: skip
    except Exception:  # noqa: BLE001 - the frontend refuses the precision
        return False
    return True


def main(args: list[str]) -> int:
    """``args``: gfx targets, and optionally ``--only=PREFIX,PREFIX`` (kernel names to compile)."""
    if triton.knobs.runtime.interpret:
        print("TRITON_INTERPRET is set: nothing to compile", file=sys.stderr)
        return 2
    only = next((a.split("=", 1)[1].split(",") for a in args if a.startswith("--only=")), None)
    archs = [a for a in args if not a.startswith("--")] or ["gfx942", "gfx1100"]
    report: dict[str, Any] = {}
    for arch in archs:
        target = hip_target(arch)
        kernels = {**moe_kernels(target), **packed_kernels(target), **dense_kernels(target), **attention_kernels(target),
                   **grouped_kernels(target), **traffic_kernels(target)}
        if only is not None:
            kernels = {k: v for k, v in kernels.items() if any(k.startswith(p) for p in only)}
        per_arch: dict[str, Any] = {}
        for name, build in kernels.items():
            t0 = time.perf_counter()
            try:
                info = describe(build())
            except Exception as exc:  # noqa: BLE001 - reported per kernel, with the compiler's message
                info = {"error": f"{type(exc).__name__}: {str(exc)[-2000:]}"}
            info["seconds"] = round(time.perf_counter() - t0, 2)
            per_arch[name] = info
        report[arch] = {"usable": target.usable, "reason": target.reason, "tf32_accepted": tf32_accepted(target),
                        "kernels": per_arch}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
