"""The families' real chat templates (data/chat_templates) rendered by our tokenizer's jinja
environment equal transformers' own rendering (``render_jinja_template``, the path
``apply_chat_template`` takes, without a tokenizer) on conversations with a system prompt,
several turns, tool definitions, tool calls and their results, and reasoning; templates
that refuse a conversation refuse it in both."""

from __future__ import annotations

import os
import random
from typing import Any, Optional

import jinja2
import pytest

from freetoken.loading.tokenizer import Tokenizer

HERE = os.path.join(os.path.dirname(__file__), "data", "chat_templates")

# the special tokens each family's tokenizer gives its template
SPECIAL = {
    "qwen3_5_moe": ("", "<|im_end|>"),
    "gpt_oss": ("<|startoftext|>", "<|return|>"),
    "mixtral": ("<s>", "</s>"),
    "olmoe": ("<|endoftext|>", "<|endoftext|>"),
}
FAMILIES = tuple(SPECIAL)


def template(family: str) -> str:
    with open(os.path.join(HERE, f"{family}.jinja"), encoding="utf-8") as f:
        return f.read()


def ours(family: str, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]], gen: bool) -> str:
    bos, eos = SPECIAL[family]
    tok = Tokenizer(None, [], template(family), bos_token=bos or None, eos_token=eos, source=family)
    return tok.apply_chat_template(messages, add_generation_prompt=gen, tools=tools)


def reference(family: str, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]], gen: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    bos, eos = SPECIAL[family]
    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template(family),
                                        add_generation_prompt=gen, bos_token=bos, eos_token=eos)  # fmt: skip
    return rendered[0]


# ----------------------------------------------------------------- conversations

_WORDS = ("weather", "Zürich", "naïve", "\"quoted\"", "it's", "a\\b", "{braces}", "<tag>", "línea\nnueva",
          "東京", "emoji 🙂", "tab\there", "50%", "x & y", "ok")  # fmt: skip


def _text(rng: random.Random, n: int = 6) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, n)))


def _tools(rng: random.Random) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {
            "name": "get_weather", "description": _text(rng),
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": _text(rng)},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "description": "forecast days"}},
                "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "search", "description": _text(rng),
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                "filters": {"type": "object", "description": "nested filters"}},
                "required": ["query"]}}},
    ]  # fmt: skip


def _call(rng: random.Random, i: int) -> dict[str, Any]:
    if rng.random() < 0.5:
        fn = {"name": "get_weather", "arguments": {"city": _text(rng, 2), "unit": "celsius", "days": rng.randint(1, 9)}}
    else:
        fn = {"name": "search", "arguments": {"query": _text(rng), "tags": [_text(rng, 2), "x"],
                                              "filters": {"lang": "de", "max": rng.randint(1, 99)}}}  # fmt: skip
    return {"id": f"call_{i}_{rng.randint(0, 999)}", "type": "function", "function": fn}


def conversations(seed: int) -> dict[str, tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]]:
    """Named conversations (messages, tools) in transformers' layout, with fresh text."""
    rng = random.Random(seed)
    sys_msg = {"role": "system", "content": _text(rng, 10)}
    multi = [sys_msg]
    for _ in range(3):
        multi += [{"role": "user", "content": _text(rng)}, {"role": "assistant", "content": _text(rng)}]
    multi.append({"role": "user", "content": _text(rng)})
    calls = [_call(rng, 0), _call(rng, 1)]
    tool_turns = [
        sys_msg,
        {"role": "user", "content": _text(rng)},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": _text(rng)},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": '{"result": "' + _text(rng, 3) + '"}'},
        {"role": "assistant", "content": _text(rng)},
        {"role": "user", "content": _text(rng)},
    ]
    call = _call(rng, 2)
    thinking = [
        {"role": "user", "content": _text(rng)},
        {"role": "assistant", "content": _text(rng), "reasoning_content": _text(rng, 12)},
        {"role": "user", "content": _text(rng)},
        {"role": "assistant", "content": "", "reasoning_content": _text(rng, 12), "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": _text(rng)},
        {"role": "assistant", "content": _text(rng), "reasoning_content": _text(rng, 12)},
    ]
    return {
        "system_and_user": ([sys_msg, {"role": "user", "content": _text(rng)}], None),
        "multi_turn": (multi, None),
        "tool_definitions": ([sys_msg, {"role": "user", "content": _text(rng)}], _tools(rng)),
        "tool_calls_and_results": (tool_turns, _tools(rng)),
        "thinking": (thinking, _tools(rng)),
    }


