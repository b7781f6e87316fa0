"""Hugging Face checkpoint directories: config.json + (sharded) *.safetensors.

The safetensors files are memory-mapped and parsed with a reader of our own (the
format is an 8-byte header length, a JSON header and the raw tensor bytes), so every
tensor is a zero-copy view of the page cache: nothing is copied into RAM twice.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from typing import Any, Iterable, Optional

import numpy as np
import torch

from freetoken.handoff import Fmt
from freetoken.loading.tensors import RawTensor

logger = logging.getLogger(__name__)

# safetensors dtype -> (numpy dtype of the stored elements, Fmt, torch view dtype)
_DTYPES: dict[str, tuple[Any, Optional[int], Optional[torch.dtype]]] = {
    "F32": (np.float32, int(Fmt.F32), None),
    "F16": (np.float16, int(Fmt.F16), None),
    "BF16": (np.uint16, int(Fmt.BF16), torch.bfloat16),
    "F8_E4M3": (np.uint8, int(Fmt.FP8_E4M3_B128), None),
    "I64": (np.int64, None, None),
    "I32": (np.int32, None, None),
    "U8": (np.uint8, None, None),
    "BOOL": (np.bool_, None, None),
}


class CheckpointError(ValueError):
    """A model file or directory is unusable; the message names the file and why."""


class SafetensorsFile:
    """One memory-mapped .safetensors file."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
                (n,) = struct.unpack("<Q", head)
                if n <= 0 or 8 + n > size:
                    raise CheckpointError(f"{path}: corrupt safetensors header (length {n}, file {size} bytes)")
                header = json.loads(f.read(n))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot read safetensors header: {exc}") from exc
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header: dict[str, dict[str, Any]] = header
        self.data_offset = 8 + n
        self.size = size
        self._mm: Optional[np.memmap] = None
        for name, info in header.items():
            b, e = info["data_offsets"]
            if self.data_offset + e > size or b > e:
                raise CheckpointError(f"{path}: tensor {name} lies outside the file (truncated download?)")

    @property
    def mm(self) -> np.memmap:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm

    def names(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> RawTensor:
        info = self.header[name]
        dt = info["dtype"]
        if dt not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {dt}")
        np_dtype, fmt, view = _DTYPES[dt]
        shape = tuple(int(s) for s in info["shape"])
        b, e = info["data_offsets"]
        raw = self.mm[self.data_offset + b : self.data_offset + e]
        arr = raw.view(np_dtype).reshape(shape)
        data: Any = arr
        if view is not None:
            data = RawTensor(name, shape, 0, arr).raw_torch().view(view)
        return RawTensor(name=name, shape=shape, fmt=fmt if fmt is not None else -1, data=data, source=self.path)


class HFCheckpoint:
    """The tensors of an HF directory (a TensorSource), plus its JSON configs."""

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: not a directory")
        self.path = path
        self.config = read_json(os.path.join(path, "config.json"), required=True)
        self.generation_config = read_json(os.path.join(path, "generation_config.json"), required=False) or {}
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(
                f"{path}: no *.safetensors files (PyTorch .bin checkpoints are not supported; convert them "
                "with `transformers` save_pretrained(safe_serialization=True))"
            )
        index = read_json(os.path.join(path, "model.safetensors.index.json"), required=False)
        if index and "weight_map" in index:
            files = sorted(set(index["weight_map"].values()))
        self.files = [SafetensorsFile(os.path.join(path, f)) for f in files]
        self._where: dict[str, SafetensorsFile] = {}
        for sf in self.files:
            for n in sf.names():
                self._where[n] = sf

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> RawTensor:
        try:
            sf = self._where[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing tensor {name}") from None
        t = sf.get(name)
        scale_name = name[: -len(".weight")] + ".weight_scale_inv" if name.endswith(".weight") else None
        if t.fmt == Fmt.FP8_E4M3_B128 and scale_name and scale_name in self._where:
            t.scale = self._where[scale_name].get(scale_name).to_float(torch.float32)
        return t

    def total_bytes(self) -> int:
        return sum(sf.size for sf in self.files)


def read_json(path: str, required: bool) -> Optional[dict[str, Any]]:
    if not os.path.exists(path):
        if required:
            raise CheckpointError(f"{path}: missing (an HF model directory needs config.json)")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot parse JSON: {exc}") from exc


def hf_architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    if archs:
        return str(archs[0])
    return str(config.get("model_type", "unknown"))
