"""freetoken_cpu_moe.step_profile.StepProfiler (what `freetoken bench decode --cpu-profile`
prints): on a Qwen3.5 hybrid (Gated DeltaNet and gated attention layers) every layer's
projections are timed, the split holds the steps it saw, and the model is left unwrapped;
on a Qwen3-MoE model (an HF directory and a GGUF file of mixed block formats), whose layers
enter their fused q/k/v through ``add_norm_call``, with decode steps taken by the one-call
native step and with that step declined (attention through torch): prompt and decode steps
run under the profiler, every part is timed once per layer and step, the tokens are those of
the unprofiled engine, and on exit the very parts that were there are back."""

from __future__ import annotations

import random
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("freetoken_cpu_moe")

from helpers import engine_for  # noqa: E402
from qwen35_helpers import VOCAB, make_hf  # noqa: E402

from freetoken import SamplingParams  # noqa: E402
from freetoken_cpu_moe import step_profile  # noqa: E402
from freetoken_cpu_moe.step_profile import PARTS, StepProfiler  # noqa: E402


def test_hybrid_layers_projections_are_timed(tmp_path):
    path = str(tmp_path)
    make_hf("qwen3_5_moe", path, seed=random.randrange(1 << 30))
    eng = engine_for(path)
    try:
        layers = eng.model.layers
        before = [(L.qkvg, L.linear and L.linear.proj, L.linear and L.linear.out) for L in layers]
        with StepProfiler(eng) as prof:
            req = eng.add_request([random.randrange(VOCAB) for _ in range(9)],
                                  SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
            while eng.has_work():
                eng.step()
        assert len(req.output_ids) == 5
        deltanet = sum(1 for L in layers if L.linear is not None)
        attention = len(layers) - deltanet
        assert deltanet and attention
        decode = prof.splits["decode"]
        assert decode.steps == 4 and decode.tokens == 4
        # per decode step: one input projection per layer, one output projection per layer
        assert decode.calls["qkv"] == 4 * len(layers) and decode.calls["o_proj"] == 4 * len(layers)
        assert decode.calls["attention"] == 4 * attention
        assert 0 < sum(decode.part_s[p] for p in PARTS) <= decode.step_s + decode.part_s["lm_head"]
        report = prof.report(len(layers))
        assert "decode: 4 steps" in report and "qkv" in report
        # the wrappers are gone
        assert [(L.qkvg, L.linear and L.linear.proj, L.linear and L.linear.out) for L in layers] == before
    finally:
        eng.close()


# ------------------------------------------------------------------ Qwen3-MoE

#: parts every layer calls once per step, and those called once per step
PER_LAYER = ("qkv", "attention", "o_proj", "router", "experts")
PER_STEP = ("embed", "lm_head")
#: parts a Qwen3-MoE model has none of (multi-head latent attention's up-projections, dense MLP layers)
ABSENT = ("kv_b", "mlp")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """A tiny Qwen3-MoE model as an HF directory (float32, 3 layers) and as a GGUF file
    (2 layers of mixed block formats)."""
    import helpers
    from test_engine_gguf import write_tiny_gguf

    seed = random.randrange(1 << 30)
    hf_dir = str(tmp_path_factory.mktemp("profile-hf"))
    helpers.make_hf(hf_dir, seed)
    gguf_path = str(tmp_path_factory.mktemp("profile-gguf") / "tiny.gguf")
    write_tiny_gguf(gguf_path, seed + 1)
    return {"hf": hf_dir, "gguf": gguf_path}, seed


def _attention_env(monkeypatch, attention: str) -> None:
    """``native``: decode steps run as the one native call (on every ISA tier: the avx2 and
    scalar tiers' default attention is torch); ``torch``: that step is declined."""
    monkeypatch.setenv("FREETOKEN_CPU_ATTENTION", attention)


def _placed(eng):
    """What the profiler replaces, where it sits, and which attributes the objects that hold
    them have of their own (a wrapper left behind, or a method turned into an instance
    attribute, shows there)."""
    model, session = eng.model, eng.session
    family = sys.modules[type(model).forward.__module__]  # the module whose forward calls the attention
    parts = {"embed": model.embed, "paged_attention": family.paged_attention,
             "native_decode": session.native_decode, "greedy_head": session.greedy_head}
    own = {"model": sorted(vars(model)), "session": sorted(vars(session))}
    for i, L in enumerate(model.layers):
        parts.update({f"{i}.qkv": L.qkv, f"{i}.o": L.o, f"{i}.moe": L.moe, f"{i}.router": L.moe.router,
                      f"{i}.experts_fn": L.moe._experts_fn})
        own[f"{i}.moe"] = sorted(vars(L.moe))
    return parts, own


def _same_parts(before, after) -> None:
    (parts0, own0), (parts1, own1) = before, after
    assert own1 == own0
    assert parts1.keys() == parts0.keys()
    for name, obj in parts0.items():
        assert parts1[name] is obj, name


def _generate(eng, prompt: list[int], max_tokens: int) -> list[int]:
    req = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    return list(req.output_ids)


def _check_split(split, steps: int, tokens: int, layers: int, kind: str) -> None:
    assert split.steps == steps and split.tokens == tokens, kind
    for p in PER_LAYER:
        assert split.calls[p] == steps * layers, (kind, p, split.calls)
    for p in PER_STEP:
        assert split.calls[p] == steps, (kind, p, split.calls)
    for p in PARTS:
        assert (split.part_s[p] > 0) is (p not in ABSENT), (kind, p, split.part_s)
    # lm_head runs after session.forward returns; the parts inside the step sum to less than it
    assert sum(split.part_s[p] for p in PARTS) <= split.step_s + split.part_s["lm_head"], kind


@pytest.mark.parametrize("attention", ["native", "torch"])
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_qwen3_moe_profile_times_every_part_and_changes_nothing(qwen3_moe, monkeypatch, source, attention):
    """One request of a 9-token prompt and 6 tokens (a prompt step, 5 decode steps) before,
    under and after the profiler, on one engine without the prefix cache."""
    paths, seed = qwen3_moe
    _attention_env(monkeypatch, attention)
    eng = engine_for(paths[source], enable_prefix_cache=False)
    try:
        native = eng.session.native_decode
        assert (native is not None) == (attention == "native")
        layers = len(eng.model.layers)
        rng = random.Random(seed)
        prompt = [rng.randrange(eng.model_config.vocab_size) for _ in range(9)]
        plain = _generate(eng, prompt, 6)
        before = _placed(eng)
        with StepProfiler(eng) as prof:
            qkv = eng.model.layers[0].qkv
            assert qkv is not before[0]["0.qkv"] and qkv.__wrapped__ is before[0]["0.qkv"]
            # what the models and the benchmark read from a wrapped part is the part's own
            assert qkv.groups is qkv.__wrapped__.groups and qkv.nbytes == qkv.__wrapped__.nbytes
            profiled = _generate(eng, prompt, 6)
            if native is not None:  # the decode steps were the native call's, timed by its own clock
                assert all(t > 0 for t in native.part_seconds().values())
        _same_parts(before, _placed(eng))
        if native is not None:
            assert native.intact()  # the native step sees the parts it was built from
        after = _generate(eng, prompt, 6)
        assert profiled == plain and after == plain, f"seed {seed}"
        _check_split(prof.splits["prefill"], 1, 9, layers, "prefill")
        _check_split(prof.splits["decode"], 5, 5, layers, "decode")
        report = prof.report(layers)
        assert "prefill: 1 steps, 9 tokens/step" in report and "decode: 5 steps, 1 tokens/step" in report
    finally:
        eng.close()


def _table(text: str, head: str) -> dict[str, list[str]]:
    """The rows of the report's table that starts with ``head``, by part."""
    lines = text[text.index(head):].splitlines()[2:]
    rows: dict[str, list[str]] = {}
    for line in lines:
        cols = line.split()
        if not cols or cols[0] not in (*PARTS, "other"):
            break
        rows[cols[0]] = cols
    return rows


@pytest.mark.parametrize("attention", ["native", "torch"])
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_bench_decode_cpu_profile_on_qwen3_moe(qwen3_moe, monkeypatch, capsys, source, attention):
    """``freetoken bench decode --cpu-profile`` runs to the end and prints the prompt and decode
    tables with every part called once per layer (or step); its profiler leaves the model's
    parts as they were."""
    from freetoken.cli.main import main

    paths, _ = qwen3_moe
    _attention_env(monkeypatch, attention)
    seen: list[tuple[StepProfiler, object, object]] = []

    class Recorded(StepProfiler):
        def __enter__(self):
            self.before = _placed(self.eng)
            return super().__enter__()

        def __exit__(self, *exc):
            super().__exit__(*exc)
            seen.append((self, self.before, _placed(self.eng)))

    monkeypatch.setattr(step_profile, "StepProfiler", Recorded)
    rc = main(["--log-level", "WARNING", "bench", "decode", "--backend", "cpu", "--model", paths[source],
               "--batch", "1", "--prompt-len", "12", "--gen-len", "5", "--repeats", "1",
               "--bandwidth-bytes", "4MiB", "--cpu-profile"])
    assert rc == 0
    text = capsys.readouterr().out
    assert len(seen) == 1
    prof, before, after = seen[0]
    _same_parts(before, after)
    native = before[0]["native_decode"]
    assert (native is not None) == (attention == "native")
    layers = len(prof.eng.model.layers)
    _check_split(prof.splits["prefill"], 1, 12, layers, "prefill")
    _check_split(prof.splits["decode"], 4, 4, layers, "decode")
    profile = text[text.index("cpu profile (batch 1, prompt 12, 5 tokens"):]
    assert f"attention {attention}" in profile
    for head, steps in (("prefill: 1 steps, 12 tokens/step", 1), ("decode: 4 steps, 1 tokens/step", 4)):
        rows = _table(profile, head)
        assert set(rows) == {*PARTS, "other"}, head
        for p in PARTS:
            assert float(rows[p][4]) == (layers if p in PER_LAYER else 0 if p in ABSENT else 1), (head, rows[p])