# What each template accepts: Mixtral's and OLMoE's have no tool role and no tool definitions
# (Mixtral refuses the conversation, OLMoE drops those turns); both are still compared.
CASES = ("system_and_user", "multi_turn", "tool_definitions", "tool_calls_and_results", "thinking")


def _render(fn: Any, *args: Any) -> tuple[str, str]:
    try:
        return "ok", fn(*args)
    except (ValueError, jinja2.TemplateError) as exc:  # ours wraps the template's error in ValueError
        msg = str(exc)
        return "error", msg.removeprefix("chat template error: ")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", CASES)
def test_template_renders_as_transformers(family, case):
    for seed in (11, 12):
        messages, tools = conversations(seed)[case]
        for gen in (True, False):
            want = _render(reference, family, messages, tools, gen)
            got = _render(ours, family, messages, tools, gen)
            assert got == want, (family, case, seed, gen)


def test_the_conversations_reach_the_templates():
    """The comparisons above are not vacuous: each template renders the parts it supports
    (tool definitions, calls with their arguments, results, reasoning) into the prompt."""
    messages, tools = conversations(5)["tool_calls_and_results"]
    messages[3]["content"] = "result of the first call: 42"  # GPT-OSS writes results as JSON strings
    call = messages[2]["tool_calls"][0]["function"]
    first_arg = next(iter(call["arguments"].values()))
    q = ours("qwen3_5_moe", messages, tools, True)
    assert "<tools>" in q and f"<function={call['name']}>" in q and messages[3]["content"] in q
    assert str(first_arg) in q and q.endswith("<|im_start|>assistant\n<think>\n")
    g = ours("gpt_oss", messages, tools, True)
    assert "namespace functions" in g and f"to=functions.{call['name']}" in g and messages[3]["content"] in g
    assert g.endswith("<|start|>assistant")
    think, _ = conversations(5)["thinking"]
    q = ours("qwen3_5_moe", think, None, False)
    assert think[-1]["reasoning_content"] in q and "<think>" in q  # the turns after the last user query
    g = ours("gpt_oss", think[:4], None, True)
    assert think[3]["reasoning_content"] in g  # analysis channel before a tool call
    m = ours("mixtral", conversations(5)["multi_turn"][0], None, True)
    assert m.startswith("<s> [INST] ") and m.count("[/INST]") == 4 and m.count("</s>") == 3
    o = ours("olmoe", conversations(5)["multi_turn"][0], None, True)
    assert o.startswith("<|endoftext|><|system|>\n") and o.endswith("<|assistant|>\n")
    with pytest.raises(ValueError, match="roles must alternate"):
        ours("mixtral", messages, tools, True)


def test_reasoning_under_any_name_reaches_the_template():
    """Reasoning sent as ``reasoning_content``, ``reasoning`` or ``thinking`` renders the same
    (GPT-OSS's template reads ``thinking``, Qwen3.5's ``reasoning_content``), as in transformers."""
    think, _ = conversations(7)["thinking"]
    for family in ("qwen3_5_moe", "gpt_oss"):
        outs = set()
        for key in ("reasoning_content", "reasoning", "thinking"):
            msgs = [{(key if k == "reasoning_content" else k): v for k, v in m.items()} for m in think]
            got = ours(family, msgs, None, True)
            assert got == reference(family, msgs, None, True), (family, key)
            outs.add(got)
        assert len(outs) == 1, family
