"""The functional API around the kernels: metadata, validation, array kinds,
weights read in place (torch, mmap), linear, pools."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from cpu_moe_cases import E, H, cm
from cpu_moe_reference import ACT_QUANT_BLOCK, act_quant_block, make_weights, moe_error, moe_reference, quantize_act, random_routes, rel_err

import freetoken


def test_version_and_metadata() -> None:
    assert cm.__version__ == "0.1.0" == freetoken.__version__
    assert cm.FORMATS == ("f32", "f16", "bf16", "fp8_e4m3_b128", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4")
    tiers = cm.isa_tiers()
    assert tiers[-1] == "scalar" and cm.active_isa() in tiers


def run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


def test_version_skew_is_refused() -> None:
    out = run_py("import freetoken; freetoken.__version__ = '9.9.9'; import freetoken_cpu_moe")
    assert out.returncode != 0 and "version skew" in out.stderr


@pytest.mark.parametrize("tier", cm.isa_tiers())
def test_env_forces_a_tier(tier: str) -> None:
    out = run_py("import freetoken_cpu_moe as cm; print(cm.active_isa())", FREETOKEN_CPU_MOE_ISA=tier)
    assert out.stdout.strip() == tier, out.stderr


def _uncapped_tiers() -> list[str]:
    out = run_py("import freetoken_cpu_moe as cm; print(' '.join(cm.isa_tiers()))", FREETOKEN_CPU_MOE_ISA="")
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_tiers_follow_the_cpu_flags() -> None:
    """Without a cap, a tier is listed exactly when /proc/cpuinfo shows what it needs (AMX also
    needs the kernel's permission for the tile state, so only one way for it)."""
    from freetoken.cpu_isa import detect_cpu

    flags = set(detect_cpu().flags)
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this system")
    tiers = _uncapped_tiers()
    assert tiers[-1] == "scalar"
    assert ("avx2" in tiers) == ({"avx2", "fma", "f16c"} <= flags)
    assert ("avx512" in tiers) == ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma"} <= flags)
    if "amx" in tiers:
        assert {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16"} <= flags


@pytest.mark.parametrize("tier", cm.isa_tiers())
def test_env_caps_the_tiers(tier: str) -> None:
    """FREETOKEN_CPU_MOE_ISA is a cap: the tiers above it are gone, as on a processor without
    them, and asking for one is refused with the cap named."""
    every = _uncapped_tiers()
    order = cm.ops.TIER_ORDER
    code = ("import freetoken_cpu_moe as cm, sys\n"
            "print(' '.join(cm.isa_tiers()))\n"
            "for t in sys.argv[1:]:\n"
            "    try:\n"
            "        cm.set_isa(t)\n"
            "        print('accepted', t)\n"
            "    except ValueError as exc:\n"
            "        print('refused', t, exc)\n")
    above = [t for t in every if order.index(t) < order.index(tier)]
    out = subprocess.run([sys.executable, "-c", code, *above], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FREETOKEN_CPU_MOE_ISA": tier})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == [t for t in every if order.index(t) >= order.index(tier)]
    for t, line in zip(above, lines[1:]):
        assert line.startswith(f"refused {t}") and f"FREETOKEN_CPU_MOE_ISA={tier}" in line, line
    assert len(lines) == 1 + len(above)


def test_unknown_cap_is_named_and_caps_nothing() -> None:
    out = run_py("import freetoken_cpu_moe as cm; print(' '.join(cm.isa_tiers()))", FREETOKEN_CPU_MOE_ISA="avx9000")
    assert out.returncode == 0 and out.stdout.split() == _uncapped_tiers()
    assert "FREETOKEN_CPU_MOE_ISA=avx9000 is not a kernel tier" in out.stderr


def cpu_flags() -> set:
    """The flags of /proc/cpuinfo's first processor (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


#: what a tier needs of the CPU, for the skip reasons of tests that need it
TIER_NEEDS = {
    "avx2": "AVX2 + FMA + F16C",
    "avx_vnni": "AVX-VNNI (CPUID leaf 7 subleaf 1, EAX bit 4) with AVX2 + FMA + F16C",
    "avx512": "AVX-512 F/BW/VL/DQ + VNNI",
}


def require_tiers(*tiers: str) -> None:
    for t in tiers:
        if t not in cm.isa_tiers():
            pytest.skip(f"this CPU has no {TIER_NEEDS[t]}: the {t} tier is not offered")


def test_avx_vnni_tier_follows_the_cpu_flags() -> None:
    """avx_vnni is offered exactly when /proc/cpuinfo lists avx_vnni with avx2, fma and f16c
    (read independently of the package's CPUID check), between avx512 and avx2."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to check the tier list against")
    tiers = _uncapped_tiers()
    assert ("avx_vnni" in tiers) == ({"avx_vnni", "avx2", "fma", "f16c"} <= flags), (tiers, sorted(flags & {"avx_vnni", "avx2"}))
    if "avx_vnni" in tiers:
        assert tiers.index("avx_vnni") + 1 == tiers.index("avx2")
        assert all(tiers.index(t) < tiers.index("avx_vnni") for t in ("amx", "avx512") if t in tiers)


def raw_weights(fmt: str, rows: int, cols: int, rng) -> "cm.Weights":
    """Weights with every byte random except the block scales (kept finite and moderate):
    every code value, K-quant 6-bit scale and min, Q6_K and Q8_0 sign occurs."""
    from cpu_moe_reference import BLOCK_BYTES, FP16_FIELDS

    if fmt not in BLOCK_BYTES:
        r = make_weights(fmt, 1, rows, cols, rng, 0.05)
        return cm.Weights(r.data, fmt, 1, rows, cols, scale=r.scale)
    nb = rows * cols // cm.format_info(fmt).block_elems
    raw = rng.integers(0, 256, size=(nb, BLOCK_BYTES[fmt]), dtype=np.uint8)
    if fmt == "mxfp4":
        raw[:, 0] = rng.integers(118, 130, size=nb)  # E8M0 exponents, 0 and 1 among none
    for off in FP16_FIELDS.get(fmt, (0,) if fmt == "q8_0" else ()):
        raw[:, off : off + 2] = rng.uniform(0.5e-3, 1e-3, size=nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return cm.Weights(raw.reshape(-1), fmt, 1, rows, cols)


@pytest.mark.parametrize("fmt", cm.FORMATS)
def test_avx_vnni_equals_avx2_bit_for_bit(fmt: str, rng) -> None:
    """The avx_vnni tier is the avx2 tier with vpdpbusd for the int8 dot products: the same
    exact int32 sums and the same float code, so every output is identical. Row counts that
    leave partial groups of 8 rows, columns that leave a partial group of 8 MXFP4/Q8_0 blocks,
    token counts through the one-token kernels, the tiles and their groups of 4 tokens."""
    require_tiers("avx2", "avx_vnni")
    rows = 37
    cols = {"q4_k": 768, "q5_k": 768, "q6_k": 768, "mxfp4": 2880, "q8_0": 2880}.get(fmt, 200)
    wts = raw_weights(fmt, rows, cols, rng)
    for T in (1, 2, 3, 5, 8, 16, 23):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        x[0, : cols // 2] *= 30.0
        y2 = cm.linear(wts, x, isa="avx2")
        yv = cm.linear(wts, x, isa="avx_vnni")
        assert np.isfinite(y2).all() and np.array_equal(y2, yv), f"{fmt} T={T}: {np.max(np.abs(y2 - yv)):.3e}"


@pytest.mark.parametrize("isa", cm.isa_tiers())
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q8_0", "mxfp4", "bf16", "fp8_e4m3_b128"])
def test_many_tokens_on_one_expert(bank_for, fmt: str, isa: str, rng) -> None:
    """70 tokens routed to one expert: one call per piece of its matrices with every token,
    more than a pass of the AVX2 tiles takes (64), against the float64 reference."""
    case = bank_for(fmt)
    T = 70
    x = rng.standard_normal((T, case.H)).astype(np.float32)
    ids = np.zeros((T, 2), np.int32)
    ids[:, 1] = rng.integers(1, case.E, size=T)
    w = rng.uniform(0.2, 1.0, size=(T, 2)).astype(np.float32)
    y = cm.moe_forward(case.bank, x, ids, w, isa=isa)
    assert moe_error(y, case.raw, x.astype(np.float64), ids, w, isa=isa) < (1e-3 if fmt in ACT_QUANT_BLOCK else 1e-5)
    if isa == "avx_vnni":
        assert np.array_equal(y, cm.moe_forward(case.bank, x, ids, w, isa="avx2"))


def test_set_isa_rejects_unknown_tier() -> None:
    with pytest.raises(ValueError, match="unknown ISA tier"):
        cm.set_isa("avx9000")


def test_weights_validation() -> None:
    with pytest.raises(ValueError, match="needs 2176 "):
        cm.Weights(np.zeros(2000, np.uint8), "q8_0", 1, 2, 1024)
    with pytest.raises(ValueError, match="not a multiple of the q4_k block size 256"):
        cm.Weights(np.zeros(144, np.uint8), "q4_k", 1, 1, 128)
    with pytest.raises(ValueError, match="unknown weight format"):
        cm.Weights(np.zeros(16, np.uint8), "q3_k", 1, 1, 16)
    with pytest.raises(ValueError, match="scales"):
        cm.Weights(np.zeros((1, 4, 4), np.uint8), "fp8_e4m3_b128", 1, 4, 4)
    with pytest.raises(ValueError, match=r"expected float32 \[1\]\[1\]\[2\]"):
        cm.Weights(np.zeros((1, 4, 200), np.uint8), "fp8_e4m3_b128", 1, 4, 200, scale=np.ones(1, np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        cm.Weights(np.zeros((8, 8), np.float32)[:, ::2], "f32", 1, 8, 4)
    w = cm.Weights(np.zeros((2, 4, 8), np.float16), cm.format_info("f16").fmt_id, 2, 4, 8)
    assert w.fmt == "f16" and w.nbytes == 128


def test_expert_bank_validation() -> None:
    g = cm.Weights(np.ones((2, 4, 8), np.float32), "f32", 2, 4, 8)
    d = cm.Weights(np.ones((2, 8, 4), np.float32), "f32", 2, 8, 4)
    bank = cm.ExpertBank(g, g, d)
    assert (bank.num_experts, bank.hidden, bank.intermediate) == (2, 8, 4)
    assert bank.address != 0
    with pytest.raises(ValueError, match="down is"):
        cm.ExpertBank(g, g, g)
    with pytest.raises(ValueError, match="unknown activation"):
        cm.ExpertBank(g, g, d, activation="relu")


def _bank_from(raws, data_override=None):
    ws = []
    for i, r in enumerate(raws):
        data = r.data if data_override is None else data_override[i]
        ws.append(cm.Weights(data, r.fmt, r.dense.shape[0], r.dense.shape[1], r.dense.shape[2], scale=r.scale))
    return cm.ExpertBank(*ws)


def test_weights_keep_buffers_alive_and_read_torch_tensors(rng) -> None:
    raws = [make_weights("q6_k", E, 256, H, rng, 0.1), make_weights("q6_k", E, 256, H, rng, 0.1), make_weights("q6_k", E, H, 256, rng, 0.1)]
    tensors = [torch.from_numpy(r.data.copy()) for r in raws]  # torch CPU tensors, no other reference kept
    bank = _bank_from(raws, tensors)
    del tensors
    gc.collect()
    junk = [np.full(r.data.shape, 0xAB, np.uint8) for r in raws]  # reuse freed memory if it were freed
    x = rng.standard_normal((3, H)).astype(np.float32)
    ids, w = random_routes(rng, 3, 2, E)
    y = cm.moe_forward(bank, torch.from_numpy(x), ids, w)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    assert moe_error(y.double().numpy(), raws, x.astype(np.float64), ids, w) < 1e-3
    del junk


def test_weights_from_an_mmap_view(tmp_path, rng) -> None:
    raws = [make_weights("q4_k", E, 256, H, rng, 0.1), make_weights("q4_k", E, 256, H, rng, 0.1), make_weights("q8_0", E, H, 256, rng, 0.1)]
    path = tmp_path / "bank.bin"
    offsets = []
    with open(path, "wb") as f:
        for r in raws:
            offsets.append(f.tell())
            f.write(r.data.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    views = [mm[o : o + r.data.nbytes] for o, r in zip(offsets, raws)]
    bank = _bank_from(raws, views)
    x = rng.standard_normal((2, H)).astype(np.float16)
    ids, w = random_routes(rng, 2, 8, E)
    y = cm.moe_forward(bank, x, ids, w, out_dtype="float32")
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    assert moe_error(y, raws, x.astype(np.float64), ids, w) < 1e-3


def test_moe_forward_argument_errors(bank_for, rng) -> None:
    case = bank_for("f32")
    x = rng.standard_normal((2, H)).astype(np.float32)
    ids, w = random_routes(rng, 2, 2, E)
    with pytest.raises(ValueError, match="hidden size"):
        cm.moe_forward(case.bank, x[:, :128].copy(), ids, w)
    with pytest.raises(ValueError, match="must both be"):
        cm.moe_forward(case.bank, x, ids[:, :1], w)
    with pytest.raises(ValueError, match="out of range"):
        cm.moe_forward(case.bank, x, np.full((2, 2), E, np.int32), w)
    with pytest.raises(ValueError, match="dtype float64"):
        cm.moe_forward(case.bank, x.astype(np.float64), ids, w)
    with pytest.raises(ValueError, match="numpy has no bfloat16"):
        cm.moe_forward(case.bank, x, ids, w, out_dtype="bfloat16")


def test_moe_forward_accumulate_and_out_dtype(bank_for, rng) -> None:
    case = bank_for("bf16")
    x = torch.from_numpy(rng.standard_normal((3, H)).astype(np.float32)).to(torch.bfloat16)
    ids, w = random_routes(rng, 3, 8, E)
    ref = moe_reference(*case.raw, x.double().numpy(), ids, w)
    y = cm.moe_forward(case.bank, x, torch.from_numpy(ids).long(), torch.from_numpy(w), out_dtype=torch.float32)
    assert y.dtype == torch.float32 and rel_err(y.double().numpy(), ref) < 1e-5
    base = torch.from_numpy(rng.standard_normal((3, H)).astype(np.float32))
    out = base.clone()
    cm.moe_forward(case.bank, x, ids, w, out=out, accumulate=True)
    assert rel_err(out.double().numpy(), ref + base.double().numpy()) < 1e-5


def test_coordinator_threads_leave_a_core(monkeypatch) -> None:
    """A hand-off coordinator's default workers: every physical core but one (the GPU's
    thread), at least one; ``FREETOKEN_CPU_MOE_THREADS`` when set."""
    from freetoken_cpu_moe.pool import coordinator_threads

    monkeypatch.delenv("FREETOKEN_CPU_MOE_THREADS", raising=False)
    assert coordinator_threads() == max(1, len(cm.physical_core_cpus()) - 1)
    monkeypatch.setattr(cm.pool, "physical_core_cpus", lambda: list(range(16)))
    assert coordinator_threads() == 15
    monkeypatch.setattr(cm.pool, "physical_core_cpus", lambda: [0])
    assert coordinator_threads() == 1
    monkeypatch.setenv("FREETOKEN_CPU_MOE_THREADS", "6")
    assert coordinator_threads() == 6


@pytest.mark.parametrize("isa", cm.isa_tiers())
@pytest.mark.parametrize("fmt", cm.FORMATS)
def test_linear(fmt: str, isa: str, rng) -> None:
    rows, cols = 320, 512  # rows not a multiple of the pool's chunks; cols spans 2 K-quant blocks
    r = make_weights(fmt, 1, rows, cols, rng, 0.05)
    wts = cm.Weights(r.data, fmt, 1, rows, cols, scale=r.scale)
    for T in (1, 3):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        y = cm.linear(wts, x, isa=isa)
        assert y.shape == (T, rows)
        tight = quantize_act(x.astype(np.float64), act_quant_block(fmt, isa)) @ r.dense[0].T
        loose = x.astype(np.float64) @ r.dense[0].T
        assert rel_err(y, tight) < (1e-3 if fmt in ACT_QUANT_BLOCK else 1e-5)  # see test_moe_matrix
        assert rel_err(y, loose) < (3e-2 if fmt in ACT_QUANT_BLOCK else 1e-5)
    y1 = cm.linear(wts, torch.from_numpy(x[0]).to(torch.bfloat16), isa=isa)
    assert y1.shape == (rows,) and y1.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="columns"):
        cm.linear(wts, np.zeros((1, cols + 1), np.float32))


def test_linear_large_output_head(rng) -> None:
    """A vocab-sized Q6_K head at T=1 (many rows: all split over the pool)."""
    rows, cols = 16384, 256
    r = make_weights("q6_k", 1, rows, cols, rng, 0.05)
    wts = cm.Weights(r.data, "q6_k", 1, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    y = cm.linear(wts, x)
    assert rel_err(y, quantize_act(x.astype(np.float64), act_quant_block("q6_k")) @ r.dense[0].T) < 1e-3


@pytest.mark.parametrize("threads", [1, 3])
def test_private_pools(bank_for, rng, threads: int) -> None:
    case = bank_for("q5_k")
    x = rng.standard_normal((16, H)).astype(np.float32)
    ids, w = random_routes(rng, 16, 8, E)
    with cm.Pool(threads, pin=False) as pool:
        assert pool.num_threads == threads
        y = cm.moe_forward(case.bank, x, ids, w, pool=pool)
    assert moe_error(y, case.raw, x.astype(np.float64), ids, w) < 1e-3
    with pytest.raises(RuntimeError, match="closed"):
        cm.moe_forward(case.bank, x, ids, w, pool=pool)
    assert cm.Pool().num_threads == len(cm.physical_core_cpus())


@pytest.mark.parametrize("isa", cm.isa_tiers())
@pytest.mark.parametrize(
    "fmt,rows,cols",
    [("f32", 5, 37), ("f16", 3, 45), ("bf16", 7, 83), ("fp8_e4m3_b128", 130, 200), ("q8_0", 9, 224), ("q8_0", 3, 32)],
)
def test_linear_tails(fmt: str, rows: int, cols: int, isa: str, rng) -> None:
    """Shapes that end in partial vectors / an odd number of blocks (the SIMD tails)."""
    r = make_weights(fmt, 1, rows, cols, rng, 0.05)
    wts = cm.Weights(r.data, fmt, 1, rows, cols, scale=r.scale)
    for T in (1, 2, 3, 4, 5):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        out = np.full((T, rows), np.nan, np.float32)
        cm.linear(wts, x, out=out, isa=isa)
        tight = quantize_act(x.astype(np.float64), act_quant_block(fmt, isa)) @ r.dense[0].T
        assert rel_err(out, tight) < (1e-3 if fmt in ACT_QUANT_BLOCK else 1e-5)  # see test_moe_matrix
