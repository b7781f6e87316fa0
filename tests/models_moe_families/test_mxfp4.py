"""GPT-OSS's MXFP4 experts at load: HF ``*_blocks``/``*_scales`` rewritten in ggml's
``block_mxfp4`` layout (checked against transformers' own dequantization through gguf-py's),
the torch dequantization of the GPU path (against gguf-py), and the MXFP4 bias blocks
against the bias constant of BiasedMoELayer (float64)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from freetoken.handoff import Fmt
from freetoken.loading.dequant import dequantize, mxfp4_ggml_from_hf
from freetoken.models.gpt_oss import mxfp4_bias_blocks
from freetoken.models.moe_block import BIAS_FINE, BIAS_ONES, BIAS_PAD


def _gguf_values(raw: np.ndarray) -> np.ndarray:
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(raw, gguf.GGMLQuantizationType.MXFP4).astype(np.float64)


def test_hf_layout_rewritten_as_ggml_blocks():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    E, R, nblk = 3, 10, 4
    blocks = torch.randint(0, 256, (E, R, nblk, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (E, R, nblk), dtype=torch.uint8, generator=g)
    # transformers returns [E, cols, rows] (transposed for x @ W)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    mx = mxfp4_ggml_from_hf(scales, blocks)
    assert mx.shape == (E, R, nblk * 17) and mx.dtype == torch.uint8
    got = _gguf_values(mx.numpy()).reshape(E, R, nblk * 32)
    np.testing.assert_array_equal(got, ref.double().numpy(), err_msg=f"seed {seed}")
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_ggml_from_hf(scales[..., :3], blocks)


@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 96), (33, 2880)])
def test_torch_dequantization_equals_gguf(rows: int, cols: int):
    seed = random.randrange(1 << 30)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(2, 251, size=(rows, cols // 32))  # normal exponents, values below float32's max
    raw = raw.reshape(rows, -1)
    out = torch.full((rows, cols), float("nan"))
    dequantize(torch.from_numpy(raw), Fmt.MXFP4, (rows, cols), out=out)
    np.testing.assert_array_equal(out.double().numpy(), _gguf_values(raw), err_msg=f"seed {seed}")


def test_bias_blocks_hold_the_bias():
    """The block's values against the bias constant (BIAS_ONES ones, then 1/127) give the
    bias to 6.2e-5 relative, over magnitudes from 1e-30 to 1e30 and float32's largest,
    both signs, and zero."""
    seed = random.randrange(1 << 30)
    rng = np.random.default_rng(seed)
    b = rng.standard_normal(4000) * 10.0 ** rng.uniform(-30, 30, 4000)
    b[:6] = [0.0, 1.0, -1.0, 127.5, 2.0 ** -119, -3.4e38]
    b[5:105] = np.rint(rng.uniform(-1000, 1000, 100))  # integers: steps of v land on every n
    blocks = mxfp4_bias_blocks(torch.from_numpy(b).float())
    assert blocks.shape == (4000, 17) and blocks.dtype == torch.uint8
    values = _gguf_values(blocks.numpy())  # [4000, 32]
    const = np.zeros(BIAS_PAD)
    const[:BIAS_ONES] = 1.0
    const[BIAS_ONES:] = BIAS_FINE
    got = values @ const
    target = b.astype(np.float32).astype(np.float64)
    err = np.abs(got - target) / np.maximum(np.abs(target), 1e-300)
    assert got[0] == 0.0
    assert float(err[1:].max()) <= 0.5 / 127 / 64 * 1.0001, f"seed {seed}: {float(err[1:].max()):.3e}"
