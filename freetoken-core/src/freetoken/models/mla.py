"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) over a paged cache of latents.

Per token, from the layer's normed input ``x``:

* queries: ``q = q_b(RMSNorm(q_a(x)))`` (``q_lora_rank``; or one ``q`` projection when the
  checkpoint has no query LoRA), ``heads`` heads of ``nope + rope`` values, split into
  ``q_nope`` and ``q_pe``;
* keys and values come from one compressed vector: ``kv_a(x)`` gives ``kv_lora_rank``
  values ``c`` (then RMSNorm'd) and ``rope`` values ``k_pe`` shared by all heads; ``kv_b``
  up-projects ``c`` to each head's ``k_nope`` (``nope``) and ``v`` (``v_dim``) values;
* RoPE (NeoX rotate-half, see below) on ``q_pe`` and ``k_pe`` only; a head's key is
  ``[k_nope, k_pe]``; softmax scale ``(nope + rope)^-0.5`` times YaRN's ``mscale^2``.

**The cache holds the latent, not K/V**: per token and layer one vector ``[c, k_pe]`` of
``kv_lora_rank + rope`` values (576 for DeepSeek-V3 against 2 x 128 x 192 for expanded
per-head K/V), as the K of a one-head cache with no V
(:meth:`MlaShape.kv_layout`, :class:`freetoken.engine.kv_cache.KVCache`).

**Decode runs with the up-projections absorbed** (:func:`absorbed_attention`): with
``W_uk[h]`` (``nope x kv_lora``) and ``W_uv[h]`` (``v_dim x kv_lora``) the two parts of
``kv_b`` for head ``h``, ``q_nope . k_nope = (q_nope W_uk[h]) . c``, so the query moves into
latent space once (``[q_nope W_uk, q_pe]``, ``kv_lora + rope`` values per head) and the
scores are one product with the cached latents; the output ``sum_j p_j v_j = W_uv[h] (sum_j
p_j c_j)`` is taken in latent space and projected once. A decode step reads the compressed
cache only, and never expands the context. In decode graphs with the Triton decode attention
(``AttentionMetadata.static_decode == "triton"``) this is the paged split-K kernel of
:func:`freetoken.models.decode_attention.paged_decode_attention` as a one-kv-head attention
of ``kv_lora + rope`` values whose value is the latent's first ``kv_lora``: it reads each
sequence's context, not its whole block table.

**Short prompt chunks absorb too, long ones expand** (:func:`expanded_attention`): for a
long chunk the context's latents are up-projected to per-head K/V once and the chunk's
queries attend over them with SDPA. For ``n`` queries over ``L`` positions the absorbed
form's attention costs ``n L heads (2 kv_lora + rope)`` products (1088 per head for
DeepSeek-V3) against ``n L heads (nope + rope + v)`` (320) plus the expansion's ``L heads
kv_lora (nope + v)``, and both run as torch products; the absorbed form's own up-projections
(``n`` queries) run on the backend's per-head projection in the checkpoint's format. So a
chunk of up to :attr:`MlaShape.absorb_max_queries` queries (170 for DeepSeek-V3) takes the
absorbed form, a longer one expands. The expansion is transient but covers the whole
context of the chunk: ``L x heads x (nope + rope + v)`` values (for DeepSeek-V3 about 0.9 GB
in BF16 at 8k positions), freed after each layer.

RoPE layout: DeepSeek's checkpoints (HF with ``rope_interleave``, the V2 code's complex
rotation, and llama.cpp's GGUF files, which its converter leaves unpermuted) rotate
interleaved pairs ``(x0, x1), (x2, x3), ...``. The loader reorders the ``q_pe`` rows of the
query projection and the ``k_pe`` rows of ``kv_a`` to ``[x0, x2, ..., x1, x3, ...]``
(:func:`interleaved_to_half`), so NeoX rotate-half tables rotate the same pairs; q.k
products are unchanged, and the cached ``k_pe`` is in that order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from freetoken.backends.contract import WeightPolicy
from freetoken.kernels.availability import head_dim_support
from freetoken.loading.hf import CheckpointError
from freetoken.loading.tensors import RawTensor
from freetoken.models.attention import AttentionMetadata
from freetoken.models.config import KVLayout
from freetoken.models.hybrid_weights import float_tensor, take_rows
from freetoken.models.layers import FusedLinears, Rotary, rms_norm


