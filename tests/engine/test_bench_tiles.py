"""``freetoken bench decode --tiles KIND:FIELDS`` (freetoken.cli.bench.tiles): the Triton
kernels' default tiles changed for one benchmark run, where the engine's launches read them,
and refused with a usage error when malformed. The engine itself takes no tile settings."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest

from freetoken.cli.bench.tiles import KINDS, apply_tiles, tiles_arg
from freetoken.cli.main import build_parser, main


@pytest.fixture
def restore_tiles(monkeypatch):
    """Every constant --tiles may change, put back after the test."""
    for module_name, names in KINDS.values():
        module = importlib.import_module(module_name)
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))


def test_tiles_arg_parses_kind_and_fields():
    assert tiles_arg("experts:block_n=2, down_routes_tile=0") == ("experts", {"block_n": 2, "down_routes_tile": 0})
    assert tiles_arg("dense-wide:block_k=512") == ("dense-wide", {"block_k": 512})
    args = build_parser().parse_args(["bench", "decode", "--tiles", "grouped:block_n=64", "--tiles", "dense:num_warps=2"])
    assert args.tiles == [("grouped", {"block_n": 64}), ("dense", {"num_warps": 2})]
    assert build_parser().parse_args(["bench", "decode"]).tiles == []


@pytest.mark.parametrize("text", ["block_n=2", "nope:block_n=2", "experts:", "experts:block_n", "experts:block_n=two"])
def test_malformed_tiles_are_usage_errors(text, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "decode", "--tiles", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--tiles" in err and "KIND:name=value" in err


def test_tiles_reach_the_launches_defaults(restore_tiles):
    """Both configs of a kind change (the byte tiles and NVIDIA's), and the functions the
    engine's launches take their tiles from return the new ones."""
    from freetoken.kernels import packed_linear as plt
    from freetoken.kernels import moe_grouped as tg
    from freetoken.kernels import moe_packed as tp

    before = (tp.DEFAULT_CONFIG, tp.NVIDIA_CONFIG, plt.DEFAULT_CONFIG, plt.WIDE_CONFIG, tg.DEFAULT_CONFIG)
    from freetoken.kernels import decode_attention as dat

    attention = dat.DEFAULT_CONFIG
    applied = apply_tiles([("experts", {"block_n": 2, "down_routes_tile": 0}), ("dense-wide", {"block_k": 512}),
                           ("grouped", {"block_n": 64}), ("attention", {"num_stages": 3, "block_n": 32})])
    assert tp.DEFAULT_CONFIG == dataclasses.replace(before[0], block_n=2, down_routes_tile=False)
    assert tp.NVIDIA_CONFIG == dataclasses.replace(before[1], block_n=2, down_routes_tile=False)
    assert tp.default_config("cpu") is tp.DEFAULT_CONFIG
    assert plt.WIDE_CONFIG.block_k == 512 and plt.NVIDIA_WIDE_CONFIG.block_k == 512
    assert plt.config_for(plt.WIDE_ROWS) is plt.WIDE_CONFIG and plt.DEFAULT_CONFIG is before[2]
    assert tg.DEFAULT_CONFIG == dataclasses.replace(before[4], block_n=64)
    assert tg.variant_key(_Shaped(), _Shaped((1, 8)), _Shaped())[1] is tg.DEFAULT_CONFIG
    # the attention's launches read the module's constant when they run
    assert dat.DEFAULT_CONFIG == dataclasses.replace(attention, num_stages=3, block_n=32)
    assert dat.ONE_SEQUENCE_CONFIG.block_n == 32 and dat.BATCH_CONFIG == dat.DEFAULT_CONFIG  # every batch's tiles
    assert applied["experts"]["NVIDIA_CONFIG"]["block_n"] == 2
    assert set(applied) == {"experts", "dense-wide", "grouped", "attention"}


class _Shaped:
    def __init__(self, shape=(1, 1)):
        self.shape, self.dtype = shape, "bfloat16"


@pytest.mark.parametrize("fields, match", [({"block_x": 2}, "no field block_x in PackedConfig"),
                                           ({"block_n": 3}, "power of two")])
def test_bad_fields_name_the_option(fields, match, restore_tiles):
    with pytest.raises(ValueError, match=f"--tiles experts: .*{match}"):
        apply_tiles([("experts", fields)])


def test_bench_decode_refuses_bad_fields_before_loading(capsys, restore_tiles):
    with pytest.raises(SystemExit) as exc:
        main(["--log-level", "WARNING", "bench", "decode", "--backend", "cpu", "--tiles", "dense:block_q=1"])
    assert exc.value.code == 2
    assert "--tiles dense: no field block_q in PackedLinearConfig" in capsys.readouterr().err


def test_bench_decode_records_the_tiles(capsys, restore_tiles):
    """The run's JSON says which tiles were given and what the configs became."""
    rc = main(["--log-level", "WARNING", "bench", "decode", "--backend", "cpu", "--batch", "1", "--prompt-len", "16",
               "--gen-len", "4", "--repeats", "1", "--bandwidth-bytes", "4MiB", "--json",
               "--tiles", "experts:block_n=2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tiles_given"] == ["experts:block_n=2"]
    assert out["tiles"]["experts"]["DEFAULT_CONFIG"]["block_n"] == 2
