"""The memory plan's view of a GGUF file's routed experts (``gguf_model_shape``): every
family's stacked ``ffn_{gate,up,down}_exps`` are found (the families whose tensor names
name no expert role fall back to llama.cpp's names), with their formats and bytes, and
GPT-OSS's experts counted with their biases folded in (``BIAS_PAD`` more columns of
gate/up and rows of down, as they are held)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from families import make_model
from freetoken.handoff import Fmt
from freetoken.models.loader import gguf_model_shape
from freetoken.models.moe_block import BIAS_PAD
from test_gguf import CASES, write_gguf


# float experts for every family; MXFP4 experts for GPT-OSS (the writer quantizes those only)
@pytest.mark.parametrize("case,mxfp4", [(c, False) for c in sorted(CASES)] + [("gpt_oss", True)])
def test_expert_formats_and_bytes(case, mxfp4, tmp_path):
    family, over = CASES[case]
    model = make_model(family, 3, **over)
    path = str(tmp_path / f"{case}.gguf")
    write_gguf(model, family, path, mxfp4=mxfp4)
    shape = gguf_model_shape(path, torch.float32)
    c = model.config
    E = c.num_experts if family == "olmoe" else c.num_local_experts
    H, I = c.hidden_size, c.intermediate_size
    fmt = int(Fmt.MXFP4) if mxfp4 else int(Fmt.F32)
    assert shape.expert_formats == {i: (fmt,) * 3 for i in range(c.num_hidden_layers)}
    cols = H + BIAS_PAD if family == "gpt_oss" else H
    per_value = 17 / 32 if mxfp4 else np.dtype(np.float32).itemsize
    assert shape.expert_file_bytes == {i: int(3 * E * I * cols * per_value) for i in range(c.num_hidden_layers)}
