"""Greedy tokens from the output head's own pool call (``_core.linear_argmax``).

A plain greedy request needs only the index of each logits row's largest value. Computed
from the logits tensor, that read comes after the head's weight stream (hundreds of MB per
token) has flushed the caches: the ~600 KB row of a 150k-token vocabulary comes back from
memory into the calling thread (~130 us on the 2-core VM), with the Python and torch of the
logits call and of sampling around it. :class:`GreedyHead` runs the head's projection
through the same native call as the model's ``compute_logits`` (so the same values, from the
same kernels and row split) and has each worker reduce the rows it has just computed, while
they are in its cache, to their first largest value; only the indices come back. Ties and
NaNs as :func:`freetoken.engine.sampling.argmax_rows`: the first of equal values, a NaN
counts as the largest.

It takes models whose ``compute_logits`` is ``lm_head(hidden).float()`` (the families in
:func:`_plain_logits`) and whose head is a kernel projection of the CPU weight policy;
:meth:`GreedyHead.build` says why it declines anything else, and the engine then samples
from the logits as before.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from freetoken_cpu_moe import _core
from freetoken_cpu_moe.dense import ACT_FMT, kernel_desc
from freetoken_cpu_moe.pool import Pool


def _plain_logits() -> set[Callable[..., Any]]:
    """The ``compute_logits`` functions that return ``self.lm_head(hidden).float()``."""
    from freetoken.models.moe_decoder import MoeDecoderModel
    from freetoken.models.qwen3_moe import Qwen3MoeModel
    from freetoken.models.qwen_hybrid import QwenHybridModel

    return {Qwen3MoeModel.compute_logits, MoeDecoderModel.compute_logits, QwenHybridModel.compute_logits}


class GreedyHead:
    """The greedy token of each row of final hidden states (:meth:`__call__`), built by :meth:`build`."""

    def __init__(self, model: Any, address: int, max_tokens: int, pool: Pool) -> None:
        self._model = model
        self._logits_fn = type(model).compute_logits
        self._head = model.lm_head
        self._address = address
        self._max_tokens = max_tokens
        self._pool = pool._core
        self._in_features = model.lm_head.in_features
        self._dtype = model.dtype
        self._fmt = ACT_FMT.get(model.dtype)
        self._check = True

    @classmethod
    def build(cls, model: Any, pool: Pool) -> tuple[Optional["GreedyHead"], str]:
        """The greedy head of ``model``, or None and why greedy requests read the logits."""
        if type(model).compute_logits not in _plain_logits():
            return None, f"{type(model).__name__}'s logits are not its head's output"
        address, max_tokens = kernel_desc(getattr(model, "lm_head", None))
        if address is None:
            return None, "the output head is not a kernel projection"
        return cls(model, address, max_tokens, pool), "reduced to the first maximum in the head's pool call"

    def intact(self) -> bool:
        """Whether the model's head and logits are still those this was built from (a replaced
        ``compute_logits`` or head sends greedy requests back to the logits)."""
        m = self._model
        return (not self._check or ("compute_logits" not in m.__dict__ and type(m).compute_logits is self._logits_fn
                                    and m.lm_head is self._head))

    def __call__(self, hidden: torch.Tensor) -> Optional[list[int]]:
        """The index of the first largest logit of each row of ``hidden`` ``[B, hidden]``, or
        None for rows this call does not take (the caller computes the logits)."""
        # each check here costs microseconds on the caches the head's and the step's weight
        # streams leave (hidden.device.type ~25 us): the fewest torch attributes
        fmt = self._fmt
        if (fmt is None or hidden.dtype is not self._dtype or not hidden.is_cpu or hidden.dim() != 2
                or hidden.shape[0] > self._max_tokens or hidden.shape[1] != self._in_features
                or not hidden.is_contiguous() or not self.intact()):
            return None
        return _core.linear_argmax(self._address, hidden.data_ptr(), fmt, hidden.shape[0], 0, fmt, self._pool, "")

    def set_profile(self, on: bool) -> None:
        """While ``on`` the step profiler's timer around ``compute_logits`` does not send
        greedy requests back to the logits (the profiler times this call itself)."""
        self._check = not on
