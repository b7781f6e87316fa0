"""Dense linears kept on the GPU as GGUF blocks (freetoken.kernels.packed_linear behind
freetoken.models.packed_linear: PackedLinear, PackedEmbedding, PackedWeightPolicy).

Every result is compared with numpy float64 over gguf-py's dequantization of the same random
blocks (gguf.quants.dequantize); outputs are poisoned (NaN) first; output row counts are
odd (ragged last tile). Formats Q4_K, Q5_K, Q6_K, Q8_0; T in {1, 3, 20} in the interpreter (20:
two token tiles of 8 and a ragged one), {1, 3, 64, 512} on a GPU.

Without a GPU the kernels run in Triton's interpreter (conftest.py) at small sizes with wide
tiles (its cost is per program), and an engine run on the fakegpu plugin goes through them;
a subprocess compiles them for sm_90. On a GPU (``-m gpu``, the H200 machine) the same tests
run compiled with the default tiles at K=2048, plus capture and replay in a CUDA graph, an
engine run with ``--gpu-dense packed`` against ``dequantized`` and against a float64 forward,
and a timing against BF16 ``F.linear`` at the Qwen3-30B-A3B shapes
(``pytest tests/gpu/test_packed_dense.py -m gpu -k timing -s``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("gguf")

import triton  # noqa: E402
from expert_reference import int8_groups  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from graph_timing import graph_time_us  # noqa: E402
from greedy_runs import check_logits, run_greedy  # noqa: E402

from freetoken.handoff import Fmt  # noqa: E402
from freetoken.models.gguf_writer import random_blocks  # noqa: E402
from freetoken.loading.tensors import RawTensor  # noqa: E402
from freetoken.models import packed_linear  # noqa: E402
from freetoken.kernels import packed_linear as plt  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = DEV == "cpu"
if INTERPRET and not triton.knobs.runtime.interpret:
    pytest.skip("no GPU and Triton's interpreter is off (TRITON_INTERPRET unset at import)", allow_module_level=True)

Q4, Q5, Q6, Q8 = int(Fmt.Q4_K), int(Fmt.Q5_K), int(Fmt.Q6_K), int(Fmt.Q8_0)
FORMATS = [Q4, Q5, Q6, Q8]
NAMES = {Q4: "q4_k", Q5: "q5_k", Q6: "q6_k", Q8: "q8_0"}
#: scale of the random fp16 block scales, so that weights are O(0.01 .. 0.1)
SCALES = {Q4: 2e-4, Q5: 1e-4, Q6: 1e-4, Q8: 2e-4}
#: output rows (odd: a ragged last tile) and input columns
ROWS, COLS = (37, 512) if INTERPRET else (517, 2048)
TOKENS = [1, 3, 20] if INTERPRET else [1, 3, 64, 512]
#: the interpreter: few programs; the GPU: the default tiles, and tiles smaller than a block
CONFIGS = ([plt.PackedLinearConfig(block_n=64, block_k=256, block_t=8, max_gemv_tokens=1024)]
           if INTERPRET else
           [dataclasses.replace(plt.DEFAULT_CONFIG, max_gemv_tokens=1024),
            plt.PackedLinearConfig(block_n=16, block_k=128, block_t=4, num_warps=2, max_gemv_tokens=1024),
            dataclasses.replace(plt.WIDE_CONFIG, max_gemv_tokens=1024)])
FP32_TOL = 1e-5  # float32 products and sums, relative to the output's scale
BF16_TOL = 1e-2  # bf16 activations and outputs


def packed(fmt: int, rows: int, cols: int, seed: int) -> tuple[RawTensor, np.ndarray]:
    """Random blocks as a RawTensor, and gguf-py's float64 dequantization of them."""
    rng = np.random.default_rng(seed)
    b = random_blocks(fmt, rows, cols, rng, scale=SCALES[fmt])
    ref = gguf_dequantize(b, GGMLQuantizationType(fmt)).astype(np.float64).reshape(rows, cols)
    return RawTensor(name=f"w{fmt}", shape=(rows, cols), fmt=fmt, data=b, source="random"), ref


def matrix(raw: RawTensor) -> plt.PackedMatrix:
    data = torch.from_numpy(np.ascontiguousarray(raw.data)).reshape(-1).to(DEV)
    return plt.PackedMatrix.from_bytes(data, raw.fmt, *raw.shape)


