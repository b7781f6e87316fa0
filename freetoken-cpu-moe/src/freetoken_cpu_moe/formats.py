"""Weight and activation formats: names, ``FT_FMT_*`` ids and block geometry."""

from __future__ import annotations

import dataclasses

from freetoken.handoff import Fmt


@dataclasses.dataclass(frozen=True)
class FormatInfo:
    """How one weight format is laid out in memory."""

    name: str
    fmt_id: int
    block_elems: int  # elements per block (1 for the float formats)
    block_bytes: int  # bytes per block

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_elems * self.block_bytes


#: Weight formats, in the order of ``freetoken_cpu_moe.FORMATS``.
FORMAT_INFO: dict[str, FormatInfo] = {
    "f32": FormatInfo("f32", int(Fmt.F32), 1, 4),
    "f16": FormatInfo("f16", int(Fmt.F16), 1, 2),
    "bf16": FormatInfo("bf16", int(Fmt.BF16), 1, 2),
    "fp8_e4m3_b128": FormatInfo("fp8_e4m3_b128", int(Fmt.FP8_E4M3_B128), 1, 1),
    "q8_0": FormatInfo("q8_0", int(Fmt.Q8_0), 32, 34),
    "q4_k": FormatInfo("q4_k", int(Fmt.Q4_K), 256, 144),
    "q5_k": FormatInfo("q5_k", int(Fmt.Q5_K), 256, 176),
    "q6_k": FormatInfo("q6_k", int(Fmt.Q6_K), 256, 210),
    "mxfp4": FormatInfo("mxfp4", int(Fmt.MXFP4), 32, 17),
}

FORMATS: tuple[str, ...] = tuple(FORMAT_INFO)

_BY_ID = {info.fmt_id: info for info in FORMAT_INFO.values()}

#: Block size (rows and columns) of the FP8 scale grid.
FP8_SCALE_BLOCK = 128


def format_info(fmt: "str | int") -> FormatInfo:
    """Look a weight format up by name (``"q4_k"``, case-insensitive) or ``FT_FMT_*`` id."""
    if isinstance(fmt, str):
        key = fmt.lower()
        if key in FORMAT_INFO:
            return FORMAT_INFO[key]
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {', '.join(FORMATS)}")
    try:
        return _BY_ID[int(fmt)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"unknown weight format id {fmt!r}; expected one of "
            + ", ".join(f"{i.fmt_id} ({i.name})" for i in FORMAT_INFO.values())
        ) from None
