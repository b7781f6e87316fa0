"""The activation rounding of the int8 dots, as hooks of the float64 model forward
(tests/gpu/qwen3_reference.py), for engines whose packed kernels run them.

The rules written out here, independent of the kernels' code: the per-route expert kernels
round a layer's gate/up input per 32 values when gate and up are both Q4_K, and its down
input ``h`` (float32 first) when down is Q4_K or Q6_K: per 16 values when the gate/up kernel
quantizes it (``int8_h``), else per 32. The native expert kernels (``packed_moe``, layers whose
three stacks are Q4_K, Q6_K or Q8_0, gate and up both Q8_0 or both K-quants) round every
gate/up input and ``h`` per 32. The packed dense GEMV rounds the input of a Q4_K or Q6_K
projection per 32 values when it multiplies one token (the native GEMV: of a Q8_0 one too); a
batch of several keeps the float products. For one request, the prompt's projections are one batch and every later
position is one token, as is every row of the output head."""

from __future__ import annotations

from typing import Callable

import qwen3_reference
import torch
from expert_reference import int8_groups

from freetoken.handoff import Fmt

Hook = Callable[[int, str, torch.Tensor], torch.Tensor]
INT8 = (Fmt.Q4_K, Fmt.Q6_K)
#: what the native kernels multiply as int8
NATIVE = (Fmt.Q4_K, Fmt.Q6_K, Fmt.Q8_0)


def native_serves(layer: dict[str, Fmt]) -> bool:
    """Whether the native expert kernels take a layer of these expert formats."""
    gate, up, down = (layer[f"ffn_{n}_exps"] for n in ("gate", "up", "down"))
    return all(f in NATIVE for f in (gate, up, down)) and (gate == Fmt.Q8_0) == (up == Fmt.Q8_0)


def expert_hook(mix: list[dict[str, Fmt]], int8_h: bool, cpu_layers: frozenset[int] = frozenset(),
                cpu_rounding: Callable[[torch.Tensor, Fmt], torch.Tensor] | None = None,
                native: bool = False) -> Hook:  # fmt: skip
    """``expert_input``: the GPU layers' expert inputs rounded as the int8 dots do (``native``:
    as the native expert kernels do where they serve the layer; and those of ``cpu_layers`` by
    ``cpu_rounding``, the CPU kernels' scheme, given the matrix's format)."""

    def pre(layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        fmt = mix[layer][f"ffn_{name}_exps"]
        if layer in cpu_layers:
            assert cpu_rounding is not None
            return cpu_rounding(x.float(), fmt).double()
        if native and native_serves(mix[layer]):
            return int8_groups(x, 32)
        if name in ("gate", "up"):
            pair = mix[layer]["ffn_gate_exps"] == mix[layer]["ffn_up_exps"] == Fmt.Q4_K
            return int8_groups(x, 32) if pair else x
        return int8_groups(x, 16 if int8_h else 32) if fmt in INT8 else x

    return pre


def dense_hook(mix: list[dict[str, Fmt]], output_fmt: Fmt, prompt_len: int, native: bool = False) -> Hook:
    """``linear_input`` of one request whose prompt of ``prompt_len`` tokens ran as one batch:
    Q4_K/Q6_K projections' inputs (``native``, the native GEMV: Q8_0 ones too) rounded at the
    later positions, the head's at every row."""
    rounded = NATIVE if native else INT8

    def pre(layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        fmt = output_fmt if layer < 0 else mix[layer][name]
        if fmt not in rounded:
            return x
        first = 0 if layer < 0 else prompt_len
        return torch.cat([x[:first], int8_groups(x[first:], 32)])

    return pre


def position_errors(tg, tensors: dict[str, torch.Tensor], ids: list[int], prompt_len: int, logits: torch.Tensor,
                    expert_input: Hook | None, linear_input: Hook | None = None) -> list[float]:  # fmt: skip
    """Each generated position's largest logit difference from the float64 forward of the tiny
    K-quant file (``tg``: tests/engine/test_engine_gguf.py) over ``ids`` with these hooks, in
    units of the reference logits' scale (their largest magnitude over those positions)."""
    want = qwen3_reference.logits(tensors, ids, tg.LAYERS, tg.HEADS, tg.KVH, tg.HD, tg.K, theta=1e6,
                                  expert_input=expert_input, linear_input=linear_input)[prompt_len - 1 : len(ids) - 1]
    return ((logits - want.float()).abs().amax(-1) / want.abs().max()).tolist()