@dataclasses.dataclass(frozen=True)
class MlaShape:
    """The sizes of one MLA block."""

    heads: int
    q_lora_rank: int  # 0: one plain query projection
    kv_lora_rank: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    v_dim: int  # v_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.nope + self.rope

    @property
    def latent(self) -> int:
        """Values the cache holds per token and layer."""
        return self.kv_lora_rank + self.rope

    def kv_layout(self) -> KVLayout:
        return KVLayout(1, self.latent, 0)

    @property
    def absorb_max_queries(self) -> int:
        """The most queries of a prompt chunk that attend in latent space: where the absorbed
        form's extra products per query and position, ``heads (2 kv_lora + rope - nope - rope
        - v)``, reach the expansion's ``heads kv_lora (nope + v)`` per position."""
        extra = 2 * self.kv_lora_rank - self.nope - self.v_dim
        return self.kv_lora_rank * (self.nope + self.v_dim) // extra if extra > 0 else 1 << 30

    def check(self, where: str) -> None:
        for name, value in (("num_attention_heads", self.heads), ("kv_lora_rank", self.kv_lora_rank),
                            ("qk_nope_head_dim", self.nope), ("v_head_dim", self.v_dim)):  # fmt: skip
            if value <= 0:
                raise CheckpointError(f"{where}: {name}={value} must be positive")
        if self.q_lora_rank < 0:
            raise CheckpointError(f"{where}: q_lora_rank={self.q_lora_rank} is negative")
        if self.rope <= 0 or self.rope % 2:
            raise CheckpointError(f"{where}: qk_rope_head_dim={self.rope} must be positive and even")


def interleaved_to_half(n: int) -> torch.Tensor:
    """The order ``[0, 2, 4, ..., 1, 3, 5, ...]`` of ``n`` rotary dimensions: interleaved
    pairs ``(2i, 2i + 1)`` become rotate-half pairs ``(i, i + n/2)``."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def _rope_rows(shape: MlaShape, interleaved: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The row orders of the query projection and of ``kv_a`` that put RoPE's pairs in
    rotate-half order (None: rows as stored)."""
    if not interleaved:
        return None, None
    perm = interleaved_to_half(shape.rope)
    D = shape.qk_head_dim
    head = torch.cat([torch.arange(shape.nope), shape.nope + perm])
    q_rows = (torch.arange(shape.heads).view(-1, 1) * D + head.view(1, D)).reshape(-1)
    kv_rows = torch.cat([torch.arange(shape.kv_lora_rank), shape.kv_lora_rank + perm])
    return q_rows, kv_rows


def _expect(raw: RawTensor, shape: tuple[int, ...]) -> RawTensor:
    if tuple(raw.shape) != shape:
        raise CheckpointError(f"{raw.source}: {raw.name} has shape {tuple(raw.shape)}, expected {shape}")
    return raw


