"""GroupLinear (freetoken_cpu_moe.dense): q/k/v-like matrices of different formats in one
native call (linear_group) against float64 with the kernels' activation quantization modelled,
against the same matrices run one by one (the prefill path), on pools of 1..3 workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_moe_reference import act_quant_block, make_weights, quantize_act, rel_err
from freetoken.handoff import Fmt
from freetoken.loading.tensors import RawTensor
from freetoken_cpu_moe.dense import CpuWeightPolicy, GroupLinear
from freetoken_cpu_moe.pool import Pool

FMT_IDS = {"q4_k": Fmt.Q4_K, "q6_k": Fmt.Q6_K, "q8_0": Fmt.Q8_0, "bf16": Fmt.BF16, "f32": Fmt.F32}
BLOCK = {"q4_k": 32, "q6_k": 32, "q8_0": 32}  # the int8-quantized formats (block: act_quant_block, the active tier)


def raw_of(name: str, fmt: str, rows: int, cols: int, rng: np.random.Generator):
    r = make_weights(fmt, 1, rows, cols, rng, 0.05)
    data = torch.from_numpy(np.ascontiguousarray(r.data).view(np.uint8).reshape(-1))
    if fmt == "f32":
        data = data.view(torch.float32)
    return RawTensor(name, (rows, cols), FMT_IDS[fmt], data, "test"), r.dense[0]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("fmts", [("q4_k", "q4_k", "q6_k"), ("q8_0", "bf16", "f32"), ("f32", "f32", "f32")])
def test_group_matches_float64_and_parts(rng, threads, fmts):
    cols = 512
    rows = (320, 64, 48)  # not multiples of the pieces
    raws, dense = zip(*(raw_of(n, f, r, cols, rng) for n, f, r in zip("qkv", fmts, rows)))
    with Pool(threads) as pool:
        lin = CpuWeightPolicy(torch.float32, pool).stacked_linear(list(raws))
        assert isinstance(lin, GroupLinear) and lin.out_features == sum(rows)
        for T in (1, 3, 7, 9):
            x = torch.from_numpy(rng.standard_normal((T, cols)).astype(np.float32))
            y = torch.full((T, sum(rows)), float("nan"))
            y[:] = lin(x)
            xd = x.double().numpy()
            at = 0
            for f, d, n in zip(fmts, dense, rows):
                tight = quantize_act(xd, act_quant_block(f) if f in BLOCK else None) @ d.T
                assert rel_err(y[:, at:at + n].double().numpy(), tight) < (1e-3 if f in BLOCK else 1e-5), (f, T)
                at += n
            alone = torch.cat([p(x) for p in lin.parts], dim=-1)
            assert rel_err(y.double().numpy(), alone.double().numpy()) < 1e-5
        yb = lin(x[:2].to(torch.bfloat16))
        assert yb.dtype == torch.bfloat16 and rel_err(yb.double().numpy(), lin(x[:2]).double().numpy()) < 1e-2
