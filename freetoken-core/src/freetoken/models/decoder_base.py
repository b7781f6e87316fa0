"""What every family's runnable model shares: the token embedding, the final norm and the
output head (tied to the embedding when the checkpoint says so or has none), the dense
ops of its device, each layer's feed-forward block (routed experts of
:mod:`freetoken.models.moe_block`, or a dense SwiGLU MLP where the config says), the
logits, and the weight bytes a decode token reads."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from freetoken.backends.contract import WeightPolicy
from freetoken.loading.tensors import RawTensor, TensorSource
from freetoken.models.config import ModelConfig
from freetoken.models.dense_ops import dense_ops_for
from freetoken.models.moe_block import SwiGLU, moe_dense_bytes, moe_layer
from freetoken.models.moe_layer import ExpertWeights


class DecoderModelBase:
    """Loading and accounting shared by the families' model classes; a subclass loads its
    attention (or other token mixer) and runs the forward."""

    config: ModelConfig
    layers: list[Any]  # each with ``moe`` (a MoELayer) or ``mlp`` (a SwiGLU), the other None

    def _load_ends(self, config: ModelConfig, source: TensorSource, names: Any, policy: WeightPolicy,
                   norm: Optional[Callable[[RawTensor], torch.Tensor]] = None) -> None:  # fmt: skip
        """The embedding, final norm (through ``norm``, default ``policy.tensor``), head,
        device, dtype, attention scale and dense ops; the vocabulary size from the
        embedding where the config lacks it."""
        self.config = c = config
        self.device = policy.device
        self.dtype = policy.dtype
        self.scale = c.head_dim ** -0.5
        get = source.get
        self.embed = policy.embedding(get(names.embed))
        if c.vocab_size <= 0:
            c.vocab_size = self.embed.raw.shape[0]
        self.norm = (norm or policy.tensor)(get(names.norm))
        tied = c.tie_word_embeddings or not source.has(names.lm_head)
        self.lm_head = policy.output_head(get(names.embed if tied else names.lm_head))
        self.ops = dense_ops_for(self.device, head_dim=c.head_dim)
        self.layers = []

    def _load_ffn(self, L: Any, i: int, get: Callable[[str], RawTensor], policy: WeightPolicy,
                  experts: Callable[[], tuple[ExpertWeights, Optional[torch.Tensor]]], **moe: Any) -> None:  # fmt: skip
        """Layer ``i``'s feed-forward block into ``L.moe`` (its experts from ``experts()``:
        the weights and, for experts with biases, their down bias; ``moe``: the options of
        :func:`~freetoken.models.moe_block.moe_layer`) or, where the config makes layer ``i``
        dense, ``L.mlp`` (roles ``mlp_gate``/``mlp_up``/``mlp_down``)."""
        L.moe = L.mlp = None
        if self.config.is_moe_layer(i):
            weights, down_bias = experts()
            L.moe = moe_layer(i, self.config, get, policy, self.ops, weights, down_bias=down_bias, **moe)
        else:
            L.mlp = SwiGLU.load(get, policy, "mlp")

    def _feed_forward(self, L: Any, h: torch.Tensor, o: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``L``'s second half: the residual ``h + o`` and its post-norm, then the routed
        experts or the dense MLP; returns (residual, what the block adds to it)."""
        if L.moe is not None:
            return L.moe.add_norm_forward(h, o, L.post_norm, eps)
        h, x = self.ops.add_rms_norm(h, o, L.post_norm, eps)
        return h, L.mlp(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------- accounting

    def _mixer_bytes(self, L: Any) -> int:
        """Weight bytes of layer ``L``'s attention (or other token mixer) one token reads."""
        raise NotImplementedError

    def bytes_per_token(self) -> dict[str, int]:
        """Weight bytes one decode token reads (batch 1): dense part and experts."""
        dense = self.lm_head.nbytes
        experts = 0
        for L in self.layers:
            dense += self._mixer_bytes(L)
            if L.moe is not None:
                dense += moe_dense_bytes(L.moe)
                experts += self.config.top_k * L.moe.experts.bytes_per_expert
            else:
                dense += L.mlp.nbytes
        return {"dense": dense, "experts": experts}
