"""Compile the paged decode attention's partial kernels for sm_90 without a GPU and print each
variant's registers and local-memory stack per thread (JSON on the last line).

Every preset's attention shape (query and kv heads, head sizes, MLA's shared latent, GPT-OSS's
window and sinks, and the head sizes 24, 80, 96 and 192/128), in bfloat16 and float32, split
into partitions and not, with the tiles :func:`freetoken.kernels.decode_attention.config_for`
gives an H100 (its 227 KiB of shared memory a program) at batches 1, 2, 8 and 32. The stack
comes from the cubin (``cuobjdump -res-usage`` of the Triton installation's CUDA tools).

Run as a script in a process where TRITON_INTERPRET is unset:
``python tests/gpu/attention_sm90_spills.py``. Used by test_decode_attention.py.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import triton
from triton.compiler import ASTSource

from freetoken.kernels import decode_attention as da
from packed_sm90_spills import TARGET, cannot_compile, resources

H100_SHARED = 227 * 1024
BLOCK_SIZE, MAX_BLOCKS = 16, 2048  # the engine's KV blocks; block tables of 32k tokens
#: (name, query heads, kv heads, head size, value size, window, sinks, one latent for K and V)
SHAPES = [
    ("qwen3-30b", 32, 4, 128, 128, None, False, False),
    ("qwen3-235b", 64, 4, 128, 128, None, False, False),
    ("gpt-oss-sliding", 64, 8, 64, 64, 128, True, False),
    ("gpt-oss-full", 64, 8, 64, 64, None, True, False),
    ("glm-4.5-air", 96, 8, 128, 128, None, False, False),
    ("deepseek-mla", 128, 1, 576, 512, None, False, True),
    ("qwen3.5-full", 16, 2, 256, 256, None, False, False),
    ("hd24", 32, 4, 24, 24, None, False, False),
    ("hd80", 32, 4, 80, 80, None, False, False),
    ("hd192-128", 64, 8, 192, 128, None, False, False),
]


def compile_variant(dtype: str, elem_bytes: int, precision: str, shape: tuple[Any, ...], config: Any,
                    split: bool) -> dict[str, int]:  # fmt: skip
    _, hq, hkv, d, dv, window, sinks, shared = shape
    c = da.kernel_constants(hq // hkv, d, dv, BLOCK_SIZE, split, precision, config, shared)
    extended = window is not None or sinks
    if extended:
        c.update(WINDOW=int(window or 0), HAS_SINKS=sinks)
    fn = da._partial_window_sinks_kernel if extended else da._partial_kernel
    vstride = d if shared else dv
    ints = dict(stride_qb=hq * d, stride_qh=d, stride_kb=BLOCK_SIZE * hkv * d, stride_kt=hkv * d, stride_kh=d,
                stride_vb=BLOCK_SIZE * hkv * vstride, stride_vt=hkv * vstride, stride_vh=vstride,
                stride_btb=MAX_BLOCKS, stride_ob=hq * dv)  # fmt: skip
    types = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "bt_ptr": "*i32", "ctx_ptr": "*i32",
             "out_ptr": f"*{dtype}", "acc_ptr": "*fp32" if split else f"*{dtype}",
             "ml_ptr": "*fp32" if split else f"*{dtype}", "count_ptr": "*i32" if c["LAST_REDUCES"] else f"*{dtype}",
             "scale_log2": "fp32", "P": "i32", "max_tokens": "i32", "sink_ptr": "*fp32" if sinks else f"*{dtype}",
             **{k: "i32" for k in ints}}  # fmt: skip
    sig: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[Any]] = {}
    for i, (name, p) in enumerate(zip(fn.arg_names, fn.params)):
        if p.is_constexpr:
            sig[name] = "constexpr"
        else:
            sig[name] = types[name]
            if types[name].startswith("*") or (name in ints and ints[name] % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, c, attrs), target=TARGET,
                            options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return resources(kernel)


def main() -> int:
    status = cannot_compile()
    if status:
        return status
    report = {}
    for dtype, elem_bytes, precision in (("bf16", 2, "tf32"), ("fp32", 4, "ieee")):
        for shape in SHAPES:
            batches: dict[Any, list[int]] = {}
            for batch in (1, 2, 8, 32):
                batches.setdefault(da.config_for(batch, shape[3], shape[4], elem_bytes, H100_SHARED, shape[7]),
                                   []).append(batch)  # fmt: skip
            for config, which in batches.items():
                for split in (True, False):
                    name = f"{dtype} {shape[0]} batches {which} split={int(split)} block_n={config.block_n} " \
                           f"warps={config.num_warps} stages={config.num_stages}"
                    report[name] = compile_variant(dtype, elem_bytes, precision, shape, config, split)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
