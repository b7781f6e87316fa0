"""Which head-tiling Triton kernels take a model's head sizes
(:func:`freetoken.kernels.availability.head_dim_support`), and that the engine decides it
when it builds a model (dense ops, decode graphs' attention), with a log line, instead of a
compiler error in a request (a Qwen3.5-MoE-shaped model of head size 24 met one)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from freetoken.kernels.availability import head_dim_support


@pytest.mark.parametrize("d,dv", [(24, None), (80, None), (96, None), (112, None), (128, None), (192, None),
                                  (256, None), (192, 128), (8, None), (2, 2), (24, 40)])  # fmt: skip
def test_every_even_size_up_to_256_runs_both_kernels(d, dv):
    s = head_dim_support(d, dv)
    assert (s.head_dim, s.v_head_dim) == (d, d if dv is None else dv)
    assert s.qk_norm_rope and s.decode_attention, s
    assert s.torch_parts() == []


@pytest.mark.parametrize("d,dv,tiles", [(576, 512, "512+64"), (320, 320, "256+64"), (512, 512, "512"),
                                        (768, 128, "512+256")])  # fmt: skip
def test_wide_heads_take_two_tiles(d, dv, tiles):
    """MLA's latent queries with the up-projections absorbed (512 + 64 values against a v of
    512) and other heads wider than one tile: a power of two and a second tile of the rest."""
    s = head_dim_support(d, dv)
    assert s.decode_attention and f"tile {tiles}/" in s.decode_attention_why, s
    if d <= 512:
        dat = pytest.importorskip("freetoken.kernels.decode_attention")  # (imports triton)

        first, second = dat.split_d(d)
        assert tiles == (f"{first}+{second}" if second else str(first))


def test_what_the_kernels_do_not_take_is_named():
    odd = head_dim_support(25)
    assert not odd.qk_norm_rope and "odd" in odd.qk_norm_rope_why
    assert odd.decode_attention  # attention has no pairs: any size
    wide = head_dim_support(800)
    assert wide.qk_norm_rope and not wide.decode_attention
    assert "800" in wide.decode_attention_why and "768" in wide.decode_attention_why
    assert wide.torch_parts() == [f"decode attention: {wide.decode_attention_why}"]
    wide_v = head_dim_support(128, 640)
    assert not wide_v.decode_attention and wide_v.qk_norm_rope and "512" in wide_v.decode_attention_why
    huge = head_dim_support(2048)
    assert not huge.qk_norm_rope and not huge.decode_attention and len(huge.torch_parts()) == 2
    with pytest.raises(ValueError, match="head sizes must be >= 1"):
        head_dim_support(0)


def test_dense_ops_decide_at_build_time(monkeypatch, caplog):
    pytest.importorskip("triton")
    from freetoken.models import dense_ops

    triton_ops = dense_ops.TritonDenseOps()
    monkeypatch.delenv(dense_ops.ENV, raising=False)
    monkeypatch.setattr(dense_ops, "_INSTALLED", {})
    monkeypatch.setattr(dense_ops, "_triton_ops_for", lambda device: (triton_ops, "a simulated GPU"))
    dense_ops._for_head_dim.cache_clear()
    dev = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, logger="freetoken.models.dense_ops"):
        for d in (24, 80, 96, 128, 192):
            assert dense_ops.dense_ops_for(dev, head_dim=d) is triton_ops
        assert dense_ops.dense_ops_for(dev) is triton_ops
        assert not caplog.records
        odd = dense_ops.dense_ops_for(dev, head_dim=25)
    assert isinstance(odd, dense_ops.TritonDenseOps) and not odd.fused_qk_norm_rope and triton_ops.fused_qk_norm_rope
    assert any("q/k norm + RoPE in torch ops" in r.getMessage() and "odd" in r.getMessage() for r in caplog.records)
    dense_ops._for_head_dim.cache_clear()


def test_unfused_qk_norm_rope_runs_the_torch_ops(monkeypatch):
    """A head size the kernel does not take: the Triton ops' q/k norm + RoPE is the torch
    ops', bit for bit, and the kernel is never launched."""
    pytest.importorskip("triton")
    from freetoken.models.dense_ops import TorchDenseOps, TritonDenseOps
    from freetoken.models.layers import Rotary

    ops = TritonDenseOps(qk_norm_rope=False)
    monkeypatch.setattr(ops.k, "qk_norm_rope", lambda *a, **k: pytest.fail("the kernel was launched"))
    T, Hq, Hkv, D, nb, bs = 2, 4, 2, 24, 2, 4
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(T, h * D, generator=g) for h in (Hq, Hkv, Hkv))
    qw, kw = torch.randn(D, generator=g), torch.randn(D, generator=g)
    rotary = Rotary(D, 10000.0, 64, torch.device("cpu"))
    pos, slots = torch.tensor([3, 9]), torch.tensor([5, 0])
    outs = []
    for impl in (ops, TorchDenseOps()):
        kc, vc = torch.full((nb, bs, Hkv, D), float("nan")), torch.full((nb, bs, Hkv, D), float("nan"))
        outs.append((impl.qk_norm_rope_store(q, k, v, qw, kw, None, rotary, pos, kc, vc, slots, 1e-6), kc, vc))
    for a, b in zip(*outs):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def test_decode_graphs_attention_decides_at_capture(monkeypatch, caplog):
    from freetoken.backends import triton_target
    from freetoken.moe.session import gpu_session

    monkeypatch.setattr(triton_target, "for_device", lambda device: types.SimpleNamespace(usable=True))
    dev = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, logger=gpu_session.__name__):
        for d in (None, 24, 80, 96, 192, 320):
            assert gpu_session._attention_impl(dev, d) == "triton"
        assert gpu_session._attention_impl(dev, 576, 512) == "triton"
        assert not caplog.records
        assert gpu_session._attention_impl(dev, 1024) == "torch"
        assert gpu_session._attention_impl(dev, 192, 640) == "torch"
    assert sum("decode attention in the decode graphs: torch" in r.getMessage() for r in caplog.records) == 2
    monkeypatch.setattr(triton_target, "for_device", lambda device: types.SimpleNamespace(usable=False))
    assert gpu_session._attention_impl(dev, 24) == "torch"

