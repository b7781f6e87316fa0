"""The native decode step's inputs without torch ops (freetoken_cpu_moe.decode_step): a
one-token step reads its embedding row in place (a float table's row, or a packed table's
cached row, moved to the cache's end as the embedding moves it), fills its tables for one
sequence without per-column lists, and writes into a buffer per token count; the hidden
states equal the per-op path's bit for bit, and an embedding replaced since build is called."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from freetoken.models.layers import Embedding

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from helpers import engine_for, make_hf, run_random_greedy  # noqa: E402
from test_engine_gguf import write_tiny_gguf  # noqa: E402


@pytest.fixture(autouse=True)
def native_attention(monkeypatch):
    """The native step needs the native attention, which every tier but scalar takes by default
    (freetoken_cpu_moe.attention.TORCH_TIERS); these tests are about the step on any tier."""
    monkeypatch.setenv("FREETOKEN_CPU_ATTENTION", "native")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    hf_dir = str(tmp_path_factory.mktemp("hf-native-inputs"))
    make_hf(hf_dir, seed)  # a float32 embedding table
    gguf_path = str(tmp_path_factory.mktemp("gguf-native-inputs") / "tiny.gguf")
    write_tiny_gguf(gguf_path, seed)  # a Q8_0 table: rows dequantized into the embedding's cache
    return {"hf": hf_dir, "gguf": gguf_path}, seed


def _compare_steps(eng, seed: int, lens: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Run greedy requests; every decode step runs the per-op path into a fresh tensor, then the
    native step into a NaN-poisoned copy of it and into its own buffer, all equal bit for bit.
    Returns each compared step's token count and the embedding calls the native steps made."""
    native = eng.session.native_decode
    per_op = eng.session._step
    sizes: list[int] = []
    calls = [0]
    embed_call = Embedding.__call__

    def counted(self, ids):
        calls[0] += 1
        return embed_call(self, ids)

    def both(ids, pos, meta):
        eng.session.native_decode = None
        try:
            want = per_op(ids, pos, meta).clone()
        finally:
            eng.session.native_decode = native
        if not meta.decode:
            return want
        Embedding.__call__ = counted
        try:
            poisoned = native(ids, pos, meta, out=torch.full_like(want, float("nan")))
            got = native(ids, pos, meta)
        finally:
            Embedding.__call__ = embed_call
        assert poisoned is not None and torch.equal(poisoned, want), f"seed {seed}: {ids.shape[0]} tokens"
        assert got is not None and torch.equal(got, want), f"seed {seed}: {ids.shape[0]} tokens"
        assert native(ids, pos, meta) is got  # the buffer of this token count, reused
        sizes.append(int(ids.shape[0]))
        return got

    eng.session._step = both
    try:
        reqs = run_random_greedy(eng, seed, lens)
        assert all(len(r.output_ids) == m for r, (_, m) in zip(reqs, lens))
    finally:
        del eng.session._step
    return sizes, calls[0]


@pytest.mark.parametrize("kind", ["hf", "gguf"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_equal_per_op_path(checkpoints, kind, dtype):
    """One-token steps read the row in place (no embedding call: the per-op path ran first, so a
    packed table's row is cached); steps of several sequences call the embedding."""
    paths, seed = checkpoints
    eng = engine_for(paths[kind], dtype=dtype, prefill_chunk=64, max_running_requests=3)
    try:
        assert eng.session.native_decode is not None
        sizes, calls = _compare_steps(eng, seed, [(7, 9)])
        assert sizes == [1] * 8 and calls == 0
        sizes, calls = _compare_steps(eng, seed + 1, [(5, 6), (13, 3), (9, 8)])
        multi = sum(1 for n in sizes if n > 1)
        assert multi and 1 in sizes and calls == 2 * multi  # two counted native calls per compared step
    finally:
        eng.close()


def test_cached_row_moves_to_the_end(checkpoints):
    paths, seed = checkpoints
    eng = engine_for(paths["gguf"])
    try:
        native = eng.session.native_decode
        emb = eng.model.embed
        assert emb.table is None
        emb(torch.tensor([3, 5, 9]))
        assert list(emb.cache)[-3:] == [3, 5, 9]
        addr = native._one_row([5])
        assert addr == emb.cache[5].data_ptr() and list(emb.cache)[-1] == 5
        assert native._one_row([11]) == 0  # not cached: the embedding dequantizes it
        assert native._one_row(None) == 0
    finally:
        eng.close()


def test_float_table_rows_and_range(checkpoints):
    paths, _ = checkpoints
    eng = engine_for(paths["hf"])
    try:
        native = eng.session.native_decode
        table = eng.model.embed.table
        assert table is not None
        V, H = table.shape
        assert native._one_row([V - 1]) == table[V - 1].data_ptr()
        assert native._one_row([V]) == 0 and native._one_row([-1]) == 0
        eng.model.embed.table = table.clone()  # replaced: the embedding runs
        assert native._one_row([0]) == 0
    finally:
        eng.close()


def test_replaced_embedding_is_called(checkpoints):
    """A wrapper around the model's embedding (the step profiler's timer) runs every step, and
    the tokens stay those of the unwrapped run."""
    from freetoken import SamplingParams

    paths, _ = checkpoints
    eng = engine_for(paths["gguf"])
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    try:
        want = eng.add_request([4, 8, 15], params)
        while eng.has_work():
            eng.step()
        orig = eng.model.embed
        seen: list[int] = []

        def embed(ids):
            seen.append(int(ids.shape[0]))
            return orig(ids)

        eng.model.embed = embed
        got = eng.add_request([4, 8, 15], params)
        while eng.has_work():
            eng.step()
        assert seen == [3, 1, 1, 1, 1] and got.output_ids == want.output_ids
    finally:
        eng.close()
