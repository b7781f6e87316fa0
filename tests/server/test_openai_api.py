"""Every endpoint and parameter of the OpenAI-compatible API, streaming and not,
through the official ``openai`` client and raw ``httpx`` (SSE framing), against a
real ``freetoken serve`` process serving the built-in demo model."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from server_helpers import metric, parse_sse, scrape

pytestmark = pytest.mark.timeout(300)

NAMES = ["demo-a", "demo-b"]
MODEL = NAMES[0]


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(["--served-model-name", NAMES[0], "--served-model-name", NAMES[1]])


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: Any) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def chat_prompt_len(tok: Any, messages: list[dict[str, str]]) -> int:
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return len(ids)


def greedy_chat(client: openai.OpenAI, messages: list[dict[str, str]], n_tokens: int, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=n_tokens, temperature=0, extra_body={"ignore_eos": True}, **kw
    )


# ------------------------------------------------------------------ health, models, startup


def test_health_reports_backend_io_path_and_model(server: Any, http: httpx.Client) -> None:
    body = http.get("/health").json()
    assert body["status"] == "ok"
    assert body["backend"] == "cpu"
    assert isinstance(body["io_path"], str) and body["io_path"]
    assert isinstance(body["model"], str) and body["model"]
    assert body["served_model_names"] == NAMES
    assert body["max_model_len"] > 0
    # The server listened while the model loaded: /health said 503 first (torch import alone takes seconds).
    assert 503 in server.health_seen and server.health_seen[-1] == 200
    # ... and /v1 answered 503 with an error object while loading (or 200 once it had loaded)
    assert any(code == 503 for code, _ in server.loading_answers), server.loading_answers
    for code, body in server.loading_answers:
        assert code == 200 or (code == 503 and body["error"]["code"] == "model_loading"), (code, body)
    log = server.log()
    assert "listening on http://127.0.0.1:" in log
    assert "loaded model" in log and "backend cpu" in log


def test_models_lists_served_names(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == NAMES
    assert all(m.object == "model" for m in models.data)
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]
    # both served names work for generation
    out = client.completions.create(model=NAMES[1], prompt="Hello", max_tokens=2, temperature=0)
    assert out.model == NAMES[1]


# ------------------------------------------------------------------ chat


def test_chat_non_streaming_shape_and_usage(client: openai.OpenAI, ref_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    out = greedy_chat(client, messages, 7, logprobs=True)
    assert out.object == "chat.completion"
    assert out.id.startswith("chatcmpl-")
    assert out.model == MODEL
    assert out.system_fingerprint and out.system_fingerprint.startswith("fp_")
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == chat_prompt_len(ref_tokenizer, messages)
    assert out.usage.completion_tokens == 7 == len(choice.logprobs.content)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_chat_multi_turn_goes_through_the_chat_template(client: openai.OpenAI, ref_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    chat = greedy_chat(client, messages, 12)
    assert chat.usage.prompt_tokens == chat_prompt_len(ref_tokenizer, messages)
    # The same conversation rendered by the reference (transformers) template and sent as a raw
    # prompt gives the same greedy text: the server really used the model's chat template.
    rendered = ref_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    raw = client.completions.create(model=MODEL, prompt=rendered, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert raw.usage.prompt_tokens == chat.usage.prompt_tokens
    assert raw.choices[0].text == chat.choices[0].message.content
    # Dropping the earlier turns changes the prompt.
    shorter = greedy_chat(client, messages[-1:], 1)
    assert shorter.usage.prompt_tokens < chat.usage.prompt_tokens


def test_chat_text_content_parts_and_developer_role(client: openai.OpenAI) -> None:
    plain = greedy_chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}], 5)
    parts = greedy_chat(client, [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ], 5)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count from one to five."}]
    full = greedy_chat(client, messages, 16)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_sse_framing_raw(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = parse_sse(raw)
    payloads = events[:-1]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in p for p in payloads)  # no include_usage: no usage key at all
    assert payloads[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    for p in payloads:
        assert set(p) == {"id", "object", "created", "model", "system_fingerprint", "choices"}


def test_max_tokens_and_max_completion_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Write a long story."}]
    a = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert a.usage.completion_tokens == 3 and a.choices[0].finish_reason == "length"
    b = greedy_chat(client, messages, 5)
    assert b.usage.completion_tokens == 5
    assert b.choices[0].message.content.startswith(a.choices[0].message.content)


def test_stop_strings_cut_the_text(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    full = greedy_chat(client, messages, 40).choices[0].message.content
    assert len(full) >= 12, full
    stop = full[6:9]
    cut = full[: full.find(stop)]
    for value in (stop, [stop, "\x00never"]):
        out = greedy_chat(client, messages, 40, stop=value)
        assert out.choices[0].message.content == cut
        assert out.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible_and_n_choices(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Pick random words."}]
    kw: dict[str, Any] = dict(model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=1234, n=3,
                              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # the choices are independent samples
    assert a.usage.completion_tokens == 36
    c = client.chat.completions.create(**{**kw, "seed": 99})
    assert [x.message.content for x in c.choices] != [x.message.content for x in a.choices]


def test_chat_streaming_n_choices(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5, temperature=0.8, seed=7, n=2,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    finished = set()
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and usage is not None and usage.completion_tokens == 10
    ref = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
                                         temperature=0.8, seed=7, n=2, extra_body={"ignore_eos": True})
    assert [texts[0], texts[1]] == [c.message.content for c in ref.choices]


def test_sampling_filters_reach_the_engine(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a mountain."}]
    greedy = greedy_chat(client, messages, 10).choices[0].message.content
    # With sampling at temperature 1, each of these filters leaves only the most likely token.
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=5,
                                             extra_body={"ignore_eos": True, **extra})
        assert out.choices[0].message.content == greedy, extra
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=5,
                                         top_p=1e-6, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == greedy
    # Penalties change a greedy continuation (they take effect, and they are accepted).
    plain = greedy_chat(client, messages, 40, logprobs=True)
    pen = greedy_chat(client, messages, 40, frequency_penalty=2.0, presence_penalty=2.0, logprobs=True)
    assert [t.token for t in pen.choices[0].logprobs.content] != [t.token for t in plain.choices[0].logprobs.content]


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, ref_tokenizer: Any) -> None:
    """+100 on a token makes a greedy answer that token throughout; -100 on it beside +100 on
    another makes it the other (chat and text completions); the texts are the reference
    tokenizer's decoding of the repeated token."""
    first, second = (ref_tokenizer.encode(w, add_special_tokens=False)[0] for w in (" mountain", " river"))
    assert first != second
    messages = [{"role": "user", "content": "Describe a mountain."}]
    out = greedy_chat(client, messages, 6, logit_bias={str(first): 100})
    assert out.choices[0].message.content == ref_tokenizer.decode([first] * 6)
    out = greedy_chat(client, messages, 6, logit_bias={str(first): -100, str(second): 100})
    assert out.choices[0].message.content == ref_tokenizer.decode([second] * 6)
    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=3,
                                     logit_bias={str(second): 100}, extra_body={"ignore_eos": True})
    assert text.choices[0].text == ref_tokenizer.decode([second] * 5)


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI) -> None:
    out = greedy_chat(client, [{"role": "user", "content": "Hi"}], 6, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    text = ""
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert bytes(entry.bytes) == entry.token.encode()
        text += entry.token
    assert text == out.choices[0].message.content
    # streaming carries the same logprobs
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_response_format_json_object_gives_valid_json(client: openai.OpenAI) -> None:
    for seed in (1, 2):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object describing a cat."}],
            max_tokens=60, temperature=1.0, seed=seed, response_format={"type": "json_object"},
        )
        text = out.choices[0].message.content
        assert out.choices[0].finish_reason in ("stop", "length")
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.lstrip().startswith("{"), text
    greedy = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=200, temperature=0,
        response_format={"type": "json_object"},
    )
    assert greedy.choices[0].finish_reason == "stop", greedy.choices[0].message.content
    assert isinstance(json.loads(greedy.choices[0].message.content), dict)


