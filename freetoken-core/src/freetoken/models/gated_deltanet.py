"""Gated DeltaNet linear attention (the ``linear_attention`` layers of Qwen3-Next and
Qwen3.5/3.6), over a flat batch of tokens from several sequences.

Per token ``t`` of a sequence, with ``q, k`` L2-normalised per head (``q`` also scaled by
``1/sqrt(dk)``), ``beta_t = sigmoid(b_t)`` and the log-decay ``g_t = A * softplus(a_t + dt_bias)``
(``A = -exp(A_log) < 0``), the state ``S`` (``[dk, dv]`` per value head) follows the gated
delta rule::

    S <- exp(g_t) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t

q/k/v come out of a depthwise causal convolution (kernel 4, SiLU) over the projected
``[q | k | v]`` channels; the output is RMS-normalised per value head, multiplied by
``silu(z)`` (the gated RMSNorm) and projected back to the hidden size. Key heads serve
``value_heads / key_heads`` consecutive value heads each (or, tiled, every ``key_heads``-th).

Prefill runs the chunked form (chunks of :data:`CHUNK` tokens: within a chunk the delta
updates are solved as one unit-lower-triangular system, across chunks the state is carried
sequentially); decode runs the recurrent form for the whole batch at once, through the
model's :meth:`~freetoken.models.dense_ops.DenseOps.deltanet_decode` (torch ops here, one
native call on the CPU backend). Both start from and write back each sequence's state in a
:class:`~freetoken.engine.recurrent_state.RecurrentStatePool` slot.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from freetoken.models.attention import AttentionMetadata
from freetoken.models.dense_ops import TORCH_OPS, DenseOps

#: tokens per chunk of the chunked (prefill) form
CHUNK = 64
#: epsilon of the q/k L2 normalisation
L2_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class DeltaNetShape:
    key_heads: int
    value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    conv_kernel: int
    #: value head ``j`` uses key head ``j mod key_heads`` (tiled) instead of ``j // (value_heads/key_heads)``
    tiled: bool = False

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def conv_state(self) -> tuple[int, int]:
        return (self.conv_kernel - 1, self.conv_channels)

    @property
    def ssm_state(self) -> tuple[int, int, int]:
        return (self.value_heads, self.key_dim, self.value_dim)


def _subnormals_flushed() -> bool:
    """Whether this thread flushes subnormal floats to zero (FTZ/DAZ): the smallest float32
    subnormal times one then comes out as zero."""
    return float(torch.full((1,), 1e-45).mul_(1.0)) == 0.0


@contextlib.contextmanager
def flushed_subnormals() -> Iterator[None]:
    """Subnormal float32 values read and produced as zero on this thread inside the block, as
    freetoken_cpu_moe's kernels run (csrc/fp_env.h); the thread's previous mode comes back after.

    States of heads that forget fast decay into the subnormal range, where every x86 multiply
    and add takes a microcode assist: with them the decode recurrence ran 4-5x slower. Values
    below 1.2e-38 are far below the rounding error of the state's other entries."""
    if _subnormals_flushed() or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence: ``q, k`` ``[H, n, dk]`` (normalised, q scaled), ``v`` ``[H, n, dv]``,
    ``g, beta`` ``[H, n]``, ``state`` ``[H, dk, dv]``; all float32. Returns the outputs
    ``[H, n, dv]`` and the final state.

    Within a chunk, with ``c_i`` the cumulative log-decay up to token ``i``,
    ``D_ij = exp(c_i - c_j)`` for ``j <= i`` (0 above the diagonal) and ``L`` the strictly
    lower part of ``(beta k k^T) * D``: ``u = (I + L)^{-1} (beta v)`` and
    ``w = (I + L)^{-1} (beta k exp(c))``; then ``v' = u - w S``,
    ``o = (q exp(c)) S + ((q k^T) * D) v'`` and ``S <- exp(c_last) S + (k exp(c_last - c))^T v'``.
    """
    H, n, dk = k.shape
    pad = (-n) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    N = (n + pad) // chunk
    q, k, v = (x.view(H, N, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.view(H, N, chunk), beta.view(H, N, chunk)
    c = g.cumsum(-1)  # [H, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # [H, N, C, C]
    kb = k * beta.unsqueeze(-1)
    system = (kb @ k.transpose(-1, -2)) * decay  # the diagonal is taken as 1 by the solve
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * c.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * c.exp().unsqueeze(-1)
    k_dec = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    last = c[..., -1].exp()  # [H, N]
    out = torch.empty_like(v)
    S = state
    for i in range(N):
        v_new = u[:, i] - w[:, i] @ S
        out[:, i] = q_dec[:, i] @ S + attn[:, i] @ v_new
        S = S * last[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, N * chunk, -1)[:, :n], S


def recurrent_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One token of ``B`` sequences: ``q, k`` ``[B, H, dk]``, ``v`` ``[B, H, dv]``, ``g, beta``
    ``[B, H]``, ``state`` ``[B, H, dk, dv]`` (contiguous, updated in place); float32. Returns ``o``
    ``[B, H, dv]``.

    The state is read once for both ``q^T S`` and ``k^T S`` and updated in place, since with
    ``d = exp(g)``: ``k^T (d S) = d k^T S`` and ``o = q^T (d S + k delta^T) = d q^T S + (q . k) delta``
    (decode time is dominated by passes over the ``[H, dk, dv]`` states)."""
    B, H, dk = k.shape
    dv = v.shape[-1]
    qs, ks = torch.matmul(torch.stack([q, k], -2), state).unbind(-2)  # [B, H, dv] each
    decay = g.exp().unsqueeze(-1)
    delta = (v - decay * ks) * beta.unsqueeze(-1)
    o = decay * qs + (q * k).sum(-1, keepdim=True) * delta
    state.mul_(decay.unsqueeze(-1))
    state.view(B * H, dk, dv).baddbmm_(k.reshape(B * H, dk, 1), delta.reshape(B * H, 1, dv))
    return o