class MlaAttention:
    """One layer's MLA block: weights placed by a :class:`WeightPolicy` and the attention
    of a step over the layer's latent cache.

    Roles (``get(role)``): ``q_a``, ``q_a_norm``, ``q_b`` (or ``q`` without query LoRA),
    ``kv_a``, ``kv_a_norm``, ``kv_b`` (HF's ``[heads * (nope + v), kv_lora]``) or the split
    ``k_b`` ``[heads, kv_lora, nope]`` and ``v_b`` ``[heads, v, kv_lora]`` (newer llama.cpp
    files; ``has(role)`` says which), and ``o``."""

    def __init__(self, shape: MlaShape, get: Callable[[str], RawTensor], has: Callable[[str], bool],
                 policy: WeightPolicy, rope_interleaved: bool) -> None:  # fmt: skip
        s = self.shape = shape
        q_rows, kv_rows = _rope_rows(s, rope_interleaved)
        H = s.heads
        kv_a = get("kv_a")
        _expect(kv_a, (s.latent, kv_a.shape[1]))
        if kv_rows is not None:
            kv_a = take_rows(kv_a, kv_rows, kv_a.name)
        if s.q_lora_rank:
            q_a = _expect(get("q_a"), (s.q_lora_rank, kv_a.shape[1]))
            q_b = _expect(get("q_b"), (H * s.qk_head_dim, s.q_lora_rank))
            if q_rows is not None:
                q_b = take_rows(q_b, q_rows, q_b.name)
            self.proj_a = FusedLinears([q_a, kv_a], policy)
            self.q_a_norm: Optional[torch.Tensor] = policy.tensor(get("q_a_norm"))
            self.q_b: Any = policy.linear(q_b)
        else:
            q = _expect(get("q"), (H * s.qk_head_dim, kv_a.shape[1]))
            if q_rows is not None:
                q = take_rows(q, q_rows, q.name)
            self.proj_a = FusedLinears([q, kv_a], policy)
            self.q_a_norm = self.q_b = None
        self.kv_a_norm = policy.tensor(get("kv_a_norm"))
        if has("kv_b"):
            kv_b = policy.tensor(_expect(get("kv_b"), (H * (s.nope + s.v_dim), s.kv_lora_rank)))
            per_head = kv_b.view(H, s.nope + s.v_dim, s.kv_lora_rank)
            k_b = float_tensor(f"{get('kv_b').name} (k part, per head transposed)",
                               per_head[:, : s.nope].transpose(1, 2), get("kv_b").source)  # fmt: skip
            v_b = float_tensor(f"{get('kv_b').name} (v part)", per_head[:, s.nope :], get("kv_b").source)
        else:
            k_b = _expect(get("k_b"), (H, s.kv_lora_rank, s.nope))
            v_b = _expect(get("v_b"), (H, s.v_dim, s.kv_lora_rank))
            w_uk = policy.tensor(k_b).transpose(1, 2)
            kv_b = torch.cat([w_uk, policy.tensor(v_b)], dim=1).reshape(H * (s.nope + s.v_dim), s.kv_lora_rank)
        #: [heads * (nope + v), kv_lora]: the expansion of a prompt chunk's context
        self.kv_b = kv_b.contiguous()
        per_head = self.kv_b.view(H, s.nope + s.v_dim, s.kv_lora_rank)
        #: the absorbed products per head (decode and short prompt chunks): ``uk`` [T, H, nope]
        #: -> [T, H, kv_lora] and ``uv`` [T, H, kv_lora] -> [T, H, v], through the policy's
        #: per-head projection (in the checkpoint's format) where it has one, else over ``kv_b``
        self.uk: Any = policy.head_linear(k_b) or FloatHeads(per_head[:, : s.nope].transpose(1, 2))
        self.uv: Any = policy.head_linear(v_b) or FloatHeads(per_head[:, s.nope :])
        self.o = policy.linear(get("o"))
        #: whether the Triton decode attention takes the latent queries (decode graphs)
        self.latent_kernel = head_dim_support(s.latent, s.kv_lora_rank).decode_attention
        #: the weight bytes one decode token reads (the expansion's kv_b only serves prompts)
        self.nbytes = (self.proj_a.nbytes + self.kv_a_norm.numel() * self.kv_a_norm.element_size()
                       + self.uk.nbytes + self.uv.nbytes + self.o.nbytes
                       + (self.q_b.nbytes if self.q_b is not None else 0))  # fmt: skip

    def __call__(self, qa: torch.Tensor, kva: torch.Tensor, rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata, cache: torch.Tensor, scale: float, eps: float) -> torch.Tensor:  # fmt: skip
        """The block's output ``[T, hidden]`` from ``proj_a``'s two outputs; stores the step's
        latents in ``cache`` ``[blocks, block_size, 1, kv_lora + rope]`` first."""
        s = self.shape
        T = qa.shape[0]
        q = self.q_b(rms_norm(qa, self.q_a_norm, eps)) if self.q_b is not None else qa
        q = q.view(T, s.heads, s.qk_head_dim)
        q_nope, q_pe = q[..., : s.nope], rotary.apply(q[..., s.nope :], cos, sin)
        c = rms_norm(kva[:, : s.kv_lora_rank], self.kv_a_norm, eps)
        k_pe = rotary.apply(kva[:, s.kv_lora_rank :].view(T, 1, s.rope), cos, sin).view(T, s.rope)
        write_latents(cache, torch.cat([c, k_pe], dim=-1), meta.slot_mapping)
        if meta.decode or all(seq.q_len <= s.absorb_max_queries for seq in meta.seqs):
            out = self.absorbed(q_nope, q_pe, cache, meta, scale)
        else:
            out = q.new_empty(T, s.heads, s.v_dim)
            for seq in meta.seqs:
                rows = slice(seq.q_start, seq.q_start + seq.q_len)
                one = _one_seq(meta, seq)
                if seq.q_len <= s.absorb_max_queries:
                    out[rows] = self.absorbed(q_nope[rows], q_pe[rows], cache, one, scale)
                else:
                    k, v = self.expand(_context(cache, seq.block_table, seq.ctx_len))
                    out[rows] = expanded_attention(q_nope[rows], q_pe[rows], k, v, one, scale)
        return self.o(out.reshape(T, s.heads * s.v_dim))

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:  # fmt: skip
        """Attention with the up-projections absorbed (module docstring): ``[T, heads, v]``."""
        q_lat = self.uk(q_nope)
        q_lat = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)
        kv_lora = self.shape.kv_lora_rank
        if meta.static_decode == "triton" and q_lat.dtype == cache.dtype and self.latent_kernel:
            from freetoken.models.decode_attention import paged_decode_attention

            T, H, _ = q_lat.shape
            o_lat = paged_decode_attention(q_lat, cache, cache[..., :kv_lora], meta.block_tables, meta.ctx_lens,
                                           scale, impl="triton").view(T, H, kv_lora)  # fmt: skip
        else:
            o_lat = absorbed_attention(q_lat, cache, meta, scale, kv_lora)
        return self.uv(o_lat)

    def expand(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A context's latents ``[L, kv_lora + rope]`` up-projected to per-head keys ``[L,
        heads, nope + rope]`` and values ``[L, heads, v]``."""
        s = self.shape
        L = lat.shape[0]
        kv = F.linear(lat[:, : s.kv_lora_rank].to(self.kv_b.dtype), self.kv_b).view(L, s.heads, s.nope + s.v_dim)
        k_pe = lat[:, s.kv_lora_rank :].unsqueeze(1).expand(L, s.heads, s.rope).to(kv.dtype)
        return torch.cat([kv[..., : s.nope], k_pe], dim=-1), kv[..., s.nope :]


class FloatHeads:
    """``y[t, h] = W[h] @ x[t, h]`` over a float ``[heads, out, in]`` tensor (a policy
    without a per-head projection)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w
        self.nbytes = w.numel() * w.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("thi,hoi->tho", x, self.w.to(x.dtype))