def relative_error(got: torch.Tensor, want: np.ndarray) -> float:
    g = got.double().cpu().numpy()
    assert np.isfinite(g).all(), "output rows left unwritten (NaN)"
    return float(np.abs(g - want).max() / np.abs(want).max())


def assert_bf16_rows(got: torch.Tensor, want: np.ndarray) -> None:
    """``got`` (bfloat16) is ``want`` rounded to bfloat16: exactly on a GPU; within one bf16
    step in Triton's interpreter, whose float32 -> bfloat16 cast truncates."""
    ref = torch.from_numpy(want).to(torch.bfloat16)
    if not INTERPRET:
        assert torch.equal(got, ref)
        return
    assert float(((got.double() - torch.from_numpy(want)).abs() / torch.from_numpy(want).abs().clamp_min(1e-30)).max()) \
        <= 2.0 ** -7


def activations(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, COLS, generator=g).to(dtype)
    return x.to(DEV), x.double().numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("fmt", FORMATS, ids=[NAMES[f] for f in FORMATS])
def test_gemv_matches_float64(fmt, tokens, dtype):
    raw, ref = packed(fmt, ROWS, COLS, seed=fmt * 100 + tokens)
    w = matrix(raw)
    x, x64 = activations(tokens, dtype, seed=tokens)
    want = x64 @ ref.T
    for config in CONFIGS:
        y = torch.full((tokens, ROWS), float("nan"), dtype=dtype, device=DEV)
        plt.gemv(x, w, y, config)
        err = relative_error(y, want)
        assert err <= (FP32_TOL if dtype == torch.float32 else BF16_TOL), (config, err)


#: the int8 GEMV against float64 over the same quantized token: float32 sums in another order,
#: and where the GPU fuses the rounding's multiply and add (one rounding, not two) a code that
#: lies within an ulp of a rounding boundary may come out one step off (~1e-4 of the output's
#: scale each); the unquantized product is >= ~2e-3 away
INT8_TOL = 3e-4


@pytest.mark.parametrize("block_n,block_k", [(16, 128), (32, 512)])
@pytest.mark.parametrize("fmt", FORMATS, ids=[NAMES[f] for f in FORMATS])
def test_gemv_int8_dots(fmt, block_n, block_k):
    """One token with ``int8_dot``: Q4_K and Q6_K rows against float64 over the token quantized
    as the kernels do (tests/gpu/expert_reference.int8_groups), and against the unquantized
    product (the quantization's error only); Q5_K and Q8_0 keep their byte tiles. Steps of
    one and of several half blocks, masked rows; BF16 tokens (exact ties of x * 127 / amax
    are common: the kernels divide correctly rounded, as the reference does)."""
    raw, ref = packed(fmt, ROWS, COLS, seed=fmt * 10 + block_n)
    x, x64 = activations(1, torch.bfloat16, seed=block_k)
    config = plt.PackedLinearConfig(block_n=block_n, block_k=block_k, int8_dot=True)
    y = torch.full((1, ROWS), float("nan"), device=DEV)
    plt.gemv(x, matrix(raw), y, config)
    quantized = fmt in (Q4, Q6)
    want = (int8_groups(x.cpu()).numpy() if quantized else x64) @ ref.T
    assert relative_error(y, want) <= (INT8_TOL if quantized else FP32_TOL)
    if quantized:
        assert relative_error(y, x64 @ ref.T) > 1e-3, "no quantization error: was the token quantized?"


