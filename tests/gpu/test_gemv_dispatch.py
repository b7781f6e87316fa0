"""``--gpu-gemv``: which one-token GEMV runs a packed dense matrix, through an engine on the
fakegpu plugin in Triton's interpreter (CI). The native kernel itself runs on the GPU machine
(tests/gpu/test_native_gemv.py); here a backend's :class:`PackedGemv` is stood in for by one
that records its calls and computes them in float64 over gguf-py's dequantization and the
token quantized as the kernels do, so the test checks what the engine hands it (which
matrices, which calls, one token at a time) and that its results are used.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("gguf")

from expert_reference import int8_groups  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from greedy_runs import run_greedy  # noqa: E402
from test_packed_dense import INTERPRET, _engine, _gguf_helpers  # noqa: E402

from freetoken.backends.contract import BackendError, PackedGemv  # noqa: E402
from freetoken.handoff import Fmt  # noqa: E402
from freetoken.models import packed_linear  # noqa: E402
from freetoken.kernels import packed_linear as plt  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the fakegpu plugin in the interpreter (the GPU machine runs "
                                                      "tests/gpu/test_native_gemv.py and the engine tests)")

SERVED = (int(Fmt.Q4_K), int(Fmt.Q6_K))


class RecordingGemv(PackedGemv):
    """Serves Q4_K and Q6_K rows as the native kernel does, in float64, and records each call."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []  # (fmt, rows, cols)

    def refusal(self, fmt: int, cols: int, dtype: Any) -> str:
        return "" if fmt in SERVED and cols % 256 == 0 else "not Q4_K/Q6_K"

    def gemv(self, x: Any, data: Any, fmt: int, y: Any) -> None:
        assert x.shape[0] == 1 and y.shape[0] == 1, "one token per call"
        rows, cols = int(y.shape[-1]), int(x.shape[-1])
        w = gguf_dequantize(data.cpu().numpy().reshape(-1), GGMLQuantizationType(fmt)).reshape(rows, cols)
        out = int8_groups(x.cpu()).numpy() @ np.asarray(w, dtype=np.float64).T
        y.copy_(torch.from_numpy(out).to(y.dtype).reshape(y.shape))
        self.calls.append((fmt, rows, cols))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tg, ref = _gguf_helpers()
    path = str(tmp_path_factory.mktemp("gemv_dispatch") / "tiny.gguf")
    return tg, path, tg.write_tiny_gguf(path, seed=29)


def _run(path: str, prompt: list[int], **kw: Any) -> tuple[list[int], torch.Tensor, dict[str, Any]]:
    from freetoken.backends import registry

    eng = _engine(path, None, backend="fakegpu", dtype="float32", moe_cpu_layers="0", gpu_dense="packed", **kw)
    try:
        info = eng.backend_info()
        ((out, logits),) = run_greedy(eng, [prompt], max_tokens=5)
    finally:
        eng.close()
        registry.reset()
    return out, logits, info


def test_gpu_gemv_dispatch(tiny, monkeypatch):
    """``auto`` with a backend GEMV: every decode step's Q4_K/Q6_K linears go through it (one
    token each), others and the prompt through Triton, and the logits equal the engine whose
    Triton int8 dots run every linear (the same quantization) to float32 rounding; the report
    says which kernel ran how many linears. ``triton`` never calls it; ``native`` on a backend
    without one refuses to start, naming the flag's other values."""
    from freetoken_fakegpu.backend import FakeGpuBackend

    tg, path, _ = tiny
    one = plt.PackedLinearConfig(block_n=512, block_k=256, block_t=4, int8_dot=True)
    batch = dataclasses.replace(one, int8_dot=False)
    monkeypatch.setattr(packed_linear, "packed_dense_impl", lambda device: ("triton", "the interpreter"))
    monkeypatch.setattr(plt, "config_for", lambda rows, device=None: batch if device is None else one)
    prompt = [(13 * j) % (tg.V - 10) + 5 for j in range(17)]

    with pytest.raises(BackendError, match="--gpu-gemv native.*auto or triton"):
        _run(path, prompt, gpu_gemv="native")

    out_t, logits_t, info_t = _run(path, prompt, gpu_gemv="triton")
    assert info_t["gpu_gemv"] == {"setting": "triton", "kernel": "triton", "native_linears": 0}

    gemv = RecordingGemv()
    monkeypatch.setattr(FakeGpuBackend, "packed_gemv", lambda self: gemv, raising=False)
    out_n, logits_n, info_n = _run(path, prompt)  # auto
    served = info_n["gpu_gemv"]["native_linears"]
    assert info_n["gpu_gemv"]["kernel"] == "recording" and served > 0, info_n["gpu_gemv"]
    assert "recording GEMV" in info_n["weights"]["dense"]
    assert gemv.calls and {f for f, _, _ in gemv.calls} <= set(SERVED)
    # 4 decode steps after the prompt's, each through every served linear once, and the
    # prompt's last position through the head (Q6_K, one row per vocabulary entry)
    head = (int(Fmt.Q6_K), tg.V, tg.H)
    assert len(gemv.calls) == 4 * served + 1 and gemv.calls.count(head) == 5, (gemv.calls, served)
    assert out_n == out_t
    err = float((logits_n - logits_t).abs().max() / logits_t.abs().max())
    assert err <= 1e-4, f"the recorded GEMV's logits against Triton's int8 dots: {err:.3g} of their scale"


