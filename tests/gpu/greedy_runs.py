"""Greedy runs of an engine with every step's logits recorded, and their comparison with a
reference run up to the first token where the two differ (after it the contexts differ)."""

from __future__ import annotations

from typing import Any

import torch

from freetoken.engine.sampling_params import SamplingParams


def run_greedy(eng: Any, prompts: list[list[int]], max_tokens: int = 8) -> list[tuple[list[int], torch.Tensor]]:
    """(output ids, logits [steps, vocab]) per prompt, all prompts decoded together."""
    rows: dict[str, list[torch.Tensor]] = {}

    def observe(ids, logits):
        for i, rid in enumerate(ids):
            rows.setdefault(rid, []).append(logits[i].float().cpu().clone())

    remove = eng.add_logits_observer(observe)
    try:
        reqs = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                for p in prompts]
        while eng.has_work():
            eng.step()
    finally:
        remove()
    return [(r.output_ids, torch.stack(rows[r.request_id])) for r in reqs]


def check_logits(got: list, ref: list, tol: float) -> int:
    """Logits within ``tol`` of the reference's scale up to and including the first differing
    token, which may differ only where the reference's top-2 margin is within ``2 * tol``.
    Returns the number of positions compared before a difference."""
    compared = 0
    for (ids, logits), (ref_ids, ref_logits) in zip(got, ref):
        scale = ref_logits.abs().max()
        n = min(len(ids), len(ref_ids))
        same = next((i for i in range(n) if ids[i] != ref_ids[i]), n)
        err = float((logits[:same + 1] - ref_logits[:same + 1]).abs().max() / scale)
        assert err <= tol, f"logits differ by {err:.3g} of their scale"
        if same < n:
            top2 = ref_logits[same].topk(2).values
            margin = float((top2[0] - top2[1]) / scale)
            assert margin <= 2 * tol, f"greedy token {same} differs where the reference margin {margin:.3g} is clear"
        compared += same
    return compared
