"""A reasoning model's reasoning apart from its answer (freetoken.server.reasoning): think
tags and GPT-OSS's harmony channels, whole and cut into random pieces, beside tool calls in
the streamed deltas; the harmony vocabulary's decoded markup and end tokens."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest

from freetoken.loading.tokenizer import HARMONY_ENDS, HARMONY_MARKUP, Tokenizer
from freetoken.server.chat import _choice_deltas
from freetoken.server.chat_tools import StreamedCalls
from freetoken.server.protocol import ChatResponseMessage
from freetoken.server.reasoning import ANSWER, REASONING, ReasoningSplit, split_for, starts_in_reasoning, style_for
from freetoken.server.tool_call_formats import HermesFormat
from freetoken.server.tool_calls import ToolCallParser

SEED = random.SystemRandom().randrange(1 << 30)

# (style, starts inside the reasoning, text, reasoning, answer)
CASES = [
    ("think", False, "<think>\nLet me think.\n\nStep 2.\n</think>\n\nHello!", "Let me think.\n\nStep 2.", "Hello!"),
    ("think", True, "First, 2 < 3.\n</think>\n\nIt is <b>3</b>.", "First, 2 < 3.", "It is <b>3</b>."),
    ("think", True, "\n  Leading space.</think> Answer", "Leading space.", "Answer"),
    ("think", False, "  No reasoning <think> here </think>", "", "  No reasoning <think> here </think>"),
    ("think", False, "<thin", "", "<thin"),  # a tag the answer stopped in is answer text
    ("think", True, "cut off before the end </thi", "cut off before the end </thi", ""),
    ("think", False, "<think></think>Answer.", "", "Answer."),
    ("think", True, "é ✓ reasoning</think>ü", "é ✓ reasoning", "ü"),
    ("harmony", False, "<|channel|>analysis<|message|>User greets. Reply.<|start|>assistant<|channel|>final"
     "<|message|>Hello!", "User greets. Reply.", "Hello!"),
    ("harmony", False, "<|channel|>final<|message|>Only an answer <|chan", "", "Only an answer <|chan"),
    ("harmony", False, "Plain text, no channel.", "", "Plain text, no channel."),
    ("harmony", False, "<|channel|>analysis<|message|>Need the weather.<|start|>assistant<|channel|>commentary "
     "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}", "Need the weather.",
     "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}<|call|>"),
    ("harmony", False, "<|start|>assistant to=functions.add<|channel|>commentary <|constrain|>json<|message|>{}",
     "", "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{}<|call|>"),
    ("harmony", False, "<|channel|>commentary to=functions.f<|message|>{}<|start|>assistant<|channel|>final<|message|>ok",
     "", "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>ok"),
    ("harmony", False, "<|channel|>analysis<|message|>a<|start|>assistant<|channel|>analysis<|message|>b"
     "<|start|>assistant<|channel|>commentary<|message|>Checking.<|start|>assistant<|channel|>final<|message|>"
     "Done.", "ab", "Checking.Done."),
    ("harmony", False, "<|channel|>analysis<|message|>stopped in the header<|start|>assistant<|chan",
     "stopped in the header", ""),
]


def fed(split: ReasoningSplit, text: str, cuts: list[int]) -> list[tuple[str, str]]:
    parts, prev = [], 0
    for cut in [*cuts, len(text)]:
        parts += split.feed(text[prev:cut])
        prev = cut
    return parts + split.finish()


def joined(parts: list[tuple[str, str]]) -> tuple[str, str]:
    return "".join(t for k, t in parts if k == REASONING), "".join(t for k, t in parts if k == ANSWER)


@pytest.mark.parametrize("style, inside, text, reasoning, answer", CASES)
def test_whole_and_in_random_pieces(style, inside, text, reasoning, answer):
    assert ReasoningSplit(style, inside).whole(text) == (reasoning, answer)
    rng = random.Random(SEED)
    markup = ("<think>", "</think>", *HARMONY_MARKUP, "<|call|>")
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, min(12, len(text) - 1))))
        parts = fed(ReasoningSplit(style, inside), text, cuts)
        assert joined(parts) == (reasoning, answer), f"cuts {cuts} seed {SEED}"
        for kind, piece in parts:  # no piece of markup reaches the reasoning
            assert piece and not (kind == REASONING and any(m in piece for m in markup)), (parts, cuts)


def test_unknown_style_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning markup"):
        ReasoningSplit("tags")


class _Vocab:
    """A tokenizer's token_to_id over a few named tokens."""

    def __init__(self, ids: dict[str, int]) -> None:
        self.ids = ids

    def token_to_id(self, token: str) -> Any:
        return self.ids.get(token)


