"""Reasoning through the HTTP server: the demo model with ``<think>``/``</think>`` in its
vocabulary and a template that opens the reasoning at the generation prompt unless
``enable_thinking`` is false. The raw text of the same prompt through /v1/completions
(greedy) is the reference the chat and Anthropic answers are split from; chat_template_kwargs,
reasoning in the history and Anthropic's thinking parameter and blocks, streamed and not."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest

from server_helpers import assert_error, parse_sse

MODEL = "demo-think"
TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{- '\\nreasoned: ' + message['reasoning_content'] }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
TOKENS = 24


def think_model_dir(root: str) -> str:
    """The demo model's weights with two of its vocabulary entries (ids 4094, 4095) made
    ``<think>`` and ``</think>`` (their merges dropped), and the template above."""
    from freetoken.models.demo import ensure_demo_model

    src = ensure_demo_model().hf_dir
    out = os.path.join(root, "demo-think")
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        if name not in ("tokenizer.json", "tokenizer_config.json"):
            os.symlink(os.path.join(src, name), os.path.join(out, name))
    with open(os.path.join(src, "tokenizer.json")) as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    names = {i: t for t, i in vocab.items()}
    gone = {names[4094], names[4095]}

    def parts(m: Any) -> list[str]:
        return m.split(" ") if isinstance(m, str) else list(m)

    tj["model"]["merges"] = [m for m in tj["model"]["merges"]
                             if "".join(parts(m)) not in gone and not set(parts(m)) & gone]  # fmt: skip
    for i, tag in ((4094, "<think>"), (4095, "</think>")):
        del vocab[names[i]]
        vocab[tag] = i
        tj["added_tokens"].append({"id": i, "content": tag, "single_word": False, "lstrip": False, "rstrip": False,
                                   "normalized": False, "special": False})  # fmt: skip
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tj, f)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = TEMPLATE
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    return think_model_dir(str(tmp_path_factory.mktemp("think")))


@pytest.fixture(scope="module")
def http(server_factory: Any, model_dir: str) -> Any:
    srv = server_factory(["--model", model_dir, "--served-model-name", MODEL])
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ref_tok(model_dir: str) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


def raw_answer(http: httpx.Client, ref_tok: Any, messages: list[dict[str, Any]], tokens: int, **template: Any) -> str:
    """The greedy text after the prompt transformers renders, through /v1/completions."""
    prompt = ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template)
    ids = ref_tok(prompt, add_special_tokens=False)["input_ids"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def expected_split(raw: str) -> tuple[str, str]:
    """(reasoning, answer) of an answer that starts inside the reasoning."""
    reasoning, closed, answer = raw.partition("</think>")
    return reasoning.strip(), answer.lstrip() if closed else ""


def chat(http: httpx.Client, messages: list[dict[str, Any]], tokens: int = TOKENS, **extra: Any) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": tokens,
                                                "temperature": 0, **extra})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_reasoning_whole_and_streamed(http, ref_tok):
    raw = raw_answer(http, ref_tok, ASK, TOKENS)
    reasoning, answer = expected_split(raw)
    assert reasoning, f"the demo model's greedy answer {raw!r} has no reasoning to split"
    message = chat(http, ASK)["choices"][0]["message"]
    assert message["reasoning_content"] == reasoning and (message["content"] or "") == answer, (message, raw)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": TOKENS,
                                                "temperature": 0, "stream": True})  # fmt: skip
    deltas = [c["choices"][0]["delta"] for c in parse_sse(r.text) if c != "[DONE]" and c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == answer
    assert not any("<think>" in d.get("reasoning_content", "") + (d.get("content") or "") for d in deltas)


def test_thinking_switched_off_through_chat_template_kwargs(http, ref_tok):
    raw = raw_answer(http, ref_tok, ASK, TOKENS, enable_thinking=False)
    message = chat(http, ASK, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert message["content"] == raw and "reasoning_content" not in message, (message, raw)


def test_reasoning_in_the_history_reaches_the_template(http):
    turns = ASK + [{"role": "assistant", "content": "Scattering."}, {"role": "user", "content": "More?"}]
    plain = chat(http, turns, tokens=1)["usage"]["prompt_tokens"]
    shown = chat(http, [turns[0], {**turns[1], "reasoning_content": "Rayleigh, short waves"}, turns[2]],
                 tokens=1)["usage"]["prompt_tokens"]  # fmt: skip
    assert shown > plain  # "\nreasoned: Rayleigh, short waves" rendered into the earlier answer


def test_anthropic_thinking_blocks_whole_and_streamed(http, ref_tok):
    """Through the official client: the thinking block first, then the text, both as one
    message and streamed (the client assembles thinking_delta and signature_delta events).
    The demo model reasons past 1024 tokens: with ``budget_tokens`` 1024 the thinking block
    is the text of the unconstrained answer's first 1024 tokens, then the reasoning is closed
    and the answer takes the rest of ``max_tokens``."""
    import anthropic

    client = anthropic.Anthropic(base_url=str(http.base_url), api_key="unused", max_retries=0, timeout=120)
    tokens, budget = 1030, 1024  # thinking's smallest budget is 1024 tokens, below max_tokens
    free = raw_answer(http, ref_tok, ASK, tokens, enable_thinking=True)
    assert "</think>" not in free, "the demo model closed its reasoning within the budget: nothing to cut"
    reasoning = raw_answer(http, ref_tok, ASK, budget, enable_thinking=True).strip()
    kw = dict(model=MODEL, messages=ASK, max_tokens=tokens, extra_body={"temperature": 0},
              thinking={"type": "enabled", "budget_tokens": budget})  # fmt: skip
    whole = client.messages.create(**kw)
    assert [b.type for b in whole.content] == ["thinking", "text"], whole.content
    assert whole.content[0].thinking == reasoning and whole.content[0].signature == ""
    answer = whole.content[1].text
    assert answer and whole.usage.output_tokens == tokens
    with client.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"], final.content
    assert final.content[0].thinking == reasoning and final.content[1].text == answer
    assert "thinking" in kinds and "signature" in kinds, kinds
    # adaptive thinking (no budget) with its text omitted: the block without the reasoning,
    # which runs to max_tokens here
    omitted = client.messages.create(**{**kw, "thinking": {"type": "adaptive", "display": "omitted"}})
    assert [(b.type, getattr(b, "thinking", None)) for b in omitted.content] == [("thinking", ""), ("text", None)]
    assert omitted.content[1].text == expected_split(free)[1]
    with client.messages.stream(**{**kw, "thinking": {"type": "adaptive", "display": "omitted"}}) as stream:
        assert "thinking" not in [e.type for e in stream]
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in final.content] == \
        [("thinking", "", None), ("text", None, omitted.content[1].text)]
    # without the parameter: no thinking block, the answer alone
    plain = client.messages.create(**{k: v for k, v in kw.items() if k != "thinking"})
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == expected_split(free)[1]


def test_anthropic_thinking_disabled_and_thinking_blocks_in_the_history(http, ref_tok):
    raw = raw_answer(http, ref_tok, ASK, TOKENS, enable_thinking=False)
    r = http.post("/v1/messages", json={"model": MODEL, "messages": ASK, "max_tokens": TOKENS, "temperature": 0,
                                        "thinking": {"type": "disabled"}})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [{"type": "text", "text": raw}]
    turns = [ASK[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Rayleigh, short waves", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "Scattering."}]},
        {"role": "user", "content": "More?"}]
    counted = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": turns}).json()["input_tokens"]
    turns[1]["content"] = turns[1]["content"][2:]
    assert counted > http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": turns}).json()[
        "input_tokens"]  # fmt: skip


@pytest.mark.parametrize("body, param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 2048}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}]},
     "messages.0.content.0"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1100,
      "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}}, "tool_choice"),
])
def test_bad_thinking_is_400_naming_the_field(http, body, param):
    r = http.post("/v1/messages", json={"model": MODEL, "messages": ASK, "max_tokens": 16, **body})
    err = r.json()
    assert r.status_code == 400 and err["type"] == "error", r.text
    assert param in err["error"]["message"], err


def test_reserved_chat_template_kwargs_and_unknown_efforts_are_400(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4,
                                                "chat_template_kwargs": {"messages": [], "enable_thinking": True}})
    assert_error(r, 400, "chat_template_kwargs")
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4,
                                                "reasoning_effort": "extreme"})
    assert_error(r, 400, "reasoning_effort")
    assert chat(http, ASK, tokens=1, reasoning_effort="high")["choices"]  # the server keeps serving
