"""The kernels run with subnormals flushed to zero (FTZ/DAZ: a subnormal operand costs
an Intel core a microcode assist per instruction) and leave the calling thread's
floating-point environment as they found it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_moe_cases import cm
from cpu_moe_reference import make_weights, random_routes, rel_err
from cpu_moe_tasks import fill_inputs, new_task

TINY = np.float32(1e-38)  # the smallest normal float32 is 1.18e-38


def subnormals_survive() -> bool:
    """True while this thread computes with subnormals (FTZ/DAZ off)."""
    return float(TINY / np.float32(4.0)) != 0.0 and float(np.float32(2.5e-39) * np.float32(2.0)) != 0.0


def test_calls_leave_the_callers_environment_alone(bank_for, rng) -> None:
    assert subnormals_survive(), "precondition: Python starts with subnormals on"
    case = bank_for("f32")
    x = rng.standard_normal((3, case.H)).astype(np.float32)
    ids, w = random_routes(rng, 3, 2, case.E)
    cm.moe_forward(case.bank, x, ids, w)
    assert subnormals_survive()
    r = make_weights("f32", 1, 64, 256, rng, 0.05)
    cm.linear(cm.Weights(r.data, "f32", 1, 64, 256), x[:, :256])
    assert subnormals_survive()
    task = new_task(case.bank, max_tokens=3, top_k=2, act_dtype=torch.float32, out_dtype=torch.float32)
    fill_inputs(task, torch.from_numpy(x), ids, w)
    cm.run_task(task.desc_buffer.host_ptr)
    assert subnormals_survive()
    with cm.Pool(1) as solo:  # everything on the calling thread
        cm.moe_forward(case.bank, x, ids, w, pool=solo)
    assert subnormals_survive()


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_subnormal_weights_and_activations_count_as_zero(fmt: str, rng) -> None:
    """Half the weights and a quarter of the activations subnormal: the result is the
    float64 product with them zeroed (which is also the product with them kept, to far
    below any tolerance: this checks that nothing breaks, e.g. a NaN from a flushed scale)."""
    rows, cols = 96, 512
    dense = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    sub = rng.random((rows, cols)) < 0.5
    dense[sub] = (rng.standard_normal(int(sub.sum())) * 3e-39).astype(np.float32)
    x = rng.standard_normal((2, cols)).astype(np.float32)
    xsub = rng.random((2, cols)) < 0.25
    x[xsub] = (rng.standard_normal(int(xsub.sum())) * 3e-39).astype(np.float32)
    data = torch.from_numpy(dense).to(torch.bfloat16) if fmt == "bf16" else torch.from_numpy(dense)
    y = cm.linear(cm.Weights(data.reshape(1, rows, cols), fmt, 1, rows, cols), x)
    w64 = data.float().double().numpy()
    w64[np.abs(w64) < 1.18e-38] = 0.0
    x64 = x.astype(np.float64)
    x64[np.abs(x64) < 1.18e-38] = 0.0
    assert np.isfinite(y).all()
    assert rel_err(y, x64 @ w64.T) < 1e-5
