"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the
official ``anthropic`` client and raw ``httpx``, against a real ``freetoken serve``
process serving the built-in demo model with an API key."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest
from server_helpers import metric, scrape

from freetoken.server.anthropic_messages import stop_reason
from freetoken.server.generation import ChoiceResult

pytestmark = pytest.mark.timeout(300)

MODEL = "demo"
KEY = "sk-test-anthropic"
# recent clients have no sampling arguments (Anthropic dropped them for its newest models): extra_body
GREEDY: dict[str, Any] = dict(model=MODEL, extra_body={"temperature": 0, "ignore_eos": True})
USER = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(["--served-model-name", MODEL, "--api-key", KEY], env={"FREETOKEN_SERVER_FAULTS": "1"})


@pytest.fixture(scope="module")
def client(server: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: Any) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=120, headers={"x-api-key": KEY}) as c:
        yield c


def text_of(message: Any) -> str:
    assert [block.type for block in message.content] == ["text"]
    return message.content[0].text


def assert_anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


def test_message_equals_both_streaming_forms(client: anthropic.Anthropic, server: Any) -> None:
    before = scrape(server.base_url)
    out = client.messages.create(messages=USER, max_tokens=12, **GREEDY)
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant" and out.model == MODEL
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    assert out.usage.output_tokens == 12 and out.usage.input_tokens > 0
    text = text_of(out)
    assert text

    with client.messages.stream(messages=USER, max_tokens=12, **GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text == text_of(final)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
        out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0)

    events = list(client.messages.create(messages=USER, max_tokens=12, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert kinds[:2] == ["message_start", "content_block_start"] and deltas
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.content == [] and events[0].message.usage.output_tokens == 0
    assert "".join(e.delta.text for e in deltas) == text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12

    after = scrape(server.base_url)
    key = "freetoken_http_requests_total"
    assert metric(after, key, endpoint="/v1/messages", status="200") - \
        metric(before, key, endpoint="/v1/messages", status="200") == 3


def test_system_prompt_and_turns_are_rendered(client: anthropic.Anthropic, ref_tokenizer: Any) -> None:
    system = "You are a terse pirate who answers in rhyme."
    turns = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Ahoy."},
             {"role": "user", "content": [{"type": "text", "text": "Where is "}, {"type": "text", "text": "the ship?"}]}]
    plain = client.messages.count_tokens(model=MODEL, messages=turns).input_tokens
    with_system = client.messages.count_tokens(model=MODEL, messages=turns, system=system).input_tokens
    as_blocks = client.messages.count_tokens(model=MODEL, messages=turns,
                                             system=[{"type": "text", "text": system}]).input_tokens
    reference = [{"role": "system", "content": system}, {"role": "user", "content": "Hello!"},
                 {"role": "assistant", "content": "Ahoy."}, {"role": "user", "content": "Where is the ship?"}]
    ids = ref_tokenizer.apply_chat_template(reference, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    assert with_system == as_blocks == len(ids)
    assert with_system >= plain + len(ref_tokenizer.encode(system, add_special_tokens=False))
    out = client.messages.create(messages=turns, system=system, max_tokens=4, **GREEDY)
    assert out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0) == with_system


def test_stop_sequence_is_reported(client: anthropic.Anthropic) -> None:
    full = text_of(client.messages.create(messages=USER, max_tokens=40, **GREEDY))
    assert len(full) >= 12, full
    stop = full[6:9]
    cut = full[: full.find(stop)]
    out = client.messages.create(messages=USER, max_tokens=40, stop_sequences=["\x00never", stop], **GREEDY)
    assert text_of(out) == cut
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    with client.messages.stream(messages=USER, max_tokens=40, stop_sequences=[stop], **GREEDY) as stream:
        final = stream.get_final_message()
    assert text_of(final) == cut and final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_max_tokens_and_count_tokens(client: anthropic.Anthropic) -> None:
    out = client.messages.create(messages=USER, max_tokens=5, metadata={"user_id": "u1"}, **GREEDY)
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 5
    counted = client.messages.count_tokens(model=MODEL, messages=USER).input_tokens
    assert counted == out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0)


