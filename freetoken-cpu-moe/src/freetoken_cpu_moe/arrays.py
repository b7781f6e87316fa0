"""Raw views of numpy arrays and torch CPU tensors: address, size, dtype.

The native code only sees addresses; this module is where Python objects are
checked (CPU, contiguous, dtype) and where outputs of the caller's kind are made.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from freetoken.handoff import Fmt

ACT_FMT_NAMES = {int(Fmt.F32): "float32", int(Fmt.F16): "float16", int(Fmt.BF16): "bfloat16"}
_NAME_TO_FMT = {v: k for k, v in ACT_FMT_NAMES.items()}


def is_torch(obj: Any) -> bool:
    return "torch" in sys.modules and isinstance(obj, sys.modules["torch"].Tensor)


@dataclasses.dataclass
class RawBuffer:
    """A contiguous host buffer: the object that owns it, its address and size."""

    obj: Any
    address: int
    nbytes: int


def raw_buffer(data: Any, what: str) -> RawBuffer:
    """Address and size of a contiguous CPU buffer (numpy, torch, or buffer protocol)."""
    if is_torch(data):
        if data.device.type != "cpu":
            raise ValueError(f"{what}: expected a CPU tensor, got one on {data.device}")
        if not data.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous (call .contiguous() once at load time)")
        return RawBuffer(data, int(data.data_ptr()), int(data.numel() * data.element_size()))
    if not isinstance(data, np.ndarray):
        try:
            data = np.frombuffer(data, dtype=np.uint8)
        except TypeError:
            raise ValueError(
                f"{what}: expected a numpy array, a torch CPU tensor or a buffer, got {type(data).__name__}"
            ) from None
    if not data.flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous")
    return RawBuffer(data, int(data.__array_interface__["data"][0]), int(data.nbytes))


def act_fmt_of(x: Any, what: str) -> int:
    """FT_FMT_* id of an activation array's dtype (float32, float16, bfloat16)."""
    name = str(x.dtype).replace("torch.", "")
    if name in _NAME_TO_FMT:
        return _NAME_TO_FMT[name]
    raise ValueError(f"{what}: dtype {x.dtype} not supported; use float32, float16 or bfloat16")


def out_fmt(out_dtype: Any, x_fmt: int) -> int:
    """FT_FMT_* id for an out_dtype argument (None = same as x)."""
    if out_dtype is None:
        return x_fmt
    name = out_dtype if isinstance(out_dtype, str) else str(getattr(out_dtype, "name", None) or out_dtype)
    name = name.replace("torch.", "")
    if name in _NAME_TO_FMT:
        return _NAME_TO_FMT[name]
    raise ValueError(f"out_dtype {out_dtype!r} not supported; use 'float32', 'float16', 'bfloat16' or a torch dtype")


def as_activation(x: Any, what: str, ndim: int = 2) -> Any:
    """A contiguous activation array of a supported dtype (numpy or torch CPU)."""
    if is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(f"{what}: expected a CPU tensor, got one on {x.device}")
        x = x.contiguous()
    elif isinstance(x, np.ndarray):
        x = np.ascontiguousarray(x)
    else:
        raise ValueError(f"{what}: expected a numpy array or a torch CPU tensor, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    act_fmt_of(x, what)
    return x


def as_int32(a: Any, what: str) -> np.ndarray:
    arr = a.detach().cpu().numpy() if is_torch(a) else np.asarray(a)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: expected an integer array, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int32)


def as_float32(a: Any, what: str) -> np.ndarray:
    if is_torch(a):
        a = a.detach().cpu().float().numpy()
    arr = np.asarray(a)
    if arr.dtype.kind != "f":
        raise ValueError(f"{what}: expected a float array, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def empty_like_kind(x: Any, shape: tuple[int, ...], fmt: int) -> Any:
    """An uninitialised output of x's kind (torch in -> torch out) and dtype fmt."""
    name = ACT_FMT_NAMES[fmt]
    if is_torch(x):
        import torch

        return torch.empty(shape, dtype=getattr(torch, name))
    if name == "bfloat16":
        raise ValueError("numpy has no bfloat16: pass torch tensors or use out_dtype='float32'")
    return np.empty(shape, dtype=name)


def address_of(a: Any) -> int:
    return int(a.data_ptr()) if is_torch(a) else int(a.__array_interface__["data"][0])

