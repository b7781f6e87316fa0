"""Anthropic's thinking budget (freetoken.server.thinking_budget): the constraint follows an
answer token by token, restricts nothing until the budget is spent inside the reasoning, then
allows only the closing markup; think tags and harmony, word-level vocabularies, the model's
tokens drawn at random. Then on the demo model in the engine: the budgeted answer is the
unconstrained one's first ``budget`` reasoning tokens, ``</think>``, and the greedy
continuation of that text (computed without the constraint)."""

from __future__ import annotations

import random
from typing import Any, Optional

import pytest
import torch

from freetoken.loading.tokenizer import Tokenizer
from freetoken.server.thinking_budget import ThinkingBudget, thinking_budget

SEED = random.SystemRandom().randrange(1 << 30)
WORDS = ["[UNK]", "analysis", "final", "commentary", "assistant", "to=functions.add", "json", "one", "two", "three",
         "four", "five", "six"]  # fmt: skip
PLAIN = WORDS[7:]
HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>"]


def word_tokenizer(specials: list[str]) -> Tokenizer:
    from tokenizers import AddedToken, Tokenizer as HFTok, decoders, models, pre_tokenizers

    tok = HFTok(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return Tokenizer(tok, [])


@pytest.fixture(scope="module")
def think_tok() -> Tokenizer:
    return word_tokenizer(["<think>", "</think>", "<|im_end|>"])


@pytest.fixture(scope="module")
def harmony_tok() -> Tokenizer:
    return word_tokenizer(HARMONY)


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text)


def run(budget: ThinkingBudget, model: list[int], vocab: int) -> tuple[list[int], list[bool]]:
    """The answer when the model would write ``model`` (one token per step; after forced
    tokens it goes on where it was), and whether each step was restricted. A restricted step checks
    the constraint's three views agree: its mask, ``allows`` and the fallback."""
    out: list[int] = []
    restricted: list[bool] = []
    it = iter(model)
    while True:
        r = budget.restricts()
        restricted.append(r)
        if r:
            mask = budget.allowed_mask(vocab, 100)
            assert mask is not None and mask.dtype == torch.bool and mask.shape == (vocab,)
            allowed = [t for t in range(vocab) if budget.allows(t, 100)]
            assert allowed == mask.nonzero().flatten().tolist()
            if int(mask.sum()) == 1:  # a forced token: the fallback is it
                token = allowed[0]
                assert budget.fallback_token(100) == token
            else:
                token = next(it, None)
                if token is None:
                    break
                if not budget.allows(token, 100):
                    token = next(t for t in allowed)
        else:
            assert budget.allowed_mask(vocab, 100) is None and budget.fallback_token(100) is None
            token = next(it, None)
            if token is None:
                break
            assert budget.allows(token, 100)
        budget.advance(token)
        out.append(token)
        assert not budget.is_complete()
    restricted.pop()
    return out, restricted


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(PLAIN) for _ in range(n))


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_think_reasoning_is_cut_at_the_budget(think_tok, budget):
    rng = random.Random(SEED + budget)
    tok, vocab = think_tok, think_tok.vocab_size
    close = tok.token_to_id("</think>")
    prompt = ids(tok, "one two <|im_end|> assistant <think>")  # the template opened the reasoning
    model = ids(tok, random_words(rng, budget + 6))
    out, restricted = run(ThinkingBudget(tok, "think", prompt, budget), model, vocab)
    assert out == model[:budget] + [close] + model[budget:], f"seed {SEED}"
    assert restricted == [False] * budget + [True] + [False] * (len(out) - budget - 1), f"seed {SEED}"


def test_think_reasoning_within_the_budget_is_left_alone(think_tok):
    rng = random.Random(SEED)
    tok = think_tok
    prompt = ids(tok, "one <think> two </think> three")  # a closed reasoning in the history: not inside
    model = ids(tok, "<think> " + random_words(rng, 4) + " </think> " + random_words(rng, 20))
    b = ThinkingBudget(tok, "think", prompt, 5)
    out, restricted = run(b, model, tok.vocab_size)
    assert out == model and not any(restricted) and b.spent == 4


def test_think_opened_by_the_model_is_counted_from_its_tag(think_tok):
    rng = random.Random(SEED + 1)
    tok = think_tok
    close = tok.token_to_id("</think>")
    model = ids(tok, "<think> " + random_words(rng, 9) + " one two <think> three four")
    out, _ = run(ThinkingBudget(tok, "think", ids(tok, "one two"), 4), model, tok.vocab_size)
    # the tag, four words, the forced close; a second reasoning after a spent budget is closed at once
    assert out == model[:5] + [close] + model[5:-2] + [close] + model[-2:], f"seed {SEED}"


def test_text_before_any_reasoning_is_not_counted(think_tok):
    tok = think_tok
    model = ids(tok, "one two three four five six one two")
    b = ThinkingBudget(tok, "think", ids(tok, "one"), 2)
    out, restricted = run(b, model, tok.vocab_size)
    assert out == model and not any(restricted) and b.spent == 0


HEADER_ANALYSIS = "<|channel|> analysis <|message|>"
CLOSING = "<|end|> <|start|> assistant <|channel|> final <|message|>"


def test_harmony_analysis_is_cut_and_a_final_message_opened(harmony_tok):
    rng = random.Random(SEED + 2)
    tok = harmony_tok
    prompt = ids(tok, "<|start|> assistant")
    model = ids(tok, HEADER_ANALYSIS + " " + random_words(rng, 11))
    out, restricted = run(ThinkingBudget(tok, "harmony", prompt, 5), model, tok.vocab_size)
    # the header and five words, the closing markup, then the model's next tokens (the final message)
    assert out == model[:8] + ids(tok, CLOSING) + model[8:], f"seed {SEED}"
    assert restricted == [False] * 8 + [True] * 6 + [False] * 6, f"seed {SEED}"