def test_stop_reason_of_eos_and_stop_strings() -> None:
    class Tok:
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(ord("a") + i) for i in ids)

    def result(ids: list[int], text: str, reason: str) -> ChoiceResult:
        return ChoiceResult(0, 3, token_ids=ids, text=text, finish_reason=reason)

    assert stop_reason(result([0, 1], "ab", "stop"), [], Tok()) == ("end_turn", None)
    assert stop_reason(result([0, 1], "ab", "stop"), ["x"], Tok()) == ("end_turn", None)
    assert stop_reason(result([0, 1, 2, 3], "a", "stop"), ["cd", "bc"], Tok()) == ("stop_sequence", "bc")
    assert stop_reason(result([0, 1, 2], "a", "stop"), ["bc", "b"], Tok()) == ("stop_sequence", "bc")
    assert stop_reason(result([0, 1], "ab", "length"), ["b"], Tok()) == ("max_tokens", None)


def test_api_key_headers(server: Any, client: anthropic.Anthropic) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": USER}
    for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
        resp = httpx.post(server.base_url + "/v1/messages", json=body, headers=headers, timeout=60)
        assert_anthropic_error(resp, 401, "authentication_error")
    resp = httpx.post(server.base_url + "/v1/messages", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"})
    assert resp.status_code == 200 and resp.json()["type"] == "message"
    # the OpenAI routes keep their error shape, and take x-api-key too
    resp = httpx.get(server.base_url + "/v1/models", timeout=60)
    assert resp.status_code == 401 and set(resp.json()) == {"error"}
    assert httpx.get(server.base_url + "/v1/models", headers={"x-api-key": KEY}, timeout=60).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=USER)
    assert client.messages.create(model=MODEL, max_tokens=2, messages=USER).usage.output_tokens >= 1


@pytest.mark.parametrize("case, body, needle", [
    ("missing max_tokens", {"model": MODEL, "messages": USER}, "max_tokens"),
    ("empty messages", {"model": MODEL, "max_tokens": 4, "messages": []}, "messages"),
    ("image block", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "'image'"),
    ("tool_result answering nothing", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}]}, "messages.0.content.0.tool_use_id"),
    ("tools", {"model": MODEL, "max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": {}}]},
     "tools.0.input_schema"),
    ("bad role", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]},
     "messages.0.role"),
    ("a lone assistant message", {"model": MODEL, "max_tokens": 4,
                                  "messages": [{"role": "assistant", "content": "Once"}]}, "prefill that answers nothing"),
    ("string max_tokens", {"model": MODEL, "max_tokens": "4", "messages": USER}, "max_tokens"),
    ("temperature above 1", {"model": MODEL, "max_tokens": 4, "messages": USER, "temperature": 1.5}, "temperature"),
    ("not JSON", b"{", "JSON"),
])
def test_bad_requests_are_400_and_the_server_keeps_serving(http: httpx.Client, case: str, body: Any,
                                                           needle: str) -> None:
    if isinstance(body, bytes):
        resp = http.post("/v1/messages", content=body, headers={"content-type": "application/json"})
    else:
        resp = http.post("/v1/messages", json=body)
    message = assert_anthropic_error(resp, 400, "invalid_request_error")
    assert needle in message, (case, message)
    ok = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": USER})
    assert ok.status_code == 200 and ok.json()["content"][0]["type"] == "text"


def test_other_errors_have_the_anthropic_shape(http: httpx.Client, client: anthropic.Anthropic) -> None:
    resp = http.post("/v1/messages", json={"model": "nope", "max_tokens": 2, "messages": USER})
    assert "nope" in assert_anthropic_error(resp, 404, "not_found_error")
    assert_anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
    resp = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]})
    assert "'document'" in assert_anthropic_error(resp, 400, "invalid_request_error")
    resp = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 10**6, "messages": USER})
    assert "context length" in assert_anthropic_error(resp, 400, "invalid_request_error")
    resp = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": USER},
                     headers={"x-freetoken-fault": "before"})
    assert_anthropic_error(resp, 500, "api_error")
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=2, messages=[])


def test_error_after_the_stream_started_is_an_error_event(client: anthropic.Anthropic, http: httpx.Client) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": USER, "stream": True, "temperature": 0, "ignore_eos": True}
    resp = http.post("/v1/messages", json=body, headers={"x-freetoken-fault": "stream"})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    frames = resp.text.split("\n\n")[:-1]
    assert frames[0].startswith("event: message_start\ndata: ")
    assert frames[-1].startswith("event: error\ndata: ") and '"api_error"' in frames[-1]
    assert not any(f.startswith("event: message_stop") for f in frames)
    with pytest.raises(anthropic.APIStatusError):
        with client.messages.stream(messages=USER, max_tokens=8, extra_headers={"x-freetoken-fault": "stream"},
                                    **GREEDY) as stream:
            stream.get_final_message()
    assert client.messages.create(messages=USER, max_tokens=2, **GREEDY).usage.output_tokens == 2
