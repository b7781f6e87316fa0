"""Generation behaviour on the built-in demo model (real BPE tokenizer): greedy
determinism, seeds, stop strings/ids, lengths, rejections, the async stream, and
the demo model's own properties."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from freetoken import SamplingParams
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine, RequestRejected


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from freetoken.models.demo import ensure_demo_model

    return ensure_demo_model(str(tmp_path_factory.mktemp("cache") / "demo"))


@pytest.fixture(scope="module")
def llm(demo):
    from freetoken import LLM

    return LLM(model=demo.hf_dir, backend="cpu", kv_cache_tokens=8192, max_model_len=1024)


PROMPTS = ["The function returns", "A list of", "Return the number of items in the"]


def test_greedy_is_deterministic_and_batch_independent(llm):
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a = llm.generate(PROMPTS, p)
    b = llm.generate(PROMPTS, p)
    alone = [llm.generate(x, p)[0] for x in PROMPTS]
    assert [o.token_ids for o in a] == [o.token_ids for o in b] == [o.token_ids for o in alone]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in a)
    assert a[0].text == llm.tokenizer.decode(a[0].token_ids)


def test_seeded_sampling_reproducible(llm):
    def run(seed, batch):
        p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)
        return llm.generate(batch, p)[0].token_ids
    x = run(11, [PROMPTS[0]])
    assert run(11, [PROMPTS[0]]) == x
    assert run(11, [PROMPTS[0], PROMPTS[1], PROMPTS[2]]) == x  # other requests do not perturb it
    assert run(12, [PROMPTS[0]]) != x


def test_stop_strings_cut_exactly(llm):
    base = llm.generate(PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    text = base.text
    assert len(text) > 12
    # a stop string starting inside the text and spanning a token boundary
    start = len(text) // 2
    stop = text[start : start + 4]
    cut = text[: text.index(stop)]
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop, "\x00never"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == cut
    assert out.token_ids == base.token_ids[: len(out.token_ids)]


def test_stop_token_ids_end_the_request(llm):
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop_id = base.token_ids[3]
    k = base.token_ids.index(stop_id)
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == base.token_ids[: k + 1]  # the stop token is reported, not rendered
    assert out.text == llm.tokenizer.decode(base.token_ids[:k])


def test_rejections(llm):
    eng = llm.engine
    with pytest.raises(RequestRejected, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(RequestRejected, match="context"):
        eng.add_request([1] * 1024, SamplingParams())
    with pytest.raises(RequestRejected, match="max_tokens=1000"):
        eng.add_request([1] * 100, SamplingParams(max_tokens=1000))
    with pytest.raises(RequestRejected, match="out of range"):
        eng.add_request([10**7], SamplingParams())
    assert not eng.has_work()


def test_max_tokens_none_runs_to_context(demo):
    eng = LLMEngine(EngineConfig(model=demo.hf_dir, backend="cpu", max_model_len=40, kv_cache_tokens=256))
    r = eng.add_request([5] * 30, SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert r.finish_reason == "length" and r.num_tokens == 40


def test_async_stream_deltas_abort_and_queue(demo):
    from freetoken.engine.async_engine import AsyncEngine, QueueFull

    async def main():
        eng = AsyncEngine(EngineConfig(model=demo.hf_dir, backend="cpu", max_running_requests=2, max_queued_requests=1,
                                       kv_cache_tokens=4096, max_model_len=512))
        await eng.start()
        try:
            ids = eng.tokenizer.encode(PROMPTS[0])
            p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=["\x00x"])
            deltas = [d async for d in eng.stream(ids, p)]
            assert deltas[-1].finished and deltas[-1].finish_reason == "length"
            assert not any(d.finished for d in deltas[:-1])
            toks = [t for d in deltas for t in d.token_ids]
            assert len(toks) == 16 and deltas[-1].completion_tokens == 16
            assert "".join(d.text for d in deltas) == eng.tokenizer.decode(toks)
            with pytest.raises(RequestRejected):
                async for _ in eng.stream([], p):
                    pass
            # closing early aborts and frees the KV pages
            agen = eng.stream(ids, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
            await agen.__anext__()
            assert eng.stats().kv_used_tokens > 0
            await agen.aclose()
            for _ in range(100):
                if eng.stats().kv_used_tokens == 0 and eng.stats().num_running == 0:
                    break
                await asyncio.sleep(0.02)
            assert eng.stats().kv_used_tokens == 0 and eng.stats().num_running == 0
            # queue limit: 2 running + 1 waiting, the next is refused. The three are submitted
            # (counted as waiting until the engine thread admits them) in one turn of the loop
            # and the fourth right after: the requests run to the end of the context (~500
            # steps), which a fast machine finishes in a fraction of a second, so no sleep.
            long = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
            gens = [eng.stream(ids, long) for _ in range(3)]
            tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
            await asyncio.sleep(0)
            st = eng.stats()
            assert st.num_running + st.num_waiting == 3, st
            with pytest.raises(QueueFull):
                await eng.stream(ids, long).__anext__()
            for t in tasks:  # cancellation (a client disconnect) aborts the requests
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in gens:  # the ones suspended after a delta: closing them aborts
                await g.aclose()
            for _ in range(100):
                if eng.stats().kv_used_tokens == 0 and eng.stats().num_running == 0:
                    break
                await asyncio.sleep(0.02)
            assert eng.stats().kv_used_tokens == 0 and eng.stats().num_running == 0
        finally:
            await eng.shutdown()

    asyncio.run(main())


def test_demo_model_is_deterministic(demo, tmp_path):
    from freetoken.models.demo import build

    build(str(tmp_path / "again"))
    for rel in ("hf/tokenizer.json", "hf/model.safetensors", "hf/config.json", "demo-qwen3moe-q8_0.gguf"):
        with open(os.path.join(demo.root, rel), "rb") as a, open(tmp_path / "again" / rel, "rb") as b:
            assert a.read() == b.read(), rel


def test_demo_gguf_tokenizer_and_template_match_hf(demo):
    from freetoken.models.loader import load_tokenizer

    hf = load_tokenizer(demo.hf_dir)
    gg = load_tokenizer(demo.gguf_path)
    texts = ["Hello, world! Return the value.\n\n  indented\tcode()", "naïve café — 日本語", "<|im_start|>user\nhi<|im_end|>"]
    for t in texts:
        assert gg.encode(t) == hf.encode(t)
        assert gg.decode(hf.encode(t)) == hf.decode(hf.encode(t))
    assert hf.encode("<|im_start|>") == [hf.token_to_id("<|im_start|>")]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert hf.apply_chat_template(msgs) == want == gg.apply_chat_template(msgs)
    with pytest.raises(ValueError, match="role"):
        hf.apply_chat_template([{"role": "wizard", "content": "x"}])
    assert hf.token_to_id("<|im_end|>") in hf.eos_token_ids


def test_demo_hf_and_gguf_agree(demo):
    """The GGUF copy is the same weights in Q8_0: greedy continuations start the same."""
    a = LLMEngine(EngineConfig(model=demo.hf_dir, backend="cpu", kv_cache_tokens=1024, max_model_len=512))
    b = LLMEngine(EngineConfig(model=demo.gguf_path, backend="cpu", kv_cache_tokens=1024, max_model_len=512))
    ids = a.tokenizer.encode(PROMPTS[2])
    la, lb = a.prompt_logits(ids), b.prompt_logits(ids)
    # Q8_0 weights + int8 activations: ~1% relative noise on random-weight logits
    assert float((la - lb).abs().max()) < 0.1 * float(la.abs().max())
    assert torch.equal(la.argmax(-1), lb.argmax(-1)) or float((la.argmax(-1) == lb.argmax(-1)).float().mean()) > 0.8


def test_async_step_failure_fails_requests_in_flight_then_recovers(demo):
    from freetoken.engine.async_engine import AsyncEngine, EngineDead, StepFailed

    async def main():
        eng = AsyncEngine(EngineConfig(model=demo.hf_dir, backend="cpu", kv_cache_tokens=2048, max_model_len=256))
        await eng.start()
        try:
            model = eng.engine.model
            real = model.forward
            calls = {"n": 0}

            def flaky(*a, **k):
                calls["n"] += 1
                if calls["n"] == 1:
                    raise RuntimeError("injected fault")
                return real(*a, **k)

            model.forward = flaky
            p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            with pytest.raises(StepFailed, match="injected fault"):
                async for _ in eng.stream([1, 2, 3], p):
                    pass
            assert eng.stats().kv_used_tokens == 0
            out = [d async for d in eng.stream([1, 2, 3], p)]  # the engine goes on
            assert out[-1].finished and out[-1].completion_tokens == 4
            model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("broken for good"))
            for _ in range(AsyncEngine.MAX_CONSECUTIVE_FAILURES):
                with pytest.raises((StepFailed, EngineDead)):
                    async for _ in eng.stream([1, 2, 3], p):
                        pass
            await asyncio.sleep(0.1)
            with pytest.raises(EngineDead):
                async for _ in eng.stream([1, 2, 3], p):
                    pass
        finally:
            await eng.shutdown()

    asyncio.run(main())


def test_kv_cache_short_of_the_running_requests_says_how_to_fit_them(demo, monkeypatch, caplog):
    """A KV budget that holds fewer full contexts than --max-running-requests allows: the
    engine still starts (requests wait for blocks) and its warning names the size that
    would run them all, and what that size costs."""
    from freetoken_cpu_moe.backend import CpuModelSession

    monkeypatch.setattr(CpuModelSession, "kv_cache_budget", lambda self: 0)
    with caplog.at_level("WARNING", logger="freetoken.engine.engine"):
        eng = LLMEngine(EngineConfig(model=demo.hf_dir, backend="cpu", max_model_len=200, max_running_requests=6))
    assert eng.kv.total_tokens == 208  # one context in whole blocks of 16
    warned = [r.getMessage() for r in caplog.records if "--kv-cache-tokens" in r.getMessage()]
    assert len(warned) == 1 and "room for 1 full contexts of 200 tokens" in warned[0], warned
    assert "--kv-cache-tokens 1200" in warned[0] and "--max-running-requests is 6" in warned[0], warned[0]
    caplog.clear()
    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="freetoken.engine.engine"):
        LLMEngine(EngineConfig(model=demo.hf_dir, backend="cpu", max_model_len=200, max_running_requests=6,
                               kv_cache_tokens=1200))
    assert not [r for r in caplog.records if "--kv-cache-tokens" in r.getMessage()]