class RecordingNormGemv(RecordingGemv):
    """:class:`RecordingGemv` that also takes the pre-norm (float64, rounded once to the
    activation dtype) in front of up to two matrices, recording each such call's formats."""

    norm_parts = 2

    def __init__(self) -> None:
        super().__init__()
        self.norm_calls: list[tuple[int, ...]] = []

    def norm_gemv(self, h: Any, delta: Any, weight: Any, eps: float, parts: Any) -> Any:
        assert h.shape[0] == 1 and len(parts) <= self.norm_parts
        h_new = h + delta if delta is not None else h
        hd = h_new.double()
        x = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(h.dtype)
        ys = []
        for data, fmt in parts:
            y = torch.empty(1, int(data.shape[0]), dtype=h.dtype, device=h.device)
            self.gemv(x, data, fmt, y)
            ys.append(y)
        self.norm_calls.append(tuple(int(f) for _, f in parts))
        return h_new, x, ys


def test_gpu_gemv_takes_the_pre_norm(tmp_path, monkeypatch):
    """A backend GEMV with ``norm_gemv``: each decode step's attention pre-norm and q/k/v go to
    it as one call in the layer whose q/k/v are two groups (a Q4_K q/k, a Q6_K v), not in the
    layer of one Q4_K group, nothing else does, and the
    greedy tokens and logits equal the engine whose Triton ops run the norm and the int8 dots
    every linear, to float32 rounding."""
    from freetoken_fakegpu.backend import FakeGpuBackend

    tg, _ = _gguf_helpers()
    path = str(tmp_path / "kquant_attention.gguf")
    # q/k/v all in the served formats: q+k one Q4_K group and a Q6_K v (two matrices per call),
    # then one Q4_K group of the three
    mix = [dict(m, attn_q=Fmt.Q4_K, attn_k=Fmt.Q4_K, attn_v=v) for m, v in zip(tg.MIX, (Fmt.Q6_K, Fmt.Q4_K))]
    tg.write_tiny_gguf(path, seed=31, mix=mix)
    one = plt.PackedLinearConfig(block_n=512, block_k=256, block_t=4, int8_dot=True)
    batch = dataclasses.replace(one, int8_dot=False)
    monkeypatch.setattr(packed_linear, "packed_dense_impl", lambda device: ("triton", "the interpreter"))
    monkeypatch.setattr(plt, "config_for", lambda rows, device=None: batch if device is None else one)
    prompt = [(11 * j) % (tg.V - 10) + 3 for j in range(13)]
    out_t, logits_t, _ = _run(path, prompt, gpu_gemv="triton")

    gemv = RecordingNormGemv()
    monkeypatch.setattr(FakeGpuBackend, "packed_gemv", lambda self: gemv, raising=False)
    out_n, logits_n, info = _run(path, prompt)
    q4, q6 = int(Fmt.Q4_K), int(Fmt.Q6_K)
    # 4 decode steps; the layer with one q/k/v group keeps the norm and the GEMV apart
    assert gemv.norm_calls == [(q4, q6)] * 4, gemv.norm_calls
    assert out_n == out_t
    err = float((logits_n - logits_t).abs().max() / logits_t.abs().max())
    assert err <= 1e-4, f"the pre-norm through the recorded GEMV against the Triton ops: {err:.3g} of their scale"


