"""Dequantization of GGUF block formats with torch tensor ops, on any device.

gguf-py's numpy dequantization runs on one CPU core at tens of M values/s; loading a
Q4_K_M MoE onto a GPU dequantizes billions of values. Here the same arithmetic runs as
a handful of element-wise torch ops over all blocks of a chunk of rows at once, on the
device the packed bytes are on (a GPU does it at memory speed).

Block layouts (ggml's ``block_q8_0``, ``block_q4_K``, ``block_q5_K``, ``block_q6_K``;
little-endian, f16 fields as IEEE half):

* ``Q8_0``  (32 values, 34 bytes): f16 ``d``, 32 int8 ``q``; ``y = q * d``.
* ``Q4_K`` (256 values, 144 bytes): f16 ``d``, f16 ``dmin``, 12 bytes holding eight
  6-bit scales ``sc`` and eight 6-bit mins ``m`` (one pair per 32-value sub-block),
  128 bytes of 4-bit quants. ``y = (d*sc) * q - (dmin*m)``. Each run of 32 quant
  bytes holds two sub-blocks: its low nibbles, then its high nibbles.
* ``Q5_K`` (256 values, 176 bytes): as Q4_K, with 32 bytes of fifth bits between the
  scales and the nibbles: bit ``j`` of byte ``l`` is the high bit of value ``l`` of
  sub-block ``j``.
* ``Q6_K`` (256 values, 210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit high
  parts, 16 int8 scales (one per 16 values), f16 ``d``; ``y = (d*sc) * (q - 32)``.
  Each 128-value half uses 64 low bytes (values ``0..63``: low nibbles, ``64..127``:
  high nibbles) and 32 high bytes (bits ``2k..2k+1`` of byte ``l`` belong to value
  ``32k + l``).
* ``MXFP4`` (32 values, 17 bytes): E8M0 exponent byte ``e``, 16 bytes of 4-bit codes;
  ``y = KVALUES[code] * 2^(e - 128)`` (see the MXFP4 section below); exact in float32.

The arithmetic is float32 and in the same order as gguf-py's reference (the scale
products first, then the quant, then the min), so results equal it bit for bit: in
Q8_0, Q4_K and Q5_K every product is exact in float32 (at most 11+6+5 significant
bits) and only the final subtraction rounds; in Q6_K ``(d*sc)`` is exact and
``(d*sc) * q`` rounds once, the same single rounding as the reference's. The result
is cast to the requested dtype once at the end (round to nearest even).

Temporaries are bounded by working through chunks of rows (64 M values per chunk on a
GPU) into a preallocated output.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from freetoken.handoff import Fmt

if TYPE_CHECKING:
    from freetoken.loading.tensors import RawTensor

__all__ = ["dequantize", "to_device_float", "DEFAULT_CHUNK_VALUES", "BLOCK_SIZES"]

# Block geometry, as freetoken.loading.tensors.BLOCK_SIZES (kept here so that tensors.py
# can import this module at its top without an import cycle; a test checks they agree).
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    int(Fmt.Q8_0): (32, 34),
    int(Fmt.Q4_K): (256, 144),
    int(Fmt.Q5_K): (256, 176),
    int(Fmt.Q6_K): (256, 210),
    int(Fmt.MXFP4): (32, 17),
}
_FLOAT_FMTS = (int(Fmt.F32), int(Fmt.F16), int(Fmt.BF16))


def fmt_name(fmt: int) -> str:
    try:
        return Fmt(fmt).name.lower()
    except ValueError:
        return f"ggml type {fmt}"


def row_bytes(fmt: int, cols: int) -> int:
    per, nbytes = BLOCK_SIZES[int(fmt)]
    if cols % per:
        raise ValueError(f"{fmt_name(fmt)} needs rows that are a multiple of {per} values, got {cols}")
    return cols // per * nbytes


#: Values dequantized per chunk, by device type: bounds the float32 temporaries (a few
#: per value) on a GPU; small enough on a CPU to stay in cache.
DEFAULT_CHUNK_VALUES: dict[str, int] = {"cuda": 64 << 20, "cpu": 1 << 20}
_DEFAULT_OTHER = 16 << 20

#: Below this many bytes a host tensor goes to the GPU in one plain copy (no staging).
_STAGE_MIN_BYTES = 8 << 20

DeviceLike = Union[str, torch.device, int]

_consts: dict[tuple[str, torch.device], torch.Tensor] = {}

# Bit fields are extracted four bytes at a time: the quant bytes are viewed as int32
# words and masked with a byte-replicated mask (0x0F0F0F0F: the low nibble of each
# byte), which is byte-order independent and does a quarter of the element ops.
_NIB = 0x0F0F0F0F
_BIT = 0x01010101
_CRUMB = 0x03030303


def _const(name: str, values: list[int], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A small int32 constant (bit shifts) cached per device."""
    key = (name, device)
    t = _consts.get(key)
    if t is None:
        t = torch.tensor(values, dtype=torch.int32, device=device).view(shape)
        _consts[key] = t
    return t


