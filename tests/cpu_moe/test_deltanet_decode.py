"""The CPU backend's native Gated DeltaNet decode step (freetoken_cpu_moe.decode_ops,
csrc/deltanet.cpp) against the delta rule written out in float64 numpy (decay, delta
update, read-out, one token at a time) and against the layer's torch form: outputs, the
updated states and convolution windows of the tokens' slots, the other slots untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.models.dense_ops import TORCH_OPS
from freetoken.models.gated_deltanet import DeltaNetShape, GatedDeltaNet
import freetoken_cpu_moe as cm
from freetoken_cpu_moe import decode_ops
from freetoken_cpu_moe.decode_ops import CPU_OPS

DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 3e-2)}
POISON = 7.0


def _layer(rng: np.random.Generator, shape: DeltaNetShape, dtype: torch.dtype) -> GatedDeltaNet:
    def t(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.from_numpy((rng.standard_normal(size) * scale).astype(np.float32))

    A = -torch.from_numpy(rng.uniform(0.2, 3.0, shape.value_heads).astype(np.float32))
    return GatedDeltaNet(0, shape, None, t(shape.conv_channels, shape.conv_kernel, scale=0.5).to(dtype), A,
                         t(shape.value_heads), t(shape.value_dim).to(dtype), None, 1e-6)  # fmt: skip


def _reference(layer: GatedDeltaNet, mixed, z, b, a, conv_state, ssm_state, slots, round_conv=None):
    """Float64 copies of the step: outputs [T, Hv*dv], then the conv windows and states.
    ``round_conv``: a dtype the convolution's output (after SiLU) is rounded to, as the
    layer's torch form keeps it in the activation dtype."""
    s = layer.shape
    f64 = lambda x: x.double().numpy().copy()  # noqa: E731
    conv_state, ssm_state = f64(conv_state), f64(ssm_state)
    w, A, dt_bias, norm = f64(layer.conv_weight), f64(layer.A), f64(layer.dt_bias), f64(layer.norm)
    silu = lambda x: x / (1.0 + np.exp(-x))  # noqa: E731
    kd, rep = s.key_heads * s.key_dim, s.value_heads // s.key_heads
    out = np.zeros((len(slots), s.value_heads, s.value_dim))
    for t, slot in enumerate(slots.tolist()):
        window = np.concatenate([conv_state[slot], f64(mixed[t])[None]], 0)  # [K, C]
        conv_state[slot] = window[1:]
        conv = silu((window * w.T).sum(0))
        if round_conv is not None:
            conv = torch.from_numpy(conv).to(round_conv).double().numpy()
        q = conv[:kd].reshape(s.key_heads, s.key_dim)
        k = conv[kd : 2 * kd].reshape(s.key_heads, s.key_dim)
        v = conv[2 * kd :].reshape(s.value_heads, s.value_dim)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(s.key_dim)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        beta = 1.0 / (1.0 + np.exp(-f64(b[t])))
        g = A * np.log1p(np.exp(f64(a[t]) + dt_bias))
        for h in range(s.value_heads):
            kh = h % s.key_heads if s.tiled else h // rep
            S = ssm_state[slot, h] * np.exp(g[h])
            delta = beta[h] * (v[h] - S.T @ k[kh])
            S = S + np.outer(k[kh], delta)
            ssm_state[slot, h] = S
            o = S.T @ q[kh]
            out[t, h] = o / np.sqrt((o * o).mean() + layer.eps) * norm
    out = out.reshape(len(slots), -1) * silu(f64(z))
    return out, conv_state, ssm_state