def test_the_prompt_decides_where_a_think_answer_starts():
    tok = _Vocab({"<think>": 7, "</think>": 8})
    assert style_for(tok) == "think" and style_for(_Vocab({"<think>": 7})) is None
    assert starts_in_reasoning(tok, [1, 2, 7, 3])  # the template opened the reasoning
    assert not starts_in_reasoning(tok, [1, 7, 5, 8, 2])  # an earlier turn's reasoning, closed
    assert not starts_in_reasoning(tok, [1, 7, 8, 2, 3])  # thinking switched off: an empty block
    assert not starts_in_reasoning(tok, [1, 2, 3])
    assert split_for(tok, [1, 7]).whole("r</think>a") == ("r", "a")
    assert split_for(tok, [1, 2]).whole("r</think>a") == ("", "r</think>a")
    assert split_for(_Vocab({}), [1]) is None


def test_stream_deltas_reasoning_then_tool_call():
    """Reasoning as reasoning_content deltas, then the answer's content and a Hermes call
    in pieces, in order, whatever the cuts."""
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    text = "I need Oslo's weather.\n</think>\n\nChecking.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
    rng = random.Random(SEED + 1)
    for _ in range(100):
        split = ReasoningSplit("think", True)
        calls = StreamedCalls(ToolCallParser(HermesFormat(), {"get_weather"}, None, True))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, 10)))
        deltas, prev = [], 0
        for i, cut in enumerate([*cuts, len(text)]):
            deltas += _choice_deltas(text[prev:cut], i == len(cuts), split, calls)
            prev = cut
        kinds = [next(iter(d)) for d in deltas]
        assert kinds == sorted(kinds, key=["reasoning_content", "content", "tool_calls"].index), kinds
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "I need Oslo's weather."
        assert "".join(d.get("content", "") for d in deltas) == "Checking."
        args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d)
        names = [d["tool_calls"][0]["function"].get("name") for d in deltas if "tool_calls" in d]
        assert json.loads(args) == call["arguments"] and names[0] == "get_weather" and calls.calls == 1


def test_stream_deltas_without_a_split_are_the_text():
    assert _choice_deltas("plain", False, None, None) == [{"content": "plain"}]
    assert _choice_deltas("", True, None, None) == []


def test_reasoning_content_is_left_out_when_there_is_none():
    assert "reasoning_content" not in ChatResponseMessage(content="hi").model_dump(mode="json")
    out = ChatResponseMessage(content="hi", reasoning_content="why").model_dump(mode="json")
    assert out["reasoning_content"] == "why" and out["content"] == "hi"


# --------------------------------------------------------------------------------------
# a harmony vocabulary
# --------------------------------------------------------------------------------------

HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>",
                    "<|endoftext|>"]  # fmt: skip


def harmony_tokenizer() -> Tokenizer:
    """A word-level vocabulary with GPT-OSS's control tokens (added as special tokens)."""
    from tokenizers import AddedToken, Tokenizer as HFTok, decoders, models, pre_tokenizers

    words = ["[UNK]", "analysis", "final", "assistant", "Hello", "there", "We", "greet"]
    tok = HFTok(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_SPECIALS])
    return Tokenizer(tok, [tok.token_to_id("<|return|>")])


