"""The CPU backend's native decode path: the fused per-token ops (freetoken_cpu_moe.decode_ops)
against float64 numpy, and whole engines (prefill + greedy decode, several sequences) whose
logits with the native attention and ops equal HF transformers' and the torch path's."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from freetoken.models.layers import Rotary
from freetoken_cpu_moe import _core
from freetoken_cpu_moe import attention as cpu_attention
from freetoken_cpu_moe.decode_ops import CPU_OPS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from helpers import LogitsRecorder, assert_close, engine_for, hf_logits, make_hf  # noqa: E402

DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 2e-2)}


def rms64(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def rope64(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """NeoX rotation of x [T, heads, D] at positions pos [T], float64."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * cos + rot * sin


def close(got: torch.Tensor, ref: np.ndarray, tol: float) -> None:
    g = got.double().numpy()
    err = np.abs(g - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err < tol, f"max error {err:.3g}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(rng, dtype, with_delta):
    dt, tol = DTYPES[dtype]
    h = torch.from_numpy(rng.standard_normal((3, 200)).astype(np.float32)).to(dt)
    d = torch.from_numpy(rng.standard_normal((3, 200)).astype(np.float32)).to(dt) if with_delta else None
    w = torch.from_numpy(rng.standard_normal(200).astype(np.float32)).to(dt)
    h_out, x = CPU_OPS.add_rms_norm(h, d, w, 1e-6)
    s = h.double().numpy() + (d.double().numpy() if with_delta else 0)
    close(h_out, s, tol)
    close(x, rms64(h_out.double().numpy(), w.double().numpy(), 1e-6), tol)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_store(rng, dtype, norm):
    """q/k as views of one fused projection output; K/V land in their cache slots, nothing else moves."""
    dt, tol = DTYPES[dtype]
    T, Hq, Hkv, D, nb, bs = 3, 4, 2, 32, 5, 4
    fused = torch.from_numpy(rng.standard_normal((T, (Hq + 2 * Hkv) * D)).astype(np.float32)).to(dt)
    q, k, v = fused.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    qw = torch.from_numpy(1 + 0.1 * rng.standard_normal(D).astype(np.float32)).to(dt) if norm else None
    kw = torch.from_numpy(1 + 0.1 * rng.standard_normal(D).astype(np.float32)).to(dt) if norm else None
    rotary = Rotary(D, 10000.0, 64, torch.device("cpu"))
    pos = torch.tensor(rng.choice(64, T, replace=False), dtype=torch.int64)
    slots = torch.tensor(rng.choice(nb * bs, T, replace=False), dtype=torch.int64)
    kc = torch.full((nb, bs, Hkv, D), 7.0, dtype=dt)
    vc = torch.full((nb, bs, Hkv, D), 7.0, dtype=dt)
    qo = CPU_OPS.qk_norm_rope_store(q, k, v, qw, kw, None, rotary, pos, kc, vc, slots, 1e-6)
    p = pos.double().numpy()
    qn = q.double().numpy().reshape(T, Hq, D)
    kn = k.double().numpy().reshape(T, Hkv, D)
    if norm:
        qn, kn = rms64(qn, qw.double().numpy(), 1e-6), rms64(kn, kw.double().numpy(), 1e-6)
    close(qo, rope64(qn, p, 10000.0), tol)
    flat_k, flat_v = kc.view(nb * bs, Hkv, D), vc.view(nb * bs, Hkv, D)
    close(flat_k[slots], rope64(kn, p, 10000.0), tol)
    close(flat_v[slots], v.double().numpy().reshape(T, Hkv, D), tol)
    others = torch.ones(nb * bs, dtype=torch.bool)
    others[slots] = False
    assert (flat_k[others] == 7).all() and (flat_v[others] == 7).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_rope_store(rng, dtype, with_bias):
    """GPT-OSS's attention input: projection biases, RoPE without a norm, the K/V write;
    against float64 and against the torch ops (the base class's implementation)."""
    from freetoken.models.dense_ops import TORCH_OPS

    dt, tol = DTYPES[dtype]
    T, Hq, Hkv, D, nb, bs = 3, 8, 2, 64, 5, 4
    fused = torch.from_numpy(rng.standard_normal((T, (Hq + 2 * Hkv) * D)).astype(np.float32)).to(dt)
    q, k, v = fused.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    bias = None
    if with_bias:
        bias = tuple(torch.from_numpy(rng.standard_normal(n * D).astype(np.float32)) for n in (Hq, Hkv, Hkv))
    rotary = Rotary(D, 150000.0, 64, torch.device("cpu"))
    pos = torch.tensor(rng.choice(64, T, replace=False), dtype=torch.int64)
    slots = torch.tensor(rng.choice(nb * bs, T, replace=False), dtype=torch.int64)
    cos, sin = rotary.tables(pos, dt)
    caches = {}
    for name, ops in (("native", CPU_OPS), ("torch", TORCH_OPS)):
        kc = torch.full((nb, bs, Hkv, D), 7.0, dtype=dt)
        vc = torch.full((nb, bs, Hkv, D), 7.0, dtype=dt)
        qo = ops.bias_rope_store(q, k, v, bias, rotary, cos, sin, pos, kc, vc, slots)
        caches[name] = (qo, kc, vc)
    p = pos.double().numpy()
    qn, kn, vn = (t.double().numpy() for t in (q, k, v))
    if with_bias:
        qn, kn, vn = (a + b.double().numpy() for a, b in zip((qn, kn, vn), bias))
    qo, kc, vc = caches["native"]
    close(qo, rope64(qn.reshape(T, Hq, D), p, 150000.0), tol)
    flat_k, flat_v = kc.view(nb * bs, Hkv, D), vc.view(nb * bs, Hkv, D)
    close(flat_k[slots], rope64(kn.reshape(T, Hkv, D), p, 150000.0), tol)
    close(flat_v[slots], vn.reshape(T, Hkv, D), tol)
    others = torch.ones(nb * bs, dtype=torch.bool)
    others[slots] = False
    assert (flat_k[others] == 7).all() and (flat_v[others] == 7).all()
    for a, b in zip(caches["native"], caches["torch"]):
        close(a, b.double().numpy(), tol)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_moe_bias_add(rng, dtype):
    """The experts' down biases weighted by the routes (ids < 0 skipped), from the first
    ``hidden`` columns of a wider output; against float64 and the torch ops."""
    from freetoken.models.dense_ops import TORCH_OPS

    dt, tol = DTYPES[dtype]
    T, K, E, H, pad = 4, 4, 6, 200, 32
    y = torch.from_numpy(rng.standard_normal((T, H + pad)).astype(np.float32)).to(dt)
    ids = torch.from_numpy(rng.integers(0, E, size=(T, K)).astype(np.int32))
    ids[1, 2] = -1
    w = torch.from_numpy(rng.random((T, K)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal((E, H)).astype(np.float32))
    out = CPU_OPS.moe_bias_add(y, ids, w, bias, H, dt)
    assert out.shape == (T, H) and out.dtype == dt
    b64 = bias.double().numpy()
    ref = y.double().numpy()[:, :H].copy()
    for t in range(T):
        for j in range(K):
            if ids[t, j] >= 0:
                ref[t] += float(w[t, j]) * b64[int(ids[t, j])]
    close(out, ref, tol)
    ids_ok = ids.clone()
    ids_ok[1, 2] = 0
    w_ok = w.clone()
    w_ok[1, 2] = 0.0
    close(out, TORCH_OPS.moe_bias_add(y, ids_ok, w_ok, bias, H, dt).double().numpy(), tol)
    with pytest.raises(ValueError, match="expert id 6 out of range"):
        CPU_OPS.moe_bias_add(y, torch.full((T, K), E, dtype=torch.int32), w, bias, H, dt)


def test_qk_norm_rope_store_rejects_bad_slots(rng):
    q, k, v = torch.randn(1, 64), torch.randn(1, 32), torch.randn(1, 32)
    kc = vc = torch.zeros(2, 4, 1, 32)
    with pytest.raises(ValueError, match="cache slot 8 out of range"):
        CPU_OPS.qk_norm_rope_store(q, k, v, None, None, None, Rotary(32, 1e4, 8, torch.device("cpu")),
                                   torch.tensor([0]), kc, vc, torch.tensor([8]), 1e-6)  # fmt: skip


@pytest.mark.parametrize("norm", [True, False])
def test_router_top_k(rng, norm):
    logits = torch.from_numpy(rng.standard_normal((5, 128)).astype(np.float32) * 3)
    ids, w = CPU_OPS.router_top_k(logits, 8, norm)
    x = logits.double().numpy()
    order = np.argsort(-x, axis=-1, kind="stable")[:, :8]
    assert ids.dtype == torch.int32 and (ids.numpy() == order).all()
    top = np.take_along_axis(x, order, -1)
    if norm:
        ref = np.exp(top - top[:, :1]) / np.exp(top - top[:, :1]).sum(-1, keepdims=True)
    else:
        ref = np.exp(top - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
    # float32 exponentials summed over the 128 logits: up to ~10 units in the last place of the
    # largest weight (1.15e-6, seed 266264720; 1.02e-6 the worst of 3000 seeds)
    close(w, ref, 1e-6 if norm else 4e-6)


# ------------------------------------------------------------------ engines


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf-cpu-native"))
    seed = random.randrange(1 << 30)
    # 32 q / 4 kv heads of 16: GQA 8, as Qwen3-30B-A3B
    model = make_hf(path, seed, num_attention_heads=32, num_key_value_heads=4, hidden_size=128)
    return model, path, seed


def _generate(path: str, prompts: list[list[int]], monkeypatch, mode: str) -> tuple[dict, list, dict]:
    from freetoken import SamplingParams

    counts = {"attention": 0, "ops": 0}
    real_attn, real_rope = _core.paged_attention, _core.qk_norm_rope_store

    def attn(*a, **k):
        counts["attention"] += 1
        return real_attn(*a, **k)

    def rope(*a, **k):
        counts["ops"] += 1
        return real_rope(*a, **k)

    monkeypatch.setattr(cpu_attention._core, "paged_attention", attn)
    monkeypatch.setattr(_core, "qk_norm_rope_store", rope)
    monkeypatch.setenv(cpu_attention.ATTENTION_ENV, mode)
    eng = engine_for(path, prefill_chunk=24)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        with LogitsRecorder(eng) as rec:
            reqs = [eng.add_request(p, params) for p in prompts]
            while eng.has_work():
                eng.step()
        return {r.request_id: torch.stack(rec[r.request_id]) for r in reqs}, reqs, counts
    finally:
        eng.close()


def test_engine_native_path_matches_hf_and_torch(checkpoint, monkeypatch):
    """Prompts of different lengths (one longer than a prefill chunk and several KV blocks),
    then greedy decode of all of them in the same steps."""
    model, path, seed = checkpoint
    rng = random.Random(seed)
    prompts = [[rng.randrange(160) for _ in range(n)] for n in (5, 40, 17)]
    native, reqs, counts = _generate(path, prompts, monkeypatch, "native")
    assert counts["attention"] > 0 and counts["ops"] > 0, counts
    for p, r in zip(prompts, reqs):
        full = p + r.output_ids
        ref = hf_logits(model, full)[len(p) - 1 : len(full) - 1]
        assert_close(native[r.request_id], ref, f"seed {seed} prompt len {len(p)}")
        assert r.output_ids == ref.argmax(-1).tolist()
    monkeypatch.setenv("FREETOKEN_DENSE_OPS", "torch")
    torch_path, reqs_t, counts_t = _generate(path, prompts, monkeypatch, "torch")
    assert counts_t == {"attention": 0, "ops": 0}
    for r, rt in zip(reqs, reqs_t):
        assert r.output_ids == rt.output_ids
        assert_close(native[r.request_id], torch_path[rt.request_id], f"seed {seed}")
