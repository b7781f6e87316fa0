"""Grouped top-k routing: over sigmoid scores with a score-correction bias (GLM-4.5, and the
"noaux_tc" routing of DeepSeek-V3; :func:`grouped_sigmoid_top_k`), or over softmax scores
(DeepSeek-V2's "greedy" and "group_limited_greedy"; :func:`grouped_softmax_top_k`).

Per token, from the router's float32 logits ``[T, E]``:

1. ``scores = sigmoid(logits)``;
2. the choice uses ``scores + correction_bias`` (the checkpoint's
   ``e_score_correction_bias``, GGUF ``exp_probs_b.bias``): with ``n_group > 1`` the experts
   are split into ``n_group`` consecutive groups, a group's score is the sum of its two best
   corrected scores, the ``topk_group`` best groups are kept and the experts of the others
   are out;
3. the ``top_k`` best corrected scores among the experts left are chosen;
4. their weights are the *uncorrected* ``scores``, divided by their sum (plus 1e-20) when
   ``norm_topk_prob``, then times ``routed_scaling_factor``.

The softmax form: ``scores = softmax(logits)``; with ``n_group > 1`` a group's score is its
best expert's score and the experts outside the ``topk_group`` best groups are out; the
``top_k`` best scores are chosen and are the weights, renormalised when ``norm_topk_prob``,
then times ``routed_scaling_factor`` (llama.cpp's order; DeepSeek-V2's checkpoints do not
renormalise).

Everything runs as device tensor ops (no host sync), so a decode graph captures it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from freetoken.loading.hf import CheckpointError


#: the scoring functions of :class:`GroupedTopK`
SCORINGS = ("sigmoid", "softmax")


@dataclasses.dataclass(frozen=True)
class GroupedTopK:
    """The hyper-parameters of :func:`grouped_sigmoid_top_k`."""

    num_experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    #: "sigmoid" (with a correction bias) or "softmax"
    scoring: str = "sigmoid"

    def check(self, where: str) -> None:
        """Raise :class:`CheckpointError` (naming the field) for values the routing cannot use."""
        E, g = self.num_experts, self.n_group
        if g < 1 or E % g:
            raise CheckpointError(f"{where}: n_group={g} does not divide the {E} routed experts")
        if not 1 <= self.topk_group <= g:
            raise CheckpointError(f"{where}: topk_group={self.topk_group} is not in 1..n_group={g}")
        if not 1 <= self.top_k <= self.topk_group * (E // g):
            raise CheckpointError(f"{where}: num_experts_per_tok={self.top_k} exceeds the "
                                  f"{self.topk_group * (E // g)} experts of topk_group={self.topk_group} groups")
        if self.scoring not in SCORINGS:
            raise CheckpointError(f"{where}: scoring_func={self.scoring!r} is not supported ({', '.join(SCORINGS)})")
        if not self.routed_scaling_factor > 0:
            raise CheckpointError(f"{where}: routed_scaling_factor={self.routed_scaling_factor} is not positive")


def _chosen(scores: torch.Tensor, choice: torch.Tensor, r: GroupedTopK) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` experts by ``choice`` (int32 ids) and their weights: their ``scores``,
    renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``."""
    ids = choice.topk(r.top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if r.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    if r.routed_scaling_factor != 1.0:
        w = w * r.routed_scaling_factor
    return ids.to(torch.int32), w


def gguf_routing_fields(meta: dict[str, Any], a: str, shared_default: int, dense_default: int) -> dict[str, Any]:
    """The grouped-routing fields of a config (shared experts, groups, scale, leading dense
    layers) from GGUF metadata of architecture ``a``, as llama.cpp's converter writes them."""
    from freetoken.loading.gguf import gguf_float, gguf_int

    return dict(
        n_shared_experts=gguf_int(meta, f"{a}.expert_shared_count", shared_default),
        n_group=gguf_int(meta, f"{a}.expert_group_count", 1) or 1,
        topk_group=gguf_int(meta, f"{a}.expert_group_used_count", 1) or 1,
        routed_scaling_factor=gguf_float(meta, f"{a}.expert_weights_scale", 1.0),
        first_k_dense_replace=gguf_int(meta, f"{a}.leading_dense_block_count", dense_default),
    )


def grouped_sigmoid_top_k(logits: torch.Tensor, correction_bias: torch.Tensor,
                          r: GroupedTopK) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Expert ids (int32 ``[T, top_k]``) and float32 weights of the sigmoid routing in the
    module docstring; ``correction_bias`` float32 ``[E]``."""
    scores = logits.float().sigmoid()
    choice = scores + correction_bias
    if r.n_group > 1 and r.topk_group < r.n_group:
        T = choice.shape[0]
        per = r.num_experts // r.n_group
        grouped = choice.view(T, r.n_group, per)
        group_scores = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, n_group]
        keep = group_scores.topk(r.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, r.num_experts)
    return _chosen(scores, choice, r)


def grouped_softmax_top_k(logits: torch.Tensor, r: GroupedTopK) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids (int32 ``[T, top_k]``) and float32 weights of the softmax routing in the
    module docstring."""
    scores = logits.float().softmax(dim=-1)
    choice = scores
    if r.n_group > 1 and r.topk_group < r.n_group:
        T = scores.shape[0]
        grouped = scores.view(T, r.n_group, r.num_experts // r.n_group)
        keep = grouped.amax(-1).topk(r.topk_group, dim=-1).indices
        mask = torch.zeros(T, r.n_group, dtype=torch.bool, device=scores.device).scatter_(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, r.num_experts)
    return _chosen(scores, choice, r)