class GatedDeltaNet:
    """One linear-attention layer's weights and its forward over a step's tokens.

    ``proj`` returns ``[q|k|v]`` (conv channels), ``z``, ``b`` and ``a`` from one input;
    ``conv_weight`` is ``[channels, kernel]``; ``A`` is ``-exp(A_log)`` (float32);
    ``norm`` the gated RMSNorm weight ``[dv]``; ``out`` the output projection.
    """

    def __init__(self, layer: int, shape: DeltaNetShape, proj: Any, conv_weight: torch.Tensor, A: torch.Tensor,
                 dt_bias: torch.Tensor, norm: torch.Tensor, out: Any, eps: float) -> None:  # fmt: skip
        self.layer = layer
        self.shape = shape
        self.proj = proj
        self.conv_weight = conv_weight
        self.A = A.float()
        self.dt_bias = dt_bias.float()
        self.norm = norm
        self.out = out
        self.eps = eps
        self.pool: Any = None  # the engine's RecurrentStatePool, attached before the first step
        self.ops: DenseOps = TORCH_OPS  # the model's per-token ops (decode steps run through them)

    @property
    def nbytes(self) -> int:
        return int(self.proj.nbytes + self.out.nbytes)

    def __call__(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        s = self.shape
        if self.pool is None:
            raise RuntimeError(f"linear-attention layer {self.layer}: no recurrent-state pool attached; the engine "
                               "attaches one (RecurrentStatePool) before the model runs")
        conv_state, ssm_state = self.pool.layers[self.layer]
        mixed, z, b, a = self.proj(x)
        T = x.shape[0]
        if meta.decode:
            slots = self.pool.decode_slots[:T]
            return self.out(self.ops.deltanet_decode(self, mixed, z, b, a, conv_state, ssm_state, slots))
        if meta.state_slots is None:
            raise RuntimeError("a prefill step of a model with recurrent layers needs meta.state_slots")
        beta, g = self._gates(b, a)
        with flushed_subnormals():
            y = torch.empty(T, s.value_heads, s.value_dim, dtype=torch.float32, device=x.device)
            for seq, slot in zip(meta.seqs, meta.state_slots):
                r = slice(seq.q_start, seq.q_start + seq.q_len)
                y[r] = self._prefill(mixed[r], g[r], beta[r], conv_state, ssm_state, slot)
        return self.out(self._gated_norm(y.to(x.dtype), z))

    def decode_torch(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                     conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """One decode token per state slot, in torch ops (what
        :meth:`freetoken.models.dense_ops.DenseOps.deltanet_decode` runs unless a backend
        brings its own): from the input projection's outputs to the gated RMSNorm's output
        ``[T, value_heads * value_dim]`` in ``z``'s dtype; the states are updated in place."""
        beta, g = self._gates(b, a)
        with flushed_subnormals():
            y = self._decode(mixed, g, beta, conv_state, ssm_state, slots)
        return self._gated_norm(y.to(z.dtype), z)

    # ---------------------------------------------------------------- pieces

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``beta = sigmoid(b)`` and the log-decay ``g = A * softplus(a + dt_bias)``, float32."""
        return torch.sigmoid(b).float(), self.A * F.softplus(a.float() + self.dt_bias)

    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[..., channels]`` -> q, k ``[..., Hv, dk]`` (repeated over their value heads,
        normalised, q scaled) and v ``[..., Hv, dv]``, float32."""
        s = self.shape
        kd = s.key_heads * s.key_dim
        lead = conv_out.shape[:-1]
        q, k, v = conv_out.float().split([kd, kd, s.value_heads * s.value_dim], dim=-1)
        rep = s.value_heads // s.key_heads
        q = l2_normalize(q.reshape(*lead, s.key_heads, s.key_dim)) * s.key_dim ** -0.5
        k = l2_normalize(k.reshape(*lead, s.key_heads, s.key_dim))
        if rep > 1 and s.tiled:
            reps = (1,) * (q.dim() - 2) + (rep, 1)
            q, k = q.repeat(reps), k.repeat(reps)
        elif rep > 1:
            q = q.repeat_interleave(rep, dim=-2)
            k = k.repeat_interleave(rep, dim=-2)
        return q, k, v.reshape(*lead, s.value_heads, s.value_dim)

    def _prefill(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_state: torch.Tensor,
                 ssm_state: torch.Tensor, slot: int) -> torch.Tensor:  # fmt: skip
        n = mixed.shape[0]
        K = self.shape.conv_kernel
        window = torch.cat([conv_state[slot], mixed.to(conv_state.dtype)], 0)  # [K-1+n, C]
        conv_state[slot] = window[n:]
        w = self.conv_weight
        conv = F.conv1d(window.t().unsqueeze(0).to(w.dtype), w.unsqueeze(1), groups=w.shape[0])[0].t()  # [n, C]
        conv = F.silu(conv).to(mixed.dtype)
        assert conv.shape[0] == n and window.shape[0] == n + K - 1
        q, k, v = self._split(conv)  # [n, H, d]
        o, S = chunked_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t(),
                                  ssm_state[slot])  # fmt: skip
        ssm_state[slot] = S
        return o.transpose(0, 1)

    def _decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        window = torch.cat([conv_state.index_select(0, slots), mixed.to(conv_state.dtype).unsqueeze(1)], 1)  # [B, K, C]
        conv_state.index_copy_(0, slots, window[:, 1:])
        # products and sum in float32 (a BF16 sum of the kernel's products loses a channel
        # that nearly cancels, and its q/k normalisation then amplifies that error; the
        # weights are promoted inside the product, not copied), the output in the activation dtype
        conv = F.silu((window.float() * self.conv_weight.t().unsqueeze(0)).sum(1)).to(mixed.dtype)
        q, k, v = self._split(conv)  # [B, H, d]
        if slots.device.type == "cpu":
            # slots readable on the host: each state is updated where it lives (a gather and a
            # scatter of the [H, dk, dv] states cost more than the recurrence itself)
            return torch.cat([recurrent_delta_step(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1],
                                                   beta[b : b + 1], ssm_state[slot : slot + 1])
                              for b, slot in enumerate(slots.tolist())])  # fmt: skip
        # on a device the step may be replayed from a graph with other slots in the static
        # buffer: gather the states, update the copy, scatter it back
        S = ssm_state.index_select(0, slots)
        o = recurrent_delta_step(q, k, v, g, beta, S)
        ssm_state.index_copy_(0, slots, S)
        return o

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm per value head (weight ``[dv]``), times ``silu(z)``; in ``y``'s dtype."""
        s = self.shape
        T = y.shape[0]
        yf = y.float().view(T, s.value_heads, s.value_dim)
        yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.norm * yf.to(y.dtype)
        out = out * F.silu(z.float().view(T, s.value_heads, s.value_dim))
        return out.to(y.dtype).reshape(T, s.value_heads * s.value_dim)
