"""Shared checks of the files ``freetoken bench make-model`` writes for a family."""

from __future__ import annotations

import dataclasses
from typing import Any


def write_tiny_and_read(tmp_path: Any, preset: str, arch: Any, gguf_arch: str) -> tuple[str, Any, dict[str, Any]]:
    """Write ``preset`` (Q4_K_M, seed 3) and check that every tensor has a name llama.cpp's
    ``arch`` (a gguf-py ``MODEL_ARCH``) knows and that ``general.architecture`` is
    ``gguf_arch``; the path, the preset's config and the file's metadata fields by key."""
    import gguf
    from gguf.constants import MODEL_TENSORS, TENSOR_NAMES

    from freetoken.cli.bench.make_model import PRESETS, write

    path = str(tmp_path / f"{preset}.gguf")
    cfg = dataclasses.replace(PRESETS[preset])
    write(path, cfg, "q4_k_m", seed=3, progress=False)
    reader = gguf.GGUFReader(path)
    known = {TENSOR_NAMES[t].format(bid=i) for t in MODEL_TENSORS[arch] for i in range(cfg.num_layers)}
    names = {t.name for t in reader.tensors}
    assert {n.rsplit(".", 1)[0] for n in names} <= known
    keys = {f.name: f for f in reader.fields.values()}
    assert str(bytes(keys["general.architecture"].parts[-1]), "utf-8") == gguf_arch
    return path, cfg, keys