class RecordingExperts(RecordingGemv):
    """:class:`RecordingGemv` that also serves routed experts as the native kernels do (Q4_K and
    Q6_K with SiLU; the token and each route's h quantized per 32 values), in float64 over
    gguf-py's dequantization, recording each call's ``[T, K]``."""

    def __init__(self) -> None:
        super().__init__()
        self.expert_calls: list[tuple[int, int]] = []

    @property
    def serves_experts(self) -> bool:
        return True

    def experts_refusal(self, formats: Any, hidden: int, intermediate: int, top_k: int, activation: str,
                        dtype: Any) -> str:  # fmt: skip
        return "" if set(formats) <= set(SERVED) and activation == "silu" else "not Q4_K/Q6_K with SiLU"

    def experts(self, x: Any, ids: Any, w: Any, stacks: Any, y: Any, table: Any = None,
                activation: str = "silu") -> None:  # fmt: skip
        from expert_reference import reference_experts

        g, u, d = (torch.from_numpy(np.asarray(gguf_dequantize(s.data.cpu().numpy().reshape(-1),
                                                               GGMLQuantizationType(s.fmt)), dtype=np.float64))
                   .reshape(s.num_experts, s.rows, s.cols) for s in stacks)  # fmt: skip
        own = ids.cpu().long()
        if table is not None:
            own = torch.where(own >= 0, table.cpu().long()[own.clamp(min=0)], own)
        y.copy_(reference_experts(x.cpu(), own, w.cpu(), g, u, d, activation, int8_x=True, int8_h=32).to(y.dtype))
        self.expert_calls.append((int(ids.shape[0]), int(ids.shape[1])))


def test_moe_gpu_kernel_dispatch(tmp_path, monkeypatch):
    """``--moe-gpu-kernel``: ``auto`` with a backend that has routed-expert kernels hands every
    packed GPU layer's routes to them (the prompt's, within the decode path's route count, and
    each decode step's), and the greedy tokens and logits equal the engine whose Triton kernels
    run the experts (in float32, without quantizing the activations) to the int8 rounding; the
    report counts the layers.
    ``triton`` never calls them; ``native`` on a backend without them refuses to start."""
    from freetoken_fakegpu.backend import FakeGpuBackend

    from freetoken.kernels import availability



    from freetoken.kernels import moe_packed

    monkeypatch.setattr(availability, "default_impl", lambda device: ("triton", "the interpreter"))
    # one program per route and token in the interpreter (float32 byte tiles, no int8 rounding)
    wide = moe_packed.PackedConfig(block_i=256, block_h=512, block_n=512, block_r=256)
    monkeypatch.setattr(moe_packed, "default_config", lambda device: wide)
    one = plt.PackedLinearConfig(block_n=512, block_k=256, block_t=4)
    monkeypatch.setattr(packed_linear, "packed_dense_impl", lambda device: ("triton", "the interpreter"))
    monkeypatch.setattr(plt, "config_for", lambda rows, device=None: one)
    tg, _ = _gguf_helpers()
    path = str(tmp_path / "kquant_experts.gguf")
    tg.write_tiny_gguf(path, seed=37, mix=[dict(m, ffn_gate_exps=Fmt.Q4_K, ffn_up_exps=Fmt.Q4_K,
                                                ffn_down_exps=f) for m, f in zip(tg.MIX, (Fmt.Q6_K, Fmt.Q4_K))])
    prompt = [(13 * j) % (tg.V - 10) + 5 for j in range(17)]
    with pytest.raises(BackendError, match="--moe-gpu-kernel native.*auto or triton"):
        _run(path, prompt, moe_gpu_kernel="native")
    out_t, logits_t, info_t = _run(path, prompt, moe_gpu_kernel="triton")
    gpu_layers = info_t["moe_gpu_layers"]
    assert gpu_layers >= 1
    assert info_t["moe_gpu_kernel"] == {"setting": "triton", "native_layers": 0, "triton_layers": gpu_layers,
                                        "triton_because": ["not offered"]}

    kernels = RecordingExperts()
    monkeypatch.setattr(FakeGpuBackend, "packed_gemv", lambda self: kernels, raising=False)
    out_n, logits_n, info_n = _run(path, prompt, gpu_gemv="triton")  # the dense linears stay on Triton
    assert info_n["moe_gpu_kernel"] == {"setting": "auto", "native_layers": gpu_layers, "triton_layers": 0,
                                        "triton_because": []}
    assert not kernels.calls, "--gpu-gemv triton: no dense GEMV through the backend"
    # the prompt in one call per GPU layer, then 4 decode steps of one token each
    assert kernels.expert_calls.count((1, tg.K)) == 4 * gpu_layers, kernels.expert_calls
    assert kernels.expert_calls.count((len(prompt), tg.K)) == gpu_layers, kernels.expert_calls
    assert out_n == out_t
    err = float((logits_n - logits_t).abs().max() / logits_t.abs().max())
    assert err <= 1e-2, f"the recorded experts' logits against Triton's int8 dots: {err:.3g} of their scale"


