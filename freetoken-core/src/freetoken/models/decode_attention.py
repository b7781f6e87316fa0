"""Decode attention over the paged KV cache that CUDA graphs can capture.

:func:`paged_decode_attention` computes one query token per sequence against the
sequence's cached context (which already holds the token's own K/V) from static device
tensors only: the block tables and context lengths are read on the device, every shape
follows from the arguments' shapes, and nothing waits for the host. A captured decode
step therefore replays correctly when ``q``, ``block_tables`` and ``ctx_lens`` change
between replays.

Two implementations:

* ``triton`` (:mod:`freetoken.kernels.decode_attention`): split-K flash decoding.
  The context of every sequence is cut into ``P`` partitions processed by parallel
  programs (one per sequence, kv head and partition; each takes all the query heads of
  its kv head as the M dimension of its ``tl.dot``), then a small kernel merges the
  partitions' softmax statistics. ``P`` comes from shapes only (:func:`num_partitions`:
  enough programs to fill the GPU, never more partitions than the longest possible
  context can use); the partition length follows the actual context length inside the
  kernels, so a short context is spread over the programs as well.
* ``torch``: the same online softmax in plain torch ops, fp32, over the block tables
  gathered in chunks of fixed shape (bounded memory), masked by ``arange < ctx_lens``
  built on the device (GPUs without Triton, and a reference of a different construction).

``impl="auto"`` takes Triton where :mod:`freetoken.backends.triton_target` says it runs
(NVIDIA compute capability >= 8.0, AMD CDNA2-4 and RDNA3/4; never Triton's interpreter),
torch otherwise.

Conventions:

* A batch row with ``ctx_lens == 0`` (a padded row) produces zeros. Cache slots at or past
  a sequence's context and block-table entries past its last block are never read into
  the result (any valid block id, e.g. a scratch block, may pad a table); context lengths
  are clamped to ``[0, max_blocks * block_size]``. Block ids are not range-checked (that
  would need a host synchronisation): they must index ``k_cache``.
* Writing the step's K/V needs nothing new: ``freetoken.models.attention.write_kv``
  (``index_copy_``) is capturable, and a padded row's slot points into a scratch block no
  sequence owns (what ``freetoken.moe.session.decode_graphs.DecodeGraphRunner`` does), so padding
  never touches a real block.
* Triton compiles a kernel variant on its first launch, which must not happen during
  stream capture: one eager call with the same shapes, strides and dtypes (:func:`warmup`
  is that call) must precede the capture. A capture that meets a variant not compiled in
  this process computes with the torch implementation instead (logged once; counted in
  :data:`capture_fallbacks`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

IMPLS = ("auto", "triton", "torch")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: programs of the Triton partial kernel aimed for per streaming multiprocessor. Swept on an
#: H200 (132 SMs, 4 kv heads of 128, bf16; tests/gpu/bench_decode_attention.py
#: --sweep-partitions): the counts nearest 3 per SM (99 partitions at batch 1, 48 at batch 2,
#: 24 at batch 4) were the fastest or within 5% of it over 16k and 32k tokens, where 4 per SM
#: took 20-40% longer (longer partitions keep more of a program's loads in flight; more
#: partitions leave the merge more to do).
PROGRAMS_PER_SM = 3
MAX_PARTITIONS = 256
#: the torch implementation gathers K and V (as fp32) in chunks of at most this many bytes
TORCH_CHUNK_BYTES = 256 << 20

#: captures that met a Triton variant not compiled before and ran the torch implementation
capture_fallbacks = 0
_compiled: set[tuple[Any, ...]] = set()


@functools.lru_cache(maxsize=None)
def _default_impl(device: torch.device) -> tuple[str, str]:
    from freetoken.backends import triton_target

    target = triton_target.for_device(device)
    if not target.usable:
        return "torch", target.reason
    import triton

    if triton.knobs.runtime.interpret:
        return "torch", "Triton's interpreter is on (TRITON_INTERPRET)"
    return "triton", target.reason


def default_impl(device: Any) -> tuple[str, str]:
    """(implementation, why) for tensors on ``device`` under ``impl="auto"``."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _default_impl(dev)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton's interpreter on the CPU: a few partitions, to exercise the split


