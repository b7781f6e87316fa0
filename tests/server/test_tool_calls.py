"""Tool-call parsing (Hermes / Qwen3 ``<tool_call>`` markup), whole and streamed, and
the forced-call token constraint driven token by token over the demo vocabulary."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from freetoken.server.tool_calls import (
    CallArguments,
    CallEnd,
    CallStart,
    ToolCall,
    ToolCallParser,
    parse_tool_calls,
)
from freetoken.server.tool_call_formats import HermesFormat
from freetoken.server.tool_constraint import call_grammar, tool_call_constraint

FMT = HermesFormat()
NAMES = {"get_weather", "add"}


def call(name: str, args: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def streamed(text: str, cuts: list[int], names: Any = NAMES, max_calls: Any = None) -> tuple[str, list[ToolCall]]:
    parser = ToolCallParser(FMT, names, max_calls)
    events = []
    prev = 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[prev:cut])
        prev = cut
    events += parser.finish()
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]


CASES = [
    ("plain text, no call", "Hello <b>world</b> < tool", "Hello <b>world</b> < tool", []),
    ("one call", call("get_weather", {"city": "Paris"}), "", [("get_weather", {"city": "Paris"})]),
    ("text around calls", "Let me check.\n" + call("get_weather", {"city": "Oslo"}) + "\n"
     + call("add", {"a": 1, "b": [2, {"c": None}]}) + "\nDone.",
     "Let me check.Done.", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": [2, {"c": None}]})]),
    ("malformed JSON stays content", "x <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": }\n</tool_call>",
     "x <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": }\n</tool_call>", []),
    ("unknown function stays content", call("rm_rf", {}), call("rm_rf", {}), []),
    ("arguments as a JSON string", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>', "",
     [("add", {"a": 2})]),
    ("unclosed last call", "ok " + call("add", {"a": 1})[: -len("</tool_call>")], "ok", [("add", {"a": 1})]),
    ("unclosed garbage", "ok <tool_call>{\"na", "ok <tool_call>{\"na", []),
    ("partial tag at the end", "value <tool_c", "value <tool_c", []),
    ("unicode", "é " + call("get_weather", {"city": "Zürich ✓"}), "é", [("get_weather", {"city": "Zürich ✓"})]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parse_whole_and_streamed_at_every_split(case: tuple[str, str, str, list[Any]]) -> None:
    _, text, want_content, want_calls = case
    content, calls = parse_tool_calls(text, FMT, NAMES)
    assert content == want_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    for cut in range(len(text) + 1):  # one split at every character boundary
        assert streamed(text, [cut])[0] == content
        assert [(c.name, c.arguments) for c in streamed(text, [cut])[1]] == [(c.name, c.arguments) for c in calls]
    # one character at a time
    c1, k1 = streamed(text, list(range(1, len(text))))
    assert c1 == content and [(c.name, c.arguments) for c in k1] == [(c.name, c.arguments) for c in calls]


def test_streamed_content_never_shows_markup() -> None:
    text = "Sure." + call("add", {"a": 1}) + "bye"
    parser = ToolCallParser(FMT, NAMES)
    pieces = []
    for ch in text:
        pieces += [e for e in parser.feed(ch) if isinstance(e, str)]
    pieces += [e for e in parser.finish() if isinstance(e, str)]
    assert all("<" not in p and "tool" not in p for p in pieces), pieces
    assert "".join(pieces) == "Sure.bye"


def incremental(text: str, cuts: list[int], names: Any = NAMES, max_calls: Any = None) -> tuple[str, list[Any]]:
    """(content, [[name, arguments, pieces, whole]]) of ``text`` fed at ``cuts`` to an incremental parser."""
    parser = ToolCallParser(FMT, names, max_calls, incremental=True)
    events: list[Any] = []
    prev = 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[prev:cut])
        prev = cut
    events += parser.finish()
    calls: list[Any] = []
    open_call = False
    for e in events:
        if isinstance(e, CallStart):
            assert not open_call
            open_call = True
            calls.append([e.call.name, "", 0, False])
        elif isinstance(e, CallArguments):
            assert open_call and e.text
            calls[-1][1] += e.text
            calls[-1][2] += 1
        elif isinstance(e, CallEnd):
            assert open_call
            open_call = False
        elif isinstance(e, ToolCall):
            assert not open_call
            calls.append([e.name, e.arguments, 1, True])
    assert not open_call
    return "".join(e for e in events if isinstance(e, str)), calls


WELL_FORMED = [c for c in CASES if not c[0].startswith(("malformed", "arguments as a JSON string"))]


@pytest.mark.parametrize("case", WELL_FORMED, ids=[c[0] for c in WELL_FORMED])
def test_incremental_parse_agrees_with_the_whole_parse(case: tuple[str, str, str, list[Any]]) -> None:
    _, text, want_content, want_calls = case
    rng = random.Random(len(text))
    splits = [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]
    splits += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) for _ in range(20)]
    for cuts in splits:
        content, calls = incremental(text, cuts)
        assert content == want_content, cuts
        assert [(n, json.loads(a)) for n, a, _, _ in calls] == want_calls, cuts


def test_incremental_arguments_go_out_before_the_call_ends() -> None:
    args = {"city": "Pa}r\\\"is", "n": [1, {"x": "]}"}], "u": "✓"}
    text = "x" + call("get_weather", args) + "y"
    parser = ToolCallParser(FMT, NAMES, incremental=True)
    seen = ""
    end_at = text.index("</tool_call>")
    for i, ch in enumerate(text):
        for e in parser.feed(ch):
            if isinstance(e, CallArguments):
                seen += e.text
            if isinstance(e, CallEnd):
                assert i == end_at + len("</tool_call>") - 1
        if i == end_at - 2:  # "}\n" of the call body still to come: the arguments are all out
            assert json.loads(seen) == args
    parser.finish()
    assert json.loads(seen) == args
    # a call cut off inside its arguments (max_tokens): what was written, and its end
    cut = call("add", {"a": 12345, "b": 6})[:50]
    content, calls = incremental(cut, list(range(1, len(cut))))
    assert content == "" and calls == [["add", cut[cut.index('{"a"'):], calls[0][2], False]]


def test_incremental_names_and_limits() -> None:
    # an unknown function or a call past max_calls is content, as in the whole parse
    for text, max_calls in [(call("rm_rf", {"a": 1}), None), (call("add", {"a": 1}) + call("add", {"b": 2}), 1)]:
        want = parse_tool_calls(text, FMT, NAMES, max_calls)
        content, calls = incremental(text, list(range(1, len(text))), max_calls=max_calls)
        assert content == want[0]
        assert [(n, json.loads(a)) for n, a, _, _ in calls] == [(c.name, json.loads(c.arguments)) for c in want[1]]
    # a body that does not start with the name is reported whole at its end
    text = '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>'
    content, calls = incremental(text, list(range(1, len(text))))
    assert content == "" and calls == [["add", '{"a": 1}', 1, True]]


def test_max_calls_keeps_the_first() -> None:
    text = call("add", {"a": 1}) + call("add", {"a": 2})
    content, calls = parse_tool_calls(text, FMT, NAMES, max_calls=1)
    assert [json.loads(c.arguments) for c in calls] == [{"a": 1}]
    assert content == call("add", {"a": 2})


# ------------------------------------------------------------------ the forced-call constraint


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from freetoken.loading.tokenizer import load_hf_tokenizer
    from freetoken.models.demo import ensure_demo_model

    return load_hf_tokenizer(ensure_demo_model().hf_dir)


def drive(constraint: Any, vocab_size: int, budget: int, rng: random.Random, use_allows: bool) -> list[int]:
    """Sample uniformly among the allowed tokens (random 'logits'), as the sampler would."""
    out: list[int] = []
    while not constraint.is_complete() and len(out) < budget:
        remaining = budget - len(out)
        mask = constraint.allowed_mask(vocab_size, remaining)
        allowed = mask.nonzero().flatten().tolist()
        assert allowed, "the constraint allowed nothing"
        tid = rng.choice(allowed)
        if use_allows:  # as the sampler: a pick allows() rejects is redrawn; nothing outside the mask is allowed
            while not constraint.allows(tid, remaining):
                allowed.remove(tid)
                assert allowed, "the mask held no token allows() accepts"
                tid = rng.choice(allowed)
            blocked = [t for t in rng.sample(range(vocab_size), 50) if not bool(mask[t])]
            assert not any(constraint.allows(t, remaining) for t in blocked)
        constraint.advance(tid)
        out.append(tid)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_constraint_always_yields_a_parseable_call(tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    names = ["get_weather", "add"] if seed % 2 else ["add"]
    budget = 60 + 20 * (seed % 3)
    c = tool_call_constraint(tokenizer, call_grammar(FMT, {n: None for n in names}))  # any JSON object
    ids = drive(c, tokenizer.vocab_size, budget, rng, use_allows=seed < 2)
    assert c.is_complete() and len(ids) <= budget
    text = tokenizer.decode(ids)
    content, calls = parse_tool_calls(text, FMT, set(names))
    assert content == "" and len(calls) == 1, text
    assert calls[0].name in names
    assert isinstance(json.loads(calls[0].arguments), dict)


def test_constraint_mask_is_padded_to_the_model_vocabulary(tokenizer: Any) -> None:
    c = tool_call_constraint(tokenizer, call_grammar(FMT, {"add": None}))
    mask = c.allowed_mask(tokenizer.vocab_size + 8, 50)
    assert mask.shape == (tokenizer.vocab_size + 8,) and not bool(mask[-8:].any())
    assert mask.dtype == torch.bool


def test_streamed_deltas_keep_order_and_number_the_calls() -> None:
    from freetoken.server.chat_tools import StreamedCalls

    text = "a" + call("add", {"a": 1}) + "b" + call("get_weather", {"city": "X"}) + "c"
    s = StreamedCalls(ToolCallParser(FMT, NAMES))
    deltas = [d for ch in text for d in s.deltas(ch, False)] + s.deltas("", True)
    kinds = [("content", d["content"]) if "content" in d else ("call", d["tool_calls"][0]["index"]) for d in deltas]
    assert kinds == [("content", "a"), ("call", 0), ("call", 0), ("content", "b"), ("call", 1), ("call", 1),
                     ("content", "c")]
    first, second = deltas[1]["tool_calls"][0], deltas[2]["tool_calls"][0]
    assert first["function"] == {"name": "add", "arguments": ""} and first["type"] == "function"
    assert json.loads(second["function"]["arguments"]) == {"a": 1}


def test_streamed_deltas_carry_argument_pieces() -> None:
    from freetoken.server.chat_tools import StreamedCalls

    args = {"a": 1, "b": [2, 3], "c": "three"}
    text = "a" + call("add", args) + call("get_weather", {"city": "X"})
    s = StreamedCalls(ToolCallParser(FMT, NAMES, incremental=True))
    deltas = [d for i in range(0, len(text), 3) for d in s.deltas(text[i:i + 3], False)] + s.deltas("", True)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    heads = [c for c in calls if "id" in c]
    assert [(c["index"], c["function"]["name"]) for c in heads] == [(0, "add"), (1, "get_weather")]
    pieces = {i: [c["function"]["arguments"] for c in calls if c["index"] == i and "id" not in c] for i in (0, 1)}
    assert len(pieces[0]) > 5 and all(pieces[0])
    assert json.loads("".join(pieces[0])) == args and json.loads("".join(pieces[1])) == {"city": "X"}


def test_parallel_tool_calls_false_stops_after_the_first_call(tmp_path: Any) -> None:
    from tool_model import tool_model_dir

    from freetoken.loading.tokenizer import load_hf_tokenizer
    from freetoken.server.chat_tools import ChatTools
    from freetoken.server.protocol import ChatCompletionRequest

    tok = load_hf_tokenizer(tool_model_dir(str(tmp_path)))
    tools = [{"type": "function", "function": {"name": n}} for n in sorted(NAMES)]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    single = ChatTools(ChatCompletionRequest.model_validate({**body, "parallel_tool_calls": False}), tok)
    assert single.stop_strings() == ["</tool_call>"] and single.constraint() is None
    # the stop string cuts the closing tag: the call still parses, and it is the only one
    text = "hm " + call("add", {"a": 1})[: -len("</tool_call>")]
    message, reason = single.message(text, "stop")
    assert reason == "tool_calls" and message.content == "hm" and len(message.tool_calls) == 1
    many = ChatTools(ChatCompletionRequest.model_validate(body), tok)
    assert many.stop_strings() == []
    forced = ChatTools(ChatCompletionRequest.model_validate({**body, "tool_choice": "required"}), tok)
    forced.compile()
    assert forced.constraint() is not None