def test_harmony_budget_spans_messages_and_a_spent_one_is_not_reopened(harmony_tok):
    rng = random.Random(SEED + 3)
    tok = harmony_tok
    analysis_id = tok.token_to_id("analysis")
    first = ids(tok, HEADER_ANALYSIS + " " + random_words(rng, 2) + " <|end|>")
    second = ids(tok, "<|start|> assistant " + HEADER_ANALYSIS + " " + random_words(rng, 4))
    b = ThinkingBudget(tok, "harmony", ids(tok, "<|start|> assistant"), 3)
    out, _ = run(b, first + second, tok.vocab_size)
    cut = len(first) + 5 + 1  # the second message's header (5 tokens) and one word of it
    assert out[:cut] == (first + second)[:cut] and out[cut:cut + 6] == ids(tok, CLOSING), f"seed {SEED}"
    # spent: right after a <|channel|>, 'analysis' is the one token not allowed
    for t in ids(tok, "<|start|> assistant <|channel|>"):
        b.advance(t)
    assert b.restricts() and not b.allows(analysis_id, 10) and b.allows(tok.token_to_id("commentary"), 10)
    mask = b.allowed_mask(tok.vocab_size, 10)
    assert mask is not None and not bool(mask[analysis_id]) and int(mask.sum()) == tok.vocab_size - 1
    b.advance(tok.token_to_id("commentary"))
    assert not b.restricts()


def test_harmony_prefill_inside_the_analysis_counts_from_the_answer(harmony_tok):
    """A prompt that ends inside an analysis message (a prefilled answer): the answer's tokens
    are reasoning from the first one, the prefill's are not counted."""
    rng = random.Random(SEED + 5)
    tok = harmony_tok
    prompt = ids(tok, "<|start|> user <|message|> one <|end|> <|start|> assistant " + HEADER_ANALYSIS + " two three")
    model = ids(tok, random_words(rng, 6))
    out, _ = run(ThinkingBudget(tok, "harmony", prompt, 2), model, tok.vocab_size)
    assert out == model[:2] + ids(tok, CLOSING) + model[2:], f"seed {SEED}"


def test_harmony_tool_calls_and_commentary_are_not_reasoning(harmony_tok):
    rng = random.Random(SEED + 4)
    tok = harmony_tok
    text = (HEADER_ANALYSIS + " " + random_words(rng, 2) + " <|end|> <|start|> assistant to=functions.add <|channel|> "
            "commentary json <|message|> " + random_words(rng, 9) + " <|call|> <|start|> assistant <|channel|> "
            "analysis to=functions.add <|message|> " + random_words(rng, 9) + " <|call|> <|channel|> final "
            "<|message|> " + random_words(rng, 9))  # fmt: skip
    b = ThinkingBudget(tok, "harmony", ids(tok, "<|start|> assistant"), 3)
    out, restricted = run(b, ids(tok, text), tok.vocab_size)
    assert out == ids(tok, text) and not any(restricted) and b.spent == 2, f"seed {SEED}"


def test_no_markup_no_budget_and_bad_budgets(think_tok):
    plain = word_tokenizer(["<|im_end|>"])
    assert thinking_budget(plain, [1, 2], 10) is None
    assert isinstance(thinking_budget(think_tok, [1, 2], 10), ThinkingBudget)
    with pytest.raises(ValueError, match="at least 1 token"):
        ThinkingBudget(think_tok, "think", [], 0)


# --------------------------------------------------------------------------------------
# the engine, the demo model with think tags
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def think_engine(tmp_path_factory: Any) -> Any:
    from test_reasoning_api import think_model_dir

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=think_model_dir(str(tmp_path_factory.mktemp("think"))), backend="cpu"))


def generate(eng: Any, prompt: list[int], params: Any, constraint: Optional[ThinkingBudget] = None) -> list[int]:
    req = eng.add_request(prompt, params, constraint=constraint)
    while eng.has_work():
        eng.step()
    assert req.finish_reason == "length", req.finish_reason
    return list(req.output_ids)


def test_engine_greedy_answer_is_cut_at_the_budget(think_engine):
    from freetoken.engine.sampling_params import SamplingParams

    eng = think_engine
    tok = eng.tokenizer
    close = tok.token_to_id("</think>")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}]))
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    free = generate(eng, prompt, greedy)
    natural = free.index(close) if close in free else len(free)
    assert natural >= 2, f"the demo model's reasoning {tok.decode(free)!r} is too short to cut"
    budget = natural // 2
    cut = generate(eng, prompt, greedy, thinking_budget(tok, prompt, budget))
    rest = generate(eng, prompt + free[:budget] + [close],
                    SamplingParams(max_tokens=40 - budget - 1, temperature=0.0, ignore_eos=True))
    assert cut == free[:budget] + [close] + rest


def test_engine_sampled_answer_keeps_its_draws_until_the_budget(think_engine):
    from freetoken.engine.sampling_params import SamplingParams

    eng = think_engine
    tok = eng.tokenizer
    close = tok.token_to_id("</think>")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name a colour."}]))
    for seed in (SEED, SEED + 1, SEED + 2):
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        free = generate(eng, prompt, params)
        natural = free.index(close) if close in free else len(free)
        if natural < 2:
            continue
        budget = natural // 2
        cut = generate(eng, prompt, params, thinking_budget(tok, prompt, budget))
        # the same draws while the budget lasts (the unconstrained path), then the close
        assert cut[:budget + 1] == free[:budget] + [close], f"seed {seed}"
        return
    pytest.fail(f"no sampled reasoning of at least 2 tokens in three seeds from {SEED}")
