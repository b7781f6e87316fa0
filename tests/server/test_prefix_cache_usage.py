"""Prefix caching seen from the HTTP API: ``usage.prompt_tokens_details.cached_tokens``
in chat and text completions (streaming and not) and the prefix-cache series of
/metrics, against a real ``freetoken serve`` process serving the demo model."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_helpers import metric, parse_sse, scrape

pytestmark = pytest.mark.timeout(300)

BLOCK = 16  # the engine's KV block size: only full blocks are shared


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory([])


@pytest.fixture(scope="module")
def http(server: Any) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def _chat(http: httpx.Client, messages: list[dict[str, str]], **kw: Any) -> Any:
    body = {"model": "freetoken-demo", "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            **kw}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp


def _cached(usage: dict[str, Any]) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_chat_second_turn_reports_cached_tokens(http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "You answer questions about the prefix cache of this server. " * 4},
                {"role": "user", "content": "What is a KV block?"}]
    first = _chat(http, messages).json()
    assert _cached(first["usage"]) == 0
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And a second turn?"}]
    second = _chat(http, messages).json()["usage"]
    assert second["prompt_tokens"] > first["usage"]["prompt_tokens"]
    assert BLOCK <= _cached(second) < second["prompt_tokens"] and _cached(second) % BLOCK == 0
    # the same conversation again: all of its full blocks, leaving the last token to compute
    whole = (second["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert _cached(_chat(http, messages).json()["usage"]) == whole
    resp = _chat(http, messages, stream=True, stream_options={"include_usage": True})
    usage = parse_sse(resp.text)[-2]["usage"]
    assert usage["prompt_tokens"] == second["prompt_tokens"] and _cached(usage) == whole


def test_completions_report_cached_tokens_per_prompt(http: httpx.Client) -> None:
    a = [(7 * i + 3) % 4000 + 10 for i in range(40)]
    b = [(11 * i + 5) % 4000 + 10 for i in range(23)]
    body = {"model": "freetoken-demo", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert _cached(http.post("/v1/completions", json={**body, "prompt": a}).json()["usage"]) == 0
    usage = http.post("/v1/completions", json={**body, "prompt": [a, b]}).json()["usage"]
    assert usage["prompt_tokens"] == 63 and _cached(usage) == 32
    resp = http.post("/v1/completions", json={**body, "prompt": [a, b], "n": 2, "stream": True,
                                              "stream_options": {"include_usage": True}})
    usage = parse_sse(resp.text)[-2]["usage"]
    assert usage["prompt_tokens"] == 63 and _cached(usage) == 32 + 16


def test_metrics_count_prefix_cache_queries_and_hits(server: Any, http: httpx.Client) -> None:
    before = scrape(server.base_url)
    prompt = [(13 * i + 1) % 4000 + 10 for i in range(50)]
    body = {"model": "freetoken-demo", "max_tokens": 2, "temperature": 0, "ignore_eos": True, "prompt": prompt}
    for _ in range(2):
        assert http.post("/v1/completions", json=body).status_code == 200
    after = scrape(server.base_url)

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert grew("freetoken_prefix_cache_queries_total") == 100
    assert grew("freetoken_prefix_cache_hits_total") == 48
    assert metric(after, "freetoken_prefix_cache_cached_tokens") >= 48
    assert metric(after, "freetoken_kv_cache_used_tokens") == 0