def num_partitions(batch: int, kv_heads: int, max_blocks: int, block_size: int, device: Any,
                   min_part_tokens: int = 128) -> int:  # fmt: skip
    """Partitions per sequence of the Triton implementation, from shapes only: about
    :data:`PROGRAMS_PER_SM` programs per SM over ``batch * kv_heads * P`` programs (``kv_heads``:
    the programs per sequence and partition, more than the kv heads where a kv head's query
    heads are split into groups), at
    most one partition per ``min_part_tokens`` of the longest context the block tables
    can hold, at most :data:`MAX_PARTITIONS`."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    useful = -(-max_blocks * block_size // min_part_tokens)
    wanted = -(-PROGRAMS_PER_SM * _sm_count(dev) // max(1, batch * kv_heads))
    return max(1, min(useful, wanted, MAX_PARTITIONS))


def _validate(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              ctx_lens: torch.Tensor, out: Optional[torch.Tensor]) -> None:  # fmt: skip
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {tuple(q.shape)}")
    B, Hq, D = q.shape
    if k_cache.dim() != 4 or v_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim] (v: its own head_dim), "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    nb, bs, Hkv, Dk = k_cache.shape
    Dv = v_cache.shape[3]
    if Dk != D:
        raise ValueError(f"head_dim differs: q has {D}, the cache {Dk}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q_heads={Hq} must be a multiple of kv_heads={Hkv}")
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share one dtype of {[str(d) for d in DTYPES]}, got "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have unit stride in head_dim")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(
            f"block_tables must be int32 [batch={B}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if block_tables.shape[1] == 0:
        raise ValueError("block_tables has no column (max_blocks must be >= 1)")
    if ctx_lens.dtype != torch.int32 or tuple(ctx_lens.shape) != (B,):
        raise ValueError(f"ctx_lens must be int32 [batch={B}], got {ctx_lens.dtype} {tuple(ctx_lens.shape)}")
    tensors = [("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("ctx_lens", ctx_lens)]
    if out is not None:
        if tuple(out.shape) != (B, Hq * Dv) or out.dtype not in DTYPES or out.stride(-1) != 1:
            raise ValueError(
                f"out must be [batch={B}, q_heads*v_head_dim={Hq * Dv}] of a float dtype with unit last stride, "
                f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}"
            )
        tensors.append(("out", out))
    for name, t in tensors:
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
    impl: str = "auto",
    *,
    partitions: Optional[int] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    ``q [B, Hq, D]`` (bf16/fp16/fp32); ``k_cache``/``v_cache``
    ``[num_blocks, block_size, Hkv, D]`` and ``[.., Hkv, DV]`` (``DV``, the v head size, may
    differ from ``D``) in q's dtype, ``Hq`` a multiple of ``Hkv``;
    ``block_tables`` int32 ``[B, max_blocks]``; ``ctx_lens`` int32 ``[B]`` (context length
    including the current token; 0 = padded row -> zeros). Returns ``[B, Hq*DV]`` in
    ``q.dtype``, or ``out`` (written in its own dtype) when given. ``partitions``
    overrides :func:`num_partitions` (Triton only). ``window``: only the last ``window``
    tokens of each context are attended (sliding window); ``sinks`` (float ``[Hq]`` on q's
    device): one extra logit per query head in the softmax's denominator (attention
    sinks). Capturable: see the module docstring.
    """
    global capture_fallbacks
    if impl not in IMPLS:
        raise ValueError(f"unknown decode attention implementation {impl!r}; expected one of {IMPLS}")
    _validate(q, k_cache, v_cache, block_tables, ctx_lens, out)
    B, Hq, D = q.shape
    Dv = v_cache.shape[3]
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    if sinks is not None and (tuple(sinks.shape) != (Hq,) or sinks.device != q.device):
        raise ValueError(f"sinks must be [q_heads={Hq}] on {q.device}, got {tuple(sinks.shape)} on {sinks.device}")
    if impl == "auto":
        impl = default_impl(q.device)[0]
    if out is None:
        out = torch.empty(B, Hq * Dv, dtype=q.dtype, device=q.device)
    if impl == "torch":
        return _torch_decode(q, k_cache, v_cache, block_tables, ctx_lens, scale, out, window, sinks)

    try:
        import triton

        from freetoken.kernels import decode_attention as dat
    except ImportError as exc:
        raise ValueError(f"impl='triton' needs triton: {exc}") from exc
    if not q.is_cuda and not triton.knobs.runtime.interpret:
        raise ValueError(f"impl='triton' on {q.device} needs a GPU (or Triton's interpreter: TRITON_INTERPRET=1)")
    from freetoken.kernels.availability import head_dim_support

    support = head_dim_support(D, Dv)
    if not support.decode_attention:
        raise ValueError(f"impl='triton': {support.decode_attention_why}")
    _, bs, Hkv, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    config = dat.config_for(B, D, Dv, q.element_size(), dat.shared_limit(q.device), dat.shares_kv(k_cache, v_cache))
    groups = dat.program_groups(Hq, Hkv, Dv)
    min_part = dat.tiles(config, D, Dv)[1]
    P = num_partitions(B, groups, max_blocks, bs, q.device, min_part) if partitions is None else partitions
    if P < 1:
        raise ValueError(f"partitions={P}: must be >= 1")
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    ctx_lens = ctx_lens.contiguous()
    if sinks is not None:
        sinks = sinks.float().contiguous()
    key = dat.variant_key(q, k_cache, v_cache, block_tables, ctx_lens, out, P, config, window, sinks)
    if key not in _compiled and q.is_cuda and torch.cuda.is_current_stream_capturing():
        if not capture_fallbacks:
            log.warning(
                "decode attention: Triton variant for batch %d, %d/%d heads, head_dim %d, %s not compiled before "
                "stream capture; this graph uses the torch implementation (run one eager call, e.g. "
                "freetoken.models.decode_attention.warmup, with the same shapes first)",
                B, Hq, Hkv, D, q.dtype,
            )  # fmt: skip
        capture_fallbacks += 1
        return _torch_decode(q, k_cache, v_cache, block_tables, ctx_lens, scale, out, window, sinks)
    dat.launch(q, k_cache, v_cache, block_tables, ctx_lens, scale, out, P, config, window, sinks)
    _compiled.add(key)
    return out