def test_harmony_markup_stays_in_decoded_text():
    tok = harmony_tokenizer()
    assert set(tok.markup.values()) == set(HARMONY_MARKUP) and style_for(tok) == "harmony"
    ids = [tok.token_to_id(t) for t in ("<|channel|>", "analysis", "<|message|>", "We", "greet", "<|end|>",
                                        "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Hello",
                                        "there", "<|return|>")]  # fmt: skip
    text = tok.decode(ids)
    assert "<|end|>" not in text and "<|return|>" not in text  # other control tokens are still skipped
    assert text.count("<|channel|>") == 2 and text.count("<|message|>") == 2 and text.count("<|start|>") == 1
    assert split_for(tok, []).whole(text) == ("We greet", "Hello there")
    assert tok.decode(ids, skip_special_tokens=False).count("<|end|>") == 1


def test_harmony_gguf_vocabulary_ends_turns_on_return_and_call_only():
    """A GGUF harmony vocabulary (control tokens) stops on <|return|> and <|call|>, not on
    <|end|>, which closes the reasoning message before the answer."""
    from freetoken.loading import tokenizer as tk

    tokens = ["a", "b"] + HARMONY_SPECIALS
    types = [1, 1] + [3] * len(HARMONY_SPECIALS)
    tok = tk.load_gguf_tokenizer(_GGUFStub(tokens, types, eos="<|return|>"), len(tokens))
    ends = {tokens[i] for i in tok.eos_token_ids}
    assert ends == {"<|return|>", "<|call|>", "<|endoftext|>"}, ends
    plain = tk.load_gguf_tokenizer(_GGUFStub(["a", "<|end|>", "<|endoftext|>"], [1, 3, 3], eos="<|endoftext|>"), 3)
    assert {["a", "<|end|>", "<|endoftext|>"][i] for i in plain.eos_token_ids} == {"<|end|>", "<|endoftext|>"}
    assert set(HARMONY_ENDS) <= ends


def test_harmony_hf_tokenizer_ends_turns_on_return_and_call(tmp_path):
    """An HF directory with a harmony vocabulary whose configs name only <|return|> as the end
    token: <|call|> ends a turn too, <|end|> does not, and the markup stays in decoded text."""
    from freetoken.loading.tokenizer import load_hf_tokenizer

    harmony_tokenizer()._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    tok = load_hf_tokenizer(str(tmp_path))
    ends = {tok._tok.id_to_token(i) for i in tok.eos_token_ids}
    assert ends == {"<|return|>", "<|call|>"}, ends
    assert style_for(tok) == "harmony"


class _GGUFStub:
    """What load_gguf_tokenizer reads of a GGUF file: its tokenizer fields."""

    def __init__(self, tokens: list[str], types: list[int], eos: str) -> None:
        self.path = "stub.gguf"
        self.metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.eos_token_id": tokens.index(eos),
                         "tokenizer.ggml.pre": "gpt2"}
        self.fields = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                       "tokenizer.ggml.merges": []}

    def field(self, name: str) -> Any:
        return self.fields.get(name)


def test_anthropic_block_events_thinking_text_and_call():
    """The streamed blocks of an answer with reasoning, text and a call: a thinking block
    (deltas, an empty signature, stopped), then the text block, then the tool_use block,
    numbered 0, 1, 2, each started and stopped once, whatever the cuts."""
    from freetoken.server.anthropic_messages import _answer_events
    from freetoken.server.anthropic_tools import BlockEvents

    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    text = "Oslo's weather.\n</think>\n\nChecking.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
    rng = random.Random(SEED + 2)
    for _ in range(50):
        blocks = BlockEvents(ToolCallParser(HermesFormat(), {"get_weather"}, None, True), thinking=True)
        split = ReasoningSplit("think", True)
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, 10)))
        raw, prev = blocks.start(), 0
        for i, cut in enumerate([*cuts, len(text)]):
            raw += _answer_events(blocks, split, text[prev:cut], i == len(cuts))
            prev = cut
        raw += blocks.finish()
        events = [json.loads(e.split("data: ", 1)[1]) for e in raw]
        started = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
        assert started == [(0, "thinking"), (1, "text"), (2, "tool_use")], (started, cuts)
        assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
        deltas = [(e["index"], e["delta"]) for e in events if e["type"] == "content_block_delta"]
        assert "".join(d.get("thinking", "") for i, d in deltas if i == 0) == "Oslo's weather."
        assert [d for i, d in deltas if i == 0][-1] == {"type": "signature_delta", "signature": ""}
        assert "".join(d.get("text", "") for i, d in deltas if i == 1) == "Checking."
        assert json.loads("".join(d["partial_json"] for i, d in deltas if i == 2)) == call["arguments"]


