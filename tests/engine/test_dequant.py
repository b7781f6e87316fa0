"""freetoken.loading.dequant: GGUF block dequantization with torch ops, on CPU and GPU.

The reference is gguf-py's numpy dequantization (``gguf.quants.dequantize``), written
independently from the same block layouts. Both compute the same float32 products in
the same order (scale products first, exact; then the quant; then the min), so the
float32 results are compared bit for bit, and the bf16 results against the float32
reference cast to bf16.

Blocks are random but valid: gguf-py only quantizes Q8_0 (used for one Q8_0 case), so
every format also gets random bytes, which reach every quant/scale bit pattern, with
their f16 fields (``d``, ``dmin``) overwritten by random finite halves (both signs,
subnormals, zero and the largest half included).

GPU variants (``-m gpu``) run the same checks on CUDA tensors and print throughput.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from freetoken.handoff import Fmt
from freetoken.loading import dequant
from freetoken.loading.dequant import BLOCK_SIZES, dequantize, to_device_float
from freetoken.loading.tensors import BLOCK_SIZES as TENSOR_BLOCK_SIZES
from freetoken.loading.tensors import RawTensor

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

BLOCK_FMTS = [Fmt.Q8_0, Fmt.Q4_K, Fmt.Q5_K, Fmt.Q6_K]
# byte offsets of the f16 fields in each block
F16_FIELDS = {Fmt.Q8_0: (0,), Fmt.Q4_K: (0, 2), Fmt.Q5_K: (0, 2), Fmt.Q6_K: (208,)}
SPECIAL_HALVES = np.array([0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0xFBFF, 0x3C00, 0x0400], dtype=np.uint16)


def finite_halves(rng: np.random.Generator, n: int) -> np.ndarray:
    h = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    h[(h & 0x7C00) == 0x7C00] &= 0xBFFF  # inf/nan -> a finite exponent
    k = min(n, len(SPECIAL_HALVES))
    h[rng.choice(n, k, replace=False)] = SPECIAL_HALVES[:k]
    return h


def random_blocks(fmt: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random valid blocks for a ``shape`` tensor, laid out as ``[*shape[:-1], row bytes]``."""
    rng = np.random.default_rng(seed)
    per, nbytes = BLOCK_SIZES[int(fmt)]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    nblocks = rows * cols // per
    b = rng.integers(0, 256, (nblocks, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[Fmt(fmt)]:
        b[:, off : off + 2] = finite_halves(rng, nblocks).view(np.uint8).reshape(nblocks, 2)
    return b.reshape(*shape[:-1], cols // per * nbytes)


def quantized_q8_0(shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-8, 4, (*shape[:-1], 1)))).astype(np.float32)
    return gguf_quants.quantize(x, GGMLQuantizationType.Q8_0)


def reference(packed: np.ndarray, fmt: int, shape: tuple[int, ...]) -> torch.Tensor:
    arr = gguf_quants.dequantize(np.ascontiguousarray(packed), GGMLQuantizationType(int(fmt)))
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equality (also tells -0.0 from 0.0)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    got, want = got.cpu(), want.cpu()
    ibits = {4: torch.int32, 2: torch.int16}[got.element_size()]
    gb, wb = got.view(ibits), want.view(ibits)
    if not torch.equal(gb, wb):
        bad = (gb != wb).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{len(bad)} of {got.numel()} values differ; first at {i}: {got[i].item()!r} != {want[i].item()!r}")


def shapes_for(fmt: int) -> list[tuple[int, ...]]:
    per = BLOCK_SIZES[int(fmt)][0]
    return [(per,), (5 * per,), (7, 3 * per), (3, 5, 2 * per), (2, 64, 4 * per)]


CASES = [(fmt, shape) for fmt in BLOCK_FMTS for shape in shapes_for(fmt)]


def _id(case):
    fmt, shape = case
    return f"{Fmt(fmt).name}-{'x'.join(map(str, shape))}"


def check_against_reference(fmt: int, shape: tuple[int, ...], packed: np.ndarray, device: str, **kw) -> None:
    want = reference(packed, fmt, shape)
    t = torch.from_numpy(packed).to(device)
    got = dequantize(t, fmt, shape, torch.float32, **kw)
    assert got.device == t.device
    assert_bits_equal(got, want)
    got16 = dequantize(t, fmt, shape, torch.bfloat16, **kw)
    assert got16.device == t.device
    assert_bits_equal(got16, want.to(torch.bfloat16))


# ----------------------------------------------------------------------------- CPU


def test_block_sizes_agree_with_tensors():
    assert BLOCK_SIZES == TENSOR_BLOCK_SIZES


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_random_blocks_equal_gguf(case):
    fmt, shape = case
    check_against_reference(fmt, shape, random_blocks(fmt, shape, seed=len(shape) * 1000 + shape[-1]), "cpu")


@pytest.mark.parametrize("shape", [(32,), (6, 96), (4, 3, 256)], ids=str)
def test_q8_0_quantized_by_gguf_equal_gguf(shape):
    check_against_reference(Fmt.Q8_0, shape, quantized_q8_0(shape, seed=shape[-1]), "cpu")


@pytest.mark.parametrize("fmt", BLOCK_FMTS, ids=lambda f: Fmt(f).name)
def test_many_blocks_equal_gguf(fmt):
    """A few hundred thousand values, several default-size chunks (and the scratch
    buffer reused across them)."""
    per = BLOCK_SIZES[int(fmt)][0]
    shape = (3, 96, 2048 if per == 256 else 1024)
    packed = random_blocks(fmt, shape, seed=7)
    check_against_reference(fmt, shape, packed, "cpu", chunk_values=100_000)


@pytest.mark.parametrize("fmt", BLOCK_FMTS, ids=lambda f: Fmt(f).name)
@pytest.mark.parametrize("chunk_values", [1, 700, 1 << 40])
def test_chunking_does_not_change_the_result(fmt, chunk_values):
    """Chunks of one block, chunks ending inside rows, one chunk for everything."""
    per = BLOCK_SIZES[int(fmt)][0]
    shape = (2, 3, 3 * per)
    check_against_reference(fmt, shape, random_blocks(fmt, shape, seed=3), "cpu", chunk_values=chunk_values)


@pytest.mark.parametrize("fmt", BLOCK_FMTS, ids=lambda f: Fmt(f).name)
def test_out_and_non_contiguous_input(fmt):
    per = BLOCK_SIZES[int(fmt)][0]
    shape = (6, 4, 2 * per)
    packed = random_blocks(fmt, shape, seed=11)
    sub = torch.from_numpy(packed)[::2]  # every other expert: not contiguous
    assert not sub.is_contiguous()
    want = reference(packed[::2], fmt, (3, 4, 2 * per))
    out = torch.full((3, 4, 2 * per), float("nan"), dtype=torch.bfloat16)
    got = dequantize(sub, fmt, (3, 4, 2 * per), torch.bfloat16, out=out, chunk_values=per)
    assert got is out
    assert_bits_equal(got, want.to(torch.bfloat16))
    # int8 storage of the same bytes is accepted
    assert_bits_equal(dequantize(torch.from_numpy(packed).view(torch.int8), fmt, shape), reference(packed, fmt, shape))


def test_errors():
    b = torch.zeros(2, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not hold"):
        dequantize(b, Fmt.Q4_K, (2, 512))
    with pytest.raises(ValueError, match="multiple of 256"):
        dequantize(b, Fmt.Q4_K, (2, 128))
    with pytest.raises(ValueError, match="not a block format"):
        dequantize(b, Fmt.F16, (2, 144))
    with pytest.raises(TypeError, match="uint8"):
        dequantize(b.float(), Fmt.Q4_K, (2, 256))
    with pytest.raises(ValueError, match="out must be"):
        dequantize(b, Fmt.Q4_K, (2, 256), out=torch.empty(2, 255))
    assert dequantize(torch.zeros(0, 144, dtype=torch.uint8), Fmt.Q4_K, (0, 256)).shape == (0, 256)


def _readonly(a: np.ndarray) -> np.ndarray:
    """Like a read-only file mapping."""
    r = np.frombuffer(a.tobytes(), dtype=a.dtype).reshape(a.shape)
    assert not r.flags.writeable
    return r


@pytest.mark.parametrize("fmt", BLOCK_FMTS, ids=lambda f: Fmt(f).name)
@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
def test_to_device_float_blocks_cpu(fmt, as_torch):
    per = BLOCK_SIZES[int(fmt)][0]
    shape = (4, 5, 3 * per)
    packed = _readonly(random_blocks(fmt, shape, seed=5))
    data = torch.from_numpy(packed.copy()) if as_torch else packed
    raw = RawTensor("w", shape, int(fmt), data)
    want = reference(packed, fmt, shape)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for cv in (None, 2 * per):  # whole; chunks of two blocks (rows in pieces)
            got = to_device_float(raw, "cpu", dtype, chunk_values=cv)
            assert_bits_equal(got, want.to(dtype))


def _fp8_raw(shape: tuple[int, ...], seed: int, with_scale: bool, as_torch: bool) -> RawTensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows, cols = shape[-2], shape[-1]
    scale = None
    if with_scale:
        scale = torch.rand((*shape[:-2], -(-rows // 128), -(-cols // 128)), generator=g) * 1e-2 + 1e-4
    data = w.view(torch.uint8)
    return RawTensor("w", shape, int(Fmt.FP8_E4M3_B128), data if as_torch else data.numpy(), scale=scale)


@pytest.mark.parametrize("shape", [(200, 300), (3, 130, 256), (2, 256, 100)], ids=str)
@pytest.mark.parametrize("with_scale", [True, False], ids=["scaled", "unscaled"])
def test_to_device_float_fp8_cpu(shape, with_scale):
    raw = _fp8_raw(shape, seed=shape[-1], with_scale=with_scale, as_torch=len(shape) == 3)
    want = raw.to_float(torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        for cv in (None, 1000, 7 * shape[-1]):  # chunks crossing 128-row blocks and experts
            assert_bits_equal(to_device_float(raw, "cpu", dtype, chunk_values=cv), want.to(dtype))


@pytest.mark.parametrize("fmt", [Fmt.F32, Fmt.F16, Fmt.BF16], ids=lambda f: Fmt(f).name)
def test_to_device_float_plain_cpu(fmt):
    x = torch.randn(3, 7, 40) * 100
    data = {
        Fmt.F32: lambda: x.numpy(),
        Fmt.F16: lambda: x.half().numpy(),
        Fmt.BF16: lambda: x.bfloat16().view(torch.uint16).numpy(),  # as the GGUF loader stores it
    }[fmt]()
    raw = RawTensor("w", (3, 7, 40), int(fmt), _readonly(data))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = raw.to_float(torch.float32).to(dtype)
        assert_bits_equal(to_device_float(raw, "cpu", dtype, chunk_values=50), want)


@pytest.mark.parametrize("fmt", BLOCK_FMTS, ids=lambda f: Fmt(f).name)
def test_default_chunks_into_bf16_out_equal_gguf(fmt):
    """The loading path's call: no ``chunk_values`` (the CPU default, 1 M values), a tensor of
    four default chunks, into a caller's bfloat16 ``out``. Twice into the same buffer, the
    first time filled with NaN: both results are gguf-py's values rounded once to bfloat16."""
    chunk = dequant.DEFAULT_CHUNK_VALUES["cpu"]
    shape = (4 * chunk // 4096, 4096)
    packed = random_blocks(fmt, shape, seed=1)
    want = reference(packed, fmt, shape).to(torch.bfloat16)
    out = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    for _ in range(2):
        got = dequantize(torch.from_numpy(packed), fmt, shape, torch.bfloat16, out=out)
        assert got is out
        assert_bits_equal(got, want)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_gpu_random_blocks_equal_gguf(case):
    fmt, shape = case
    check_against_reference(fmt, shape, random_blocks(fmt, shape, seed=len(shape) * 1000 + shape[-1]), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", BLOCK_FMTS, ids=lambda f: Fmt(f).name)
def test_gpu_many_blocks_and_chunks_equal_gguf(fmt):
    per = BLOCK_SIZES[int(fmt)][0]
    shape = (3, 96, 2048 if per == 256 else 1024)
    packed = random_blocks(fmt, shape, seed=7)
    for cv in (None, 1, 100_000):
        check_against_reference(fmt, shape, packed, "cuda", chunk_values=cv)
    check_against_reference(Fmt.Q8_0, (4, 3, 256), quantized_q8_0((4, 3, 256), seed=1), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", BLOCK_FMTS, ids=lambda f: Fmt(f).name)
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_gpu_to_device_float_blocks(fmt, pinned):
    """Host -> GPU through the (pinned) staging path: a tensor over 8 MB in several chunks."""
    shape = (8, 512, 4096)  # 16 M values: 9-14 MB packed
    packed = random_blocks(fmt, shape, seed=13)
    raw = RawTensor("w", shape, int(fmt), _readonly(packed))
    want = dequantize(torch.from_numpy(packed), fmt, shape, torch.float32)  # CPU, checked against gguf above
    sub = (slice(0, 2), slice(0, 64))
    assert_bits_equal(want[sub], reference(packed[sub], fmt, want[sub].shape))
    for dtype in (torch.float32, torch.bfloat16):
        got = to_device_float(raw, "cuda", dtype, chunk_values=3 << 20, pinned=pinned)
        assert got.device.type == "cuda"
        assert_bits_equal(got, want.to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(200, 300), (3, 130, 256), (2, 256, 100)], ids=str)
def test_gpu_to_device_float_fp8_and_plain(shape):
    raw = _fp8_raw(shape, seed=shape[-1], with_scale=True, as_torch=True)
    want = raw.to_float(torch.float32)
    for cv in (None, 1000):
        assert_bits_equal(to_device_float(raw, "cuda", torch.bfloat16, chunk_values=cv), want.to(torch.bfloat16))
    x = torch.randn(shape) * 10
    for fmt, data in ((Fmt.F32, x.numpy()), (Fmt.BF16, x.bfloat16().view(torch.uint16).numpy()), (Fmt.F16, x.half())):
        r = RawTensor("w", shape, int(fmt), data)
        assert_bits_equal(to_device_float(r, "cuda", torch.bfloat16), r.to_float(torch.float32).to(torch.bfloat16))


def _cuda_rate(fn, values: int, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        t1.synchronize()
        best = min(best, t0.elapsed_time(t1) / 1e3)
    return values / best


@pytest.mark.gpu
def test_gpu_throughput_q4_k_64m():
    """Prints values/s for a 64 M-value Q4_K tensor: on the device, and host -> device."""
    shape = (16384, 4096)  # 64 M values, 36 MiB packed
    n = shape[0] * shape[1]
    g = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(0, 256, (shape[0], shape[1] // 256 * 144), dtype=torch.uint8, device="cuda", generator=g)
    blocks = packed.view(-1, 144)
    blocks[:, 0:4] = torch.tensor([0x00, 0x1C, 0x00, 0x18], dtype=torch.uint8, device="cuda")  # d = 1/256, dmin = 1/512
    out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    rate = _cuda_rate(lambda: dequantize(packed, Fmt.Q4_K, shape, torch.bfloat16, out=out), n)
    rate32 = _cuda_rate(lambda: dequantize(packed, Fmt.Q4_K, shape, torch.float32), n)
    host = packed.cpu()
    # check a slice against gguf-py, and the whole against the CPU path
    # gguf-py's float32 values rounded once to bfloat16 (the values need more than bf16's 8 bits)
    assert_bits_equal(out[:64], reference(host[:64].numpy(), Fmt.Q4_K, (64, shape[1])).to(torch.bfloat16))
    assert_bits_equal(out, dequantize(host, Fmt.Q4_K, shape, torch.bfloat16))
    raw = RawTensor("w", shape, int(Fmt.Q4_K), host.numpy())
    h2d = {}
    for pinned in (True, False):
        for _ in range(2):  # the first call warms up (pinned allocation)
            t = time.perf_counter()
            res = to_device_float(raw, "cuda", torch.bfloat16, pinned=pinned, chunk_values=8 << 20)
            torch.cuda.synchronize()
            h2d[pinned] = n / (time.perf_counter() - t)
        assert_bits_equal(res, out)
        del res
    print(
        f"\nQ4_K 64M values on {torch.cuda.get_device_name()}: on device -> bf16 {rate / 1e9:.1f} G values/s, "
        f"-> f32 {rate32 / 1e9:.1f} G values/s; host -> device -> bf16 "
        f"pinned staging {h2d[True] / 1e9:.2f} G values/s, pageable {h2d[False] / 1e9:.2f} G values/s "
        f"(8 M-value chunks); "
        f"chunk {dequant.DEFAULT_CHUNK_VALUES['cuda'] >> 20} M values"
    )
