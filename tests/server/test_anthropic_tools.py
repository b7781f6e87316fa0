"""Tools in Anthropic's Messages API through a real ``freetoken serve`` process and the
official ``anthropic`` client: the demo model's random weights with a Qwen3-style chat
template (tests/server/tool_model.py). Unconstrained output of random weights is
noise, so calls are checked where they are forced (``any``, a named tool)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from tool_model import tool_model_dir

from freetoken.server.anthropic_protocol import MessagesRequest
from freetoken.server.anthropic_tools import BlockEvents, chat_request
from freetoken.server.tool_call_formats import HermesFormat
from freetoken.server.tool_calls import ToolCallParser

pytestmark = pytest.mark.timeout(300)

MODEL = "demo-tools"
# bounded schemas: forced inputs follow them, so random weights write short ones
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                            "required": ["city"], "additionalProperties": False}}
ADD = {"name": "add", "input_schema": {"type": "object", "properties": {
    "a": {"type": "number", "maximum": 999}, "b": {"type": "number", "maximum": 999}}, "additionalProperties": False}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# recent clients have no sampling arguments: extra_body
SAMPLE: dict[str, Any] = dict(model=MODEL, extra_body={"temperature": 1.0})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    return tool_model_dir(str(tmp_path_factory.mktemp("anthropic-tools")))


@pytest.fixture(scope="module")
def server(server_factory: Any, model_dir: str) -> Any:
    return server_factory(["--model", model_dir, "--served-model-name", MODEL])


@pytest.fixture(scope="module")
def client(server: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: Any) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def the_call(message: Any) -> Any:
    """The one tool_use block of a forced answer (no text block before it)."""
    assert message.stop_reason == "tool_use", message
    assert [b.type for b in message.content] == ["tool_use"], message.content
    block = message.content[0]
    assert block.id.startswith("toolu_") and len(block.id) > len("toolu_")
    assert block.name in {"get_weather", "add"} and isinstance(block.input, dict)
    jsonschema.validate(block.input, {t["name"]: t for t in TOOLS}[block.name]["input_schema"])
    return block


def count(client: anthropic.Anthropic, messages: Any, **kw: Any) -> int:
    return client.messages.count_tokens(model=MODEL, messages=messages, **kw).input_tokens


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"},
                                    {"type": "any", "disable_parallel_tool_use": True}],
                         ids=["any", "named", "any-single"])
def test_forced_call(client: anthropic.Anthropic, choice: Any) -> None:
    out = client.messages.create(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=300, **SAMPLE)
    block = the_call(out)
    if choice["type"] == "tool":
        assert block.name == "add"
    # the tools were rendered into the prompt
    assert out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0) == \
        count(client, ASK, tools=TOOLS) > count(client, ASK)


def test_forced_call_streamed_with_the_client_helper(client: anthropic.Anthropic) -> None:
    with client.messages.stream(messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                                max_tokens=300, **SAMPLE) as stream:
        events = list(stream)
        final = stream.get_final_message()
    block = the_call(final)
    assert block.name == "get_weather"
    kinds = [e.type for e in events if e.type not in ("input_json", "text")]  # the helper's own events
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "tool_use")]
    assert starts[0].content_block.id == block.id and starts[0].content_block.input == {}
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "input_json_delta" and e.index == 0 for e in deltas)
    assert len(deltas) > 3  # the input is streamed as it is generated
    assert json.loads("".join(e.delta.partial_json for e in deltas)) == block.input
    snapshots = [e.snapshot for e in events if e.type == "input_json"]  # the helper's partial parses
    assert len(snapshots) == len(deltas) and snapshots[-1] == block.input


def test_raw_stream_events(http: httpx.Client) -> None:
    body = {"model": MODEL, "max_tokens": 300, "messages": ASK, "tools": TOOLS, "stream": True,
            "tool_choice": {"type": "any"}}
    frames = http.post("/v1/messages", json=body).text.split("\n\n")[:-1]
    events = []
    for frame in frames:
        head, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        events.append(payload)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[2]["content_block"]["type"] == "tool_use" and events[2]["content_block"]["input"] == {}
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] > 0


def test_tool_result_round_trip(client: anthropic.Anthropic, model_dir: str) -> None:
    first = client.messages.create(messages=ASK, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=300, **SAMPLE)
    block = the_call(first)
    asked = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]}]
    answered = [*asked, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": block.id, "content": [{"type": "text", "text": "RESULT-sunny-21C"}]},
        {"type": "text", "text": "Thanks!"}]}]
    before = count(client, [*asked, {"role": "user", "content": "Thanks!"}], tools=TOOLS)
    after = count(client, answered, tools=TOOLS)
    assert after > before
    out = client.messages.create(messages=answered, tools=TOOLS, max_tokens=4, **SAMPLE)
    assert out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0) == after
    assert out.stop_reason in ("end_turn", "max_tokens", "tool_use")

    # the server's rendering equals the OpenAI route's for the same conversation
    from freetoken.loading.tokenizer import load_hf_tokenizer
    from freetoken.server.chat_tools import template_messages
    from freetoken.server.protocol import ChatCompletionRequest

    tok = load_hf_tokenizer(model_dir)
    req = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "messages": answered, "tools": TOOLS})
    req.check()
    chat, prefill = chat_request(req)
    assert prefill == ""
    def rendered(req: ChatCompletionRequest) -> str:  # as chat.render_prompt renders it
        return tok.apply_chat_template(template_messages(req), add_generation_prompt=True,
                                       tools=[t.model_dump(mode="json", exclude_none=True) for t in req.tools or []])

    text = rendered(chat)
    assert "<tool_response>\nRESULT-sunny-21C\n</tool_response><|im_end|>\n<|im_start|>user\nThanks!" in text
    # the template's tojson writes non-ASCII characters as they are (sampled arguments may hold some)
    assert f'"name": "{block.name}", "arguments": {json.dumps(block.input, ensure_ascii=False)}' in text
    openai_tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                      "description": t.get("description")}} for t in TOOLS]
    openai_messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}}]},
        {"role": "tool", "tool_call_id": block.id, "content": "RESULT-sunny-21C"},
        {"role": "user", "content": "Thanks!"}]
    openai = ChatCompletionRequest.model_validate({"model": MODEL, "messages": openai_messages, "tools": openai_tools})
    assert rendered(openai) == text

    # is_error results are marked
    failed = [*asked, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": block.id, "content": "boom", "is_error": True}]}]
    req = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "messages": failed})
    assert chat_request(req)[0].messages[-1].content == "Error: boom"
    assert client.messages.create(messages=failed, tools=TOOLS, max_tokens=2, **SAMPLE).usage.output_tokens >= 1


def test_none_and_auto(client: anthropic.Anthropic) -> None:
    # none: the tools are not rendered, the output is not parsed
    assert count(client, ASK, tools=TOOLS, tool_choice={"type": "none"}) == count(client, ASK)
    out = client.messages.create(messages=ASK, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=8,
                                 **SAMPLE)
    assert [b.type for b in out.content] == ["text"] and out.stop_reason in ("end_turn", "max_tokens")
    out = client.messages.create(messages=ASK, tools=TOOLS, max_tokens=8, **SAMPLE)
    assert out.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0) == count(client, ASK, tools=TOOLS)


def test_block_events_number_the_blocks() -> None:
    blocks = BlockEvents(ToolCallParser(HermesFormat(), {"add"}))
    text = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    events = blocks.start()
    for i in range(0, len(text), 7):
        events += blocks.feed(text[i:i + 7], False)
    events += blocks.feed("", True) + blocks.finish()
    parsed = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    summary = [(p["type"], p.get("index"), (p.get("content_block") or p.get("delta") or {}).get("type"))
               for p in parsed]
    assert summary[0] == ("ping", None, None)
    assert summary[1] == ("content_block_start", 0, "text")
    assert set(summary[2:-4]) == {("content_block_delta", 0, "text_delta")}
    assert summary[-4:] == [("content_block_stop", 0, None), ("content_block_start", 1, "tool_use"),
                            ("content_block_delta", 1, "input_json_delta"), ("content_block_stop", 1, None)]
    assert "".join(p["delta"]["text"] for p in parsed[2:-4]) == "Let me add."
    assert json.loads(parsed[-2]["delta"]["partial_json"]) == {"a": 1} and blocks.calls == 1
    assert parsed[-3]["content_block"]["name"] == "add" and parsed[-3]["content_block"]["id"].startswith("toolu_")


TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}]}
BAD = [
    ("tool without name", {"tools": [{"input_schema": {"type": "object"}}]}, "tools.0.name"),
    ("bad tool name", {"tools": [{"name": "a b", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ("no input_schema", {"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ("input_schema not an object schema", {"tools": [{"name": "f", "input_schema": {"type": "string"}}]},
     "tools.0.input_schema.type"),
    ("server tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ("duplicate names", {"tools": [WEATHER, WEATHER]}, "unique"),
    ("unknown named tool", {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ("named tool without name", {"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ("bad tool_choice type", {"tools": TOOLS, "tool_choice": {"type": "required"}}, "tool_choice"),
    ("tool_choice without tools", {"tools": None, "tool_choice": {"type": "any"}}, "tool_choice"),
    ("tool_result answering nothing", {"messages": [*ASK, TOOL_USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}]}, "messages.2.content.0.tool_use_id"),
    ("tool_result in an assistant message", {"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]}, "only allowed in user messages"),
    ("tool_use in a user message", {"messages": [{"role": "user", "content": TOOL_USE["content"]}]},
     "only allowed in assistant messages"),
    ("tool_use without input", {"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "add"}]}, *ASK]}, "messages.1.content.0.input"),
    ("tool_use as the prefill", {"messages": [*ASK, TOOL_USE]}, "final assistant message"),
    ("image in a tool_result", {"messages": [*ASK, TOOL_USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}]},
     "'image'"),
]
# only generation enforces schemas (count_tokens renders the tools as given)
ENFORCED = [("forced call with a schema keyword llguidance lacks", {"tool_choice": {"type": "any"}, "tools": [
    {"name": "f", "input_schema": {"type": "object", "properties": {"xs": {"not": {"type": "string"}}}}}]}, "not")]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_bad_tool_input_is_400_and_the_server_keeps_serving(http: httpx.Client, path: str) -> None:
    for case, over, needle in BAD + (ENFORCED if path == "/v1/messages" else []):
        body = {"model": MODEL, "max_tokens": 4, "messages": ASK, "tools": TOOLS, **over}
        resp = http.post(path, json=body)
        assert resp.status_code == 400, (case, resp.text)
        error = resp.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", (case, error)
        assert needle in error["error"]["message"], (case, error)
    ok = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 300, "messages": ASK, "tools": TOOLS,
                                         "tool_choice": {"type": "any"}})
    assert ok.status_code == 200 and ok.json()["stop_reason"] == "tool_use"
