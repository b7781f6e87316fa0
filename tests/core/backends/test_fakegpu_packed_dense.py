"""The dense part kept as the GGUF file's blocks (``--gpu-dense``) through the generic GPU
session on the fakegpu plugin (host "device"): the plan's choice and sizes, the refusal
that names the flag, and an engine run equal to the cpu backend's.

On fakegpu the packed linears run their torch path (dequantize into the scratch, then a
matmul); the Triton kernels are checked in tests/gpu/test_packed_dense.py. ``auto`` packs
only where the Triton kernels run, so the plan tests say they do (``packed_dense_impl``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from freetoken.backends import registry
from freetoken.backends.contract import MemoryPlanError
from freetoken.backends.options import EngineOptions, MoEOptions
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.sampling_params import SamplingParams
from freetoken.loading.gguf import GGUFCheckpoint
from freetoken.models.loader import gguf_model_shape
from freetoken.models import packed_linear
from freetoken.moe.session.gpu_memory_plan import WORKSPACE_BYTES

_TESTS = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(_TESTS, "engine"))
sys.path.insert(0, os.path.join(_TESTS, "gpu"))
import qwen3_reference  # noqa: E402
import test_engine_gguf as tg  # noqa: E402

PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [5, 6], [77] * 20]
MAX_LEN = 128


@pytest.fixture(autouse=True)
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("packed_dense") / "tiny.gguf")
    return path, tg.write_tiny_gguf(path, seed=5)


def _file_dense_bytes(path: str, elt: int) -> int:
    """Every non-expert tensor of the file: block formats as stored, routers float32, the
    rest at ``elt`` bytes per value (counted here from gguf-py's reader, not the loader)."""
    ck = GGUFCheckpoint(path)
    total = 0
    for t in ck.reader.tensors:
        if "_exps" in t.name:
            continue
        if int(t.tensor_type) in (8, 12, 13, 14):
            total += int(t.n_bytes)
        else:
            total += int(t.n_elements) * (4 if "ffn_gate_inp" in t.name else elt)
    return total


def _session(budget, **kw):
    from freetoken_fakegpu.backend import FakeGpuBackend

    opts = EngineOptions(act_dtype=torch.float32, gpu_memory_limit=budget, max_model_len=MAX_LEN, **kw)
    return FakeGpuBackend().open_model(opts)


def test_dense_file_bytes_are_the_files(tiny):
    tiny, _ = tiny
    for dtype, elt in ((torch.float32, 4), (torch.bfloat16, 2)):
        shape = gguf_model_shape(tiny, dtype)
        assert shape.dense_file_bytes == _file_dense_bytes(tiny, elt)
        assert shape.dense_file_bytes < shape.dense_bytes
        # the prefill scratch: the largest packed linear (the Q6_K output head [V, H]) in one chunk
        ck = GGUFCheckpoint(tiny)
        assert shape.dense_scratch_bytes == ck.tensor_elements("output.weight") * elt


def test_prompt_copy_bytes_are_the_linears_at_the_activation_dtype(tiny):
    """``prompt_copy_bytes`` (``--gpu-dense both``): every packed 2-D matrix of the file but the
    embedding and the output head, at the activation dtype (counted from gguf-py's reader)."""
    tiny, _ = tiny
    ck = GGUFCheckpoint(tiny)
    for dtype, elt in ((torch.float32, 4), (torch.bfloat16, 2)):
        want = sum(int(t.n_elements) * elt for t in ck.reader.tensors
                   if "_exps" not in t.name and int(t.tensor_type) in (8, 12, 13, 14) and len(t.shape) == 2
                   and t.name not in ("token_embd.weight", "output.weight"))
        assert want > 0 and gguf_model_shape(tiny, dtype).prompt_copy_bytes == want


def test_auto_packs_exactly_when_it_frees_room_for_expert_layers(tiny, monkeypatch):
    """auto: packed where packing puts more layers' experts on the device, else both forms
    (decode reads the blocks, prompts the copies) where they hold as many layers as the
    dequantized form, else dequantized."""
    tiny, _ = tiny
    monkeypatch.setattr(packed_linear, "packed_dense_impl", lambda device: ("triton", "as on a GPU"))
    shape = gguf_model_shape(tiny, torch.float32)
    layer = 3 * tg.E * tg.H * tg.I * 4  # one layer's experts dequantized (fakegpu: no packed experts)
    other = WORKSPACE_BYTES + 256 * shape.activation_bytes_per_token + MAX_LEN * shape.kv_bytes_per_token
    deq = shape.dense_bytes
    pk = shape.dense_file_bytes + shape.dense_scratch_bytes
    both = pk + shape.prompt_copy_bytes
    # this tiny file's float32 copies outweigh what the packed head and embedding save
    assert 0 < deq - pk < layer and 0 < both - deq < layer

    def plan(budget, **kw):
        s = _session(budget, **kw)
        s.plan(shape)
        return s

    cases = [  # (budget, form, GPU layers)
        (other + deq + 2 * layer, "dequantized", 2),  # both forms would hold one layer less
        (other + both + 2 * layer, "both", 2),  # everything fits either way
        (other + pk + 2 * layer, "packed", 2),  # dequantized: 1 layer; packed: both
        (other + deq + layer, "dequantized", 1),  # packed frees too little for another layer; both: none
        (other + both + layer, "both", 1),  # as many as dequantized
        (other + pk + layer, "packed", 1),  # dequantized: no layer
        (other + pk, "packed", 0),  # dequantized: not even the dense part fits
    ]
    emb = shape.embedding_file_bytes
    assert 0 < emb < layer
    for budget, form, layers in cases:
        s = plan(budget)
        assert (s.dense_form, len(s.plan_result.gpu_layers)) == (form, layers), budget - other
        # --gpu-embedding auto: a packed table goes to host memory when layers stay on the CPU
        host = form != "dequantized" and layers < 2
        assert s.plan_result.embedding == ("host" if host else "device")
        bytes_ = {"dequantized": deq, "packed": pk, "both": both}[form] - (emb if host else 0)
        assert s.plan_result.dense == bytes_
        assert s.plan_result.dense_form == form
        assert isinstance(s.weight_policy, packed_linear.PackedWeightPolicy) is (form != "dequantized")
        assert getattr(s.weight_policy, "prompt_copies", False) is (form == "both")
    # explicit placement: packed only when needed to fit it, both forms when they fit it
    assert plan(other + pk + 2 * layer, moe_cpu_layers="0").dense_form == "packed"
    assert plan(other + both + 2 * layer, moe_cpu_layers="0").dense_form == "both"
    assert plan(other + deq + 2 * layer, moe_cpu_layers="0").dense_form == "dequantized"
    # forced forms, and no budget to plan with
    assert plan(other + deq + 2 * layer, gpu_dense="packed").dense_form == "packed"
    both = plan(other + pk + shape.prompt_copy_bytes + 2 * layer, gpu_dense="both")
    assert (both.dense_form, len(both.plan_result.gpu_layers)) == ("both", 2)
    assert both.plan_result.dense == pk + shape.prompt_copy_bytes
    assert isinstance(both.weight_policy, packed_linear.PackedWeightPolicy) and both.weight_policy.prompt_copies
    assert len(plan(other + pk + shape.prompt_copy_bytes + layer, gpu_dense="both").plan_result.gpu_layers) == 1
    assert plan(other + pk + 2 * layer, gpu_dense="dequantized").dense_form == "dequantized"
    assert plan(None).dense_form == "dequantized"
    # where the kernels do not run, auto never packs
    monkeypatch.setattr(packed_linear, "packed_dense_impl", lambda device: ("torch", "no GPU"))
    assert plan(other + pk + 2 * layer).dense_form == "dequantized"


def test_embedding_table_on_the_host(tiny, monkeypatch):
    """``--gpu-embedding``: the table's file bytes (counted here from gguf-py's reader) leave
    the plan's dense part with ``host``, and with ``auto`` exactly when layers' experts would
    stay on the CPU; a budget one layer short of all layers fits them all once the table is on
    the host. ``host`` is refused, naming the flag, where it cannot apply."""
    tiny, _ = tiny
    monkeypatch.setattr(packed_linear, "packed_dense_impl", lambda device: ("triton", "as on a GPU"))
    shape = gguf_model_shape(tiny, torch.float32)
    ck = GGUFCheckpoint(tiny)
    table = next(int(t.n_bytes) for t in ck.reader.tensors if t.name == "token_embd.weight")
    assert shape.embedding_file_bytes == table > 0
    layer = 3 * tg.E * tg.H * tg.I * 4
    other = WORKSPACE_BYTES + 256 * shape.activation_bytes_per_token + MAX_LEN * shape.kv_bytes_per_token
    pk = shape.dense_file_bytes + shape.dense_scratch_bytes

    def plan(budget, **kw):
        s = _session(budget, gpu_dense="packed", **kw)
        s.plan(shape)
        return s.plan_result

    tight = other + pk - table + 2 * layer  # both layers fit only with the table on the host
    for mode, where, layers in (("auto", "host", 2), ("host", "host", 2), ("device", "device", 1)):
        p = plan(tight, gpu_embedding=mode)
        assert (p.embedding, len(p.gpu_layers)) == (where, layers), mode
        assert p.dense == pk - (table if where == "host" else 0)
    # room for everything: auto keeps the table on the device; so does a placement given
    # that fits with it there, while one that does not fit takes it to the host
    assert plan(other + pk + 2 * layer).embedding == "device"
    assert plan(tight, moe_cpu_layers="1").embedding == "device"
    assert plan(tight, moe_cpu_layers="0").embedding == "host"
    with pytest.raises(MemoryPlanError, match="--gpu-embedding host.*--gpu-dense packed"):
        _session(tight, gpu_dense="dequantized", gpu_embedding="host").plan(shape)
    monkeypatch.setattr(shape, "embedding_file_bytes", 0)  # an embedding that is also the head
    with pytest.raises(MemoryPlanError, match="--gpu-embedding host: this model's embedding is also its output"):
        plan(tight, gpu_embedding="host")
    assert plan(tight).embedding == "device"


def test_refusal_names_the_packed_form(tiny):
    tiny, _ = tiny
    shape = gguf_model_shape(tiny, torch.float32)
    other = WORKSPACE_BYTES + 256 * shape.activation_bytes_per_token + MAX_LEN * shape.kv_bytes_per_token
    pk = shape.dense_file_bytes + shape.dense_scratch_bytes
    s = _session(other + pk + 1000, gpu_dense="dequantized", moe_cpu_layers="all")
    with pytest.raises(MemoryPlanError) as err:
        s.plan(shape)
    text = str(err.value)
    assert "(dequantized)" in text and "--gpu-dense packed" in text
    s = _session(other + pk + 1000, gpu_dense="packed", moe_cpu_layers="all")
    s.plan(shape)  # the same budget holds the packed form
    assert s.plan_result.dense == pk


def test_packed_needs_a_packed_form():
    from freetoken.models.loader import model_shape
    from freetoken.models.config import ModelConfig

    cfg = ModelConfig("qwen3_moe", 300, 256, 2, 4, 2, 64, 0, 256, 4, 2)
    for mode in ("packed", "both"):
        s = _session(None, gpu_dense=mode)
        with pytest.raises(MemoryPlanError, match=f"--gpu-dense {mode}: .*GGUF files only"):
            s.plan(model_shape(cfg, torch.float32))  # an HF checkpoint's sizes: no dense_file_bytes
    with pytest.raises(MemoryPlanError, match="--gpu-dense"):
        _session(None, gpu_dense="int4").plan(model_shape(cfg, torch.float32))


def _run(path, backend, **kw):
    registry.reset()
    eng = LLMEngine(EngineConfig(model=path, backend=backend, dtype="float32", max_model_len=MAX_LEN,
                                 kv_cache_tokens=1024, **kw))  # fmt: skip
    rows: dict[str, list[torch.Tensor]] = {}
    remove = eng.add_logits_observer(
        lambda ids, logits: [rows.setdefault(r, []).append(logits[i].clone()) for i, r in enumerate(ids)])
    try:
        reqs = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
        while eng.has_work():
            eng.step()
        remove()
        info = eng.backend_info()
        policy = getattr(eng.session, "weight_policy", None)
    finally:
        eng.close()
    return [r.output_ids for r in reqs], [torch.stack(rows[r.request_id]) for r in reqs], info, policy


def test_engine_with_packed_dense_equals_cpu_backend(tiny):
    tiny, tensors = tiny
    want_ids, want_logits, _, _ = _run(tiny, "cpu")
    deq_ids, deq_logits, deq_info, _ = _run(tiny, "fakegpu", moe_cpu_layers="0", gpu_dense="dequantized")
    ids, logits, info, policy = _run(tiny, "fakegpu", moe_cpu_layers="0", gpu_dense="packed")
    assert info["dense_form"] == "packed" and deq_info["dense_form"] == "dequantized"
    assert info["weights"]["dense_form"] == "packed" and info["memory_plan"]["dense_form"] == "packed"
    shape = gguf_model_shape(tiny, torch.float32)
    assert policy.device_bytes == shape.dense_file_bytes  # what was placed is what was planned
    assert policy.scratch.nbytes <= shape.dense_scratch_bytes
    assert ids == deq_ids
    for got, dq in zip(logits, deq_logits):
        # the same weight values (gguf-py's), float32 products: the dequantized form's
        # logits up to summation order
        assert float((got - dq).abs().max()) <= 1e-5 * float(dq.abs().max())
    # an independent float64 forward over gguf-py's dequantization of the same file, on the
    # run's own tokens (every expert on the "device": float32 summation order only)
    for prompt, out, got in zip(PROMPTS, ids, logits):
        seq = prompt + out
        want = qwen3_reference.logits(tensors, seq, tg.LAYERS, tg.HEADS, tg.KVH, tg.HD, tg.K,
                                      theta=1e6)[len(prompt) - 1 : len(seq) - 1].float()  # fmt: skip
        assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())
    # the cpu backend rounds activations to int8 (per 32 values) for its packed kernels: its
    # logits are within that rounding's bound for a row (8e-2 of the scale:
    # tests/engine/test_engine_gguf.py) up to the first step where the greedy tokens differ
    # (after it the contexts differ)
    for got_ids, got, ref_ids, ref in zip(ids, logits, want_ids, want_logits):
        same = next((i for i, (a, b) in enumerate(zip(got_ids, ref_ids)) if a != b), len(ref_ids) - 1)
        scale = max(1.0, float(ref.abs().max()))
        assert float((got[: same + 1] - ref[: same + 1]).abs().max()) <= 8e-2 * scale


