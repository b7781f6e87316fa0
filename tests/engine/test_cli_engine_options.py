"""The engine options shared by `freetoken serve`, `generate` and `bench decode`
(freetoken.cli.engine_options), and `freetoken bench decode`'s report."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from freetoken.cli import generate, serve
from freetoken.cli.bench import decode
from freetoken.cli.engine_options import (
    FLAGS,
    add_engine_arguments,
    engine_config_from_args,
    parse_size,
)
from freetoken.cli.main import build_parser, main
from freetoken.engine.config import EngineConfig

COMMANDS = {
    "serve": ["serve"],
    "generate": ["generate", "--prompt", "hi"],
    "bench decode": ["bench", "decode"],
}

EVERY_FLAG = [
    "--model", "/models/x.gguf", "--backend", "cpu", "--dtype", "bf16", "--kv-cache-dtype", "fp16", "--max-model-len", "4096",
    "--max-running-requests", "8", "--kv-cache-tokens", "65536", "--prefill-chunk", "1024", "--seed", "7",
    "--moe-cpu-layers", "0-11,40", "--cpu-threads", "12", "--enforce-eager", "--no-decode-ahead", "--cuda-graph-max-bs", "32",
    "--cuda-graph-bs", "8,1,4,4", "--gpu-memory-utilization", "0.85", "--gpu-memory-limit", "1.5GiB",
    "--no-prefix-cache", "--gpu-dense", "packed", "--gpu-embedding", "host", "--gpu-gemv", "triton", "--pin-host-threads", "off", "--cpu-spin-ms", "7.5", "--moe-gpu-experts", "dequantized", "--moe-gpu-kernel", "triton", "--moe-cache-size", "6", "--moe-hybrid-max-fetch", "2",
    "--moe-stream-prefill", "on", "--moe-stream-min-tokens", "96", "--moe-stream-experts", "all", "--moe-stream-windows", "8", "--moe-lock-host", "off", "--moe-locked-fetch", "0.3", "--moe-locked-max-fetch", "3", "--moe-collect-stats",
    "--moe-stats-interval", "2.5",
]  # fmt: skip
EXPECTED = {
    "model": "/models/x.gguf", "backend": "cpu", "dtype": "bfloat16", "kv_cache_dtype": "float16", "max_model_len": 4096,
    "max_running_requests": 8, "kv_cache_tokens": 65536, "prefill_chunk": 1024, "seed": 7,
    "moe_cpu_layers": "0-11,40", "cpu_threads": 12, "enforce_eager": True, "decode_ahead": False, "cuda_graph_max_bs": 32,
    "cuda_graph_bs": [1, 4, 8], "gpu_memory_utilization": 0.85, "gpu_memory_limit": 3 * 2**29,
    "enable_prefix_cache": False, "gpu_dense": "packed", "gpu_embedding": "host", "gpu_gemv": "triton", "pin_host_threads": "off", "cpu_spin_ms": 7.5, "moe_gpu_experts": "dequantized", "moe_gpu_kernel": "triton", "moe_cache_size": 6 * 2**30,
    "moe_hybrid_max_fetch": 2, "moe_stream_prefill": "on", "moe_stream_min_tokens": 96, "moe_stream_experts": "all", "moe_stream_windows": 8, "moe_lock_host": "off",
    "moe_locked_fetch": 0.3, "moe_locked_max_fetch": 3, "moe_collect_stats": True, "moe_stats_interval": 2.5,
}  # fmt: skip


def _config(argv: list[str]) -> EngineConfig:
    """The EngineConfig the command of ``argv`` runs with."""
    args = build_parser().parse_args(argv)
    module = {"serve": serve, "generate": generate, "bench": decode}[args.command]
    return module.engine_config(args)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_reaches_engine_config(command):
    seed = ["--seed", "7"] if command == "generate" else []  # generate's --seed is its own (the request's)
    config = _config(COMMANDS[command] + EVERY_FLAG + seed)
    for field, value in EXPECTED.items():
        assert getattr(config, field) == value, field


def test_every_engine_field_has_a_flag_on_every_command():
    assert set(EXPECTED) == set(FLAGS)
    for argv in COMMANDS.values():
        args = build_parser().parse_args(argv)
        assert all(hasattr(args, field) for field in FLAGS)


def test_locked_fetch_auto_is_the_default_and_can_be_given():
    assert EngineConfig().moe_locked_fetch is None and _config(["serve"]).moe_locked_fetch is None
    assert _config(["serve", "--moe-locked-fetch", "AUTO"]).moe_locked_fetch is None
    assert _config(["serve", "--moe-locked-fetch", "0"]).moe_locked_fetch == 0.0


def test_defaults_are_engine_config_defaults():
    assert vars(_config(["serve"])) == vars(EngineConfig())
    gen = _config(["generate", "--prompt", "hi"])
    assert gen.max_running_requests == 1 and gen.seed == 0 and gen.dtype == "auto"
    assert _config(["generate", "--prompt", "hi", "--seed", "5"]).seed == 5


@pytest.mark.parametrize("text, expected", [("0", 0.0), ("0.25", 0.25), ("4", 4 * 2**30), ("512MiB", 2**29),
                                            ("1.5GiB", 1.5 * 2**30)])
def test_moe_cache_size_is_gib_size_or_fraction(text, expected):
    config = _config(["serve", "--moe-cache-size", text])
    assert config.moe_cache_size == expected
    options = config.backend_options(None).moe
    assert (options.cache_bytes, options.cache_fraction) == ((int(expected), 0.0) if expected >= 1 else (0, expected))
    assert not options.cache_auto


def test_moe_cache_size_auto_is_the_default_and_can_be_given():
    for config in (EngineConfig(moe_cache_size=0), _config(["serve", "--moe-cache-size", "0"])):
        assert config.moe_cache_size == 0.0 and not config.backend_options(None).moe.cache_auto
    for config in (EngineConfig(), _config(["serve"]), EngineConfig(moe_cache_size="auto"),
                   _config(["serve", "--moe-cache-size", "Auto"])):
        assert config.moe_cache_size == "auto"
        options = config.backend_options(None).moe
        assert (options.cache_bytes, options.cache_fraction, options.cache_auto) == (0, 0.0, True)


@pytest.mark.parametrize("argv", [["--moe-cache-size", "-1"], ["--moe-cache-size", "lots"],
                                  ["--moe-gpu-experts", "fp4"], ["--moe-stream-prefill", "maybe"],
                                  ["--moe-hybrid-max-fetch", "-2"], ["--moe-stats-interval", "0"],
                                  ["--moe-locked-fetch", "1.5"], ["--moe-locked-fetch", "most"],
                                  ["--moe-stream-experts", "mapped"],
                                  ["--moe-stream-windows", "0"], ["--gpu-embedding", "cpu"]])
def test_bad_moe_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    assert "invalid value" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--gpu-dependent-launch", "on"], ["--moe-locked-fetch-mode", "copy"]])
def test_removed_flags_are_unknown(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_serve_keeps_its_own_options():
    args = build_parser().parse_args(["serve", "--served-model-name", "m", "--max-queued-requests", "3",
                                      "--max-running-requests", "2"])
    config = serve.engine_config(args)
    assert (config.max_queued_requests, config.served_model_name, config.max_running_requests) == (3, "m", 2)


def test_bench_decode_sizes_the_engine_for_its_runs():
    config = _config(["bench", "decode", "--batch", "1", "8", "--prompt-len", "100", "--gen-len", "20"])
    assert config.max_running_requests == 8
    assert config.max_model_len == 121
    assert config.prefill_chunk == 800  # a batch's prompts in one step
    assert config.kv_cache_tokens >= 8 * 121
    # flags the user gives win
    config = _config(["bench", "decode", "--prompt-len", "100", "--gen-len", "20", "--prefill-chunk", "64",
                      "--max-running-requests", "16", "--kv-cache-tokens", "4096", "--max-model-len", "200"])
    assert (config.prefill_chunk, config.max_running_requests, config.kv_cache_tokens, config.max_model_len) == (
        64, 16, 4096, 200)
    assert _config(["bench", "decode", "--tokens", "9", "--prompt-len", "10"]).max_model_len == 20  # old name


@pytest.mark.parametrize("text, expected", [
    ("17179869184", 16 * 2**30), ("16GiB", 16 * 2**30), ("24G", 24 * 2**30), ("1.5GiB", 3 * 2**29),
    ("512MiB", 2**29), ("512mi", 2**29), ("2TB", 2 * 10**12), ("500MB", 5 * 10**8), ("4096B", 4096),
    ("  8 gib ", 8 * 2**30), ("1k", 1024),
])  # fmt: skip
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["12XB", "", "GiB", "-1G", "1.5.2G", "1e9"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="16GiB"):
        parse_size(text)


@pytest.mark.parametrize("text", ["0", "0.1B", "0GiB"])
def test_parse_size_refuses_nothing(text):
    with pytest.raises(ValueError, match="at least 1 byte"):
        parse_size(text)


BAD = [
    ("--moe-cpu-layers", "3-1", "runs backwards"),
    ("--moe-cpu-layers", "x", "0-11,40"),
    ("--cpu-threads", "0", ">= 1"),
    ("--cpu-threads", "two", "whole number"),
    ("--cpu-spin-ms", "-1", "[0, 1000]"),
    ("--cpu-spin-ms", "soon", "[0, 1000]"),
    ("--cuda-graph-bs", "0,4", "batch sizes >= 1"),
    ("--cuda-graph-bs", ",", "batch sizes >= 1"),
    ("--cuda-graph-max-bs", "0", ">= 1"),
    ("--gpu-memory-utilization", "1.5", "(0, 1]"),
    ("--gpu-memory-utilization", "0", "(0, 1]"),
    ("--gpu-memory-utilization", "nan", "(0, 1]"),
    ("--gpu-memory-limit", "12XB", "16GiB"),
    ("--gpu-memory-limit", "0", "at least 1 byte"),
    ("--dtype", "int8", "bfloat16"),
    ("--max-model-len", "1", ">= 2"),
    ("--max-running-requests", "0", ">= 1"),
    ("--prefill-chunk", "-3", ">= 1"),
    ("--kv-cache-tokens", "8", ">= 16"),  # EngineConfig's check, as a usage error
]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("flag, value, accepted", BAD)
def test_bad_value_is_a_usage_error_naming_the_flag(command, flag, value, accepted, capsys):
    with pytest.raises(SystemExit) as exc:
        _config(COMMANDS[command] + [flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert flag in last and accepted in last and "Traceback" not in err


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--moe-cpu-layers", "3-1"], "--moe-cpu-layers"),
    (["bench", "decode", "--gpu-memory-limit", "12XB"], "--gpu-memory-limit"),
    (["generate", "--prompt", "hi", "--cuda-graph-bs", "0,4"], "--cuda-graph-bs"),
    (["generate", "--prompt", "hi", "--kv-cache-tokens", "8"], "--kv-cache-tokens"),
])  # fmt: skip
def test_bad_value_in_a_real_process(argv, flag):
    proc = subprocess.run([sys.executable, "-m", "freetoken.cli.main", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "FREETOKEN_BACKEND": "cpu"})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("freetoken ") and "error:" in last and flag in last


def test_bench_decode_batch_beyond_running_requests_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        _config(["bench", "decode", "--batch", "1", "8", "--max-running-requests", "4"])
    assert exc.value.code == 2 and "--max-running-requests 4" in capsys.readouterr().err


def test_help_names_every_default():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    text = " ".join(parser.format_help().split())
    for flag in FLAGS.values():
        assert flag in text
    assert text.count("default") >= len(FLAGS)


def test_unknown_field_names_are_refused():
    with pytest.raises(ValueError, match="not engine options"):
        add_engine_arguments(argparse.ArgumentParser(), exclude=("sede",))


def test_a_namespace_without_a_parser_raises_value_error():
    args = argparse.Namespace(_engine_option_fields=("kv_cache_tokens",), kv_cache_tokens=8)
    with pytest.raises(ValueError, match="--kv-cache-tokens must be >= 16"):
        engine_config_from_args(args)


# ---------------------------------------------------------------- bench decode report


def test_backend_step_report_reads_only_what_the_backend_reports():
    assert decode.backend_step_report({}) == (None, None)
    share, parts = decode.backend_step_report({"cpu_wait_share": 0.25, "step_breakdown": {"attention": 120, "x": "?"}})
    assert share == 0.25 and parts == {"attention": 120.0}
    assert decode.backend_step_report({"cpu_wait_share": "n/a", "step_breakdown": 3}) == (None, None)


def test_bench_decode_times_runs_without_the_route_counter(capsys, monkeypatch):
    """The distinct-expert count (a torch.unique per MoE layer and step: a device sync on a
    GPU) wraps only its own decode-only run, never a timed run or a warm-up."""
    live: list[object] = []
    seen: list[tuple[int, int, bool]] = []  # (batch, prompt_len, a counter wraps the routers) per run
    counter_cls, run_batch = decode._RouteCounter, decode.run_batch

    class Counter(counter_cls):
        def __init__(self, model):
            super().__init__(model)
            live.append(self)

        def remove(self):
            super().remove()
            live.remove(self)

    def spy(eng, batch, prompt_len, *args, **kwargs):
        seen.append((batch, prompt_len, bool(live)))
        return run_batch(eng, batch, prompt_len, *args, **kwargs)

    monkeypatch.setattr(decode, "_RouteCounter", Counter)
    monkeypatch.setattr(decode, "run_batch", spy)
    rc = main(["--log-level", "WARNING", "bench", "decode", "--backend", "cpu", "--batch", "1", "--prompt-len", "16",
               "--gen-len", "4", "--repeats", "2", "--bandwidth-bytes", "4MiB", "--json"])
    assert rc == 0 and not live
    out = json.loads(capsys.readouterr().out)
    counted = [r for r in seen if r[2]]
    assert counted == [(1, 1, True)], seen  # the counting run alone: prompt of 1 token
    assert len(seen) == 1 + 2 + 1  # warm-up, two timed runs, the counting run
    assert out["batches"]["1"]["distinct_experts_per_layer"] > 0


def test_bench_decode_cpu_smoke(capsys):
    """The whole benchmark on the demo model with tiny lengths (a few seconds on the CPU)."""
    rc = main(["--log-level", "WARNING", "bench", "decode", "--backend", "cpu", "--batch", "1", "8",
               "--prompt-len", "16", "--gen-len", "4", "--repeats", "1", "--bandwidth-bytes", "4MiB", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_len"] == 16 and out["gen_len"] == 4 and out["temperature"] == 0.0
    assert set(out["batches"]) == {"1", "8"}
    assert set(out["decode_tok_s"]) == {"1", "8"} and set(out["prompt_tok_s"]) == {"1", "8"}
    for b, r in out["batches"].items():
        assert r["decode_tok_s"] > 0 and r["prompt_tok_s"] > 0 and r["decode_steps"] == 3, b
        assert r["decode_tok_s"] == out["decode_tok_s"][b]
        # the CPU backend runs on no GPU and reports no CPU-expert wait: present, and empty
        assert r["gpu_max_allocated_bytes"] is None and r["gpu_reserved_bytes"] is None
        assert r["cpu_wait_share"] is None and r["step_breakdown"] is None
        assert r["ceiling_tok_s"] > 0 and 0 < r["fraction_of_ceiling"]
    assert out["gpu_max_allocated_bytes"] is None and out["gpu_total_bytes"] is None
    assert out["engine_config"]["max_running_requests"] == 8 and out["backend"] == "cpu"
    assert out["bandwidth_GBs"] > 0 and out["backend_report"]["backend"] == "cpu"

    table = decode.format_table(out)
    row8 = next(line for line in table.splitlines() if line.split()[:1] == ["8"])
    assert "-" in row8.split() and "GPU memory: - " in table and "step breakdown: -" in table
    assert "4 tokens generated per request (greedy)" in table
    # what a backend that reports the wait and the breakdown gets
    out["batches"]["8"].update(cpu_wait_share=0.25, step_breakdown={"attention": 120.0, "cpu_wait": 400.0})
    out.update(gpu_max_allocated_bytes=3 * 2**30, gpu_reserved_bytes=4 * 2**30, gpu_total_bytes=80 * 2**30)
    table = decode.format_table(out)
    row8 = next(line for line in table.splitlines() if line.split()[:1] == ["8"])
    assert "25%" in row8.split()
    assert "attention 120 us, cpu_wait 400 us" in table
    assert "peak allocated 3.00 GiB, reserved 4.00 GiB of 80.00 GiB" in table


def test_bench_decode_temperature_samples_seeded_random_tokens(capsys, monkeypatch):
    """``--temperature 1000``: every request samples (near-uniformly) with its own seed, the
    same for the same --seed; the temperature is in the JSON and the table's run line."""
    from freetoken.engine.engine import LLMEngine

    add_request = LLMEngine.add_request
    reqs: list = []

    def spy(self, prompt_ids, params, *args, **kwargs):
        reqs.append(add_request(self, prompt_ids, params, *args, **kwargs))
        return reqs[-1]

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    argv = ["--log-level", "WARNING", "bench", "decode", "--backend", "cpu", "--batch", "2", "--prompt-len", "4",
            "--gen-len", "12", "--repeats", "1", "--bandwidth-bytes", "4MiB", "--temperature", "1000", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["temperature"] == 1000.0

    def timed_runs() -> list:  # the timed run's requests (the route-counting run's prompt is 1 token)
        return [r for r in reqs if len(r.prompt_ids) == 4 and len(r.output_ids) == 12]

    timed = timed_runs()
    assert len(timed) == 2
    for r in reqs:
        assert r.params.temperature == 1000.0 and r.params.seed is not None
    assert len({r.params.seed for r in timed}) == 2
    for r in timed:
        # near-uniform draws from the demo model's vocabulary (thousands of tokens): almost never a
        # repeat, where greedy decoding of its random weights repeats a few tokens
        assert len(set(r.output_ids)) >= 10, r.output_ids
    first = [r.output_ids for r in timed]
    reqs.clear()
    assert main(argv) == 0
    capsys.readouterr()
    assert [r.output_ids for r in timed_runs()] == first  # seeded from --seed
    assert "12 tokens generated per request (temperature 1000, a seed per request)" in decode.format_table(out)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "decode", "--temperature", "-1"])
    assert exc.value.code == 2
