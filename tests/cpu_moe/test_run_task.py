"""run_task: the synchronous entry point on ft_task_desc built by allocate_task."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_moe_cases import cm
from freetoken import handoff
from cpu_moe_reference import moe_error, moe_reference, random_routes, rel_err
from cpu_moe_tasks import new_task, fill_inputs

TIERS = cm.isa_tiers()


@pytest.mark.parametrize("isa", TIERS)
@pytest.mark.parametrize(
    "act_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float16, torch.float32)]
)
def test_run_task_matches_reference(bank_for, rng, isa, act_dtype, out_dtype) -> None:
    case = bank_for(("q4_k", "q4_k", "q6_k"))
    task = new_task(case.bank, max_tokens=8, top_k=4, act_dtype=act_dtype, out_dtype=out_dtype)
    T = 5  # fewer than max_tokens: rows T.. must stay untouched
    x = torch.from_numpy(rng.standard_normal((T, case.H)).astype(np.float32)).to(act_dtype)
    ids, w = random_routes(rng, T, 4, case.E)
    fill_inputs(task, x, ids, w)
    task.y.fill_(float("nan"))
    slot_before = bytes(task.flags)
    cm.run_task(task.desc_buffer.host_ptr, isa=isa)
    assert bytes(task.flags) == slot_before, "run_task must not touch the flag slot"
    y = task.y.to(torch.float64).numpy()
    assert np.isnan(y[T:]).all(), "rows past num_tokens were written"
    tol = 1e-3 + (4e-3 if out_dtype == torch.bfloat16 else 0.0)  # see test_moe_matrix
    assert moe_error(y[:T], case.raw, x.to(torch.float64).numpy(), ids, w, isa=isa) < tol


def test_run_task_accumulate(bank_for, rng) -> None:
    case = bank_for("bf16")
    task = new_task(case.bank, max_tokens=4, top_k=2, act_dtype=torch.float32, out_dtype=torch.float32)
    x = torch.from_numpy(rng.standard_normal((4, case.H)).astype(np.float32))
    ids, w = random_routes(rng, 4, 2, case.E)
    fill_inputs(task, x, ids, w)
    base = rng.standard_normal((4, case.H)).astype(np.float32)
    task.y.copy_(torch.from_numpy(base))
    task.desc.flags = handoff.TASK_ACCUMULATE
    cm.run_task(task.desc_buffer.host_ptr)
    ref = base + moe_reference(*case.raw, x.double().numpy(), ids, w)
    assert rel_err(task.y.double().numpy(), ref) < 1e-5


def _bad(task, **fields) -> str:
    for k, v in fields.items():
        setattr(task.desc, k, v)
    with pytest.raises(ValueError) as exc:
        cm.run_task(task.desc_buffer.host_ptr)
    return str(exc.value)


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"abi_version": 99}, "abi_version"),
        ({"bank": 0}, "bank"),
        ({"num_tokens": 9}, "max_tokens"),
        ({"hidden": 128}, "hidden"),
        ({"flags": 8}, "flags"),
        ({"act_dtype": int(handoff.Fmt.Q4_K)}, "act_dtype"),
        ({"top_k": 0}, "top_k"),
    ],
)
def test_run_task_rejects_bad_descriptors(bank_for, fields, needle) -> None:
    case = bank_for("f16")
    task = new_task(case.bank, max_tokens=8, top_k=2, act_dtype=torch.float32, out_dtype=torch.float32)
    task.x.normal_()
    task.w.fill_(0.5)
    task.ids.fill_(0)
    assert needle in _bad(task, **fields)


def test_run_task_rejects_expert_out_of_range(bank_for) -> None:
    case = bank_for("f16")
    task = new_task(case.bank, max_tokens=2, top_k=2, act_dtype=torch.float32, out_dtype=torch.float32)
    task.x.normal_()
    task.w.fill_(0.5)
    task.ids.fill_(-1)
    task.ids[1, 1] = case.E
    assert "out of range" in _bad(task)
    with pytest.raises(ValueError, match="null"):
        cm.run_task(0)
