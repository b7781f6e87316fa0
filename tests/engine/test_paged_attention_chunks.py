"""The torch paged attention (any device) against a float64 reference, for steps that
mix a whole prompt, a later chunk of a prompt (queries aligned at the last keys of a
longer context) and a decode row, with grouped-query heads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.models.attention import AttentionMetadata, SeqSlice, paged_attention


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """q [n, H, D] at the last n positions of k/v [ctx, kvh, D]; float64."""
    n, H, D = q.shape
    ctx, kvh, _ = k.shape
    g = H // kvh
    out = np.empty((n, H, D))
    for i in range(n):
        pos = ctx - n + i
        for h in range(H):
            s = k[: pos + 1, h // g] @ q[i, h] * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[: pos + 1, h // g]
    return out


@pytest.mark.parametrize("H,kvh", [(8, 2), (4, 4)])
def test_prompt_chunks_and_decode_rows(H: int, kvh: int) -> None:
    g = torch.Generator().manual_seed(H * 10 + kvh)
    D, bs, nb = 16, 8, 32
    k_cache = torch.randn(nb, bs, kvh, D, generator=g, dtype=torch.float64)
    v_cache = torch.randn(nb, bs, kvh, D, generator=g, dtype=torch.float64)
    # (q_len, ctx_len): a whole prompt, a later chunk, a decode row
    shapes = [(13, 13), (9, 37), (1, 21)]
    perm = torch.randperm(nb, generator=g).tolist()
    seqs, qs, start = [], [], 0
    for q_len, ctx in shapes:
        blocks = [perm.pop() for _ in range((ctx + bs - 1) // bs)]
        seqs.append(SeqSlice(q_start=start, q_len=q_len, ctx_len=ctx, block_table=torch.tensor(blocks), blocks=blocks))
        qs.append(torch.randn(q_len, H, D, generator=g, dtype=torch.float64))
        start += q_len
    q = torch.cat(qs)
    meta = AttentionMetadata(slot_mapping=torch.zeros(start, dtype=torch.long), seqs=seqs, block_size=bs)
    scale = D ** -0.5
    got = paged_attention(q, k_cache, v_cache, meta, scale).view(start, H, D)
    for s, qi in zip(seqs, qs):
        k = k_cache[s.block_table].reshape(-1, kvh, D)[: s.ctx_len].numpy()
        v = v_cache[s.block_table].reshape(-1, kvh, D)[: s.ctx_len].numpy()
        want = _reference(qi.numpy(), k, v, scale)
        np.testing.assert_allclose(got[s.q_start : s.q_start + s.q_len].numpy(), want, rtol=1e-9, atol=1e-9)
