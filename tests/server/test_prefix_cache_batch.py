"""The prefix cache does not change what is generated: the same batch of mixed greedy
requests (chat and text completions sharing prefixes, different lengths, sent at once)
through two real ``freetoken serve`` processes, prefix cache on and off, with a KV cache
so small that requests are preempted, gives the same outputs; the cached server took
prompt tokens from its cache and both preempted."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from server_helpers import metric, scrape

pytestmark = pytest.mark.timeout(300)

# 8 KV blocks of 16 tokens: every request grows to 3-6 blocks while decoding, so any three of them
# running at once (even sharing a two-block prefix) outgrow the cache and some are preempted
ARGS = ["--kv-cache-tokens", "128", "--max-running-requests", "4", "--max-model-len", "96"]


@pytest.fixture(scope="module")
def servers(server_factory: Any) -> dict[str, Any]:
    return {"cache": server_factory(ARGS), "no_cache": server_factory([*ARGS, "--no-prefix-cache"])}


def _workload(seed: int) -> list[dict[str, Any]]:
    """Text completions over token ids sharing a 40-token prefix, and chats sharing a system prompt."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 4000) for _ in range(40)]
    jobs: list[dict[str, Any]] = []
    for i in range(6):
        prompt = shared[: rng.randrange(17, 41)] + [rng.randrange(10, 4000) for _ in range(rng.randrange(1, 12))]
        jobs.append({"kind": "completion", "prompt": prompt, "max_tokens": rng.randrange(28, 44)})
    system = "You are a terse assistant that answers in one line. " * 2
    for i in range(4):
        jobs.append({"kind": "chat", "max_tokens": rng.randrange(16, 29), "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: {rng.random():.6f}?"}]})
    return jobs


def _run(client: openai.OpenAI, job: dict[str, Any]) -> tuple[str, str]:
    common = {"model": "freetoken-demo", "max_tokens": job["max_tokens"], "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    if job["kind"] == "completion":
        r = client.completions.create(prompt=job["prompt"], **common)
        return r.choices[0].text, str(r.choices[0].finish_reason)
    c = client.chat.completions.create(messages=job["messages"], **common)
    return c.choices[0].message.content or "", str(c.choices[0].finish_reason)


def _batch(server: Any, jobs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(len(jobs)) as pool:  # all at once: one continuous batch
        return list(pool.map(lambda j: _run(client, j), jobs))


def test_outputs_equal_with_and_without_the_prefix_cache_under_preemption(servers: dict[str, Any]) -> None:
    jobs = _workload(7)
    want = _batch(servers["no_cache"], jobs)
    assert all(reason == "length" and text for text, reason in want)
    assert _batch(servers["cache"], jobs) == want
    assert _batch(servers["cache"], jobs) == want  # again, now from a warm cache
    cached, plain = scrape(servers["cache"].base_url), scrape(servers["no_cache"].base_url)
    assert metric(cached, "freetoken_prefix_cache_hits_total") > 0
    assert metric(plain, "freetoken_prefix_cache_hits_total") == 0
    assert metric(cached, "freetoken_engine_preemptions_total") > 0
    assert metric(plain, "freetoken_engine_preemptions_total") > 0