def test_engine_with_both_forms_runs_prompts_through_the_copies(tiny, monkeypatch):
    """``--gpu-dense both``: the policy places the blocks and the copies the plan counted, the
    prompts' linears multiply the copies (only the output head, which has none, dequantizes
    into the scratch), and the logits equal the packed form's (the same gguf-py values)."""
    tiny, _ = tiny
    calls: list[int] = []
    plain = packed_linear.PackedLinear._dequantized_matmul

    def recorded(self, x, y):
        calls.append(self.out_features)
        return plain(self, x, y)

    ids, logits, _, _ = _run(tiny, "fakegpu", moe_cpu_layers="0", gpu_dense="packed")
    monkeypatch.setattr(packed_linear.PackedLinear, "_dequantized_matmul", recorded)
    both_ids, both_logits, info, policy = _run(tiny, "fakegpu", moe_cpu_layers="0", gpu_dense="both")
    shape = gguf_model_shape(tiny, torch.float32)
    assert info["dense_form"] == "both" and info["weights"]["dense_form"] == "both"
    assert policy.prompt_bytes == shape.prompt_copy_bytes > 0
    assert policy.device_bytes == shape.dense_file_bytes + shape.prompt_copy_bytes
    assert calls and set(calls) == {tg.V}, f"linears other than the head dequantized: {sorted(set(calls))}"
    assert both_ids == ids
    for got, want in zip(both_logits, logits):
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_locked_fetch_plans_its_slots(tiny):
    """Locked fetch keeps device slots for the experts a step fetches (``locked_max_fetch`` of
    the largest layer's experts) in the plan; without it there are none."""
    tiny, _ = tiny
    shape = gguf_model_shape(tiny, torch.float32)
    layer = 3 * tg.E * tg.H * tg.I * 4  # one layer's experts as the plan counts them here (dequantized)
    scratch = {}
    for fraction in (0.0, 0.5):
        s = _session(1 << 40, moe_cpu_layers="all",
                     moe=MoEOptions(stream_prefill="off", locked_fetch=fraction, locked_max_fetch=3))
        s.plan(shape)
        scratch[fraction] = s.plan_result.scratch
    assert scratch == {0.0: 0, 0.5: 3 * layer // tg.E}
