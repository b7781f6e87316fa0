"""Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet hybrids): engine logits against transformers'
models built from tiny random configs with both layer types (FP32), from HF safetensors
and from the same weights written as GGUF."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from freetoken import SamplingParams
from helpers import LogitsRecorder, engine_for, hf_logits
from qwen35_helpers import FAMILIES, first_route_tie, make_hf, prompt_without_route_ties, round_to_f16, write_gguf

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models_moe_families"))
import families  # noqa: E402


#: Where the engine and transformers split a sequence differently (prefill pieces against
#: one forward; recurrent decode against the chunked form over every position) the same
#: math sums in different orders, and random tiny hybrids amplify that (the chunked form's
#: triangular solves, softmax routing, four layers) to ~1e-3 at some positions in FP32:
#: transformers' own FP32 forward is up to 1e-3 from its float64 forward on most of these
#: models (not all: one qwen3_next seed strayed 0.30 over 150 tokens, so the long chunked
#: test compares with float64), and its cached decode up to 6e-4 from its own full forward. A wrong state hand-over
#: between pieces, a wrong slot or a stale conv window moves logits by 1e-1 and more.
FORMS_ATOL = 5e-3
#: how far an FP32 forward of these models strays from the float64 one (both directions)
FP32_ATOL = 1e-3


def close_forms(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, atol=FORMS_ATOL, rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"hf-{request.param}"))
    seed = random.randrange(1 << 30)
    model = make_hf(request.param, path, seed)
    return request.param, model, path, seed


def _prompts(model, rng: random.Random, lengths: tuple[int, ...]) -> list[list[int]]:
    """Random prompts whose routing is clear of ties (qwen35_helpers.ROUTE_GAP): the tokens
    generated after them may still meet one, rarely."""
    return [prompt_without_route_ties(model, rng, n)[0] for n in lengths]


def test_config_and_layer_pattern(checkpoint):
    family, model, path, seed = checkpoint
    eng = engine_for(path)
    cfg = eng.model_config
    assert cfg.architecture == family
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.kv_layers == (3,) and len(eng.kv.layers) == 1
    assert cfg.recurrent is not None and cfg.recurrent.layers == (0, 1, 2)
    assert not eng.prefix_cache.enabled  # no recurrent state per cached prefix


def test_one_prompt_all_positions(checkpoint):
    """The engine's FP32 prefill against transformers' float64 forward: at most twice as
    far from it as transformers' own FP32 forward, or 1e-3 (how far that forward strays on
    these models, above). These random hybrids are ill-conditioned enough that the two FP32
    forwards differ by up to ~4e-4 at some seeds while each stays within ~8e-4 of float64;
    a wrong piece moves logits by 1e-1."""
    family, model, path, seed = checkpoint
    rng = random.Random(seed)
    eng = engine_for(path)
    ids, ref = prompt_without_route_ties(model, rng, 23)
    ours = float((eng.prompt_logits(ids).double() - ref).abs().max())
    theirs = float((hf_logits(model, ids).double() - ref).abs().max())
    assert ours <= max(2 * theirs, FP32_ATOL), \
        f"{family} seed {seed}: {ours:.3g} from float64, transformers FP32 {theirs:.3g}"


def test_chunked_prefill_across_deltanet_chunks(checkpoint):
    """Prefill pieces of 50 (and 7) tokens against one 150-token float64 forward: the pieces
    straddle the DeltaNet's 64-token chunks (64 and 128) and the 16-token KV blocks. The
    reference is float64: transformers' own FP32 forward strayed 0.30 from it at positions
    112+ for one qwen3_next seed (928897292), where the engine's pieces stayed within 1.8e-4;
    over 14 seeds of both families the engine was at most 1.1e-3 from float64. The prompt
    routes clear of ties (qwen35_helpers.ROUTE_GAP)."""
    family, model, path, seed = checkpoint
    rng = random.Random(seed + 1)
    eng = engine_for(path, prefill_chunk=50)
    ids, ref = prompt_without_route_ties(model, rng, 150)
    ref = ref.float()
    close_forms(eng.prompt_logits(ids), ref, f"{family} seed {seed} chunk 50")
    close_forms(eng.prompt_logits(ids, chunk=7), ref, f"{family} seed {seed} chunk 7")


@torch.no_grad()
def hf_decode_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' logits for each sampled position the way it generates: the prompt in
    one forward (chunked form), then one token at a time through its cache (recurrent form)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    cache, rows = out.past_key_values, [out.logits[0, -1]]
    for t in output[:-1]:
        out = model(torch.tensor([[t]]), cache=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0, -1])
    return torch.stack(rows).float()


def _check_generation(model, eng, prompts, params, what):
    """Every sampled row against transformers' generation (prompt in one forward, then
    cached decode: the same forms the engine runs) and against one full forward."""
    with LogitsRecorder(eng) as rec:
        reqs = [eng.add_request(p, params) for p in prompts]
        while eng.has_work():
            eng.step()
    for p, r in zip(prompts, reqs):
        got = torch.stack(rec[r.request_id])
        ref = hf_decode_logits(model, p, r.output_ids)
        assert got.shape == ref.shape
        # row i is computed at position len(p) - 1 + i; from a generated token whose float64
        # routing comes near a tie on, FP32 may route it otherwise (the prompts are clear of ties)
        keep = min(len(r.output_ids), first_route_tie(model, p + r.output_ids) - len(p) + 1)
        assert keep >= 1, f"{what}: the prompt itself routes near a tie"
        got, ref, out_ids = got[:keep], ref[:keep], r.output_ids[:keep]
        close_forms(got, ref, f"{what} prompt len {len(p)}")
        # greedy: each pick is transformers' argmax, up to ties within the tolerance
        picked = ref.gather(1, torch.tensor(out_ids).view(-1, 1)).view(-1)
        assert (ref.max(-1).values - picked <= 2 * FORMS_ATOL).all(), f"{what}: {out_ids}"
        full = hf_logits(model, p + r.output_ids)[len(p) - 1 : -1][:keep]
        close_forms(got, full, f"{what} vs full forward")
    assert eng.states.used_slots == 0 and eng.stats().kv_used_tokens == 0


def test_batch_of_different_lengths_paged_decode(checkpoint):
    """Prefill then batched recurrent decode, against a full forward of prompt + output."""
    family, model, path, seed = checkpoint
    rng = random.Random(seed + 2)
    eng = engine_for(path)
    prompts = _prompts(model, rng, (1, 5, 17, 70))
    _check_generation(model, eng, prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                      f"{family} seed {seed}")  # fmt: skip


def test_chunked_prefill_while_others_decode(checkpoint):
    family, model, path, seed = checkpoint
    rng = random.Random(seed + 3)
    eng = engine_for(path, prefill_chunk=24, max_running_requests=3)
    prompts = _prompts(model, rng, (3, 90, 4, 29))  # the 4th waits for a slot
    _check_generation(model, eng, prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                      f"{family} seed {seed}")  # fmt: skip


def test_preemption_recomputes_state_exactly(checkpoint):
    """A KV budget too small for all requests forces preemption: the preempted request's
    recurrent state is dropped and recomputed from its tokens."""
    family, model, path, seed = checkpoint
    rng = random.Random(seed + 5)
    eng = engine_for(path, kv_cache_tokens=96, max_model_len=96, prefill_chunk=64)
    prompts = _prompts(model, rng, (30, 28, 26))
    _check_generation(model, eng, prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                      f"{family} seed {seed}")  # fmt: skip
    assert eng.stats().num_preemptions > 0


def test_gguf_written_by_our_writer_matches(checkpoint, tmp_path):
    """The same model (matrices rounded to F16) written as GGUF with llama.cpp's names and
    conventions (qwen35moe: value heads tiled; qwen3next: in_proj_qkvz split) loads and
    matches transformers."""
    family, model, path, seed = checkpoint
    import copy

    ref_model = copy.deepcopy(model)
    round_to_f16(ref_model)
    f = str(tmp_path / f"{family}.gguf")
    write_gguf(family, ref_model, f)
    eng = engine_for(f)
    assert eng.model_config.architecture == family
    assert eng.model_config.value_heads_tiled == (family == "qwen3_5_moe")
    rng = random.Random(seed + 6)
    ids = prompt_without_route_ties(ref_model, rng, 80)[0]
    ref = hf_logits(ref_model, ids)
    close_forms(eng.prompt_logits(ids, chunk=80), ref, f"{family} GGUF seed {seed}")
    close_forms(eng.prompt_logits(ids, chunk=30), ref, f"{family} GGUF seed {seed} chunk 30")
    prompts = _prompts(ref_model, rng, (9, 33))
    _check_generation(ref_model, eng, prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                      f"{family} GGUF seed {seed}")  # fmt: skip


def test_unsupported_layer_type_is_named(tmp_path):
    from freetoken.loading.hf import CheckpointError
    from freetoken.models import qwen3_5_moe

    cfg = dict(vocab_size=10, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               layer_types=["linear_attention", "sliding_attention"])  # fmt: skip
    with pytest.raises(CheckpointError, match="sliding_attention.*supported: linear_attention, full_attention"):
        qwen3_5_moe.config_from_hf(cfg)
    cfg["layer_types"] = ["linear_attention", "full_attention"]
    cfg["linear_num_value_heads"] = 3
    with pytest.raises(CheckpointError, match="not a multiple"):
        qwen3_5_moe.config_from_hf(cfg)


def test_gpu_session_decode_graphs_equal_the_cpu_backend(checkpoint):
    """Three requests of different lengths decoded by the GPU session's code in decode graphs
    (fake GPU backend: the DeltaNet steps through DenseOps' torch form, the recurrent states
    gathered and scattered) against the CPU backend (one native DeltaNet op per layer): the same
    greedy tokens, logits within the forms' tolerance."""
    family, model, path, seed = checkpoint
    rng = random.Random(seed + 7)
    prompts = _prompts(model, rng, (7, 30, 12))
    runs = families.greedy_on_cpu_and_gpu_session(path, prompts)
    (want_ids, want_rows), (got_ids, got_rows) = runs["cpu"], runs["gpu-session"]
    for got, want, g, w in zip(got_ids, want_ids, got_rows, want_rows):
        # the same tokens up to a near-tie (the forms differ by ~5e-4 at most on these models)
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        if same < len(want):
            gap = float(w[same, want[same]] - w[same, got[same]])
            assert gap <= 2 * FORMS_ATOL, f"{family} seed {seed}: {got} vs {want}, gap {gap:.3g}"
        close_forms(g[: same + 1], w[: same + 1], f"{family} seed {seed}: GPU session vs CPU backend")
