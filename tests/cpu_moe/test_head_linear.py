"""HeadLinear (freetoken_cpu_moe.head_linear): one matrix per head applied to that head's
slice of the input (multi-head latent attention's absorbed up-projections), in Q8_0 and
float formats, against float64 with the kernels' activation quantization modelled, on
pools of 1..3 workers, with a poisoned output and a non-contiguous input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_moe_reference import act_quant_block, make_weights, quantize_act, rel_err
from freetoken.handoff import Fmt
from freetoken.loading.tensors import RawTensor
from freetoken_cpu_moe.dense import CpuWeightPolicy
from freetoken_cpu_moe.dense import HeadLinear
from freetoken_cpu_moe.pool import Pool

FMT_IDS = {"q8_0": Fmt.Q8_0, "bf16": Fmt.BF16, "f32": Fmt.F32}


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("fmt", ["q8_0", "bf16", "f32"])
@pytest.mark.parametrize("shape", [(6, 40, 64), (5, 16, 96)])  # [heads, out, in]
def test_heads_match_float64(rng, threads, fmt, shape):
    H, R, C = shape
    w = make_weights(fmt, H, R, C, rng, 0.05)
    data = torch.from_numpy(np.ascontiguousarray(w.data).view(np.uint8).reshape(-1))
    if fmt == "f32":
        data = data.view(torch.float32)
    raw = RawTensor("w", shape, FMT_IDS[fmt], data, "test")
    with Pool(threads) as pool:
        lin = CpuWeightPolicy(torch.float32, pool).head_linear(raw)
        assert isinstance(lin, HeadLinear) and lin.nbytes == raw.nbytes
        block = act_quant_block(fmt)
        for T in (1, 3, 9):
            wide = torch.from_numpy(rng.standard_normal((T, H, 2 * C)).astype(np.float32))
            x = wide[..., ::2]  # not contiguous: the call takes a copy
            y = torch.full((T, H, R), float("nan"))
            y[:] = lin(x)
            xd = x.double().numpy()
            for h in range(H):
                ref = quantize_act(xd[:, h], block) @ w.dense[h].T
                assert rel_err(y[:, h].double().numpy(), ref) < (1e-3 if block else 1e-5), (fmt, T, h)
        yb = lin(x.to(torch.bfloat16))
        assert yb.dtype == torch.bfloat16 and rel_err(yb.double().numpy(), lin(x).double().numpy()) < 1e-2
        with pytest.raises(ValueError, match="expected"):
            lin(torch.zeros(1, H + 1, C))


def test_formats_the_kernels_do_not_read_have_no_head_linear():
    raw = RawTensor("w", (2, 3, 4), 9999, np.zeros(24, dtype=np.uint8), "test")
    with Pool(1) as pool:
        assert CpuWeightPolicy(torch.float32, pool).head_linear(raw) is None
