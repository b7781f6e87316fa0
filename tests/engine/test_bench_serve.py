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
