"""``response_format: json_schema`` and schema-valid forced tool calls (llguidance), through a
real ``freetoken serve`` process and the official ``openai`` client on the demo model's random
weights; and the constraint itself in process (mask agrees with ``allows``, EOS only at the end)."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import openai
import pytest
from server_helpers import assert_error
from tool_model import tool_model_dir

from freetoken.server.schema_constraint import SchemaError, compile_schema, schema_constraint, schema_grammar

pytestmark = pytest.mark.timeout(300)

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                              "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tags": {"type": "array", "items": NAME, "maxItems": 3},
            "addr": {"type": "object", "properties": {"city": NAME}, "required": ["city"], "additionalProperties": False}},
            "required": ["id", "tags", "addr"], "additionalProperties": False},
        "score": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["user", "score"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L"]},
                                               "flag": {"type": "boolean"}},
              "required": ["color", "size"], "additionalProperties": False},
    "anyof": {"type": "object", "properties": {
        "v": {"anyOf": [NAME, {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3}},
        "required": ["v", "items"], "additionalProperties": False},
}
ASK = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    return tool_model_dir(str(tmp_path_factory.mktemp("schema")))


@pytest.fixture(scope="module")
def server(server_factory: Any, model_dir: str) -> Any:
    return server_factory(["--model", model_dir, "--served-model-name", "demo"])


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _format(name: str, strict: bool) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": strict}}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_outputs_validate_against_their_schemas(client: openai.OpenAI, strict: bool) -> None:
    for i, name in enumerate(SCHEMAS):
        r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=300, temperature=1.0, seed=i,
                                           n=2, response_format=_format(name, strict))  # type: ignore[arg-type]
        for choice in r.choices:
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content or ""), SCHEMAS[name])


def test_streaming_output_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="demo", messages=ASK, max_tokens=300, temperature=0.8, seed=5,
                                            stream=True, response_format=_format("nested", True))  # type: ignore[arg-type]
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])


def test_unsupported_schema_feature_is_400_then_serving_goes_on(client: openai.OpenAI, server: Any) -> None:
    import httpx

    bad = {"type": "json_schema", "json_schema": {"name": "u", "schema": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}
    body = {"model": "demo", "messages": ASK, "max_tokens": 20, "response_format": bad}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert_error(resp, 400, "response_format.json_schema.schema")
    assert "uniqueItems" in resp.json()["error"]["message"]
    missing = {**body, "response_format": {"type": "json_schema"}}
    assert httpx.post(server.base_url + "/v1/chat/completions", json=missing, timeout=60).status_code == 400
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=300, seed=1,
                                       response_format=_format("enums", True))  # type: ignore[arg-type]
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMAS["enums"])


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": NAME, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "number", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_tool_call_arguments_follow_the_schema(client: openai.OpenAI, choice: Any) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        r = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                                           max_tokens=200, temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r.choices[0]
        fn = calls[0].function  # type: ignore[union-attr]
        jsonschema.validate(json.loads(fn.arguments), schemas[fn.name])


# ------------------------------------------------------------------ in process


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    from freetoken.loading.tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(model_dir)


def test_mask_agrees_with_allows_and_eos_only_when_complete(tokenizer: Any) -> None:
    rng = random.Random(0)
    eos = tokenizer.eos_token_ids[0]
    for name, schema in SCHEMAS.items():
        c = schema_constraint(tokenizer, compile_schema(tokenizer, schema))
        ids: list[int] = []
        while not c.is_complete():
            assert len(ids) < 400, name
            mask = c.allowed_mask(tokenizer.vocab_size + 4, 10_000)  # far from the budget: the mask is exact
            assert not bool(mask[-4:].any())
            allowed = mask.nonzero().flatten().tolist()
            assert allowed, name
            for t in rng.sample(range(tokenizer.vocab_size), 40) + allowed[:20]:
                assert c.allows(t, 10_000) == bool(mask[t]), (name, t)
            assert not bool(mask[eos])  # the document is not complete yet
            choice = rng.choice(allowed)
            c.advance(choice)
            ids.append(choice)
        jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)


def test_unsupported_keywords_are_named() -> None:
    for schema, word in [({"type": "array", "uniqueItems": True}, "uniqueItems"), ({"not": {"type": "string"}}, "not")]:
        with pytest.raises(SchemaError, match=word):
            schema_grammar(schema)
