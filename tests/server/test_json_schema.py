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


# ------------------------------------------------------------- closable within max_tokens


def _random_output(c: Any, budget: int, rng: random.Random, vocab: int, greedy: bool) -> list[int]:
    """Tokens the engine's own sampler picks from random logits under ``c`` with ``budget`` tokens."""
    import torch

    from freetoken.engine.sampling import constrained_pick
    from freetoken.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=budget)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    ids: list[int] = []
    while not c.is_complete() and len(ids) < budget:
        row = torch.randn(vocab, generator=gen) * 4
        tok, _ = constrained_pick(row, row, params, c, budget - len(ids), gen)
        c.advance(tok)
        ids.append(tok)
        if tok in c.vocab.eos_ids:
            break
    return ids


def test_outputs_close_within_max_tokens(tokenizer: Any) -> None:
    """From the closing of the empty output (the least budget that can be kept) upwards,
    every output the sampler draws is complete JSON valid against its schema and fits the budget."""
    rng = random.Random(3)
    for name, schema in SCHEMAS.items():
        grammar = compile_schema(tokenizer, schema)
        least = len(schema_constraint(tokenizer, grammar)._state().closing or [])
        assert 0 < least < 60, name
        for budget in [least, least + 1, least + 3, least + 9, least + 30]:
            for greedy in (False, True):
                ids = _random_output(schema_constraint(tokenizer, grammar), budget, rng, tokenizer.vocab_size, greedy)
                assert len(ids) <= budget
                text = tokenizer.decode([t for t in ids if t not in tokenizer.eos_token_ids])
                jsonschema.validate(json.loads(text), schema)


def test_too_small_a_budget_is_left_to_the_grammar(tokenizer: Any) -> None:
    grammar = compile_schema(tokenizer, SCHEMAS["nested"])
    least = len(schema_constraint(tokenizer, grammar)._state().closing or [])
    ids = _random_output(schema_constraint(tokenizer, grammar), least - 1, random.Random(0), tokenizer.vocab_size, False)
    assert len(ids) == least - 1
    text = tokenizer.decode(ids)
    with pytest.raises(ValueError):
        json.loads(text)  # a prefix of a document, cut at the budget


def test_closing_walk_finishes_the_document(tokenizer: Any) -> None:
    """The closing from random states of random outputs is accepted by llguidance and the
    result validates (the walk is checked against the schema, not against itself)."""
    from freetoken.server.grammar_closing import closing_tokens

    rng = random.Random(5)
    for name, schema in SCHEMAS.items():
        grammar = compile_schema(tokenizer, schema)
        for _ in range(4):
            c = schema_constraint(tokenizer, grammar)
            prefix = _random_output(c, rng.randrange(1, 30), rng, tokenizer.vocab_size, False)
            if c.is_complete() or prefix[-1] in tokenizer.eos_token_ids:
                continue
            c._state()
            closing = closing_tokens(c.matcher, c.vocab.closing_candidates, c.vocab.eos)
            assert closing is not None, name
            m = c.matcher.deep_copy()
            assert m.consume_tokens(closing) and (m.is_stopped() or m.is_accepting())
            ids = [t for t in prefix + closing if t not in tokenizer.eos_token_ids]
            jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_small_max_tokens_still_give_valid_json(client: openai.OpenAI, tokenizer: Any, choice: Any) -> None:
    """max_tokens from the closing of the empty output (in-process, same tokenizer) up:
    "stop" ("tool_calls") and valid JSON, within max_tokens."""
    from freetoken.server.tool_call_formats import HermesFormat
    from freetoken.server.tool_constraint import call_grammar, tool_call_constraint

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    names = sorted(schemas) if choice == "required" else ["get_weather"]
    call = tool_call_constraint(tokenizer, call_grammar(HermesFormat(), {n: schemas[n] for n in names}))
    least_call = len(call._state().closing or [])
    least_doc = len(schema_constraint(tokenizer, compile_schema(tokenizer, SCHEMAS["nested"]))._state().closing or [])
    for i, extra in enumerate([0, 2, 7]):
        r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=least_doc + extra, temperature=1.0,
                                           seed=i, response_format=_format("nested", True))  # type: ignore[arg-type]
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= least_doc + extra
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMAS["nested"])
        r = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                                           max_tokens=least_call + extra, temperature=1.0, seed=i)
        (made,) = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens <= least_call + extra
        fn = made.function  # type: ignore[union-attr]
        jsonschema.validate(json.loads(fn.arguments), schemas[fn.name])


def test_below_the_closing_the_answer_is_cut_with_length(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=8, temperature=1.0, seed=1,
                                       response_format=_format("nested", True))  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert (r.choices[0].message.content or "").startswith("{")


# ------------------------------------------------------------------- masks off the engine step


def test_masks_are_computed_while_the_engine_runs_its_forward_pass(tokenizer: Any) -> None:
    """The next state's mask is computed while the batch's forward pass runs: with masks
    made 10 ms slower (sleeping, as llguidance's native code runs without the GIL) and a
    20 ms forward pass between steps, the engine's thread hardly waits; without a forward
    pass it waits for all of it."""
    import time

    from freetoken.server.schema_constraint import SchemaConstraint, grammar_vocab

    class SlowMasks(SchemaConstraint):
        def _compute(self) -> Any:
            time.sleep(0.01)
            return super()._compute()

    grammar = compile_schema(tokenizer, SCHEMAS["nested"])
    for forward_s in (0.02, 0.0):
        c = SlowMasks(grammar_vocab(tokenizer), grammar)
        rng = random.Random(0)
        for _ in range(15):
            time.sleep(forward_s)
            mask = c.allowed_mask(tokenizer.vocab_size, 10_000)
            allowed = [t for t in mask.nonzero().flatten().tolist() if t not in tokenizer.eos_token_ids]
            c.advance(rng.choice(allowed))
            if c.is_complete():
                break
        t = c.timing
        slow = 0.01 * t.states + t.computed  # what the masks took (the sleeps are not on their own clock)
        assert t.states >= 5, t
        if forward_s:
            assert t.waited < 0.2 * slow, t
        else:
            assert t.waited > 0.8 * slow, t