def test_response_format_json_object_streaming_and_n(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Two JSON objects please."}], max_tokens=40,
        temperature=0.9, seed=11, n=2, stream=True, response_format={"type": "json_object"},
    )
    texts = {0: "", 1: ""}
    reasons = {}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert reasons == {0: "stop", 1: "stop"}
    for text in texts.values():
        assert isinstance(json.loads(text), dict), text


def test_response_format_json_object_makes_one_engine_request_per_choice(
        server: Any, client: openai.OpenAI, ref_tokenizer: Any) -> None:
    """The constraint runs inside the engine's sampler: no redraw requests, no re-prefill."""
    messages = [{"role": "user", "content": "A JSON object with three keys, please."}]
    prompt_len = chat_prompt_len(ref_tokenizer, messages)
    before = scrape(server.base_url)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=1.0, seed=5,
                                         n=3, response_format={"type": "json_object"})
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                            stream=True, response_format={"type": "json_object"})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    after = scrape(server.base_url)
    assert all(isinstance(json.loads(c.message.content), dict) for c in out.choices)
    assert isinstance(json.loads(streamed), dict)
    added = metric(after, "freetoken_engine_requests_total") - metric(before, "freetoken_engine_requests_total")
    prompt = (metric(after, "freetoken_engine_prompt_tokens_total")
              - metric(before, "freetoken_engine_prompt_tokens_total"))
    assert (added, prompt) == (4, 4 * prompt_len)


