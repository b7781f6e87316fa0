"""How far greedy runs of the demo model drift from the all-CPU placement over 200 decode
steps: every expert on the GPU, the all-CPU placement again (deterministic), locked fetch
as the default (auto), and the cache under churn (as test_cache_churn_in_graphs_matches_cpu
runs it, several times: which step a fetched expert becomes resident depends on when its
copy finished). Prints, per run and prompt, the positions
before the first differing token and the largest logit error (of the reference's scale)
over the first 25/50/100/200 positions. Run on the GPU machine:
    python3 tests/gpu/churn_spread.py [repeats]
"""

from __future__ import annotations

import sys

sys.path.insert(0, "tests/gpu")

from freetoken.backends.registry import get_backend  # noqa: E402
from freetoken.moe.experts import expert_cache  # noqa: E402
from greedy_runs import run_greedy  # noqa: E402
from test_gpu_expert_traffic import EXPERT_BYTES, PROMPTS, _engine  # noqa: E402


def spread(got, ref) -> str:
    parts = []
    for (ids, logits), (ref_ids, ref_logits) in zip(got, ref):
        scale = ref_logits.abs().max()
        n = min(len(ids), len(ref_ids))
        same = next((i for i in range(n) if ids[i] != ref_ids[i]), n)
        errs = ((logits[:same + 1] - ref_logits[:same + 1]).abs().amax(dim=1) / scale).tolist()
        cuts = [f"{max(errs[:c]):.3f}" for c in (25, 50, 100, 200) if c <= len(errs)]
        parts.append(f"same {same} max {'/'.join(cuts)}")
    return " | ".join(parts)


def run(backend, **kw):
    eng = _engine(backend, dtype="bfloat16", moe_stream_prefill="off", **kw)
    try:
        return run_greedy(eng, PROMPTS, 200)
    finally:
        eng.close()


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    backend = get_backend("cuda")
    ref = run(backend, moe_cpu_layers="all", moe_locked_fetch=0)
    print("all-GPU     ", spread(run(backend, moe_cpu_layers="0"), ref), flush=True)
    print("all-CPU again", spread(run(backend, moe_cpu_layers="all", moe_locked_fetch=0), ref), flush=True)
    print("locked auto ", spread(run(backend, moe_cpu_layers="all"), ref), flush=True)
    expert_cache.HEAT_HALF_LIFE, expert_cache.FETCH_Z, expert_cache.FETCH_MARGIN = 1, 0.0, 0.0
    for i in range(reps):
        got = run(backend, moe_cpu_layers="all", moe_cache_size=float(12 * EXPERT_BYTES), moe_hybrid_max_fetch=2,
                  moe_locked_fetch=0)
        print(f"churn {i}     ", spread(got, ref), flush=True)


if __name__ == "__main__":
    main()
