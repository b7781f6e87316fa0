"""The call markups of GLM-4.5, DeepSeek-V3/V3.1, Kimi-K2 and GPT-OSS's harmony (Hermes has
test_tool_calls.py): calls found whole and streamed at every split, section tags never in
the content, what is not a call stays content, a forced call's text parses back to the
call, the markup found from the chat template, and a forced call refused where the markup
cannot be constrained."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from freetoken.server.tool_call_formats import (
    FORMATS,
    DeepSeekFormat,
    Glm45Format,
    HarmonyFormat,
    KimiK2Format,
    format_for,
)
from freetoken.server.tool_calls import CallArguments, CallStart, ToolCall, ToolCallParser, parse_tool_calls

NAMES = {"get_weather", "add"}
GLM, DS31, DS3, KIMI = Glm45Format(), DeepSeekFormat(fenced=False), DeepSeekFormat(fenced=True), KimiK2Format()
HARMONY = HarmonyFormat()


def glm(name: str, args: dict[str, Any]) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                    for k, v in args.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def ds31(*calls: tuple[str, dict[str, Any]]) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def ds3(*calls: tuple[str, dict[str, Any]]) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```<｜tool▁call▁end｜>"
                   for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def kimi(*calls: tuple[str, dict[str, Any]]) -> str:
    body = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
                   for i, (n, a) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def harmony(name: str, args: dict[str, Any]) -> str:
    """A call as GPT-OSS's template writes it back (freetoken.server.reasoning puts the model's
    own headers in this form)."""
    return f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{json.dumps(args)}<|call|>"


W = ("get_weather", {"city": "Zürich ✓", "days": 3})
A = ("add", {"a": 1, "b": [2, {"c": None}], "flag": True})

CASES = [
    (GLM, "one call", glm(*W), "", [W]),
    (GLM, "text around two calls", "Checking.\n" + glm(*W) + "\n" + glm(*A) + "\nDone.", "Checking.Done.", [W, A]),
    (GLM, "a string that reads as a number stays JSON's number", glm("add", {"a": "12"}), "", [("add", {"a": 12})]),
    (GLM, "no arguments", "<tool_call>get_weather\n</tool_call>", "", [("get_weather", {})]),
    (GLM, "junk between pairs stays content", "<tool_call>add\n<arg_key>a</arg_key>oops</tool_call>",
     "<tool_call>add\n<arg_key>a</arg_key>oops</tool_call>", []),
    (GLM, "unknown function stays content", glm("rm", {}), glm("rm", {}), []),
    (DS31, "one call in a section", "Sure. " + ds31(W), "Sure.", [W]),
    (DS31, "two calls in one section", ds31(W, A) + " ok", "ok", [W, A]),
    (DS31, "the fenced form read too", ds3(A), "", [A]),
    (DS31, "malformed arguments stay content", "<｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": }<｜tool▁call▁end｜>",
     "<｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": }<｜tool▁call▁end｜>", []),
    (DS31, "a partial section tag at the end", "x <｜tool▁calls▁be", "x <｜tool▁calls▁be", []),
    (DS3, "fenced calls", "Let me see." + ds3(W, A), "Let me see.", [W, A]),
    (KIMI, "one call", kimi(W), "", [W]),
    (KIMI, "text and two calls", "I will call two.\n" + kimi(A, W), "I will call two.", [A, W]),
    (HARMONY, "one call", harmony(*W), "", [W]),
    (HARMONY, "a preamble, then a call", "Looking it up." + harmony(*A), "Looking it up.", [A]),
    (HARMONY, "a call to a built-in tool stays content",
     "<|start|>assistant to=browser.search<|channel|>analysis json<|message|>{}<|call|>",
     "<|start|>assistant to=browser.search<|channel|>analysis json<|message|>{}<|call|>", []),
    (HARMONY, "arguments that are no object stay content",
     "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>[1]<|call|>",
     "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>[1]<|call|>", []),
    (KIMI, "an id without an index stays content",
     "<|tool_call_begin|>functions.add<|tool_call_argument_begin|>{}<|tool_call_end|>",
     "<|tool_call_begin|>functions.add<|tool_call_argument_begin|>{}<|tool_call_end|>", []),
]


def _events(fmt: Any, text: str, cuts: list[int], incremental: bool = False) -> list[Any]:
    parser = ToolCallParser(fmt, NAMES, incremental=incremental)
    events: list[Any] = []
    prev = 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[prev:cut])
        prev = cut
    return events + parser.finish()


def _calls(events: list[Any]) -> list[tuple[str, Any]]:
    out: list[list[Any]] = []
    for e in events:
        if isinstance(e, ToolCall):
            out.append([e.name, e.arguments])
        elif isinstance(e, CallStart):
            out.append([e.call.name, ""])
        elif isinstance(e, CallArguments):
            out[-1][1] += e.text
    return [(n, json.loads(a)) for n, a in out]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0].name}: {c[1]}" for c in CASES])
def test_whole_streamed_and_incremental(case: tuple[Any, str, str, str, list[Any]]) -> None:
    fmt, _, text, want_content, want_calls = case
    content, calls = parse_tool_calls(text, fmt, NAMES)
    assert content == want_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    rng = random.Random(len(text))
    splits = [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]
    splits += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 8))) for _ in range(10)]
    # an incremental call is not taken back once its arguments began (see ToolCallParser)
    modes = (False,) if case[1].startswith("malformed") else (False, True)
    for cuts in splits:
        for incremental in modes:
            events = _events(fmt, text, cuts, incremental)
            assert "".join(e for e in events if isinstance(e, str)) == want_content, (cuts, incremental)
            assert _calls(events) == want_calls, (cuts, incremental)


@pytest.mark.parametrize("fmt", [DS31, DS3, KIMI], ids=lambda f: f.name)
def test_no_markup_reaches_the_content(fmt: Any) -> None:
    text = "Sure." + {"deepseek-v3.1": ds31, "deepseek-v3": ds3, "kimi-k2": kimi}[fmt.name](W, A) + "bye"
    for incremental in (False, True):
        pieces = [e for e in _events(fmt, text, list(range(1, len(text))), incremental) if isinstance(e, str)]
        assert "".join(pieces) == "Sure.bye"
        assert all("<" not in p and "｜" not in p for p in pieces), pieces


def test_kimi_calls_keep_the_models_ids() -> None:
    text = kimi(A, W)
    _, calls = parse_tool_calls(text, KIMI, NAMES)
    assert [c.id for c in calls] == ["functions.add:0", "functions.get_weather:1"]
    starts = [e.call.id for e in _events(KIMI, text, list(range(1, len(text))), True) if isinstance(e, CallStart)]
    assert starts == ["functions.add:0", "functions.get_weather:1"]


@pytest.mark.parametrize("fmt", [DS31, DS3, KIMI, FORMATS["hermes"]], ids=lambda f: f.name)
def test_a_forced_calls_text_parses_back(fmt: Any) -> None:
    for name, args in (W, A):
        before, after = fmt.constrained_call(name)
        content, calls = parse_tool_calls(before + json.dumps(args) + after, fmt, NAMES)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args)]
    assert GLM.constrained_call("add") is None
    assert HARMONY.constrained_call("add") is None and not HARMONY.forcible


class _Tok:
    template_renders_tools = True

    def __init__(self, template: str) -> None:
        self.chat_template = template


@pytest.mark.parametrize("template, name", [
    ("{{ '<tool_call>' + tc.name }}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value></tool_call>", "glm45"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ n }}<｜tool▁sep｜>{{ a }}<｜tool▁call▁end｜>", "deepseek-v3.1"),
    ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ n }}\n```json\n{{ a }}\n```<｜tool▁call▁end｜>", "deepseek-v3"),
    ("<|tool_calls_section_begin|><|tool_call_begin|>{{ id }}<|tool_call_argument_begin|>", "kimi-k2"),
    ("{{- \"<|start|>assistant to=\" }}{{- \"functions.\" + tool_call.name + \"<|channel|>commentary \" }}", "harmony"),
    ("<tool_call>\n{\"name\": {{ n }}}</tool_call>", "hermes"),
    ("no markup at all", "hermes"),
])
def test_the_markup_is_found_in_the_template(template: str, name: str) -> None:
    assert format_for(_Tok(template)).name == name


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from freetoken.loading.tokenizer import load_hf_tokenizer
    from freetoken.models.demo import ensure_demo_model

    return load_hf_tokenizer(ensure_demo_model().hf_dir)


def _forced(tokenizer: Any, fmt: Any, schemas: dict[str, Any], rng: random.Random, budget: int) -> str:
    """The text of a forced call, its tokens drawn at random among those the grammar allows
    as the sampler draws them (a pick ``allows`` rejects for the budget is drawn again)."""
    from freetoken.server.tool_constraint import call_grammar, tool_call_constraint

    c = tool_call_constraint(tokenizer, call_grammar(fmt, schemas), fmt)
    ids: list[int] = []
    while not c.is_complete() and len(ids) < budget:
        remaining = budget - len(ids)
        allowed = c.allowed_mask(tokenizer.vocab_size, remaining).nonzero().flatten().tolist()
        tid = rng.choice(allowed)
        while not c.allows(tid, remaining):
            allowed.remove(tid)
            assert allowed, "the constraint allowed nothing"
            tid = rng.choice(allowed)
        ids.append(tid)
        c.advance(tid)
    assert c.is_complete() and len(ids) <= budget
    return tokenizer.decode(ids)


SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"]},
    "add": {"type": "object", "properties": {"a": {"type": "number"}, "tags": {"type": "array",
                                                                              "items": {"type": "string"}}},
            "required": ["a", "tags"]},
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fmt", [DS31, DS3, KIMI, GLM], ids=lambda f: f.name)
def test_a_forced_call_parses_back_and_follows_the_schema(tokenizer: Any, fmt: Any, seed: int) -> None:
    rng = random.Random(seed)
    names = sorted(SCHEMAS) if seed % 2 else ["add"]
    text = _forced(tokenizer, fmt, {n: SCHEMAS[n] for n in names}, rng, 160)
    content, calls = parse_tool_calls(text, fmt, set(names), schemas=SCHEMAS)
    assert content == "" and len(calls) == 1, text
    args = json.loads(calls[0].arguments)
    schema = SCHEMAS[calls[0].name]
    assert set(schema["required"]) <= set(args) <= set(schema["properties"]), (text, args)
    if calls[0].name == "get_weather":
        assert isinstance(args["city"], str) and isinstance(args.get("days", 0), int)
    else:
        assert isinstance(args["a"], (int, float)) and all(isinstance(t, str) for t in args["tags"])


@pytest.mark.parametrize("seed", range(3))
def test_a_forced_glm_call_without_properties_and_with_an_enum(tokenizer: Any, seed: int) -> None:
    """GLM-4.5's markup: a function without properties takes any keys with bare values; a
    string enum allows only its values; both close within the budget though bare text ends
    only at ``<``."""
    rng = random.Random(seed)
    schemas = {"note": {"type": "object"},
               "pick": {"type": "object", "properties": {"side": {"type": "string", "enum": ["left", "right"]}},
                        "required": ["side"]}}  # fmt: skip
    for name in schemas:
        text = _forced(tokenizer, GLM, {name: schemas[name]}, rng, 60)
        content, calls = parse_tool_calls(text, GLM, set(schemas), schemas=schemas)
        assert content == "" and [c.name for c in calls] == [name], text
        args = json.loads(calls[0].arguments)
        if name == "pick":
            assert args in ({"side": "left"}, {"side": "right"}), text
        else:
            assert all(isinstance(k, str) and k.strip() for k in args), text


def test_a_forced_call_in_glms_markup_is_accepted() -> None:
    from freetoken.server.chat_tools import ChatTools
    from freetoken.server.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                tool_choice="required")
    tools_of_request = ChatTools(req, _Tok("<tool_call>{{ n }}<arg_key>k</arg_key>"))
    assert tools_of_request.fmt.name == "glm45" and tools_of_request.forced == ["add"]


def test_glm_values_follow_the_functions_schema() -> None:
    """GLM-4.5 writes strings bare, so "123" is a string where the schema says string, a
    number where it says integer or says nothing."""
    schemas = {"add": {"type": "object", "properties": {"id": {"type": "string"}, "zip": {"type": ["string", "null"]},
                                                        "n": {"type": "integer"}}}}
    text = glm("add", {"id": "123", "zip": "02139", "n": 7, "free": "42"})
    _, calls = parse_tool_calls(text, GLM, NAMES, schemas=schemas)
    assert [json.loads(c.arguments) for c in calls] == [{"id": "123", "zip": "02139", "n": 7, "free": 42}]
    _, untyped = parse_tool_calls(text, GLM, NAMES)
    assert json.loads(untyped[0].arguments)["id"] == 123
