"""Grouped sigmoid routing with a score-correction bias (:mod:`freetoken.models.routing`,
GLM-4.5 and DeepSeek-V3's ``noaux_tc``) against a float64 numpy reference written from the
definition, and against transformers' ``Glm4MoeTopkRouter``."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from freetoken.loading.hf import CheckpointError
from freetoken.models.routing import GroupedTopK, grouped_sigmoid_top_k

SEED = random.SystemRandom().randrange(1 << 30)


def reference(logits: np.ndarray, bias: np.ndarray, r: GroupedTopK) -> list[dict[int, float]]:
    """Per token {expert: weight}, float64, one token at a time."""
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias.astype(np.float64)
    per = r.num_experts // r.n_group
    out = []
    for t in range(logits.shape[0]):
        group_score = [np.sort(choice[t, g * per : (g + 1) * per])[-2:].sum() for g in range(r.n_group)]
        kept = sorted(range(r.n_group), key=lambda g: -group_score[g])[: r.topk_group]
        allowed = [e for g in kept for e in range(g * per, (g + 1) * per)]
        chosen = sorted(allowed, key=lambda e: -choice[t, e])[: r.top_k]
        w = scores[t, chosen]
        if r.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        out.append({e: float(v * r.routed_scaling_factor) for e, v in zip(chosen, w)})
    return out


CASES = [
    GroupedTopK(16, 3, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    GroupedTopK(16, 3, n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0),
    GroupedTopK(64, 8, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.827),  # DeepSeek-V3's shape / 4
    GroupedTopK(128, 8, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0),  # GLM-4.5-Air
    GroupedTopK(32, 4, n_group=2, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5),  # every group kept
]


@pytest.mark.parametrize("r", CASES, ids=lambda r: f"E{r.num_experts}k{r.top_k}g{r.n_group}/{r.topk_group}"
                         f"-norm{int(r.norm_topk_prob)}-s{r.routed_scaling_factor}")
def test_routing_matches_float64_reference(r):
    seed = SEED + r.num_experts + 7 * r.n_group + r.norm_topk_prob
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(37, r.num_experts, generator=g)
    bias = 0.5 * torch.randn(r.num_experts, generator=g)  # large enough to change choices
    ids, w = grouped_sigmoid_top_k(logits, bias, r)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (37, r.top_k)
    want = reference(logits.numpy(), bias.numpy(), r)
    for t, ref in enumerate(want):
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        assert set(got) == set(ref), f"seed {seed} token {t}"
        for e, v in ref.items():
            assert abs(got[e] - v) <= 1e-6 * max(1.0, abs(v)), f"seed {seed} token {t} expert {e}"
    # the bias changes the choice, not the weights: without it some tokens pick other experts
    plain, _ = grouped_sigmoid_top_k(logits, torch.zeros_like(bias), r)
    assert any(set(a) != set(b) for a, b in zip(plain.tolist(), ids.tolist()))


def test_routing_matches_transformers_router():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                        norm_topk_prob=True, routed_scaling_factor=2.5)  # fmt: skip
    router = Glm4MoeTopkRouter(cfg)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        router.weight.copy_(0.3 * torch.randn(16, 32, generator=g))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=g))
    x = torch.randn(25, 32, generator=g)
    logits, hw, hi = router(x)
    r = GroupedTopK(16, 3, 4, 2, True, 2.5)
    ids, w = grouped_sigmoid_top_k(x @ router.weight.T, router.e_score_correction_bias, r)
    for t in range(25):
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        want = dict(zip(hi[t].tolist(), hw[t].tolist()))
        assert set(got) == set(want), f"seed {SEED} token {t}"
        assert all(abs(got[e] - want[e]) <= 1e-6 for e in want), f"seed {SEED} token {t}"


@pytest.mark.parametrize("kw,field", [(dict(n_group=3), "n_group=3"), (dict(topk_group=5), "topk_group=5"),
                                      (dict(top_k=9, n_group=4, topk_group=2), "num_experts_per_tok=9"),
                                      (dict(routed_scaling_factor=0.0), "routed_scaling_factor")])  # fmt: skip
def test_bad_routing_is_named(kw, field):
    base = dict(num_experts=16, top_k=3, n_group=4, topk_group=2)
    with pytest.raises(CheckpointError, match=field):
        GroupedTopK(**{**base, **kw}).check("test")
