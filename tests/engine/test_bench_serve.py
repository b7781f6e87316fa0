"""``freetoken bench serve`` on the demo model: a short chat, prefix cache on and off."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_bench_serve_reports_cached_and_computed_tokens_per_turn() -> None:
    out = subprocess.run([sys.executable, "-m", "freetoken.cli.main", "bench", "serve", "--turns", "3",
                          "--user-tokens", "32", "--answer-tokens", "3", "--json"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    on, off = res["runs"]["prefix_cache"], res["runs"]["no_prefix_cache"]
    assert [t["prompt_tokens"] for t in on] == [t["prompt_tokens"] for t in off] == [32, 67, 102]
    assert all(t["cached_tokens"] == 0 and t["computed_tokens"] == t["prompt_tokens"] for t in off)
    # with the cache a turn reuses the full KV blocks (16 or 32 tokens) of the previous prompt + answer
    assert [t["cached_tokens"] for t in on] == [0, 32, 64]
    assert all(t["cached_tokens"] + t["computed_tokens"] == t["prompt_tokens"] for t in on)
    assert all(t["ttft_ms"] > 0 for t in on + off)
    assert res["last_turn_ttft_ms"]["prefix_cache"] == on[-1]["ttft_ms"]


def test_bench_schema_times_plain_and_schema_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "freetoken.cli.main", "bench", "schema", "--steps", "6", "--rounds", "2",
                          "--answer-tokens", "24", "--threads", "1", "--json"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    runs = res["runs"]
    assert set(runs) == {"plain", "schema", "plain+plain", "plain+schema"}
    assert all(r["steps"] == 6 and r["step_ms_median"] > 0 and r["cpu_ms_median"] > 0 for r in runs.values())
    assert "mask_states" not in runs["plain"] and "mask_states" not in runs["plain+plain"]
    for name in ("schema", "plain+schema"):  # the schema request's masks were computed and waited for
        assert runs[name]["mask_states"] >= 6 and runs[name]["mask_compute_ms_per_state"] > 0
    assert res["schema_vs_plain"] == runs["schema"]["step_ms_median"] / runs["plain"]["step_ms_median"]


def test_synthetic_vocabulary_is_byte_level() -> None:
    from freetoken.cli.bench.schema_decode import synthetic_vocab

    tokens, special = synthetic_vocab(3000, [2999, 5000], seed=1)
    assert len(tokens) == 3000 and special == [2999] and tokens[2999].startswith(b"\xff")
    assert tokens[:256] == [bytes([b]) for b in range(256)]
    assert len(set(tokens)) == 3000 and all(isinstance(t, bytes) and t for t in tokens)