def _close(got: torch.Tensor, ref: np.ndarray, tol: float, what: str) -> None:
    g = got.double().numpy()
    err = np.abs(g - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err < tol, f"{what}: max error {err:.3g}"


@pytest.fixture(params=cm.isa_tiers())
def tier(request):
    """Each ISA tier this CPU runs (the recurrence and SiLU have one body per tier)."""
    before = cm.active_isa()
    cm.set_isa(request.param)
    yield request.param
    cm.set_isa(before)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("tiled", [True, False])
def test_deltanet_decode_matches_float64_and_torch(rng, dtype, tiled, tier, monkeypatch):
    dt, tol = DTYPES[dtype]
    calls = []
    native = decode_ops._core.deltanet_decode
    monkeypatch.setattr(decode_ops._core, "deltanet_decode", lambda *a: calls.append(1) or native(*a))
    shape = DeltaNetShape(key_heads=2, value_heads=6, key_dim=32, value_dim=24, conv_kernel=4, tiled=tiled)
    layer = _layer(rng, shape, dt)
    T, nslots = 3, 6
    slots = torch.tensor([4, 1, 2], dtype=torch.int64)
    # the input projection's outputs: column slices of one wider row, as FusedLinears returns them
    C, Z, H = shape.conv_channels, shape.value_heads * shape.value_dim, shape.value_heads
    proj = torch.from_numpy(rng.standard_normal((T, C + Z + 2 * H)).astype(np.float32)).to(dt)
    mixed, z, b, a = proj.split([C, Z, H, H], dim=-1)
    conv0 = torch.full((nslots, *shape.conv_state), POISON, dtype=dt)
    ssm0 = torch.full((nslots, *shape.ssm_state), POISON, dtype=torch.float32)
    for slot in slots.tolist():
        conv0[slot] = torch.from_numpy(rng.standard_normal(shape.conv_state).astype(np.float32)).to(dt)
        ssm0[slot] = torch.from_numpy(rng.standard_normal(shape.ssm_state).astype(np.float32) * 0.3)
    # both implementations keep the convolution's output in the activation dtype: so does the
    # reference (without it, ~1 draw in 10^3 has a channel that nearly cancels, whose rounding
    # the q/k normalisation amplifies past the BF16 bound)
    ref_out, ref_conv, ref_ssm = _reference(layer, mixed, z, b, a, conv0, ssm0, slots,
                                            None if dt == torch.float32 else dt)

    results = {}
    for name, ops in (("native", CPU_OPS), ("torch", TORCH_OPS)):
        conv, ssm = conv0.clone(), ssm0.clone()
        out = ops.deltanet_decode(layer, mixed, z, b, a, conv, ssm, slots)
        assert out.shape == (T, Z) and out.dtype == dt
        _close(out, ref_out, tol, f"{name} output")
        _close(conv, ref_conv, tol, f"{name} conv windows")
        _close(ssm, ref_ssm, tol, f"{name} states")
        others = [i for i in range(nslots) if i not in slots.tolist()]
        assert (conv[others] == POISON).all() and (ssm[others] == POISON).all(), f"{name}: other slots written"
        results[name] = out
    assert len(calls) == 1, "the native op did not run"
    # each is within tol of float64, so of each other within twice that (bfloat16: the two round
    # at different points; one seed in ~10^3 put them 0.033 apart with each within 0.022 of float64)
    _close(results["native"], results["torch"].double().numpy(), 2 * tol, "native against torch")


def test_deltanet_decode_rejects_bad_slots(rng):
    shape = DeltaNetShape(key_heads=1, value_heads=2, key_dim=8, value_dim=8, conv_kernel=4)
    layer = _layer(rng, shape, torch.float32)
    C, Z = shape.conv_channels, 2 * 8
    mixed, z, b, a = torch.randn(2, C), torch.randn(2, Z), torch.randn(2, 2), torch.randn(2, 2)
    conv, ssm = torch.zeros(3, *shape.conv_state), torch.zeros(3, *shape.ssm_state)
    with pytest.raises(ValueError, match="state slot 3 out of range"):
        CPU_OPS.deltanet_decode(layer, mixed, z, b, a, conv, ssm, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="state slot 1 given to two tokens"):
        CPU_OPS.deltanet_decode(layer, mixed, z, b, a, conv, ssm, torch.tensor([1, 1]))


def test_deltanet_decode_padded_rows_share_the_scratch_slot(rng):
    """A decode graph pads its bucket with rows on the pool's scratch slot (the last row):
    the real rows' results and states equal an unpadded step; the other slots stay untouched."""
    shape = DeltaNetShape(key_heads=1, value_heads=2, key_dim=8, value_dim=8, conv_kernel=4)
    layer = _layer(rng, shape, torch.float32)
    C, Z = shape.conv_channels, 2 * 8
    mixed, z, b, a = torch.randn(4, C), torch.randn(4, Z), torch.randn(4, 2), torch.randn(4, 2)
    mixed[2:], z[2:], b[2:], a[2:] = mixed[0], z[0], b[0], a[0]  # padding repeats row 0
    conv0 = torch.from_numpy(rng.standard_normal((4, *shape.conv_state)).astype(np.float32))
    ssm0 = torch.from_numpy(rng.standard_normal((4, *shape.ssm_state)).astype(np.float32) * 0.3)
    conv, ssm = conv0.clone(), ssm0.clone()
    out = CPU_OPS.deltanet_decode(layer, mixed, z, b, a, conv, ssm, torch.tensor([2, 0, 3, 3]))
    want_conv, want_ssm = conv0.clone(), ssm0.clone()
    want = CPU_OPS.deltanet_decode(layer, mixed[:2], z[:2], b[:2], a[:2], want_conv, want_ssm, torch.tensor([2, 0]))
    torch.testing.assert_close(out[:2], want)
    torch.testing.assert_close(conv[:3], want_conv[:3])
    torch.testing.assert_close(ssm[:3], want_ssm[:3])
    assert torch.equal(conv[1], conv0[1]) and torch.equal(ssm[1], ssm0[1])
