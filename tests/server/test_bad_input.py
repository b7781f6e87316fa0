"""Bad input gets a 4xx OpenAI error object, an internal error gets a 500 (traceback
logged), and after each of them the same server keeps serving correctly."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from server_helpers import assert_error, metric, parse_sse, scrape

pytestmark = pytest.mark.timeout(300)

CONTEXT = 256
BODY_LIMIT = 256 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(
        ["--served-model-name", "demo", "--max-model-len", str(CONTEXT), "--max-body-bytes", str(BODY_LIMIT)],
        env={"FREETOKEN_SERVER_FAULTS": "1"},
    )


@pytest.fixture(scope="module")
def http(server: Any) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def ok_chat(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                            "temperature": 0}
    body.update(over)
    return body


def still_serving(http: httpx.Client) -> None:
    resp = http.post(CHAT, json=ok_chat())
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"[1, 2, 3]", b'"a string"', b'{"model": "demo", "messages": [', "{\"model\": \"d\u00e9\"".encode()],
    ids=["garbage", "empty", "array", "string", "truncated", "unterminated"],
)
def test_malformed_json(http: httpx.Client, raw: bytes) -> None:
    for path in (CHAT, COMPLETIONS):
        err = assert_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
        assert err["type"] == "invalid_request_error"
    still_serving(http)


CHAT_CASES = [
    ("missing model", {"model": None}, "model"),
    ("missing messages", {"messages": None}, "messages"),
    ("messages wrong type", {"messages": "hello"}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("missing role", {"messages": [{"content": "hi"}]}, "messages.0.role"),
    ("content wrong type", {"messages": [{"role": "user", "content": 42}]}, "messages.0.content"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"max_tokens": -5}, "max_tokens"),
    ("max_tokens string", {"max_tokens": "10"}, "max_tokens"),
    ("max_tokens float", {"max_tokens": 2.5}, "max_tokens"),
    ("max_completion_tokens zero", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("max_tokens beyond context", {"max_tokens": CONTEXT + 1}, "max_tokens"),
    ("temperature negative", {"temperature": -0.1}, "temperature"),
    ("temperature too high", {"temperature": 2.5}, "temperature"),
    ("temperature string", {"temperature": "hot"}, "temperature"),
    ("top_p zero", {"top_p": 0}, "top_p"),
    ("top_p above one", {"top_p": 1.5}, "top_p"),
    ("top_p negative", {"top_p": -0.5}, "top_p"),
    ("min_p above one", {"min_p": 1.5}, "min_p"),
    ("top_k below -1", {"top_k": -3}, "top_k"),
    ("n zero", {"n": 0}, "n"),
    ("n negative", {"n": -1}, "n"),
    ("n too large", {"n": 1000}, "n"),
    ("presence_penalty out of range", {"presence_penalty": 3}, "presence_penalty"),
    ("frequency_penalty out of range", {"frequency_penalty": -3}, "frequency_penalty"),
    ("stop wrong type", {"stop": 5}, "stop"),
    ("stop empty string", {"stop": [""]}, "stop"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs too many", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("logprobs wrong type", {"logprobs": "yes"}, "logprobs"),
    ("stream wrong type", {"stream": "yes"}, "stream"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("unsupported response_format", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("json_schema without a name", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.name"),
    ("tools with a template that does not render them", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("seed wrong type", {"seed": "abc"}, "seed"),
    ("logit_bias key not a token id", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias negative token id", {"logit_bias": {"-3": 1}}, "logit_bias"),
    ("logit_bias above 100", {"logit_bias": {"3": 100.5}}, "logit_bias"),
    ("logit_bias string value", {"logit_bias": {"3": "1"}}, "logit_bias.3"),
    ("logit_bias token id outside the vocabulary", {"logit_bias": {str(10**9): 1}}, "logit_bias"),
]


@pytest.mark.parametrize("case", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_chat_bad_fields(http: httpx.Client, case: tuple[str, dict[str, Any], str | None]) -> None:
    _, over, param = case
    body = ok_chat(**over)
    for key, value in over.items():
        if value is None:
            del body[key]
    err = assert_error(http.post(CHAT, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


def test_unknown_model_is_404(http: httpx.Client) -> None:
    err = assert_error(http.post(CHAT, json=ok_chat(model="gpt-4")), 404, "model")
    assert err["code"] == "model_not_found"
    assert_error(http.post(COMPLETIONS, json={"model": "nope", "prompt": "x"}), 404, "model")
    assert_error(http.get("/v1/models/nope"), 404, "model")
    still_serving(http)


def test_prompt_longer_than_context(http: httpx.Client) -> None:
    long_text = "word " * (CONTEXT * 2)
    err = assert_error(http.post(CHAT, json=ok_chat(messages=[{"role": "user", "content": long_text}])), 400,
                       "messages")
    assert err["code"] == "context_length_exceeded"
    err = assert_error(http.post(COMPLETIONS, json={"model": "demo", "prompt": long_text}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    ids = list(range(1, CONTEXT + 5))
    assert_error(http.post(COMPLETIONS, json={"model": "demo", "prompt": ids}), 400, "prompt")
    # the same with streaming: still a 400 before any event
    assert_error(http.post(COMPLETIONS, json={"model": "demo", "prompt": long_text, "stream": True}), 400, "prompt")
    still_serving(http)


def test_default_max_tokens_is_the_rest_of_the_context(http: httpx.Client) -> None:
    # a long prompt, so the rest of the context (the default) is short
    body = ok_chat(ignore_eos=True, messages=[{"role": "user", "content": "many words here " * 60}])
    prompt_tokens = http.post(CHAT, json=body).json()["usage"]["prompt_tokens"]
    assert CONTEXT - 64 < prompt_tokens < CONTEXT, prompt_tokens
    del body["max_tokens"]
    out = http.post(CHAT, json=body).json()
    assert out["usage"]["completion_tokens"] == CONTEXT - prompt_tokens
    assert out["choices"][0]["finish_reason"] == "length"


COMPLETION_CASES = [
    ("missing prompt", {"prompt": None}, "prompt"),
    ("prompt wrong type", {"prompt": 12}, "prompt"),
    ("prompt empty list", {"prompt": []}, "prompt"),
    ("prompt mixed list", {"prompt": ["a", 1]}, "prompt"),
    ("prompt empty token list", {"prompt": [[1, 2], []]}, "prompt"),
    ("prompt empty string", {"prompt": ""}, "prompt"),
    ("token id out of vocabulary", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("negative token id", {"prompt": [1, -2]}, "prompt"),
    ("logprobs negative", {"logprobs": -1}, "logprobs"),
    ("logprobs too many", {"logprobs": 100}, "logprobs"),
    ("echo wrong type", {"echo": "yes"}, "echo"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("temperature negative", {"temperature": -1}, "temperature"),
    ("top_p zero", {"top_p": 0.0}, "top_p"),
    ("n zero", {"n": 0}, "n"),
    ("suffix unsupported", {"suffix": "end"}, "suffix"),
    ("logit_bias below -100", {"logit_bias": {"3": -101}}, "logit_bias"),
    ("logit_bias token id outside the vocabulary", {"logit_bias": {str(10**9): -1}}, "logit_bias"),
]


@pytest.mark.parametrize("case", COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES])
def test_completion_bad_fields(http: httpx.Client, case: tuple[str, dict[str, Any], str | None]) -> None:
    _, over, param = case
    body: dict[str, Any] = {"model": "demo", "prompt": "hello", "max_tokens": 2}
    body.update(over)
    for key, value in over.items():
        if value is None:
            del body[key]
    assert_error(http.post(COMPLETIONS, json=body), 400, param)


def test_oversized_bodies_get_413(http: httpx.Client) -> None:
    big = "x" * (BODY_LIMIT + 1024)
    err = assert_error(http.post(CHAT, json=ok_chat(messages=[{"role": "user", "content": big}])), 413)
    assert "too large" in err["message"]

    def chunks() -> Any:  # no Content-Length: the limit is enforced while reading
        piece = b"x" * 65536
        yield b'{"model": "demo", "prompt": "'
        for _ in range(BODY_LIMIT // len(piece) + 2):
            yield piece
        yield b'"}'

    assert_error(http.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"}), 413)
    still_serving(http)


def test_unknown_endpoint_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/does-not-exist"), 404)
    assert_error(http.get(CHAT), 405)
    still_serving(http)


def test_openai_client_raises_typed_errors(server: Any) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt="x", n=0)


def test_internal_error_fails_one_request_only(server: Any, http: httpx.Client) -> None:
    before = scrape(server.base_url)
    for path, body in ((CHAT, ok_chat()), (COMPLETIONS, {"model": "demo", "prompt": "hi", "max_tokens": 2})):
        resp = http.post(path, json=body, headers={"x-freetoken-fault": "before"})
        err = assert_error(resp, 500)
        assert err["type"] == "internal_server_error"
    log = server.wait_log("Traceback", "InjectedFault")
    assert "Traceback" in log and "InjectedFault" in log
    after = scrape(server.base_url)
    assert metric(after, "freetoken_http_requests_total", endpoint=CHAT, status="500") == \
        metric(before, "freetoken_http_requests_total", endpoint=CHAT, status="500") + 1
    # mid-stream: the headers are out, so the stream ends with an error event, then [DONE]
    with http.stream("POST", CHAT, json=ok_chat(stream=True, max_tokens=8, ignore_eos=True),
                     headers={"x-freetoken-fault": "stream"}) as resp:
        assert resp.status_code == 200
        events = parse_sse(resp.read().decode())
    assert events[-2]["error"]["type"] == "internal_server_error"
    still_serving(http)
    assert metric(scrape(server.base_url), "freetoken_requests_running") == 0


def test_bad_requests_are_counted_by_status(server: Any, http: httpx.Client) -> None:
    before = metric(scrape(server.base_url), "freetoken_http_requests_total", endpoint=CHAT, status="400")
    for _ in range(3):
        assert_error(http.post(CHAT, json=ok_chat(n=0)), 400)
    after = metric(scrape(server.base_url), "freetoken_http_requests_total", endpoint=CHAT, status="400")
    assert after == before + 3


def test_out_of_memory_fails_one_request_and_the_others_are_served(server: Any, http: httpx.Client) -> None:
    """A step that runs out of memory (a real allocation failure the engine injects for a
    request carrying the fault header) fails that request with a 503 naming memory, before
    the response starts or mid-stream, while a request beside it completes in full."""
    import concurrent.futures

    long_chat = ok_chat(messages=[{"role": "user", "content": "tell me a long story " * 12}])
    beside = {"model": "demo", "prompt": "hi", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(http.post, COMPLETIONS, json=beside)
        resp = http.post(CHAT, json=long_chat, headers={"x-freetoken-fault": "oom-prefill"})
        other_resp = other.result()
    err = assert_error(resp, 503)
    assert err["code"] == "out_of_memory" and err["type"] == "service_unavailable_error"
    assert "ran out of memory" in err["message"] and "--prefill-chunk" in err["message"]
    assert other_resp.status_code == 200, other_resp.text
    assert other_resp.json()["usage"]["completion_tokens"] == 24
    # mid-stream: two tokens went out, then the stream ends with the error event and [DONE]
    with http.stream("POST", CHAT, json=ok_chat(stream=True, max_tokens=8, ignore_eos=True),
                     headers={"x-freetoken-fault": "oom-decode"}) as resp:
        assert resp.status_code == 200
        events = parse_sse(resp.read().decode())
    assert events[-2]["error"]["code"] == "out_of_memory", events[-2]
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2] if e.get("choices"))
    assert content, events
    # Anthropic's API: its own error body, 503 as an overloaded_error
    resp = http.post("/v1/messages", json={"model": "demo", "max_tokens": 4,
                                           "messages": [{"role": "user", "content": "hello"}]},
                     headers={"x-freetoken-fault": "oom-prefill"})
    assert resp.status_code == 503, resp.text
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "overloaded_error"
    assert "ran out of memory" in resp.json()["error"]["message"]
    server.wait_log("ran out of memory")
    still_serving(http)
    assert metric(scrape(server.base_url), "freetoken_requests_running") == 0