GPT_OSS_TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "models_moe_families", "data", "chat_templates",
                                "gpt_oss.jinja")  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def gpt_oss_tools(tool_choice: Any = "auto") -> Any:
    from freetoken.server.chat_tools import ChatTools
    from freetoken.server.protocol import ChatCompletionRequest

    tok = harmony_tokenizer()
    with open(GPT_OSS_TEMPLATE) as f:
        tok.chat_template = f.read()
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Oslo?"}],
                                                "tools": [WEATHER], "tool_choice": tool_choice})  # fmt: skip
    return ChatTools(req, tok)


def test_gpt_oss_reasoning_then_a_call_streamed_and_whole():
    """GPT-OSS's answer as its model writes it (the recipient after the channel, a
    <|constrain|> content type, the turn ended by <|call|>, which is no text): the analysis as
    reasoning_content, the call as tool_calls, no content, in any pieces."""
    tools = gpt_oss_tools()
    assert tools.fmt.name == "harmony"
    text = ("<|channel|>analysis<|message|>The user wants Oslo's weather.<|start|>assistant<|channel|>commentary "
            "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}")  # fmt: skip
    reasoning, answer = ReasoningSplit("harmony").whole(text)
    message, finish = tools.message(answer, "stop")
    assert reasoning == "The user wants Oslo's weather." and finish == "tool_calls" and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    rng = random.Random(SEED + 3)
    for _ in range(50):
        split, calls = ReasoningSplit("harmony"), StreamedCalls(tools.parser(incremental=True))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, 10)))
        deltas, prev = [], 0
        for i, cut in enumerate([*cuts, len(text)]):
            deltas += _choice_deltas(text[prev:cut], i == len(cuts), split, calls)
            prev = cut
        assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
        assert not any(d.get("content") for d in deltas), deltas
        args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d)
        assert json.loads(args) == {"city": "Oslo"} and calls.calls == 1, (deltas, cuts)


def test_gpt_oss_calls_cannot_be_forced():
    from freetoken.server.errors import APIError

    with pytest.raises(APIError) as err:
        gpt_oss_tools("required")
    assert err.value.status == 400 and "harmony" in err.value.message and err.value.param == "tool_choice"


def test_reasoning_effort_reaches_gpt_oss_template():
    """OpenAI's ``reasoning_effort`` is the variable GPT-OSS's template writes into its system
    message; chat_template_kwargs name it too, and win where both do."""
    from freetoken.server.chat import render_prompt
    from freetoken.server.protocol import ChatCompletionRequest

    tok = harmony_tokenizer()
    with open(GPT_OSS_TEMPLATE) as f:
        tok.chat_template = f.read()

    rendered: list[str] = []
    tok.encode = lambda text, add_special_tokens=False: rendered.append(text) or []  # the prompt text, kept

    def system_line(**fields: Any) -> str:
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                                    **fields})  # fmt: skip
        render_prompt(req, tok)
        return next(line for line in rendered.pop().splitlines() if line.startswith("Reasoning:"))

    assert system_line() == "Reasoning: medium"  # the template's default
    assert system_line(reasoning_effort="low") == "Reasoning: low"
    assert system_line(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}) == "Reasoning: high"
