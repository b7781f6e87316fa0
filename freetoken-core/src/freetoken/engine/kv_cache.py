"""The paged KV cache: fixed-size blocks of token slots shared by all requests."""

from __future__ import annotations

import logging

import torch

from freetoken.models.config import KVLayout, ModelConfig

logger = logging.getLogger(__name__)


class OutOfBlocks(RuntimeError):
    pass


class KVCache:
    """Per attention layer (``config.kv_layers``: every layer unless the model has
    linear-attention layers) a K and a V tensor ``[num_blocks, block_size, kv_heads, head_dim]``
    and a free list of blocks. The config's :meth:`~freetoken.models.config.ModelConfig.kv_layout`
    sets the widths: multi-head latent attention caches one latent vector per token as K (one
    "head" of its compressed width) and has no separate V (a zero-width V tensor, so every
    layer is still a (K, V) pair). Memory is reserved with ``torch.empty`` and only
    touched as blocks are used."""

    def __init__(self, config: ModelConfig, num_tokens: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = max(1, num_tokens // block_size)
        # a ModelConfig, or any object with its shape fields
        layout = config.kv_layout() if hasattr(config, "kv_layout") else KVLayout(
            config.num_kv_heads, config.head_dim, config.head_dim)
        self.layout = layout
        k_shape = (self.num_blocks, block_size, layout.heads, layout.k_dim)
        v_shape = (self.num_blocks, block_size, layout.heads, layout.v_dim)
        kv_layers = getattr(config, "kv_layers", None)
        n_layers = config.num_layers if kv_layers is None else len(kv_layers)
        self.layers = [
            (torch.empty(k_shape, dtype=dtype, device=device), torch.empty(v_shape, dtype=dtype, device=device))
            for _ in range(n_layers)
        ]
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.bytes = n_layers * self.num_blocks * block_size * layout.values_per_token() * (
            torch.empty((), dtype=dtype).element_size())

    @property
    def total_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return (tokens + self.block_size - 1) // self.block_size

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        if blocks:
            # Batched attention reads whole blocks (masked past each context), so a
            # block must never hold NaN/Inf garbage from uninitialised memory.
            idx = torch.tensor(blocks, dtype=torch.int64, device=self.layers[0][0].device)
            for k, v in self.layers:
                k.index_fill_(0, idx, 0)
                v.index_fill_(0, idx, 0)
        return blocks

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
