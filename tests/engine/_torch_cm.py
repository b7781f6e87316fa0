"""TEMPORARY pure-torch stand-in for freetoken_cpu_moe's functional API.

Used by tests/engine only while the real extension lacks kernels (conftest
installs it then); never shipped. Dequantizes with gguf-py.
"""

from __future__ import annotations

import numpy as np
import torch

_FMT = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14, "fp8_e4m3_b128": 100}


class Weights:
    def __init__(self, data, fmt, num_experts, rows, cols, scale=None):
        self.fmt = _FMT[fmt] if isinstance(fmt, str) else int(fmt)
        self.E, self.rows, self.cols = num_experts, rows, cols
        t = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.asarray(data))
        if self.fmt in (8, 12, 13, 14):
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            arr = dequantize(t.contiguous().view(torch.uint8).numpy().reshape(num_experts * rows, -1), GGMLQuantizationType(self.fmt))
            self.w = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).view(num_experts, rows, cols)
        elif self.fmt == 30:
            self.w = t.view(torch.bfloat16).float().view(num_experts, rows, cols)
        else:
            self.w = t.float().reshape(num_experts, rows, cols)


class ExpertBank:
    def __init__(self, gate, up, down, activation="silu"):
        self.gate, self.up, self.down = gate.w, up.w, down.w


def moe_forward(bank, x, ids, w, out_dtype=None):
    xf = x.float()
    y = torch.zeros_like(xf)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            h = torch.nn.functional.silu(bank.gate[e] @ xf[t]) * (bank.up[e] @ xf[t])
            y[t] += w[t, k] * (bank.down[e] @ h)
    return y.to(out_dtype or x.dtype)


def linear(weights, x, out_dtype=None):
    return (x.float() @ weights.w[0].T).to(out_dtype or x.dtype)