class RecordingMxfp4Experts(RecordingExperts):
    """:class:`RecordingExperts` serving MXFP4 experts with GPT-OSS's clamped SwiGLU (as the
    native kernels do since they read MXFP4), recording the activation each call names."""

    def __init__(self) -> None:
        super().__init__()
        self.activations: list[str] = []

    def experts_refusal(self, formats: Any, hidden: int, intermediate: int, top_k: int, activation: str,
                        dtype: Any) -> str:  # fmt: skip
        mx = int(Fmt.MXFP4)
        return "" if tuple(formats) == (mx, mx, mx) and activation == "swiglu_oai" else "not MXFP4 with swiglu_oai"

    def experts(self, x: Any, ids: Any, w: Any, stacks: Any, y: Any, table: Any = None,
                activation: str = "silu") -> None:  # fmt: skip
        self.activations.append(activation)
        super().experts(x, ids, w, stacks, y, table, activation)


def test_gpt_oss_mxfp4_experts_dispatch(tmp_path, monkeypatch):
    """GPT-OSS's MXFP4 experts (gate/up biases folded in as one more block per row) on a
    backend whose routed-expert kernels serve MXFP4 with the clamped SwiGLU: every packed GPU
    layer's decode routes go to them, named ``swiglu_oai``, and the greedy tokens and logits
    equal the engine whose Triton kernels run those experts to the int8 rounding."""
    from freetoken_fakegpu.backend import FakeGpuBackend
    from test_packed_checkpoints import _gpt_oss_mxfp4_gguf, _test_dirs

    from freetoken.kernels import availability
    from freetoken.kernels import moe_packed

    _test_dirs("engine", "models_moe_families")
    monkeypatch.setattr(availability, "default_impl", lambda device: ("triton", "the interpreter"))
    wide = moe_packed.PackedConfig(block_i=256, block_h=512, block_n=512, block_r=256)
    monkeypatch.setattr(moe_packed, "default_config", lambda device: wide)
    path, model = _gpt_oss_mxfp4_gguf(tmp_path)
    prompt = [(13 * j) % 150 + 3 for j in range(11)]
    kw = dict(gpu_gemv="triton")
    out_t, logits_t, info_t = _run(path, prompt, moe_gpu_kernel="triton", **kw)
    layers = info_t["moe_gpu_layers"]
    assert layers == model.config.num_hidden_layers

    kernels = RecordingMxfp4Experts()
    monkeypatch.setattr(FakeGpuBackend, "packed_gemv", lambda self: kernels, raising=False)
    out_n, logits_n, info_n = _run(path, prompt, **kw)
    assert info_n["moe_gpu_kernel"] == {"setting": "auto", "native_layers": layers, "triton_layers": 0,
                                        "triton_because": []}
    assert kernels.expert_calls.count((1, model.config.num_experts_per_tok)) == 4 * layers, kernels.expert_calls
    assert set(kernels.activations) == {"swiglu_oai"}
    assert out_n == out_t
    err = float((logits_n - logits_t).abs().max() / logits_t.abs().max())
    assert err <= 1e-2, f"the recorded experts' logits against Triton's: {err:.3g} of their scale"
