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


def check_layers_option(tmp_path: Any, capsys: Any, tiny: str, full: str, gguf_arch: str, full_layers: int) -> None:
    """``--layers 2`` cuts ``tiny`` to layers 0 and 1 (metadata and tensors); ``--layers 0``
    of ``full`` is refused naming the range."""
    import gguf

    from freetoken.cli.main import main

    path = str(tmp_path / "two.gguf")
    assert main(["bench", "make-model", "--preset", tiny, "--layers", "2", "--quant", "q8_0", "--out", path]) == 0
    reader = gguf.GGUFReader(path)
    assert int(reader.fields[f"{gguf_arch}.block_count"].parts[-1][0]) == 2
    assert {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")} == {"0", "1"}
    assert main(["bench", "make-model", "--preset", full, "--layers", "0", "--out", path]) == 2
    assert f"--layers must be in 1..{full_layers}" in capsys.readouterr().err
