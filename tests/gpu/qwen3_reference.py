"""A float64 Qwen3-MoE forward written from the architecture's definition, for tests.

Independent of freetoken's model code: full-sequence causal attention (no cache), GQA,
per-head q/k RMSNorm, NeoX rotary embeddings, top-k softmax routing renormalised over the
top-k, SwiGLU experts, all in float64 over tensors named as in GGUF files
(``blk.{i}.attn_q.weight`` ...). ``expert_input`` may transform an expert matrix's input
(e.g. the CPU kernels' int8 activation rounding) per (layer, matrix), ``linear_input`` the
input rows ``[positions, features]`` of a dense projection (``attn_q``, ``attn_k``,
``attn_v``, ``attn_output``; the output head as layer -1, ``output``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """``x [N, heads, D]`` at positions 0..N-1."""
    N, _, D = x.shape
    half = D // 2
    inv = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / D)
    ang = torch.arange(N, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def logits(t: dict[str, torch.Tensor], ids: list[int], layers: int, heads: int, kv_heads: int, head_dim: int,
           top_k: int, theta: float, eps: float = 1e-6,
           expert_input: Optional[Callable[[int, str, torch.Tensor], torch.Tensor]] = None,
           linear_input: Optional[Callable[[int, str, torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:  # fmt: skip
    """Logits (float64 ``[len(ids), vocab]``) of every position of ``ids``."""
    g = {k: v.double() for k, v in t.items()}
    pre = expert_input or (lambda layer, name, x: x)
    lin = linear_input or (lambda layer, name, x: x)
    N, D, G = len(ids), head_dim, heads // kv_heads
    x = g["token_embd.weight"][torch.tensor(ids)]
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    for i in range(layers):
        w = lambda n: g[f"blk.{i}.{n}.weight"]  # noqa: E731
        h = _rms(x, w("attn_norm"), eps)
        q = _rope(_rms((lin(i, "attn_q", h) @ w("attn_q").T).view(N, heads, D), w("attn_q_norm"), eps), theta)
        k = _rope(_rms((lin(i, "attn_k", h) @ w("attn_k").T).view(N, kv_heads, D), w("attn_k_norm"), eps), theta)
        v = (lin(i, "attn_v", h) @ w("attn_v").T).view(N, kv_heads, D)
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        att = torch.einsum("hqk,khd->qhd", p, v).reshape(N, heads * D)
        x = x + lin(i, "attn_output", att) @ w("attn_output").T
        h = _rms(x, w("ffn_norm"), eps)
        top, sel = torch.topk(h @ w("ffn_gate_inp").T, top_k, dim=-1)
        rw = torch.softmax(top, dim=-1)
        gate, up, down = w("ffn_gate_exps"), w("ffn_up_exps"), w("ffn_down_exps")
        moe = torch.zeros_like(x)
        for n in range(N):
            for j in range(top_k):
                e = int(sel[n, j])
                a = pre(i, "gate", h[n]) @ gate[e].T
                b = pre(i, "up", h[n]) @ up[e].T
                act = a * torch.sigmoid(a) * b
                moe[n] += rw[n, j] * (pre(i, "down", act) @ down[e].T)
        x = x + moe
    return lin(-1, "output", _rms(x, g["output_norm.weight"], eps)) @ g["output.weight"].T
