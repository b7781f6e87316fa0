"""Per-request recurrent state of linear-attention layers, kept beside the paged KV cache.

A Gated DeltaNet layer carries, per sequence, the last ``kernel - 1`` inputs of its short
causal convolution and one ``[key dim, value dim]`` state matrix per value head. Unlike K/V,
this state is not per token: it is overwritten in place as the sequence advances, so a
sequence owns one *slot* of it from admission to finish, abort or preemption (a preempted
request is recomputed from its tokens, so its slot is released and a fresh one, zeroed,
is taken when it is admitted again).

:class:`RecurrentStatePool` holds ``num_slots`` slots plus one scratch slot no sequence
owns. Decode steps read their slots from a static device buffer (:attr:`decode_slots`),
staged before every step with the real slots first and the scratch slot after them, so
a captured decode graph that pads its batch to a bucket reads and writes the scratch slot
for the padding rows.
"""

from __future__ import annotations

import logging

import torch

from freetoken.models.config import RecurrentStateShape

logger = logging.getLogger(__name__)


class OutOfStateSlots(RuntimeError):
    pass


class RecurrentStatePool:
    """Conv and SSM state tensors per linear-attention layer, ``[num_slots + 1, ...]``;
    the last slot is the scratch slot."""

    def __init__(self, shape: RecurrentStateShape, num_slots: int, conv_dtype: torch.dtype,
                 device: torch.device, max_decode_rows: int) -> None:  # fmt: skip
        if num_slots < 1:
            raise ValueError(f"the recurrent state needs at least one slot, got {num_slots}")
        self.shape = shape
        self.num_slots = num_slots
        self.scratch = num_slots
        self.device = torch.device(device)
        n = num_slots + 1
        #: layer index -> (conv state [n, kernel-1, channels], ssm state [n, heads, dk, dv] in float32)
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            i: (torch.zeros((n, *shape.conv), dtype=conv_dtype, device=self.device),
                torch.zeros((n, *shape.ssm), dtype=torch.float32, device=self.device))
            for i in shape.layers
        }  # fmt: skip
        self.bytes = sum(c.numel() * c.element_size() + s.numel() * s.element_size() for c, s in self.layers.values())
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._rows = max(1, max_decode_rows)
        self.decode_slots = torch.full((self._rows,), self.scratch, dtype=torch.int64, device=self.device)
        self._host_rows = torch.full((self._rows,), self.scratch, dtype=torch.int64)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        """A slot whose state is zero (a sequence at position 0)."""
        if not self._free:
            raise OutOfStateSlots(f"all {self.num_slots} recurrent-state slots are in use")
        slot = self._free.pop()
        for conv, ssm in self.layers.values():
            conv[slot].zero_()
            ssm[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if not (0 <= slot < self.num_slots) or slot in self._free:
            raise ValueError(f"recurrent-state slot {slot} is not in use")
        self._free.append(slot)

    def stage_decode(self, slots: list[int]) -> None:
        """Write a decode step's slots into :attr:`decode_slots` (the rest: scratch)."""
        if len(slots) > self._rows:
            self._grow(len(slots))
        h = self._host_rows
        h.fill_(self.scratch)
        h[: len(slots)] = torch.tensor(slots, dtype=torch.int64)
        self.decode_slots.copy_(h, non_blocking=False)

    def _grow(self, rows: int) -> None:
        # only eager steps can be wider than the graphs' largest bucket: a new buffer is fine
        self._rows = rows
        self.decode_slots = torch.full((rows,), self.scratch, dtype=torch.int64, device=self.device)
        self._host_rows = torch.full((rows,), self.scratch, dtype=torch.int64)
