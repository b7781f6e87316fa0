"""MXFP4 -> Q8_0 at load (freetoken.loading.dequant) against independent dequantizations:
transformers' for the HF checkpoint layout, gguf-py's for ggml's block_mxfp4."""

from __future__ import annotations

import random

import numpy as np
import torch

from freetoken.loading.dequant import mxfp4_codes_hf, mxfp4_split_ggml, mxfp4_to_q8_0


def _q8_0_values(q8: torch.Tensor) -> np.ndarray:
    import gguf
    from gguf.quants import dequantize

    return dequantize(q8.numpy(), gguf.GGMLQuantizationType.Q8_0)


def test_hf_layout_converts_exactly():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    E, R, nblk = 3, 10, 4
    blocks = torch.randint(0, 256, (E, R, nblk, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(104, 147, (E, R, nblk), dtype=torch.uint8, generator=g)  # the exact range, both ends
    scales[0, 0, 0], scales[1, 2, 3] = 104, 146
    # transformers returns [E, cols, rows] (transposed for x @ W)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    q8, inexact = mxfp4_to_q8_0(scales, mxfp4_codes_hf(blocks))
    assert inexact == 0
    got = _q8_0_values(q8).reshape(E, R, nblk * 32)
    np.testing.assert_array_equal(got, ref.numpy(), err_msg=f"seed {seed}")


def test_ggml_layout_converts_exactly_and_tiny_blocks_round():
    import gguf
    from gguf.quants import dequantize, quantize

    seed = random.randrange(1 << 30)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((5, 256)) * 0.03).astype(np.float32)
    x[1, :32] *= 1e-6  # a block far below Q8_0's exact range
    mx = gguf.GGMLQuantizationType.MXFP4
    packed = quantize(x, mx)
    ref = dequantize(packed, mx)
    q8, inexact = mxfp4_to_q8_0(*mxfp4_split_ggml(torch.from_numpy(packed)))
    got = _q8_0_values(q8)
    assert inexact == 1
    exact = np.ones_like(ref, dtype=bool)
    exact[1, :32] = False
    np.testing.assert_array_equal(got[exact], ref[exact], err_msg=f"seed {seed}")
    np.testing.assert_allclose(got[~exact], ref[~exact], atol=2.0 ** -25, err_msg=f"seed {seed}")
