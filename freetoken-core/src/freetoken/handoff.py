"""Python mirror of ``include/freetoken/handoff.h``: the shared hand-off layouts.

Every layout that crosses between the native packages is defined in the C header
and mirrored here exactly once, as :mod:`ctypes` structures. A test compiles the
header and checks every size and field offset against these classes, so the two
cannot drift apart silently.
"""

from __future__ import annotations

import ctypes
import enum

ABI_VERSION = 1


class Fmt(enum.IntEnum):
    """Element and weight formats (``FT_FMT_*``); GGUF ids kept as ggml's."""

    F32 = 0
    F16 = 1
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30
    MXFP4 = 39
    FP8_E4M3_B128 = 100
    I32 = 200


class Act(enum.IntEnum):
    """Expert activations (``FT_ACT_*``)."""

    SILU = 0
    GELU_TANH = 1
    SWIGLU_OAI = 2


class Err(enum.IntEnum):
    """Values of a flag slot's ``err`` field (``FT_ERR_*``)."""

    NONE = 0
    WATCHDOG = 1
    BAD_TASK = 2
    CPU_EXCEPTION = 3


TASK_ACCUMULATE = 1


class FlagSlot(ctypes.Structure):
    """``ft_flag_slot``: ready/done/err/seq on one 64-byte cache line."""

    _fields_ = [
        ("ready", ctypes.c_uint64),
        ("done", ctypes.c_uint64),
        ("err", ctypes.c_uint64),
        ("seq", ctypes.c_uint64),
        ("gpu_ready_ns", ctypes.c_uint64),  # diagnostic GPU clock stamps (KernelIO)
        ("gpu_done_seen_ns", ctypes.c_uint64),
        ("gpu_y_read_ns", ctypes.c_uint64),
        ("gpu_publish_start_ns", ctypes.c_uint64),
    ]


class WeightDesc(ctypes.Structure):
    """``ft_weight_desc``: one stacked per-expert weight matrix."""

    _fields_ = [
        ("data", ctypes.c_uint64),
        ("scale", ctypes.c_uint64),
        ("expert_stride", ctypes.c_uint64),
        ("row_stride", ctypes.c_uint64),
        ("scale_expert_stride", ctypes.c_uint64),
        ("format", ctypes.c_uint32),
        ("num_experts", ctypes.c_uint32),
        ("rows", ctypes.c_uint32),
        ("cols", ctypes.c_uint32),
        ("pad", ctypes.c_uint32 * 2),
    ]


class ExpertBank(ctypes.Structure):
    """``ft_expert_bank``: the routed experts of one MoE layer."""

    _fields_ = [
        ("gate", WeightDesc),
        ("up", WeightDesc),
        ("down", WeightDesc),
        ("num_experts", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("intermediate", ctypes.c_uint32),
        ("activation", ctypes.c_uint32),
        ("act_alpha", ctypes.c_float),
        ("act_limit", ctypes.c_float),
        ("pad", ctypes.c_uint32 * 10),
    ]


class TaskDesc(ctypes.Structure):
    """``ft_task_desc``: one (layer, batch-size slot) task with stable buffers."""

    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("layer", ctypes.c_uint32),
        ("slot", ctypes.c_uint32),
        ("max_tokens", ctypes.c_uint32),
        ("num_tokens", ctypes.c_uint32),
        ("top_k", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("act_dtype", ctypes.c_uint32),
        ("out_dtype", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("x", ctypes.c_uint64),
        ("ids", ctypes.c_uint64),
        ("w", ctypes.c_uint64),
        ("y", ctypes.c_uint64),
        ("flag_slot", ctypes.c_uint64),
        ("bank", ctypes.c_uint64),
        ("pad", ctypes.c_uint64 * 5),
    ]


#: Sizes the header's static_asserts also pin.
LAYOUT_SIZES = {
    "ft_flag_slot": 64,
    "ft_weight_desc": 64,
    "ft_expert_bank": 256,
    "ft_task_desc": 128,
}

#: C struct name -> Python mirror, for the layout test.
MIRRORS: dict[str, type[ctypes.Structure]] = {
    "ft_flag_slot": FlagSlot,
    "ft_weight_desc": WeightDesc,
    "ft_expert_bank": ExpertBank,
    "ft_task_desc": TaskDesc,
}