def _one_seq(meta: AttentionMetadata, seq: Any) -> AttentionMetadata:
    """``meta`` restricted to one sequence whose tokens start at 0."""
    return AttentionMetadata(meta.slot_mapping, [dataclasses.replace(seq, q_start=0)], meta.block_size)


def write_latents(cache: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``latent`` ``[T, kv_lora + rope]`` into the cache slots ``slots``."""
    nb, bs, _, W = cache.shape
    cache.view(nb * bs, W).index_copy_(0, slots, latent.to(cache.dtype))


def _context(cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """One sequence's cached latents ``[ctx_len, kv_lora + rope]``."""
    W = cache.shape[3]
    return cache.index_select(0, block_table).view(-1, W)[:ctx_len]


def absorbed_attention(q_lat: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                       kv_lora: int) -> torch.Tensor:  # fmt: skip
    """Causal attention of latent-space queries ``q_lat`` ``[T, heads, kv_lora + rope]`` over
    the cached latents, whose first ``kv_lora`` values serve as the value: ``[T, heads,
    kv_lora]``. Softmax in float32. Batched decode steps (and decode-graph replays) take one
    batched product over the padded block tables; other steps go sequence by sequence."""
    T, H, W = q_lat.shape
    static = meta.static_decode is not None
    if static or (meta.decode and len(meta.seqs) > 1 and meta.block_tables is not None and meta.mask is not None):
        # one query per sequence over its whole block table, the positions past its context
        # masked; a decode graph's static buffers (``static_decode``: int32 block tables and
        # context lengths on the device) give the mask without any host-side shape
        assert meta.block_tables is not None
        B, nbk = meta.block_tables.shape
        flat = meta.block_tables.reshape(-1)
        lat = cache.index_select(0, flat.long() if static else flat).to(q_lat.dtype).view(B, nbk * meta.block_size, W)
        if static:
            assert meta.ctx_lens is not None
            pos = torch.arange(nbk * meta.block_size, device=q_lat.device)
            mask = pos.view(1, -1) < meta.ctx_lens.view(-1, 1)
        else:
            assert meta.mask is not None
            mask = meta.mask.view(B, -1)
        scores = torch.matmul(q_lat.view(B, H, W), lat.transpose(1, 2)).float() * scale  # [B, H, L]
        scores = scores.masked_fill(~mask.view(B, 1, -1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q_lat.dtype)
        return torch.matmul(probs, lat[..., :kv_lora])
    out = q_lat.new_empty(T, H, kv_lora)
    for s in meta.seqs:
        lat = _context(cache, s.block_table, s.ctx_len).to(q_lat.dtype)  # [L, W]
        q = q_lat[s.q_start : s.q_start + s.q_len]  # [n, H, W]
        scores = torch.matmul(q.reshape(-1, W), lat.T).view(s.q_len, H, -1).float()
        scores.mul_(scale)  # in place: float32 products are scaled in their own buffer
        if s.q_len > 1:  # query i sits at position ctx_len - q_len + i
            pos_q = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device).view(-1, 1, 1)
            pos_k = torch.arange(s.ctx_len, device=q.device).view(1, 1, -1)
            scores.masked_fill_(pos_k > pos_q, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q_lat.dtype)
        # one [q_len * heads, L] x [L, kv_lora] product (a 3-D matmul broadcasts the latents)
        o = torch.matmul(probs.view(-1, s.ctx_len), lat[:, :kv_lora])
        out[s.q_start : s.q_start + s.q_len] = o.view(s.q_len, H, kv_lora)
    return out


def expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       meta: AttentionMetadata, scale: float) -> torch.Tensor:  # fmt: skip
    """Causal attention of one sequence's queries (``meta.seqs[0]``, tokens from 0) over its
    context's per-head keys ``k`` ``[L, heads, nope + rope]`` and values ``v`` ``[L, heads,
    v]`` (:meth:`MlaAttention.expand`): ``[n, heads, v]``."""
    seq = meta.seqs[0]
    n, L = seq.q_len, seq.ctx_len
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    k, v = k.transpose(0, 1).unsqueeze(0).to(q.dtype), v.transpose(0, 1).unsqueeze(0).to(q.dtype)
    if n == L:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:  # a later chunk: query i at position L - n + i
        allowed = torch.arange(L, device=q.device).view(1, -1) <= torch.arange(L - n, L, device=q.device).view(-1, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return o[0].transpose(0, 1)
