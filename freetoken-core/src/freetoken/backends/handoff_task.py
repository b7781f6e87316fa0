"""Hand-off tasks: the stable host buffers and flag slot of one (layer, batch-size slot).

A task's C layout (the flag slot and the task descriptor the CPU coordinator reads)
lives in ``include/freetoken/handoff.h``, mirrored by :mod:`freetoken.handoff`. Every
:class:`~freetoken.backends.contract.Staging` allocates tasks through
:func:`allocate_task`, which carves the buffers out of memory that Staging provides.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import TYPE_CHECKING, Any

from freetoken import handoff

if TYPE_CHECKING:
    from freetoken.backends.contract import Staging

_ALIGN = 128


@dataclasses.dataclass
class HostBuffer:
    """Host memory that a backend allocated (pinned, and mapped when asked).

    ``tensor`` is a CPU torch view of the memory (uint8, ``nbytes`` long) and keeps
    it alive; ``device_ptr`` is the address the GPU uses (mapped memory) or 0.
    ``owner`` is whatever object frees the memory when garbage-collected.
    """

    tensor: Any
    host_ptr: int
    device_ptr: int
    nbytes: int
    mapped: bool
    owner: Any = None


@dataclasses.dataclass
class HandoffTask:
    """One (layer, batch-size slot) hand-off with stable buffers.

    All buffers are host tensors allocated through :class:`Staging` and live as long
    as the task; graphs captured over the task keep using the same addresses on
    every replay. ``desc`` is the ``ft_task_desc`` the CPU coordinator reads;
    ``flags`` the ``ft_flag_slot``. ``device_ptrs`` maps buffer names ("x", "ids",
    "w", "y", "flags") to the GPU-visible address of mapped memory (empty when the
    backend has no mapped memory).
    """

    layer: int
    slot: int
    max_tokens: int
    top_k: int
    hidden: int
    act_dtype: Any  # torch.dtype of x
    out_dtype: Any  # torch.dtype of y
    x: Any
    ids: Any
    w: Any
    y: Any
    flag_buffer: HostBuffer
    desc_buffer: HostBuffer
    device_ptrs: dict[str, int] = dataclasses.field(default_factory=dict)
    keepalive: list[Any] = dataclasses.field(default_factory=list)

    @property
    def flags(self) -> handoff.FlagSlot:
        return handoff.FlagSlot.from_address(self.flag_buffer.host_ptr)

    @property
    def desc(self) -> handoff.TaskDesc:
        return handoff.TaskDesc.from_address(self.desc_buffer.host_ptr)

    @property
    def flag_addr(self) -> int:
        return self.flag_buffer.host_ptr

    def check_error(self) -> None:
        """Raise if the CPU side reported an error on this slot (and clear it)."""
        err = self.flags.err
        if err:
            self.flags.err = 0
            try:
                what = handoff.Err(err).name
            except ValueError:
                what = f"code {err}"
            raise HandoffError(
                f"CPU side of MoE hand-off failed for layer {self.layer} slot {self.slot}: {what}"
            )


class HandoffError(RuntimeError):
    """The CPU side of a hand-off reported an error (watchdog, bad task, exception)."""


def _dtype_fmt(dtype: Any) -> int:
    import torch

    table = {torch.float32: handoff.Fmt.F32, torch.float16: handoff.Fmt.F16, torch.bfloat16: handoff.Fmt.BF16}
    try:
        return int(table[dtype])
    except KeyError:
        raise ValueError(f"unsupported activation dtype {dtype}; use float32, float16 or bfloat16") from None


def _round_up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def allocate_task(
    staging: "Staging",
    layer: int,
    slot: int,
    max_tokens: int,
    top_k: int,
    hidden: int,
    act_dtype: Any,
    out_dtype: Any,
    bank_addr: int = 0,
    mapped: bool = True,
) -> HandoffTask:
    """Carve x/ids/w/y, the flag slot and the descriptor out of host buffers.

    x/ids/w/y share one buffer (one registration, one mapping); the flag slot and
    the descriptor get their own so that a flag slot never shares a cache line with
    data the GPU streams into.
    """
    import torch

    if max_tokens < 1 or top_k < 1 or hidden < 1:
        raise ValueError(f"bad task shape: max_tokens={max_tokens} top_k={top_k} hidden={hidden}")
    act_size = torch.empty((), dtype=act_dtype).element_size()
    out_size = torch.empty((), dtype=out_dtype).element_size()
    sizes = {
        "x": _round_up(max_tokens * hidden * act_size),
        "ids": _round_up(max_tokens * top_k * 4),
        "w": _round_up(max_tokens * top_k * 4),
        "y": _round_up(max_tokens * hidden * out_size),
    }
    data = staging.alloc_host(sum(sizes.values()), mapped=mapped)
    flags = staging.alloc_host(_round_up(ctypes.sizeof(handoff.FlagSlot)), mapped=mapped)
    descb = staging.alloc_host(_round_up(ctypes.sizeof(handoff.TaskDesc)), mapped=False)

    offs: dict[str, int] = {}
    off = 0
    for name, n in sizes.items():
        offs[name] = off
        off += n
    raw = data.tensor
    x = raw[offs["x"] : offs["x"] + max_tokens * hidden * act_size].view(act_dtype).view(max_tokens, hidden)
    ids = raw[offs["ids"] : offs["ids"] + max_tokens * top_k * 4].view(torch.int32).view(max_tokens, top_k)
    w = raw[offs["w"] : offs["w"] + max_tokens * top_k * 4].view(torch.float32).view(max_tokens, top_k)
    y = raw[offs["y"] : offs["y"] + max_tokens * hidden * out_size].view(out_dtype).view(max_tokens, hidden)
    ctypes.memset(flags.host_ptr, 0, ctypes.sizeof(handoff.FlagSlot))
    ids.fill_(-1)

    device_ptrs: dict[str, int] = {}
    if data.mapped and data.device_ptr:
        device_ptrs = {k: data.device_ptr + offs[k] for k in sizes}
    if flags.mapped and flags.device_ptr:
        device_ptrs["flags"] = flags.device_ptr

    desc = handoff.TaskDesc.from_address(descb.host_ptr)
    ctypes.memset(descb.host_ptr, 0, ctypes.sizeof(handoff.TaskDesc))
    desc.abi_version = handoff.ABI_VERSION
    desc.layer = layer
    desc.slot = slot
    desc.max_tokens = max_tokens
    desc.num_tokens = max_tokens
    desc.top_k = top_k
    desc.hidden = hidden
    desc.act_dtype = _dtype_fmt(act_dtype)
    desc.out_dtype = _dtype_fmt(out_dtype)
    desc.x = data.host_ptr + offs["x"]
    desc.ids = data.host_ptr + offs["ids"]
    desc.w = data.host_ptr + offs["w"]
    desc.y = data.host_ptr + offs["y"]
    desc.flag_slot = flags.host_ptr
    desc.bank = bank_addr

    return HandoffTask(
        layer=layer,
        slot=slot,
        max_tokens=max_tokens,
        top_k=top_k,
        hidden=hidden,
        act_dtype=act_dtype,
        out_dtype=out_dtype,
        x=x,
        ids=ids,
        w=w,
        y=y,
        flag_buffer=flags,
        desc_buffer=descb,
        device_ptrs=device_ptrs,
        keepalive=[data],
    )