@pytest.mark.parametrize("fmt", FORMATS, ids=[NAMES[f] for f in FORMATS])
def test_dequantize_and_gather_rows_equal_gguf(fmt):
    """Bit for bit: the kernels' weight values are gguf-py's."""
    raw, ref = packed(fmt, ROWS, COLS, seed=fmt)
    w = matrix(raw)
    out = torch.full((ROWS - 4, COLS), float("nan"), device=DEV)
    plt.dequantize_rows(w, out, first=3)
    assert np.array_equal(out.cpu().double().numpy(), ref[3 : ROWS - 1])
    ids = torch.tensor([0, ROWS - 1, 5, 5, 2, 17, ROWS // 2], dtype=torch.int64, device=DEV)
    rows = torch.full((7, COLS), float("nan"), device=DEV)
    plt.gather_rows(ids, w, rows)
    assert np.array_equal(rows.cpu().double().numpy(), ref[ids.cpu().numpy()])


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("fmt", FORMATS, ids=[NAMES[f] for f in FORMATS])
def test_packed_linear_both_paths(fmt, impl, monkeypatch):
    """PackedLinear: the GEMV for small T, the scratch (three chunks of rows here) and a
    matmul above ``max_gemv_tokens``; the embedding's rows. Against float64."""
    monkeypatch.setattr(packed_linear, "SCRATCH_VALUES", ROWS * COLS // 3)
    raw, ref = packed(fmt, ROWS, COLS, seed=fmt + 7)
    data = torch.from_numpy(np.ascontiguousarray(raw.data)).to(DEV)
    config = dataclasses.replace(CONFIGS[0], max_gemv_tokens=4)
    scratch = packed_linear.PrefillScratch(torch.device(DEV), torch.float32)
    lin = packed_linear.PackedLinear(data, fmt, raw.shape, scratch, impl, config)
    assert lin.chunk_rows < ROWS and lin.nbytes == raw.data.nbytes
    for tokens in TOKENS:
        x, x64 = activations(tokens, torch.float32, seed=tokens + 1)
        err = relative_error(lin(x), x64 @ ref.T)
        assert err <= FP32_TOL, (tokens, err)
    assert scratch.nbytes == lin.chunk_rows * COLS * 4
    emb = packed_linear.PackedEmbedding(raw, data, torch.bfloat16, impl)
    ids = torch.tensor([[4, 0], [ROWS - 1, 4]], device=DEV)
    got = emb(ids)
    assert got.shape == (2, 2, COLS) and got.dtype == torch.bfloat16
    assert_bf16_rows(got.cpu(), ref[ids.cpu().numpy()])


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_packed_linear_prompt_copy(impl):
    """``prompt_weight`` (``--gpu-dense both``): calls of several tokens multiply the copy and
    never dequantize into the scratch; the one-token GEMV keeps its calls (Triton), the torch
    path takes the copy for every call. The copy is marked (a scaled matrix) so the path
    that ran is visible in the result."""
    fmt = Q4
    raw, ref = packed(fmt, ROWS, COLS, seed=21)
    data = torch.from_numpy(np.ascontiguousarray(raw.data)).to(DEV)
    config = dataclasses.replace(CONFIGS[0], max_gemv_tokens=4)
    scratch = packed_linear.PrefillScratch(torch.device(DEV), torch.float32)
    copy = (torch.from_numpy(ref) * 2).float().to(DEV)  # twice the weights: tells the paths apart
    lin = packed_linear.PackedLinear(data, fmt, raw.shape, scratch, impl, config, prompt_weight=copy)
    for tokens in (1, 4, 5, 37):
        x, x64 = activations(tokens, torch.float32, seed=tokens + 3)
        by_copy = impl == "torch" or tokens > 1
        want = x64 @ ref.T * (2 if by_copy else 1)
        err = relative_error(lin(x), want)
        assert err <= FP32_TOL, (tokens, err)
    assert scratch.nbytes == 0, "a linear with a prompt copy dequantized into the scratch"


def test_wide_matrices_take_the_wide_tiles():
    """An output head's row count selects the wide tiles (WIDE_CONFIG, 8 x 256; for one token
    on NVIDIA NVIDIA_WIDE_CONFIG, int8 dots), a projection's the default ones; the wide byte
    tiles' GEMV of one token against float64 (Q6_K, the head's format)."""
    from freetoken.backends import triton_target

    scratch = packed_linear.PrefillScratch(torch.device(DEV), torch.float32)
    fmt = Q6
    nvidia = DEV == "cuda" and triton_target.for_device(DEV).backend == "cuda"
    wide, narrow = (plt.NVIDIA_WIDE_CONFIG, plt.NVIDIA_CONFIG) if nvidia else (plt.WIDE_CONFIG, plt.DEFAULT_CONFIG)
    assert not nvidia or (wide.int8_dot and narrow.int8_dot)
    for rows, want in ((plt.WIDE_ROWS, wide), (plt.WIDE_ROWS - 1, narrow)):
        raw, _ = packed(fmt, rows, 256, seed=rows)
        data = torch.from_numpy(np.ascontiguousarray(raw.data)).to(DEV)
        lin = packed_linear.PackedLinear(data, fmt, raw.shape, scratch, "triton")
        assert lin.config == want, rows
        # batches of several tokens: the byte tiles whatever the device (int8 dots serve one token)
        assert lin.batch_config == (plt.WIDE_CONFIG if rows >= plt.WIDE_ROWS else plt.DEFAULT_CONFIG), rows
    assert (plt.WIDE_CONFIG.block_n, plt.WIDE_CONFIG.block_k) == (8, 256)
    raw, ref = packed(fmt, ROWS, COLS, seed=99)
    x, x64 = activations(1, torch.float32, seed=5)
    y = torch.full((1, ROWS), float("nan"), device=DEV)
    plt.gemv(x, matrix(raw), y, plt.WIDE_CONFIG)
    assert relative_error(y, x64 @ ref.T) <= FP32_TOL


_COMPILE_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freetoken.kernels import packed_linear as plt
from freetoken.kernels import moe_packed as tp

report = {}
cfg = plt.DEFAULT_CONFIG
for fmt in (12, 13, 14, 8):
    per, nb, g = tp.FORMATS[fmt]
    for bt, int8 in ((1, False), (2, False), (8, False), (1, True)):
        sig = {"x_ptr": "*bf16", "w_u8": "*u8", "w_i8": "*i8", "w_f16": "*fp16", "y_ptr": "*bf16", "T": "i32"}
        consts = dict(N=5120, K=2048, FMT=fmt, RB=2048 // per * nb, G=g, BLOCK_N=8 if int8 else cfg.block_n,
                      BLOCK_K=cfg.step_columns(bt, 2048), BLOCK_T=bt, INT8=int8, DP4A=int8)
        sig.update({k: "constexpr" for k in consts})
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
        k = triton.compile(ASTSource(plt._packed_gemv_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        dp4a = "dp4a.s32.s32" in k.asm["ptx"]
        report[f"gemv_{fmt}_t{bt}{'_int8' if int8 else ''}"] = (
            bool(k.asm.get("cubin")) and dp4a == (int8 and fmt in (12, 14)))
    sig = {"ids_ptr": "*i64", "w_u8": "*u8", "w_i8": "*i8", "w_f16": "*fp16", "out_ptr": "*bf16", "T": "i32"}
    consts = dict(V=151936, K=2048, FMT=fmt, RB=2048 // per * nb, G=g, BLOCK_T=4, BLOCK_C=1024)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    k = triton.compile(ASTSource(plt._gather_rows_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    report[f"gather_{fmt}"] = bool(k.asm.get("cubin"))
print(json.dumps(report))
"""


def test_kernels_compile_for_sm90():
    """The GEMV (one token and token tiles) and the embedding gather compile for the H200
    (sm_90) with Triton's bundled ptxas, no GPU needed (a subprocess without
    TRITON_INTERPRET): catches what the interpreter accepts and the compiler does not; with
    int8 dots, Q4_K and Q6_K rows use dp4a."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 20 and all(report.values()), report


# --------------------------------------------------------------------------------------
# the engine: --gpu-dense packed
# --------------------------------------------------------------------------------------


def _gguf_helpers():
    """tests/engine/test_engine_gguf.py (the tiny K-quant file writer) and the float64
    forward of tests/gpu/qwen3_reference.py."""
    here = os.path.join(os.path.dirname(__file__), "..", "engine")
    if here not in sys.path:
        sys.path.insert(0, here)
    import qwen3_reference
    import test_engine_gguf

    return test_engine_gguf, qwen3_reference


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tg, ref = _gguf_helpers()
    path = str(tmp_path_factory.mktemp("packed_dense") / "tiny.gguf")
    return tg, ref, path, tg.write_tiny_gguf(path, seed=13)


def _engine(path, on=None, **kw):
    """An engine on ``on`` (a Backend, e.g. the GPU fixture's) or on ``kw["backend"]`` (a name)."""
    from freetoken.backends import registry
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine

    registry.reset()
    return LLMEngine(EngineConfig(model=path, max_model_len=160, kv_cache_tokens=2048, **kw), backend=on)


def _prompts(vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % (vocab - 10) + 5 for j in range(n)] for i, n in enumerate((5, 23, 9, 40))]


def _check_float64(tg, reference, tensors, prompts, got) -> None:
    """The engine's logits at every generated position against the float64 forward over
    gguf-py's dequantization of the file, on the engine's own tokens (every expert on the
    device: float32 summation order only)."""
    for prompt, (out, logits) in zip(prompts, got):
        ids = prompt + out
        want = reference.logits(tensors, ids, tg.LAYERS, tg.HEADS, tg.KVH, tg.HD, tg.K,
                                theta=1e6)[len(prompt) - 1 : len(ids) - 1].float()  # fmt: skip
        err = float((logits - want).abs().max() / want.abs().max())
        assert err <= 1e-3, f"packed dense: logits differ by {err:.3g} of their scale"


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's run of the fakegpu engine (the GPU runs the cuda one)")
def test_fakegpu_engine_through_the_interpreted_kernels(tiny_gguf, monkeypatch):
    """The packed kernels inside an engine (GEMV for decode, scratch for prefill, the
    embedding gather) on the fakegpu plugin, in the interpreter, against float64."""
    tg, reference, path, tensors = tiny_gguf
    monkeypatch.setattr(packed_linear, "packed_dense_impl", lambda device: ("triton", "the interpreter"))
    monkeypatch.setattr(plt, "DEFAULT_CONFIG", plt.PackedLinearConfig(block_n=512, block_k=256, block_t=4))
    eng = _engine(path, None, backend="fakegpu", dtype="float32", moe_cpu_layers="0", gpu_dense="packed")
    try:
        info = eng.backend_info()
        assert info["dense_form"] == "packed" and "triton" in info["weights"]["dense"], info["weights"]
        prompts = _prompts(tg.V)
        got = run_greedy(eng, prompts, max_tokens=4)
    finally:
        eng.close()
        from freetoken.backends import registry

        registry.reset()  # the later tests of this process choose their own backend
    _check_float64(tg, reference, tensors, prompts, got)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's run (the GPU runs test_gpu_engine.py's int8 tests)")
def test_fakegpu_engine_int8_dots_through_the_interpreter(tiny_gguf, monkeypatch):
    """The int8 dots inside an engine, in the interpreter (the byte extractions that stand for
    dp4a): the fakegpu plugin given NVIDIA's choices (int8 dots for the packed experts and for
    one-token GEMVs, the byte tiles for batches) with the interpreter's tiles, one request,
    against the float64 forward with the activations rounded as tests/gpu/int8_model_reference.py
    writes the rules, position by position. Where the engine rounds every activation as the
    reference does a position agrees to ~1e-6 of the logits' scale (float32 summation order).
    That noise can move an activation that sits on a rounding boundary to the other step
    (seen: one position of five at 5.3e-3 after other tests had run in the same process,
    which moved the engine's float32 logits by a few ulps; the next position, which reads
    the flipped K/V, at 7e-6). So: at least 6 of the 8 positions within 1e-4,
    every one within 4e-2 (the largest one-flip change measured on these files), and the
    reference without the dense rounding (6e-3..9e-2 here) within 1e-4 at none."""
    import dataclasses

    from int8_model_reference import dense_hook, expert_hook, position_errors
    from test_packed_experts import WIDE, WIDE_BF16

    from freetoken.kernels import availability



    from freetoken.kernels import moe_experts


    from freetoken.kernels import moe_packed

    tg, _, path, tensors = tiny_gguf
    one = plt.PackedLinearConfig(block_n=512, block_k=256, block_t=4, int8_dot=True)
    batch = dataclasses.replace(one, int8_dot=False)
    monkeypatch.setattr(packed_linear, "packed_dense_impl", lambda device: ("triton", "the interpreter"))
    monkeypatch.setattr(availability, "default_impl", lambda device: ("triton", "the interpreter"))
    monkeypatch.setattr(plt, "config_for", lambda rows, device=None: batch if device is None else one)
    monkeypatch.setattr(moe_packed, "default_config",
                        lambda device: dataclasses.replace(WIDE, int8_dot=True, int8_h=True))
    monkeypatch.setattr(moe_experts, "DEFAULT_CONFIG", WIDE_BF16)  # the F16/Q6_K/Q8_0 layer's BF16 experts
    eng = _engine(path, None, backend="fakegpu", dtype="float32", moe_cpu_layers="0", gpu_dense="packed")
    prompt = [(11 * j) % (tg.V - 10) + 5 for j in range(21)]
    try:
        ((out, logits),) = run_greedy(eng, [prompt], max_tokens=8)
    finally:
        eng.close()
        from freetoken.backends import registry

        registry.reset()
    ids = prompt + out
    experts = expert_hook(tg.MIX, int8_h=True)

    err, plain = (position_errors(tg, tensors, ids, len(prompt), logits, experts, hook)
                  for hook in (dense_hook(tg.MIX, tg.OUTPUT_FMT, len(prompt)), None))  # fmt: skip
    assert len(err) == 8, err
    assert sum(e <= 1e-4 for e in err) >= 6, f"int8 dots against the rounding reference, per position: {err}"
    assert max(err) <= 4e-2, f"int8 dots against the rounding reference, per position: {err}"
    assert min(plain) > 1e-4, f"the reference without the dense rounding fits a position: {plain}"


@pytest.mark.gpu
@pytest.mark.parametrize("eager,embedding", [(True, "device"), (False, "device"), (False, "host")],
                         ids=["eager", "graphs", "graphs-host-embedding"])
def test_gpu_engine_packed_matches_float64(backend, tiny_gguf, eager, embedding, monkeypatch):
    """FP32, every expert on the GPU, dense packed (Q8_0/Q4_K/Q6_K attention and head, Q8_0
    embedding, F16/BF16 k projections as floats): logits against the float64 forward, with
    the byte tiles (AMD's; NVIDIA's default int8 dots round the activations: their GEMV is
    tested above against the rounding reference, engines with them in test_gpu_engine.py).
    ``--gpu-embedding host``: the table in page-locked host memory, read inside the graphs."""
    from freetoken.kernels import moe_packed

    monkeypatch.setattr(moe_packed, "NVIDIA_CONFIG", moe_packed.DEFAULT_CONFIG)
    monkeypatch.setattr(plt, "NVIDIA_CONFIG", plt.DEFAULT_CONFIG)
    monkeypatch.setattr(plt, "NVIDIA_WIDE_CONFIG", plt.WIDE_CONFIG)
    tg, reference, path, tensors = tiny_gguf
    eng = _engine(path, backend, dtype="float32", moe_cpu_layers="0", gpu_dense="packed",
                  enforce_eager=eager, cuda_graph_max_bs=8, gpu_embedding=embedding)  # fmt: skip
    try:
        info = eng.backend_info()
        assert info["graphs"] is (not eager) and info["dense_form"] == "packed", info
        assert info["memory_plan"]["embedding"] == embedding, info["memory_plan"]
        assert ("host memory" in info["weights"]["embedding"]) is (embedding == "host"), info["weights"]
        assert "triton" in info["weights"]["dense"], info["weights"]
        prompts = _prompts(tg.V)
        got = run_greedy(eng, prompts, max_tokens=12)
    finally:
        eng.close()
    _check_float64(tg, reference, tensors, prompts, got)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["0", "1"], ids=["all-gpu", "mixed"])
def test_gpu_engine_packed_equals_dequantized_bf16(backend, tiny_gguf, placement):
    """BF16 with decode graphs, 32 greedy steps: ``--gpu-dense packed`` against
    ``dequantized`` (the dequantized form rounds weights to BF16, the packed one multiplies
    the exact block values: logits within BF16 rounding; the greedy tokens equal up to a
    step where the dequantized run's top two logits are within it)."""
    tg, _, path, _ = tiny_gguf
    prompts = _prompts(tg.V)
    runs = {}
    for form in ("dequantized", "packed"):
        eng = _engine(path, backend, dtype="bfloat16", moe_cpu_layers=placement, gpu_dense=form,
                      cuda_graph_max_bs=8)  # fmt: skip
        try:
            info = eng.backend_info()
            assert info["graphs"] and info["dense_form"] == form, info
            runs[form] = run_greedy(eng, prompts, max_tokens=32)
        finally:
            eng.close()
    # the two forms' BF16 roundings differ, and greedy decoding of a random model compounds
    # that: the logits are held to 5e-2 over the first 8 steps (exactness is the FP32 test's)
    compared = check_logits([(i[:8], lg[:8]) for i, lg in runs["packed"]],
                            [(i[:8], lg[:8]) for i, lg in runs["dequantized"]], tol=5e-2)
    same = sum(a == b for (a, _), (b, _) in zip(runs["packed"], runs["dequantized"]))
    print(f"packed vs dequantized ({placement}): {same}/{len(prompts)} prompts' 32 tokens equal, "
          f"{compared} positions compared")


# --------------------------------------------------------------------------------------
# on the GPU: graph capture and replay, Qwen3-30B-A3B shapes and timing
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 64, 512])
@pytest.mark.parametrize("fmt", FORMATS, ids=[NAMES[f] for f in FORMATS])
def test_gpu_linear_in_cuda_graph(fmt, tokens):
    """PackedLinear (GEMV up to 16 tokens, scratch + matmul above) and PackedEmbedding, its
    table on the device and in page-locked host memory (read over PCIe by the same kernel),
    captured in a CUDA graph after one eager call, replayed with new inputs: equal to
    float64 each time (no host sync, no allocation that depends on values)."""
    raw, ref = packed(fmt, ROWS, COLS, seed=fmt * 7 + tokens)
    data = torch.from_numpy(np.ascontiguousarray(raw.data)).cuda()
    scratch = packed_linear.PrefillScratch(torch.device("cuda"), torch.bfloat16)
    lin = packed_linear.PackedLinear(data, fmt, raw.shape, scratch)
    emb = packed_linear.PackedEmbedding(raw, data, torch.bfloat16)
    host = torch.from_numpy(np.ascontiguousarray(raw.data)).pin_memory()
    emb_host = packed_linear.PackedEmbedding(raw, host, torch.bfloat16, device="cuda")
    x = torch.zeros(tokens, COLS, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    out: dict[str, torch.Tensor] = {}

    def step() -> None:
        out["y"] = lin(x)
        out["rows"] = emb(ids)
        out["host_rows"] = emb_host(ids)

    step()  # compiles the variants, allocates the scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        xs = torch.randn(tokens, COLS, generator=g).to(torch.bfloat16)
        rows = torch.randint(0, ROWS, (tokens,), generator=g)
        x.copy_(xs)
        ids.copy_(rows)
        out["y"].fill_(float("nan"))
        out["host_rows"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out["y"], xs.double().numpy() @ ref.T) <= BF16_TOL
        assert_bf16_rows(out["rows"].cpu(), ref[rows.numpy()])
        assert out["host_rows"].device.type == "cuda"
        assert_bf16_rows(out["host_rows"].cpu(), ref[rows.numpy()])


#: Qwen3-30B-A3B: (name, rows, cols, format) of a layer's q/k/v (fused) and o, and the head
QWEN3_SHAPES = [("qkv", 4096 + 512 + 512, 2048, Q4), ("o", 2048, 4096, Q4), ("head", 151936, 2048, Q6)]


@pytest.mark.gpu
def test_gpu_timing_against_bf16():
    """Decode (T=1) GEMV at the Qwen3-30B-A3B shapes under graph replay, against BF16
    ``F.linear`` on the same values and the HBM floor of the packed bytes (4.3 TB/s);
    printed, not asserted. Correctness at those shapes against the BF16 result."""
    rng = np.random.default_rng(0)
    for name, rows, cols, fmt in QWEN3_SHAPES:
        b = random_blocks(fmt, rows, cols, rng, scale=SCALES[fmt])
        data = torch.from_numpy(b).reshape(-1).cuda()
        w = plt.PackedMatrix.from_bytes(data, fmt, rows, cols)
        dense = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
        plt.dequantize_rows(w, dense)
        x = torch.randn(1, cols, device="cuda").to(torch.bfloat16)
        y = torch.empty(1, rows, dtype=torch.bfloat16, device="cuda")
        packed_us = graph_time_us(lambda: plt.gemv(x, w, y))
        bf16_us = graph_time_us(lambda: torch.nn.functional.linear(x, dense))
        want = torch.nn.functional.linear(x.float(), dense.float())
        err = float((y.float() - want).abs().max() / want.abs().max())
        assert err <= BF16_TOL, (name, err)
        print(f"{name} [{rows}, {cols}] {NAMES[fmt]}: packed {packed_us:.1f} us ({w.nbytes / 1e6:.1f} MB, floor "
              f"{w.nbytes / 4.3e12 * 1e6:.1f} us), bf16 {bf16_us:.1f} us ({dense.numel() * 2 / 1e6:.1f} MB, floor "
              f"{dense.numel() * 2 / 4.3e12 * 1e6:.1f} us)")
