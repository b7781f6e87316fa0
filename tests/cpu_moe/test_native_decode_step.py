"""The one-call decode step (freetoken_cpu_moe.decode_step, csrc/decode_step.cpp): one step of
random float32 layers against float64 numpy; whole engines (an HF checkpoint, a GGUF file of
mixed block formats; float32 and bfloat16; every ISA tier) whose every decode step equals the
per-op path's bit for bit; the models it declines; a wrapped part sending steps back to the
per-op path."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import freetoken_cpu_moe as cm
from freetoken_cpu_moe import _core
from freetoken_cpu_moe.decode_step import NativeDecode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from helpers import assert_close, engine_for, hf_logits, make_hf, run_random_greedy  # noqa: E402
from test_engine_gguf import write_tiny_gguf  # noqa: E402


@pytest.fixture(autouse=True)
def native_attention(monkeypatch):
    """The native step needs the native attention, which every tier but scalar takes by default
    (freetoken_cpu_moe.attention.TORCH_TIERS); these tests are about the step on any tier."""
    monkeypatch.setenv("FREETOKEN_CPU_ATTENTION", "native")


def rms64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope64(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """NeoX rotation of x [T, heads, D] at positions pos [T], float64."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = pos[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], -1)[:, None]
    rot = np.concatenate([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)


def test_one_step_against_float64(rng):
    """Two layers, three sequences with cached context, float32 weights: the step's hidden
    states and the K/V it writes against a float64 forward; the output starts as NaN."""
    from freetoken.models.layers import Rotary

    H, Hq, Hkv, D, E, K, I, L, eps, theta = 64, 4, 2, 16, 6, 2, 32, 2, 1e-6, 10000.0
    nb, bs = 8, 4
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    layers = []
    for _ in range(L):
        layers.append(dict(
            in_norm=1 + 0.1 * f32(H), post_norm=1 + 0.1 * f32(H), q_norm=1 + 0.1 * f32(D), k_norm=1 + 0.1 * f32(D),
            q=0.2 * f32(Hq * D, H), k=0.2 * f32(Hkv * D, H), v=0.2 * f32(Hkv * D, H), o=0.2 * f32(H, Hq * D),
            router=f32(E, H), gate=0.2 * f32(E, I, H), up=0.2 * f32(E, I, H), down=0.2 * f32(E, H, I),
        ))
    final_norm = 1 + 0.1 * f32(H)
    rotary = Rotary(D, theta, 64, torch.device("cpu"))
    caches = [(torch.from_numpy(f32(nb, bs, Hkv, D)), torch.from_numpy(f32(nb, bs, Hkv, D))) for _ in range(L)]
    keep, specs = [], []
    for lw, (kc, vc) in zip(layers, caches):
        qkv = [cm.Weights(lw[n], "f32", 1, lw[n].shape[0], H) for n in ("q", "k", "v")]
        o = cm.Weights(lw["o"], "f32", 1, H, Hq * D)
        router = cm.Weights(lw["router"], "f32", 1, E, H)
        bank = cm.ExpertBank(cm.Weights(lw["gate"], "f32", E, I, H), cm.Weights(lw["up"], "f32", E, I, H),
                             cm.Weights(lw["down"], "f32", E, H, I))
        norms = [torch.from_numpy(lw[n]) for n in ("in_norm", "post_norm", "q_norm", "k_norm")]
        keep += [qkv, o, router, bank, norms]
        specs.append((norms[0].data_ptr(), norms[1].data_ptr(), [w.address for w in qkv], [0, Hq * D, (Hq + Hkv) * D],
                      norms[2].data_ptr(), norms[3].data_ptr(), o.address, router.address, bank.address,
                      kc.data_ptr(), vc.data_ptr()))
    fn = torch.from_numpy(final_norm)
    step = _core.DecodeStep(fmt=0, norm_fmt=0, kv_fmt=0, H=H, Hq=Hq, Hkv=Hkv, D=D, E=E, K=K, norm_topk=True, eps=eps,
                            scale=D ** -0.5, final_norm=fn.data_ptr(), cos=rotary.cos.data_ptr(),
                            sin_signed=rotary.sin_signed.data_ptr(), max_pos=64, num_blocks=nb, block_size=bs,
                            layers=specs)  # fmt: skip
    # three sequences, one new token each at the end of contexts of 3, 9 and 14 positions
    ctx = np.array([3, 9, 14], dtype=np.int32)
    tab = np.array([[5, 0, 0, 0], [0, 4, 2, 0], [1, 3, 6, 7]], dtype=np.int32)  # padded rows
    width = tab.shape[1]
    pos = ctx.astype(np.int64) - 1
    slots = np.array([tab[s, p // bs] * bs + p % bs for s, p in enumerate(pos)], dtype=np.int64)
    T = 3
    x = f32(T, H)
    kv_before = [(kc.double().numpy().copy(), vc.double().numpy().copy()) for kc, vc in caches]
    out = torch.full((T, H), float("nan"))
    starts, lens = np.arange(3, dtype=np.int32), np.ones(3, dtype=np.int32)
    step.run(T=T, embed=x.ctypes.data, positions=pos.ctypes.data, slots=slots.ctypes.data, num_seqs=3,
             q_start=starts.ctypes.data, q_len=lens.ctypes.data, ctx_len=ctx.ctypes.data, block_table=tab.ctypes.data,
             bt_stride=width, out=out.data_ptr(), pool=cm.default_pool()._core)  # fmt: skip

    h = x.astype(np.float64)
    for li, lw in enumerate(layers):
        w = {n: a.astype(np.float64) for n, a in lw.items()}
        xn = rms64(h, w["in_norm"], eps)
        q = rms64((xn @ w["q"].T).reshape(T, Hq, D), w["q_norm"], eps)
        k = rms64((xn @ w["k"].T).reshape(T, Hkv, D), w["k_norm"], eps)
        v = (xn @ w["v"].T).reshape(T, Hkv, D)
        q, k = rope64(q, pos.astype(np.float64), theta), rope64(k, pos.astype(np.float64), theta)
        kcache, vcache = (a.reshape(nb * bs, Hkv, D).copy() for a in kv_before[li])
        kcache[slots], vcache[slots] = k, v
        kc_got, vc_got = (t.double().numpy().reshape(nb * bs, Hkv, D) for t in caches[li])
        np.testing.assert_allclose(kc_got, kcache, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(vc_got, vcache, rtol=1e-5, atol=1e-5)
        attn = np.zeros((T, Hq, D))
        for s in range(3):
            rows = [tab[s, p // bs] * bs + p % bs for p in range(ctx[s])]
            for hd in range(Hq):
                kv = hd // (Hq // Hkv)
                sc = kcache[rows, kv] @ q[s, hd] * D ** -0.5
                p = np.exp(sc - sc.max())
                attn[s, hd] = (p / p.sum()) @ vcache[rows, kv]
        h = h + attn.reshape(T, -1) @ w["o"].T
        xn = rms64(h, w["post_norm"], eps)
        logits = xn @ w["router"].T
        delta = np.zeros_like(h)
        for t in range(T):
            top = np.argsort(-logits[t], kind="stable")[:K]
            p = np.exp(logits[t, top] - logits[t, top].max())
            for e, pw in zip(top, p / p.sum()):
                g, u = w["gate"][e] @ xn[t], w["up"][e] @ xn[t]
                delta[t] += pw * (w["down"][e] @ (g / (1 + np.exp(-g)) * u))
        h = h + delta
    ref = rms64(h, final_norm.astype(np.float64), eps)
    got = out.double().numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_rejects_a_mismatched_layer():
    w = cm.Weights(np.zeros((8, 16), np.float32), "f32", 1, 8, 16)
    qkv = cm.Weights(np.zeros((16, 16), np.float32), "f32", 1, 16, 16)  # 2 q + 1 k + 1 v heads of 4
    norm = torch.ones(16)
    bank = cm.ExpertBank(*(cm.Weights(np.zeros((2, 16, 16), np.float32), "f32", 2, 16, 16) for _ in range(3)))
    kc = torch.zeros(2, 4, 1, 4)
    layer = (norm.data_ptr(), norm.data_ptr(), [qkv.address], [0], norm.data_ptr(), norm.data_ptr(), w.address,
             w.address, bank.address, kc.data_ptr(), kc.data_ptr())
    with pytest.raises(ValueError, match="layer 0 o: 1 x \\[8, 16\\], expected one \\[16, 8\\] matrix"):
        _core.DecodeStep(fmt=0, norm_fmt=0, kv_fmt=0, H=16, Hq=2, Hkv=1, D=4, E=2, K=1, norm_topk=True, eps=1e-6,
                         scale=0.5, final_norm=norm.data_ptr(), cos=norm.data_ptr(), sin_signed=norm.data_ptr(),
                         max_pos=4, num_blocks=2, block_size=4, layers=[layer])  # fmt: skip


# ------------------------------------------------------------------ engines


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    seed = random.randrange(1 << 30)
    hf_dir = str(tmp_path_factory.mktemp("hf-native-step"))
    model = make_hf(hf_dir, seed, num_attention_heads=8, num_key_value_heads=2, hidden_size=128)
    gguf_path = str(tmp_path_factory.mktemp("gguf-native-step") / "tiny.gguf")
    write_tiny_gguf(gguf_path, seed)
    return {"hf": hf_dir, "gguf": gguf_path}, model, seed


def _run_both(path: str, dtype: str, seed: int) -> tuple[list[int], dict[str, list[int]]]:
    """Greedy requests whose decode steps (1-3 sequences) run both paths: the per-op forward,
    then the native step into a NaN-filled output over the same cache; returns the batch
    size of each compared step and the tokens."""
    eng = engine_for(path, dtype=dtype, prefill_chunk=64, max_running_requests=3)
    native = eng.session.native_decode
    assert native is not None
    sizes: list[int] = []
    per_op = eng.session._step

    def both(ids, pos, meta):
        eng.session.native_decode = None
        try:
            want = per_op(ids, pos, meta)
        finally:
            eng.session.native_decode = native
        if not meta.decode:
            return want
        got = native(ids, pos, meta, out=torch.full_like(want, float("nan")))
        assert got is not None and torch.equal(got, want), f"seed {seed}: step of {ids.shape[0]} tokens differs"
        sizes.append(int(ids.shape[0]))
        return got

    eng.session._step = both
    try:
        # different lengths: decode steps of 3, 2 and 1 sequences
        reqs = run_random_greedy(eng, seed, [(5, 8), (21, 4), (12, 11)])
        return sizes, {r.request_id: r.output_ids for r in reqs}
    finally:
        eng.close()


@pytest.mark.parametrize("kind", ["hf", "gguf"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_steps_equal_per_op_path(checkpoints, monkeypatch, kind, dtype):
    paths, _, seed = checkpoints
    before = _core.active_isa()
    try:
        for tier in _core.isa_tiers():
            if tier == "amx":
                continue  # dense and expert kernels at decode sizes are the avx512 tier's
            _core.set_isa(tier)
            sizes, _ = _run_both(paths[kind], dtype, seed)
            assert 1 in sizes and max(sizes) > 1, sizes
    finally:
        _core.set_isa(before)


def test_engine_native_decode_matches_hf(checkpoints):
    """The greedy tokens and logits of native decode steps against transformers."""
    from freetoken import SamplingParams

    from helpers import LogitsRecorder

    paths, model, seed = checkpoints
    eng = engine_for(paths["hf"])
    assert eng.session.native_decode is not None
    rng = random.Random(seed + 1)
    try:
        with LogitsRecorder(eng) as rec:
            prompts = [[rng.randrange(160) for _ in range(n)] for n in (4, 19)]
            reqs = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0.0)) for p in prompts]
            while eng.has_work():
                eng.step()
        for p, r in zip(prompts, reqs):
            full = p + r.output_ids
            ref = hf_logits(model, full)[len(p) - 1 : len(full) - 1]
            assert_close(torch.stack(rec[r.request_id]), ref, f"seed {seed} prompt len {len(p)}")
            assert r.output_ids == ref.argmax(-1).tolist()
    finally:
        eng.close()


@pytest.mark.parametrize("env, value, reason", [
    ("FREETOKEN_DENSE_OPS", "torch", "not the session's native ops"),
    ("FREETOKEN_CPU_ATTENTION", "torch", "decode attention runs through torch"),
])  # fmt: skip
def test_declined_models_keep_the_per_op_path(checkpoints, monkeypatch, env, value, reason):
    paths, _, _ = checkpoints
    monkeypatch.setenv(env, value)
    eng = engine_for(paths["hf"])
    try:
        assert eng.session.native_decode is None
        _, why = NativeDecode.build(eng.model, eng.session.kv_caches, eng.session.ops, eng.session.attention.mode,
                                    eng.session.pool)  # fmt: skip
        assert reason in why
    finally:
        eng.close()


def test_native_step_turned_off_gives_the_per_op_tokens(checkpoints, monkeypatch):
    """With CpuModelSession.native_decode_step off (the tests' way to the reference path) the
    session builds no native step, and its greedy tokens are the native step's."""
    from freetoken import SamplingParams
    from freetoken_cpu_moe.backend import CpuModelSession

    paths, _, seed = checkpoints
    rng = random.Random(seed + 7)
    prompts = [[rng.randrange(160) for _ in range(n)] for n in (3, 11)]
    outs = {}
    for native in (True, False):
        monkeypatch.setattr(CpuModelSession, "native_decode_step", native)
        eng = engine_for(paths["hf"])
        try:
            assert (eng.session.native_decode is not None) == native
            reqs = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0.0)) for p in prompts]
            while eng.has_work():
                eng.step()
            outs[native] = [r.output_ids for r in reqs]
        finally:
            eng.close()
    assert outs[True] == outs[False]


def test_dense_mlp_layer_declined(tmp_path):
    path = str(tmp_path / "hf")
    make_hf(path, 3, mlp_only_layers=[1])
    eng = engine_for(path)
    try:
        assert eng.session.native_decode is None
        _, why = NativeDecode.build(eng.model, eng.session.kv_caches, eng.session.ops, eng.session.attention.mode,
                                    eng.session.pool)  # fmt: skip
        assert why == "layer 1 has a dense MLP"
    finally:
        eng.close()


def test_a_wrapped_router_takes_the_per_op_path(checkpoints):
    """A part replaced after loading (here a counter around one layer's route) runs: such
    steps take the per-op path; put back, the native step runs again."""
    from freetoken import SamplingParams

    paths, _, seed = checkpoints
    eng = engine_for(paths["hf"])
    native = eng.session.native_decode
    moe = eng.model.layers[1].moe
    calls: list[int] = []
    orig = moe.route

    def route(x):
        calls.append(int(x.shape[0]))
        return orig(x)

    try:
        moe.route = route
        assert not native.intact()
        r = eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while eng.has_work():
            eng.step()
        assert calls == [3, 1, 1, 1] and len(r.output_ids) == 4
        del moe.route
        assert native.intact()
    finally:
        eng.close()


def test_every_vector_tier_takes_the_native_step_by_default(checkpoints, monkeypatch):
    """Without FREETOKEN_CPU_ATTENTION, attention is native on every tier but scalar, so an
    engine built on an avx2 (or better) tier steps through the native decode; on scalar it
    keeps the per-op path and says why."""
    from freetoken_cpu_moe.attention import attention_mode

    paths, _, _ = checkpoints
    monkeypatch.delenv("FREETOKEN_CPU_ATTENTION")
    before = _core.active_isa()
    try:
        for tier in _core.isa_tiers():
            _core.set_isa(tier)
            assert attention_mode() == ("torch" if tier == "scalar" else "native"), tier
            eng = engine_for(paths["hf"])
            try:
                if tier == "scalar":
                    assert eng.session.native_decode is None
                else:
                    assert eng.session.native_decode is not None, tier
            finally:
                eng.close()
    finally:
        _core.set_isa(before)