def _packed_copy(b: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of a ``[n, k]`` byte slice (aligned, so it can be viewed
    as wider elements whatever the slice's offset)."""
    return torch.empty(b.shape, dtype=b.dtype, device=b.device).copy_(b)


def _words(b: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` bytes (k a multiple of 4) as ``[n, k/4]`` int32 words."""
    return _packed_copy(b).view(torch.int32)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per block (``[n, 2]`` uint8, little-endian IEEE half) -> ``[n, 1]`` float32."""
    return _packed_copy(b).view(torch.float16).to(torch.float32)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of a Q4_K/Q5_K block (``[n, 12]``) -> eight 6-bit scales and
    eight 6-bit mins, ``[n, 8]`` uint8 each.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3 likewise; bytes
    8-11 hold the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble),
    whose top 2 bits are the top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    s = s.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([a & 63, (c & 15) | ((a >> 6) << 4)], dim=1)
    mn = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=1)
    return sc, mn


def _split_nibbles(w: torch.Tensor) -> torch.Tensor:
    """Words ``[..., g, k]`` -> ``[..., g, 2, k]``: each group's low nibbles, then its
    high nibbles (byte for byte)."""
    out = torch.empty((*w.shape[:-1], 2, w.shape[-1]), dtype=torch.int32, device=w.device)
    torch.bitwise_and(w, _NIB, out=out.select(-2, 0))
    torch.bitwise_and(w >> 4, _NIB, out=out.select(-2, 1))
    return out


def _q8_0(blk: torch.Tensor, y: torch.Tensor) -> None:
    y.copy_(blk[:, 2:34].view(torch.int8))
    y.mul_(_f16(blk[:, 0:2]))


def _k_min_scale(blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32-value sub-block of Q4_K/Q5_K: ``d*sc`` and ``dmin*m``, ``[n, 8, 1]`` float32
    (both exact)."""
    d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
    sc, mn = _k_scales(blk[:, 4:16])
    return (d * sc.to(torch.float32)).unsqueeze(-1), (dmin * mn.to(torch.float32)).unsqueeze(-1)


def _q4_k(blk: torch.Tensor, y: torch.Tensor) -> None:
    n = blk.shape[0]
    dl, ml = _k_min_scale(blk)
    # 4 runs of 32 bytes; run g: low nibbles = sub-block 2g, high nibbles = sub-block 2g+1
    q = _split_nibbles(_words(blk[:, 16:144]).view(n, 4, 8))
    y3 = y.view(n, 8, 32)
    y3.copy_(q.view(torch.uint8).view(n, 8, 32))
    y3.mul_(dl).sub_(ml)


def _q5_k(blk: torch.Tensor, y: torch.Tensor) -> None:
    n = blk.shape[0]
    dl, ml = _k_min_scale(blk)
    q = _split_nibbles(_words(blk[:, 48:176]).view(n, 4, 8)).view(n, 8, 8)
    # 32 bytes of fifth bits: bit j of byte l -> value l of sub-block j
    bit = _const("bit8", list(range(8)), (1, 8, 1), blk.device)
    hi = (_words(blk[:, 16:48]).view(n, 1, 8) >> bit) & _BIT
    q |= hi << 4
    y3 = y.view(n, 8, 32)
    y3.copy_(q.view(torch.uint8).view(n, 8, 32))
    y3.mul_(dl).sub_(ml)


def _q6_k(blk: torch.Tensor, y: torch.Tensor) -> None:
    n = blk.shape[0]
    # each 128-value half: 64 low bytes (values 0-63 low nibbles, 64-127 high nibbles)
    lo = _split_nibbles(_words(blk[:, 0:128]).view(n, 2, 16))  # [n, 2, 2, 16] words
    # and 32 high bytes: bits 2k..2k+1 of byte l -> value 32k + l
    crumb = _const("crumb", [0, 2, 4, 6], (1, 1, 4, 1), blk.device)
    hi = (_words(blk[:, 128:192]).view(n, 2, 1, 8) >> crumb) & _CRUMB  # [n, 2, 4, 8] words
    q = lo.view(n, 64)
    q |= hi.view(n, 64) << 4
    y.copy_(q.view(torch.uint8).view(n, 256))
    y.sub_(32)
    dl = (_f16(blk[:, 208:210]) * blk[:, 192:208].view(torch.int8).to(torch.float32)).unsqueeze(-1)
    y.view(n, 16, 16).mul_(dl)


#: MXFP4's doubled E2M1 values (see the MXFP4 section below)
MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
MXFP4_BLOCK_BYTES = 17


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """float32 ``2^k`` of integer exponents (exact; ``2^-127``, ``2^-128`` subnormal, as ggml's)."""
    return torch.ldexp(torch.ones(k.shape, dtype=torch.float32, device=k.device), k)


def _mxfp4(blk: torch.Tensor, y: torch.Tensor) -> None:
    n = blk.shape[0]
    q = _split_nibbles(_words(blk[:, 1:17]).view(n, 1, 4))  # [n, 1, 2, 4] words: values 0-15, then 16-31
    kv = torch.tensor(MXFP4_KVALUES, dtype=torch.float32, device=blk.device)
    y.copy_(kv[q.view(torch.uint8).view(n, 32).long()])
    y.mul_(_pow2(blk[:, 0:1].to(torch.int32) - 128))


#: Per format: ``fn(blocks [n, bytes] uint8, y [n, values] float32)`` fills ``y``.
_BLOCK_FNS: dict[int, Callable[[torch.Tensor, torch.Tensor], None]] = {
    int(Fmt.Q8_0): _q8_0,
    int(Fmt.Q4_K): _q4_k,
    int(Fmt.Q5_K): _q5_k,
    int(Fmt.Q6_K): _q6_k,
    int(Fmt.MXFP4): _mxfp4,
}


def _chunk_values(device: torch.device, chunk_values: Optional[int]) -> int:
    if chunk_values is not None:
        if chunk_values <= 0:
            raise ValueError(f"chunk_values must be positive, got {chunk_values}")
        return int(chunk_values)
    return DEFAULT_CHUNK_VALUES.get(device.type, _DEFAULT_OTHER)


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    if not shape:
        raise ValueError("a packed tensor needs at least one dimension")
    return math.prod(shape[:-1]), shape[-1]


def _as_bytes(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype == torch.uint8:
        return packed
    if packed.dtype == torch.int8:
        return packed.view(torch.uint8)
    raise TypeError(f"packed blocks must be a uint8 tensor, got {packed.dtype}")


def _check_out(out: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if tuple(out.shape) != shape or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {list(shape)} tensor on {device}, got {list(out.shape)} on {out.device}"
            f"{'' if out.is_contiguous() else ' (not contiguous)'}"
        )


class _BlockDequant:
    """Dequantizes runs of whole blocks into a flat output, ``chunk`` blocks at a time,
    through one float32 scratch buffer (none when the output is float32)."""

    def __init__(self, fmt: int, out_flat: torch.Tensor, chunk_values: int) -> None:
        self.fn = _BLOCK_FNS[fmt]
        self.per, self.nbytes = BLOCK_SIZES[fmt]
        self.out = out_flat
        self.chunk = max(1, chunk_values // self.per)
        self.scratch: Optional[torch.Tensor] = None
        if out_flat.dtype != torch.float32:
            n = min(self.chunk, out_flat.numel() // self.per)
            self.scratch = torch.empty((n, self.per), dtype=torch.float32, device=out_flat.device)

    def __call__(self, blocks: torch.Tensor, b0: int) -> None:
        """Blocks ``[n, bytes]`` (on the output's device) -> output blocks ``b0 .. b0+n``."""
        n = blocks.shape[0]
        per = self.per
        for i in range(0, n, self.chunk):
            j = min(n, i + self.chunk)
            dst = self.out[(b0 + i) * per : (b0 + j) * per].view(j - i, per)
            if self.scratch is None:
                self.fn(blocks[i:j], dst)
            else:
                y = self.scratch[: j - i]
                self.fn(blocks[i:j], y)
                dst.copy_(y)


def dequantize(
    packed: torch.Tensor,
    fmt: int,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    out: Optional[torch.Tensor] = None,
    chunk_values: Optional[int] = None,
) -> torch.Tensor:
    """Dequantize GGUF blocks on the device they are on.

    ``packed`` is a uint8 tensor (CPU or GPU) of ``prod(shape[:-1])`` rows of
    ``row_bytes(fmt, shape[-1])`` bytes (any leading shape, e.g. ``RawTensor.data``'s
    ``[..., row_bytes]``; ``[E, rows, row_bytes]`` for an expert stack). ``fmt`` is a
    block format (``Fmt.Q8_0``, ``Q4_K``, ``Q5_K``, ``Q6_K``, ``MXFP4``). Returns ``shape`` in
    ``dtype`` on ``packed``'s device (written into ``out`` if given: contiguous,
    ``shape``, same device), computed in float32 and cast once.

    Works through chunks of about ``chunk_values`` values (default
    :data:`DEFAULT_CHUNK_VALUES` for the device; whole blocks, so a chunk may end
    inside a row), so temporaries take a few bytes per value of one chunk only.
    """
    fmt = int(fmt)
    if fmt not in _BLOCK_FNS:
        raise ValueError(f"dequantize: {fmt_name(fmt)} is not a block format ({sorted(_BLOCK_FNS)})")
    shape = tuple(int(s) for s in shape)
    rows, cols = _rows_cols(shape)
    rb = row_bytes(fmt, cols)
    packed = _as_bytes(packed)
    if packed.numel() != rows * rb:
        raise ValueError(
            f"dequantize: {list(packed.shape)} bytes do not hold a {list(shape)} {fmt_name(fmt)} tensor "
            f"({rows} rows of {rb} bytes)"
        )
    device = packed.device
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    else:
        _check_out(out, shape, device)
    if out.numel() == 0:
        return out
    run = _BlockDequant(fmt, out.view(-1), _chunk_values(device, chunk_values))
    run(packed.reshape(-1, BLOCK_SIZES[fmt][1]), 0)
    return out


# --------------------------------------------------------------------------- to device


def _host_rows(raw: RawTensor) -> tuple[torch.Tensor, int, int]:
    """The raw tensor's storage as ``[rows, row elements]`` (a view where possible)."""
    t = raw.raw_torch()
    fmt = int(raw.fmt)
    shape = tuple(int(s) for s in raw.shape)
    if not shape:
        return t.reshape(1, -1), 1, 1
    rows, cols = _rows_cols(shape)
    if fmt in BLOCK_SIZES:
        t = _as_bytes(t)
        return t.reshape(rows, row_bytes(fmt, cols)), rows, cols
    if fmt == Fmt.BF16 and t.dtype != torch.bfloat16:
        t = t.view(torch.bfloat16)
    elif fmt == Fmt.FP8_E4M3_B128 and t.dtype != torch.float8_e4m3fn:
        t = t.view(torch.float8_e4m3fn)
    return t.reshape(rows, cols), rows, cols


def _stream(
    src: torch.Tensor,
    device: torch.device,
    step: int,
    pinned: bool,
    consume: Callable[[torch.Tensor, int, int], None],
) -> None:
    """Hand ``consume(chunk_on_device, r0, r1)`` the rows of ``src`` in chunks of ``step``
    rows, each copied to ``device`` once. Host -> CUDA copies of large tensors go through
    two pinned staging buffers, so filling one (reading the file mapping) overlaps the
    transfer and the dequantization of the other."""
    rows = src.shape[0]
    if src.device == device:
        for r0 in range(0, rows, step):
            consume(src[r0 : min(rows, r0 + step)], r0, min(rows, r0 + step))
        return
    big = src.numel() * src.element_size() >= _STAGE_MIN_BYTES
    if not (pinned and big and device.type == "cuda" and src.device.type == "cpu" and rows > step):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            consume(src[r0:r1].to(device), r0, r1)
        return
    stream = torch.cuda.current_stream(device)
    bufs = [torch.empty((step, *src.shape[1:]), dtype=src.dtype, pin_memory=True) for _ in range(2)]
    done: list[Optional[torch.cuda.Event]] = [None, None]
    for i, r0 in enumerate(range(0, rows, step)):
        r1 = min(rows, r0 + step)
        k = i % 2
        ev = done[k]
        if ev is not None:
            ev.synchronize()  # the copy out of this buffer (two chunks ago) has finished
        buf = bufs[k][: r1 - r0]
        buf.copy_(src[r0:r1])
        dev = buf.to(device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        done[k] = ev
        consume(dev, r0, r1)
    for ev in done:
        if ev is not None:
            ev.synchronize()  # the staging buffers are reused by the caching host allocator


def _fp8_scale_rows(scale: torch.Tensor, lead: int, rows: int, cols: int, block: int) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    """For flattened rows ``g`` of an ``[lead, rows, cols]`` FP8 tensor: their block
    scales widened to ``[n, cols]`` (row ``g`` -> scale row ``(g // rows, g % rows // block)``)."""
    sr = -(-rows // block)
    s2 = scale.to(torch.float32).reshape(lead * sr, -1)

    def rows_scale(r0: int, r1: int) -> torch.Tensor:
        g = torch.arange(r0, r1, device=s2.device)
        idx = g // rows * sr + g % rows // block
        return s2[idx].repeat_interleave(block, dim=1)[:, :cols]

    return rows_scale


def to_device_float(
    raw: RawTensor,
    device: DeviceLike,
    dtype: torch.dtype = torch.bfloat16,
    *,
    chunk_values: Optional[int] = None,
    pinned: bool = True,
) -> torch.Tensor:
    """``raw`` as a float tensor of ``raw.shape`` in ``dtype`` on ``device``.

    The stored bytes go to the device once (in chunks of rows; through pinned staging
    buffers for large host -> CUDA copies unless ``pinned=False``) and are turned into
    floats there: block formats by :func:`dequantize`, F32/F16/BF16 by a cast, FP8 E4M3
    with 128x128 block scales (``raw.scale``) by ``fp8 * scale`` in float32 as
    :meth:`RawTensor.to_float` does. Equal to ``raw.to_float(torch.float32).to(dtype)``.
    When the data already is on ``device`` in ``dtype`` the result may share its memory
    (as :meth:`RawTensor.to_float` does).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fmt = int(raw.fmt)
    shape = tuple(int(s) for s in raw.shape)
    if fmt not in BLOCK_SIZES and fmt not in _FLOAT_FMTS and fmt != Fmt.FP8_E4M3_B128:
        raise ValueError(f"to_device_float: unsupported tensor format {fmt_name(fmt)} ({raw.name})")
    src, rows, cols = _host_rows(raw)
    if fmt in _FLOAT_FMTS and src.device == device and src.dtype == dtype:
        return src.reshape(shape)
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.numel() == 0:
        return out
    dst = out.view(rows, cols) if shape else out.view(1, 1)
    step = max(1, _chunk_values(device, chunk_values) // max(cols, 1))

    if fmt in BLOCK_SIZES:
        per, nbytes = BLOCK_SIZES[fmt]
        run = _BlockDequant(fmt, out.view(-1), _chunk_values(device, chunk_values))
        bpr = cols // per  # blocks per row
        _stream(src, device, step, pinned, lambda c, r0, r1: run(c.reshape(-1, nbytes), r0 * bpr))
    elif fmt == Fmt.FP8_E4M3_B128:
        if raw.scale is None:
            _stream(src, device, step, pinned, lambda c, r0, r1: dst[r0:r1].copy_(c.to(torch.float32)))
        else:
            scale = raw.scale if isinstance(raw.scale, torch.Tensor) else torch.as_tensor(raw.scale)
            lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
            mrows = shape[-2] if len(shape) >= 2 else 1
            rows_scale = _fp8_scale_rows(scale.to(device), lead, mrows, cols, 128)
            _stream(src, device, step, pinned,
                    lambda c, r0, r1: dst[r0:r1].copy_(c.to(torch.float32).mul_(rows_scale(r0, r1))))
    else:
        _stream(src, device, step, pinned, lambda c, r0, r1: dst[r0:r1].copy_(c))
    return out


# ---------------------------------------------------------------------------- MXFP4
#
# MXFP4 (OCP microscaling, GPT-OSS's experts): blocks of 32 values, each a 4-bit E2M1 code
# and one E8M0 exponent byte ``e`` per block; value = KVALUES[code] * 2^(e - 128) with the
# doubled E2M1 values below (so 2^(e - 127) times the E2M1 value). Two byte layouts:
#
# * HF checkpoints: ``*_blocks`` uint8 ``[..., nblk, 16]`` and ``*_scales`` uint8 ``[..., nblk]``;
#   value ``2j`` of a block is the low nibble of byte ``j``, value ``2j + 1`` its high nibble.
# * ggml ``block_mxfp4`` (17 bytes, the expert kernels' ``mxfp4`` format): ``e``, then 16
#   bytes; value ``j < 16`` is the low nibble of byte ``j``, value ``j + 16`` its high nibble.
#
# HF blocks are rewritten in ggml's layout at load (:func:`mxfp4_ggml_from_hf`, the same
# bytes); devices that dequantize experts (the GPU's torch path) use :func:`_mxfp4`.


def mxfp4_ggml_from_hf(scales: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """ggml ``block_mxfp4`` rows (uint8 ``[..., nblk * 17]``) of HF ``*_scales`` (uint8
    ``[..., nblk]``) and ``*_blocks`` (uint8 ``[..., nblk, 16]``): the same exponents and
    codes, the codes reordered from pairs (value ``2j``, ``2j + 1`` in byte ``j``) to halves."""
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
                         "(expected [..., nblk, 16] and [..., nblk])")  # fmt: skip
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat([scales.unsqueeze(-1), packed], dim=-1)  # [..., nblk, 17]
    return out.reshape(*scales.shape[:-1], -1).contiguous()