def test_any_integer_seed_is_accepted_and_reproducible(client: openai.OpenAI) -> None:
    for seed in (-7, 2**70):
        kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "seed"}], max_tokens=6,
                                  temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        a = client.chat.completions.create(**kw)
        b = client.chat.completions.create(**kw)
        assert a.choices[0].message.content == b.choices[0].message.content


# ------------------------------------------------------------------ completions


def test_completion_string_prompt_usage_and_echo(client: openai.OpenAI, ref_tokenizer: Any) -> None:
    prompt = "The quick brown fox jumps over"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == len(ref_tokenizer.encode(prompt, add_special_tokens=True))
    assert out.usage.completion_tokens == 5
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                     extra_body={"ignore_eos": True})
    assert echo.choices[0].text == prompt + out.choices[0].text


def test_completion_token_id_prompts_equal_text_prompts(client: openai.OpenAI, ref_tokenizer: Any) -> None:
    texts = ["Once upon a time", "In a galaxy far away"]
    ids = [ref_tokenizer.encode(t, add_special_tokens=True) for t in texts]
    by_text = client.completions.create(model=MODEL, prompt=texts, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in by_text.choices] == [0, 1]
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert single.choices[0].text == by_text.choices[1].text
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)
    assert by_ids.usage.completion_tokens == 12
    # several prompts times n: index = prompt * n + choice
    multi = client.completions.create(model=MODEL, prompt=texts, max_tokens=3, temperature=0, n=2,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    assert multi.choices[2].text == multi.choices[3].text == by_text.choices[1].text[: len(multi.choices[2].text)]


def test_completion_logprobs_legacy_shape(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, logprobs=2,
                                    echo=True, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 4
    assert all(v is None for v in lp.token_logprobs[:n_prompt])  # prompt tokens are not scored (documented)
    for value, top in zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert value <= 0 and len(top) <= 2 and max(top.values()) == pytest.approx(value, abs=1e-5)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_completion_streaming_raw_and_client(client: openai.OpenAI, http: httpx.Client) -> None:
    full = client.completions.create(model=MODEL, prompt="Rivers flow", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    body = {"model": MODEL, "prompt": "Rivers flow", "max_tokens": 8, "temperature": 0, "stream": True,
            "echo": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = parse_sse(resp.read().decode())
    payloads = events[:-1]
    assert all(p["object"] == "text_completion" for p in payloads)
    text = "".join(c["text"] for p in payloads for c in p["choices"])
    assert text == "Rivers flow" + full.choices[0].text
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 8
    assert [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]] == ["length"]
    chunks = list(client.completions.create(model=MODEL, prompt="Rivers flow", max_tokens=8, temperature=0,
                                            stream=True, logprobs=2, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert len(tokens) == 8 and "".join(tokens) == full.choices[0].text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(8)]


# ------------------------------------------------------------------ metrics


def test_metrics_parsed_by_prometheus_client(server: Any, client: openai.OpenAI) -> None:
    before = scrape(server.base_url)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "metrics"}],
                                         max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    after = scrape(server.base_url)
    key = dict(endpoint="/v1/chat/completions", status="200")
    assert metric(after, "freetoken_http_requests_total", **key) == metric(before, "freetoken_http_requests_total", **key) + 1
    assert metric(after, "freetoken_prompt_tokens_total") - metric(before, "freetoken_prompt_tokens_total") == out.usage.prompt_tokens
    assert metric(after, "freetoken_generation_tokens_total") - metric(before, "freetoken_generation_tokens_total") == 4
    assert metric(after, "freetoken_time_to_first_token_seconds_count") == metric(before, "freetoken_time_to_first_token_seconds_count") + 1
    assert metric(after, "freetoken_inter_token_latency_seconds_count") == metric(before, "freetoken_inter_token_latency_seconds_count") + 3
    for gauge in ("freetoken_requests_running", "freetoken_requests_waiting", "freetoken_kv_cache_usage_ratio",
                  "freetoken_kv_cache_total_tokens", "freetoken_kv_cache_used_tokens"):
        assert gauge in after, gauge
    assert metric(after, "freetoken_kv_cache_total_tokens") > 0
    assert 0.0 <= metric(after, "freetoken_kv_cache_usage_ratio") <= 1.0