def warmup(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
    impl: str = "auto",
    *,
    partitions: Optional[int] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One eager :func:`paged_decode_attention` call (compiles the Triton variants these
    arguments select), to run before capturing a graph that makes the same call. The
    arguments should be the very buffers the graph will read (their strides and
    alignment select the variant too); their values do not matter."""
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("decode attention warmup must run before stream capture, not during it")
    return paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, scale, out, impl,
                                  partitions=partitions, window=window, sinks=sinks)  # fmt: skip


def _torch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  ctx_lens: torch.Tensor, scale: float, out: torch.Tensor, window: Optional[int] = None,
                  sinks: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """Online softmax over fixed-shape chunks of the gathered blocks, all in fp32."""
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    Dv = v_cache.shape[3]
    G = Hq // Hkv
    max_blocks = block_tables.shape[1]
    dev = q.device
    if B == 0:
        return out
    per_block = B * bs * Hkv * (D + Dv) * 4  # fp32 K and V of one block column
    chunk = max(1, min(max_blocks, TORCH_CHUNK_BYTES // per_block))
    qf = q.float().view(B, Hkv, G, D) * scale
    ctx = ctx_lens.to(torch.int64).clamp(0, max_blocks * bs).view(B, 1)
    m = torch.full((B, Hkv, G), float("-inf"), dtype=torch.float32, device=dev)
    l = torch.zeros(B, Hkv, G, dtype=torch.float32, device=dev)
    acc = torch.zeros(B, Hkv, G, Dv, dtype=torch.float32, device=dev)
    for c0 in range(0, max_blocks, chunk):
        ids = block_tables[:, c0 : c0 + chunk].to(torch.int64)
        L = ids.shape[1] * bs
        pos = torch.arange(c0 * bs, c0 * bs + L, device=dev).view(1, L)
        valid = pos < ctx  # [B, L]
        if window is not None:
            valid &= pos >= ctx - window
        k = k_cache.index_select(0, ids.reshape(-1)).view(B, L, Hkv, D).float()
        v = v_cache.index_select(0, ids.reshape(-1)).view(B, L, Hkv, Dv).float()
        s = torch.einsum("bhgd,blhd->bhgl", qf, k)
        s = torch.where(valid.view(B, 1, 1, L), s, float("-inf"))  # also drops NaN of unused slots
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_ref = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing valid yet stays at zero
        alpha = torch.exp(m - m_ref)
        p = torch.exp(s - m_ref.unsqueeze(-1))
        v = torch.where(valid.view(B, L, 1, 1), v, 0.0)  # p = 0 there, but 0 * NaN is NaN
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha.unsqueeze(-1) + torch.einsum("bhgl,blhd->bhgd", p, v)
        m = m_new
    if sinks is not None:  # the sink's term of the denominator (zero where nothing was attended)
        l = l + torch.where(m == float("-inf"), 0.0, torch.exp(sinks.float().view(1, Hkv, G) - m))
    o = acc / torch.where(l > 0, l, 1.0).unsqueeze(-1)
    out.copy_(o.view(B, Hq * Dv))
    return out
