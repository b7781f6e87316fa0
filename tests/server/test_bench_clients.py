"""``freetoken bench clients`` against a real ``freetoken serve`` on loopback: the counts it
reports agree with the server's own counters, its timings are the ones a client sees, a
request the server refuses is a failed request with the server's message (exit status 1),
and the server serves on afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from server_helpers import metric, scrape

from freetoken.cli.bench.clients import carries_token, percentile

pytestmark = pytest.mark.timeout(400)

MODEL = "demo"
MAX_LEN = 256


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(["--served-model-name", MODEL, "--max-running-requests", "8", "--max-model-len",
                           str(MAX_LEN)])


def bench_clients(url: str, *args: str) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run([sys.executable, "-m", "freetoken.cli.main", "bench", "clients", "--url", url,
                           "--vocab", "4096", "--json", *args], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON printed (rc {proc.returncode}); stderr:\n{proc.stderr[-3000:]}"
    return proc.returncode, json.loads(lines[-1]), proc.stderr


def test_counts_agree_with_the_server(server: Any) -> None:
    before = scrape(server.base_url)
    rc, out, err = bench_clients(server.base_url, "--clients", "1", "5", "--requests", "2", "--prompt-tokens", "23",
                                 "--max-tokens", "11", "--seed", "7")
    assert rc == 0, err[-3000:]
    after = scrape(server.base_url)
    assert out["model"] == MODEL  # the first of GET /v1/models
    one, five = out["runs"]
    assert (one["clients"], one["requests"], one["ok"], one["failed"], one["tokens"]) == (1, 2, 2, 0, 22)
    assert (five["clients"], five["requests"], five["ok"], five["failed"], five["tokens"]) == (5, 10, 10, 0, 110)
    # the server's own counters: every request and token the client counted, nothing else
    gen = metric(after, "freetoken_generation_tokens_total") - metric(before, "freetoken_generation_tokens_total")
    prompt = metric(after, "freetoken_prompt_tokens_total") - metric(before, "freetoken_prompt_tokens_total")
    assert gen == 22 + 110
    assert prompt == 23 * 12
    finished = (metric(after, "freetoken_request_finished_total", finish_reason="length")
                - metric(before, "freetoken_request_finished_total", finish_reason="length"))
    assert finished == 12
    for run in (one, five):
        assert run["errors"] == []
        assert 0 < run["ttft_ms_p50"] <= run["ttft_ms_p99"] < run["wall_s"] * 1e3
        assert 0 <= run["itl_ms_p50"] <= run["itl_ms_p99"]  # chunks of one step can arrive together
        assert 0 < run["per_user_tok_s_min"] <= run["per_user_tok_s_p50"]


def test_refused_requests_fail_with_the_servers_message_and_the_server_goes_on(server: Any) -> None:
    rc, out, _ = bench_clients(server.base_url, "--clients", "3", "--requests", "1", "--prompt-tokens", "40",
                               "--max-tokens", str(MAX_LEN + 10))
    assert rc == 1
    (run,) = out["runs"]
    assert (run["requests"], run["ok"], run["failed"], run["tokens"]) == (3, 0, 3, 0)
    assert len(run["errors"]) == 1 and run["errors"][0].startswith("HTTP 400"), run["errors"]
    assert "max" in run["errors"][0].lower(), run["errors"]  # the server's message names the length limit
    rc, out, err = bench_clients(server.base_url, "--clients", "2", "--requests", "1", "--prompt-tokens", "9",
                                 "--max-tokens", "4")
    assert rc == 0, err[-3000:]
    assert out["runs"][0]["ok"] == 2 and out["runs"][0]["tokens"] == 8


def test_an_unreachable_server_is_named() -> None:
    proc = subprocess.run([sys.executable, "-m", "freetoken.cli.main", "bench", "clients", "--url",
                           "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "cannot reach http://127.0.0.1:9" in proc.stderr


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng()
    for n in (1, 2, 7, 100):
        xs = rng.standard_normal(n).tolist()
        for q in (0, 50, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)
    assert percentile([], 50) is None


def test_which_chunks_carry_tokens() -> None:
    assert carries_token({"choices": [{"index": 0, "text": "a", "finish_reason": None}]})
    assert carries_token({"choices": [{"index": 0, "text": "", "finish_reason": None}]})  # bytes of a later char
    assert carries_token({"choices": [{"index": 0, "text": "z", "finish_reason": "length"}]})
    assert not carries_token({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    assert not carries_token({"choices": [], "usage": {"completion_tokens": 3}})
