"""Expert weights as the checkpoint stores them, described for the native kernels.

:class:`Weights` is one weight matrix per expert, stacked over experts, read in
place (numpy, torch CPU tensor, or a view of an mmap'ed model file): it keeps a
reference to the buffer and never copies or frees it. :class:`ExpertBank` groups
gate/up/down of one MoE layer and owns the ``ft_expert_bank`` struct (see
``freetoken/handoff.h``) that hand-off task descriptors point to.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Optional

from freetoken import handoff

from freetoken_cpu_moe import _core
from freetoken_cpu_moe.arrays import raw_buffer
from freetoken_cpu_moe.formats import FP8_SCALE_BLOCK, format_info

ACTIVATIONS = {
    "silu": int(handoff.Act.SILU),
    "gelu_tanh": int(handoff.Act.GELU_TANH),
    "swiglu_oai": int(handoff.Act.SWIGLU_OAI),
}


class Weights:
    """One weight matrix per expert, logical shape ``[num_experts][rows][cols]``.

    ``y = W @ x`` with ``x`` of ``cols`` elements. ``data`` holds the raw bytes in
    the checkpoint's layout (row-major floats, or GGUF blocks: each row is
    ``cols / block_elems`` blocks). ``fp8_e4m3_b128`` also takes ``scale``: float32
    ``[E][ceil(rows/128)][ceil(cols/128)]`` (weight = fp8 * scale).
    """

    def __init__(
        self,
        data: Any,
        fmt: "str | int",
        num_experts: int,
        rows: int,
        cols: int,
        scale: Optional[Any] = None,
    ) -> None:
        info = format_info(fmt)
        if num_experts < 1 or rows < 1 or cols < 1:
            raise ValueError(f"Weights: bad shape [{num_experts}][{rows}][{cols}]")
        if cols % info.block_elems:
            raise ValueError(
                f"Weights: cols={cols} is not a multiple of the {info.name} block size {info.block_elems}"
            )
        buf = raw_buffer(data, f"Weights({info.name}) data")
        row_bytes = info.row_bytes(cols)
        expected = num_experts * rows * row_bytes
        if buf.nbytes != expected:
            raise ValueError(
                f"Weights({info.name}): data has {buf.nbytes} bytes, but [{num_experts}][{rows}][{cols}] "
                f"in {info.name} needs {expected} ({row_bytes} bytes per row)"
            )
        self.fmt: str = info.name
        self.format_id: int = info.fmt_id
        self.num_experts = int(num_experts)
        self.rows = int(rows)
        self.cols = int(cols)
        self.nbytes = expected
        self._data = buf.obj  # keeps the caller's buffer alive
        self._scale: Any = None
        scale_addr = 0
        scale_stride = 0
        if info.name == "fp8_e4m3_b128":
            if scale is None:
                raise ValueError("Weights(fp8_e4m3_b128): the float32 block scales (weight_scale_inv) are required")
            if "float32" not in str(scale.dtype):
                raise ValueError(f"Weights(fp8_e4m3_b128): scale must be float32, got {scale.dtype}")
            sbuf = raw_buffer(scale, "Weights(fp8_e4m3_b128) scale")
            srows, scols = math.ceil(rows / FP8_SCALE_BLOCK), math.ceil(cols / FP8_SCALE_BLOCK)
            want = num_experts * srows * scols * 4
            if sbuf.nbytes != want:
                raise ValueError(
                    f"Weights(fp8_e4m3_b128): scale has {sbuf.nbytes} bytes, expected float32 "
                    f"[{num_experts}][{srows}][{scols}] ({want} bytes)"
                )
            self._scale = sbuf.obj
            scale_addr = sbuf.address
            scale_stride = srows * scols * 4
        elif scale is not None:
            raise ValueError(f"Weights({info.name}): scale is only used by fp8_e4m3_b128")

        self.desc = handoff.WeightDesc()
        self.desc.data = buf.address
        self.desc.scale = scale_addr
        self.desc.expert_stride = rows * row_bytes
        self.desc.row_stride = row_bytes
        self.desc.scale_expert_stride = scale_stride
        self.desc.format = info.fmt_id
        self.desc.num_experts = num_experts
        self.desc.rows = rows
        self.desc.cols = cols

    @property
    def address(self) -> int:
        """Address of this object's ``ft_weight_desc``."""
        return ctypes.addressof(self.desc)

    @property
    def data(self) -> Any:
        return self._data

    @property
    def scale(self) -> Any:
        return self._scale

    def __repr__(self) -> str:
        return f"Weights({self.fmt}, [{self.num_experts}][{self.rows}][{self.cols}], {self.nbytes} bytes)"


class ExpertBank:
    """The routed experts of one MoE layer: gate/up ``[E][I][H]``, down ``[E][H][I]``.

    ``activation``: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` (GeGLU, tanh approximation)
    or ``"swiglu_oai"`` (GPT-OSS: ``gate = min(gate, limit)``, ``up = clamp(up,
    -limit, limit)``, ``out = (up + 1) * gate * sigmoid(alpha * gate)``).
    """

    def __init__(
        self,
        gate: Weights,
        up: Weights,
        down: Weights,
        activation: str = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> None:
        for name, wt in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(wt, Weights):
                raise TypeError(f"ExpertBank: {name} must be a Weights, got {type(wt).__name__}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"ExpertBank: unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
        E, I, H = gate.num_experts, gate.rows, gate.cols
        if (up.num_experts, up.rows, up.cols) != (E, I, H):
            raise ValueError(f"ExpertBank: up is [{up.num_experts}][{up.rows}][{up.cols}], gate is [{E}][{I}][{H}]")
        if (down.num_experts, down.rows, down.cols) != (E, H, I):
            raise ValueError(
                f"ExpertBank: down is [{down.num_experts}][{down.rows}][{down.cols}], expected [{E}][{H}][{I}]"
            )
        self.gate, self.up, self.down = gate, up, down
        self.activation = activation
        self.alpha = float(alpha)
        self.limit = float(limit)
        self.num_experts, self.hidden, self.intermediate = E, H, I
        self._struct = handoff.ExpertBank()
        self._struct.gate = gate.desc
        self._struct.up = up.desc
        self._struct.down = down.desc
        self._struct.num_experts = E
        self._struct.hidden = H
        self._struct.intermediate = I
        self._struct.activation = ACTIVATIONS[activation]
        self._struct.act_alpha = self.alpha
        self._struct.act_limit = self.limit
        _core.validate_bank(self.address)

    @property
    def address(self) -> int:
        """Address of the ``ft_expert_bank`` this object owns (for ``ft_task_desc.bank``)."""
        return ctypes.addressof(self._struct)

    @property
    def nbytes(self) -> int:
        """Bytes of expert weights (all experts, gate + up + down)."""
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    def expert_nbytes(self) -> int:
        """Bytes of weights one expert reads (gate + up + down)."""
        return self.nbytes // self.num_experts

    def __repr__(self) -> str:
        return (
            f"ExpertBank(E={self.num_experts}, H={self.hidden}, I={self.intermediate}, "
            f"{self.gate.fmt}/{self.up.fmt}/{self.down.fmt}, {self.activation})"
        )
