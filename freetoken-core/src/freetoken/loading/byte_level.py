"""GPT-2's byte-level alphabet: each of the 256 byte values stands for one printable
character (printable Latin-1 bytes for themselves, the others for code points from 256 up),
so byte-level BPE vocabularies are written as text."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def byte_symbols() -> tuple[str, ...]:
    """Byte value -> its character."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return tuple(out)


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """Character -> byte value."""
    return {c: b for b, c in enumerate(byte_symbols())}


def to_symbols(data: bytes) -> str:
    """``data`` written in the byte-level alphabet."""
    table = byte_symbols()
    return "".join(table[b] for b in data)
