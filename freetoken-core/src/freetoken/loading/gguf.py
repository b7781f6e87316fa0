"""GGUF files: metadata, and tensors memory-mapped in their packed form.

Read with gguf-py's :class:`gguf.GGUFReader`, which maps the file; every tensor's
bytes stay exactly as in the file (packed Q4_K/Q5_K/Q6_K/Q8_0/MXFP4 blocks go to the CPU
kernels unchanged). Shapes are reported in row-major order (ggml's ``ne`` reversed),
so a ``[rows, cols]`` matrix and an ``[experts, rows, cols]`` stack read as in HF.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Optional

from freetoken.handoff import Fmt
from freetoken.loading.hf import CheckpointError
from freetoken.loading.tensors import RawTensor

logger = logging.getLogger(__name__)

#: ggml types we can run (the ids equal :class:`freetoken.handoff.Fmt` values).
SUPPORTED_TYPES = {int(Fmt.F32), int(Fmt.F16), int(Fmt.BF16), int(Fmt.Q8_0), int(Fmt.Q4_K), int(Fmt.Q5_K), int(Fmt.Q6_K),
                   int(Fmt.MXFP4)}  # fmt: skip

# Arrays we keep lazy (large vocabularies): read on request by the tokenizer loader.
_LAZY_PREFIX = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


class GGUFCheckpoint:
    """A GGUF file as a TensorSource plus its metadata."""

    def __init__(self, path: str) -> None:
        from gguf import GGUFReader

        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: no such file")
        try:
            self.reader = GGUFReader(path, "r")
        except Exception as exc:  # gguf-py raises ValueError/struct errors on bad files
            size = os.path.getsize(path)
            raise CheckpointError(
                f"{path}: not a readable GGUF file ({size} bytes; truncated or corrupt download?): {exc}"
            ) from exc
        self.path = path
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF.") or key.startswith(_LAZY_PREFIX):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception:  # pragma: no cover - exotic value types we do not use
                logger.debug("GGUF field %s unreadable; skipped", key)
        self._tensors = {t.name: t for t in self.reader.tensors}

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def field(self, key: str) -> Optional[Any]:
        """Any metadata field (including the large tokenizer arrays), or None."""
        if key in self.metadata:
            return self.metadata[key]
        f = self.reader.fields.get(key)
        return None if f is None else f.contents()

    def names(self) -> Iterable[str]:
        return self._tensors.keys()

    def has(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> RawTensor:
        try:
            t = self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing tensor {name}") from None
        ttype = int(t.tensor_type)
        if ttype not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name} has ggml type {t.tensor_type.name}, which FreeToken does not run; "
                f"supported: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4"
            )
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        data = t.data
        if ttype == Fmt.BF16:
            data = data.view("uint16").reshape(shape) if data.dtype.itemsize == 2 else data.view("uint16").reshape(shape)
        return RawTensor(name=name, shape=shape, fmt=ttype, data=data, source=self.path)

    def tensor_layout(self, name: str) -> Optional[tuple[int, int]]:
        """(ggml type, bytes) of a tensor, without checking that we run its type; None if absent."""
        t = self._tensors.get(name)
        return None if t is None else (int(t.tensor_type), int(t.n_bytes))

    def tensor_elements(self, name: str) -> int:
        """Values of a tensor (KeyError if absent)."""
        return int(self._tensors[name].n_elements)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Row-major shape of a tensor (KeyError if absent), without reading its data."""
        return tuple(int(x) for x in reversed(self._tensors[name].shape.tolist()))

    def total_bytes(self) -> int:
        return os.path.getsize(self.path)


def gguf_int(meta: dict[str, Any], key: str, default: Optional[int] = None) -> int:
    v = meta.get(key, default)
    if v is None:
        raise CheckpointError(f"GGUF metadata lacks {key}")
    if isinstance(v, list):  # per-layer arrays: all equal for the models we run
        v = v[0]
    return int(v)


def gguf_float(meta: dict[str, Any], key: str, default: Optional[float] = None) -> float:
    v = meta.get(key, default)
    if v is None:
        raise CheckpointError(f"GGUF metadata lacks {key}")
    return float(v)
