"""Tools in /v1/chat/completions through a real ``freetoken serve`` process and the
official ``openai`` client: the demo model's random weights with a Qwen3-style chat
template (tests/server/tool_model.py)."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_helpers import assert_error, parse_sse
from tool_model import tool_model_dir

pytestmark = pytest.mark.timeout(300)

MODEL = "demo-tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
                   "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number", "maximum": 999}, "b": {"type": "number", "maximum": 999}},
                   "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    return tool_model_dir(str(tmp_path_factory.mktemp("tools")))


@pytest.fixture(scope="module")
def server(server_factory: Any, model_dir: str) -> Any:
    return server_factory(["--model", model_dir, "--served-model-name", MODEL])


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: Any) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ref_tok(model_dir: str) -> Any:
    """transformers renders the template; ``tokenizers`` reading tokenizer.json counts the tokens
    (transformers' own Qwen2 pre-tokenizer splits runs of newlines differently from tokenizer.json)."""
    import tokenizers
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir), \
        tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def ref_prompt(tok: Any, messages: list[dict[str, Any]], tools: Any = None) -> tuple[str, int]:
    text = tok[0].apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return text, len(tok[1].encode(text, add_special_tokens=False).ids)


def check_arguments(name: str, arguments: str) -> dict[str, Any]:
    """The forced call's arguments: a JSON object (test_json_schema.py checks them against the schemas)."""
    args = json.loads(arguments)
    assert isinstance(args, dict), arguments
    assert name in {"get_weather", "add"}
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_call_non_streaming(client: openai.OpenAI, ref_tok: Any, choice: Any) -> None:
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, n=3,
                                         max_tokens=300, temperature=1.0, seed=7)
    _, prompt_tokens = ref_prompt(ref_tok, ASK, TOOLS)
    assert out.usage.prompt_tokens == prompt_tokens  # the tools were rendered into the prompt
    ids = set()
    for c in out.choices:
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None
        assert c.message.tool_calls and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        ids.add(call.id)
        check_arguments(call.function.name, call.function.arguments)
        if isinstance(choice, dict):
            assert call.function.name == "add"
    assert len(ids) == 3


def test_forced_call_streaming_with_the_client_helper(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                        max_tokens=80, temperature=0.8, seed=3) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "tool_calls"
    assert not c.message.content
    (call,) = c.message.tool_calls
    assert call.id.startswith("call_")
    check_arguments(call.function.name, call.function.arguments)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_arguments_arrive_in_pieces(client: openai.OpenAI, choice: Any) -> None:
    """The arguments go out token by token; the client's helper assembles them (get_weather:
    its required city makes arguments of several tokens)."""
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                        max_tokens=120, temperature=1.0, seed=5) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    pieces = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(pieces) > 3 and "".join(pieces) == call.function.arguments
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.function.arguments
    assert final.choices[0].finish_reason == "tool_calls"
    check_arguments(call.function.name, call.function.arguments)
    jsonschema.validate(json.loads(call.function.arguments), {t["function"]["name"]: t for t in TOOLS}[
        call.function.name]["function"]["parameters"])


def test_streamed_chunks_shape_and_no_markup(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 80, "seed": 11, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    events = parse_sse(http.post("/v1/chat/completions", json=body).text)[:-1]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all("<tool_call>" not in (d.get("content") or "") for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    args = "".join(c["function"]["arguments"] for c in calls)
    check_arguments("get_weather", args)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_and_none(client: openai.OpenAI, ref_tok: Any) -> None:
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    c = out.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    if c.message.tool_calls is None:
        assert isinstance(c.message.content, str)
    assert out.usage.prompt_tokens == ref_prompt(ref_tok, ASK, TOOLS)[1]
    # none: the tools are not rendered, the output is not parsed
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                         max_tokens=12, temperature=0)
    assert out.usage.prompt_tokens == ref_prompt(ref_tok, ASK)[1]
    assert out.choices[0].message.tool_calls is None and isinstance(out.choices[0].message.content, str)


def test_tool_results_go_back_through_the_template(client: openai.OpenAI, model_dir: str, ref_tok: Any) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, seed=5)
    call = first.choices[0].message.tool_calls[0]
    messages: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "RESULT-sunny-21C"},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    # transformers takes the arguments as an object (the server parses the JSON string the same way)
    ref_messages = json.loads(json.dumps(messages))
    ref_messages[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    text, n = ref_prompt(ref_tok, ref_messages, TOOLS)
    assert "<tool_response>\nRESULT-sunny-21C\n</tool_response>" in text
    assert f'"name": "{call.function.name}", "arguments": {call.function.arguments}' in text
    assert out.usage.prompt_tokens == n
    # the server's own rendering, text for text
    from freetoken.loading.tokenizer import load_hf_tokenizer
    from freetoken.server.chat_tools import template_messages
    from freetoken.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages, "tools": TOOLS})
    tok = load_hf_tokenizer(model_dir)
    assert tok.apply_chat_template(template_messages(req), tools=TOOLS) == text


BAD = [
    ("tool without name", {"tools": [{"type": "function", "function": {"parameters": {}}}]},
     "tools.0.function.name"),
    ("bad function name", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ("parameters not an object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools.0.function.parameters"),
    ("tool type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ("duplicate names", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("unknown named tool", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("bad tool_choice", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tool message without id", {"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ("tool message answering nothing", {"messages": [*ASK, {"role": "tool", "content": "x", "tool_call_id": "c"}]},
     "messages.1.tool_call_id"),
    ("tool_calls on a user message", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ("tool call without arguments", {"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f"}}]}]}, "messages.1.tool_calls.0.function.arguments"),
    ("legacy functions", {"functions": [{"name": "f"}]}, "functions"),
    ("forced call with json_object", {"tools": TOOLS, "tool_choice": "required",
                                      "response_format": {"type": "json_object"}}, "response_format"),
    ("forced call with a schema keyword llguidance lacks", {"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}]}, "tools"),
]


def test_bad_tool_input_is_400_and_the_server_keeps_serving(http: httpx.Client) -> None:
    for name, over, param in BAD:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **over}
        err = assert_error(http.post("/v1/chat/completions", json=body), 400, param)
        assert err["type"] == "invalid_request_error", name
    ok = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": TOOLS,
                                                 "tool_choice": "required", "max_tokens": 80})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "tool_calls"
