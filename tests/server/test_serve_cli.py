"""`freetoken serve` options: API key on (the other modules run with it off), the
queue bound (429), and a clean shutdown on SIGTERM with a stream in flight."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from server_helpers import assert_error, metric, scrape

pytestmark = pytest.mark.timeout(300)

KEY = "sk-test-0123456789"
MODEL = "demo"
#: long enough that the requests waiting behind the running one are seen waiting by a
#: /metrics poll every 20 ms on a fast machine (24 tokens ran through in two polls)
QUEUE_TOKENS = 200


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from freetoken.models.demo import ensure_demo_model

    return ensure_demo_model().gguf_path


@pytest.fixture(scope="module")
def server(server_factory: Any, gguf_path: str) -> Any:
    # --model with the demo model's GGUF file (the other modules serve the default, its HF directory)
    return server_factory(["--model", gguf_path, "--served-model-name", MODEL, "--api-key", KEY,
                           "--max-running-requests", "1", "--max-queued-requests", "2"])


def test_model_option_serves_the_given_file(server: Any, gguf_path: str) -> None:
    assert gguf_path in server.log()
    health = httpx.get(server.base_url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["served_model_names"] == [MODEL]


def test_api_key_required_on_v1(server: Any) -> None:
    base = server.base_url
    with httpx.Client(base_url=base, timeout=60) as http:
        err = assert_error(http.get("/v1/models"), 401)
        assert err["code"] == "invalid_api_key"
        assert_error(http.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(http.get("/v1/models", headers={"Authorization": KEY}), 401)  # no Bearer scheme
        assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 401)
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        # health and metrics stay open (load balancers, scrapers)
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    good = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    out = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    m = scrape(base)
    assert metric(m, "freetoken_http_requests_total", endpoint="/v1/models", status="401") >= 3


def test_queue_bound_gives_429_and_requests_wait(server: Any) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    waiting_seen: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.post("/v1/completions", headers=headers, json={
            "model": MODEL, "prompt": f"Queue test {i}", "max_tokens": QUEUE_TOKENS, "temperature": 0, "ignore_eos": True})

    async def watch(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            resp = await client.get("/metrics")
            for line in resp.text.splitlines():
                if line.startswith("freetoken_requests_waiting "):
                    waiting_seen.append(float(line.split()[1]))
            await asyncio.sleep(0.02)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                     limits=httpx.Limits(max_connections=32)) as client:
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(client, stop))
            try:
                return await asyncio.gather(*(one(client, i) for i in range(10)))
            finally:
                stop.set()
                await watcher

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1, codes
    assert codes.count(200) >= 2, codes  # at least one ran and one waited for it
    for r in responses:
        if r.status_code == 429:
            err = assert_error(r, 429)
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == QUEUE_TOKENS
    assert max(waiting_seen) >= 1  # beyond --max-running-requests, requests waited
    # the server recovers once the queue drains
    with httpx.Client(base_url=server.base_url, timeout=60, headers=headers) as http:
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 2}).status_code == 200


def test_sigterm_shuts_down_cleanly_with_a_stream_in_flight(server: Any) -> None:
    got_first = threading.Event()
    lines: list[str] = []

    def streamer() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
                    "model": MODEL, "prompt": "long", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as resp:
                for line in resp.iter_lines():
                    lines.append(line)
                    got_first.set()
        got_first.set()

    thread = threading.Thread(target=streamer, daemon=True)
    thread.start()
    assert got_first.wait(60)
    start = time.monotonic()
    code = server.stop(signal.SIGTERM, timeout=30)
    assert code == 0, server.log()[-3000:]
    assert time.monotonic() - start < 10
    thread.join(30)
    # the stream in flight was ended properly: an error event saying why, then [DONE]
    events = [ln for ln in lines if ln]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert "server_shutting_down" in events[-2], events[-3:]
    log = server.wait_log("received SIGTERM", "engine stopped", "server stopped")
    assert "received SIGTERM" in log and "engine stopped" in log and "server stopped" in log
    assert "Traceback" not in log, log[-3000:]
