"""When a MoE layer's pre-norm, router and top-k take the ops' fused launch, and when a
replaced route (a recorder, on the class or the instance) keeps them apart so it sees every
step's routing."""

from __future__ import annotations

import torch

from freetoken.models import moe_layer
from freetoken.models.moe_layer import MoELayer


class _Ops:
    """Dense ops whose fused routing records that it was asked and then declines."""

    def __init__(self) -> None:
        self.fused_calls = 0

    def add_norm_route(self, *args):
        self.fused_calls += 1
        return None

    def add_rms_norm(self, h, delta, weight, eps):
        return h, h * 2

    def router_top_k(self, logits, k, norm):
        return torch.zeros(1, k, dtype=torch.int32), torch.ones(1, k)


def _layer() -> tuple[MoELayer, _Ops, list]:
    lay = MoELayer.__new__(MoELayer)
    ops = _Ops()
    seen: list = []
    lay.ops, lay.router, lay.top_k, lay.norm_topk_prob, lay.layer = ops, (lambda x: x), 1, False, 0
    lay._experts_fn = lambda x, ids, w: seen.append((x.clone(), ids, w)) or x
    return lay, ops, seen


def test_plain_layer_asks_for_the_fused_routing():
    lay, ops, seen = _layer()
    h = torch.randn(1, 4)
    lay.add_norm_forward(h, None, None, 1e-6)
    assert ops.fused_calls == 1 and len(seen) == 1  # declined: the separate launches ran


def test_route_replaced_on_the_class_keeps_the_launches_apart(monkeypatch):
    recorded = []
    plain = MoELayer.route

    def recorder(self, x):
        recorded.append(x.clone())
        return plain(self, x)

    monkeypatch.setattr(MoELayer, "route", recorder)
    assert moe_layer._PLAIN_ROUTE is plain
    lay, ops, seen = _layer()
    h = torch.randn(1, 4)
    lay.add_norm_forward(h, None, None, 1e-6)
    assert ops.fused_calls == 0, "the fused routing bypassed a recorder put on the class"
    assert len(recorded) == 1 and torch.equal(recorded[0], h * 2) and len(seen) == 1


def test_route_replaced_on_the_instance_keeps_the_launches_apart():
    lay, ops, seen = _layer()
    recorded = []
    lay.route = lambda x: (recorded.append(x) or (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)))
    lay.add_norm_forward(torch.randn(1, 4), None, None, 1e-6)
    assert ops.fused_calls == 0 and len(recorded) == 1 and len(seen) == 1


class _GroupedOps(_Ops):
    """Dense ops whose fused grouped routing answers (ids 1, weight 0.5) and counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped_calls = 0

    def add_norm_grouped_route(self, h, delta, weight, eps, router, correction_bias, routing):
        self.grouped_calls += 1
        return h, h * 3, torch.ones(1, 1, dtype=torch.int32), torch.full((1, 1), 0.5)

    def grouped_top_k(self, logits, correction_bias, routing):
        return torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)


def _grouped_layer(shared=None):
    from freetoken.models.moe_block import GroupedTopKMoELayer

    lay = GroupedTopKMoELayer.__new__(GroupedTopKMoELayer)
    ops = _GroupedOps()
    seen: list = []
    lay.ops, lay.router, lay.top_k, lay.norm_topk_prob, lay.layer = ops, (lambda x: x), 1, True, 0
    lay.routing, lay.correction_bias, lay.shared = None, None, shared
    lay._experts_fn = lambda x, ids, w: seen.append((x.clone(), ids.clone(), w.clone())) or x
    return lay, ops, seen


def test_grouped_layer_takes_its_fused_routing_and_adds_its_shared_experts():
    """A grouped-routing layer asks the ops' grouped fusion (not the softmax one), runs its
    experts on the fused routes and adds its shared experts to them, as its unfused forward."""
    lay, ops, seen = _grouped_layer(shared=lambda x: x * 10)
    h = torch.randn(1, 4)
    h_out, y = lay.add_norm_forward(h, None, None, 1e-6)
    assert ops.grouped_calls == 1 and ops.fused_calls == 0
    assert torch.equal(seen[0][0], h * 3) and seen[0][1].tolist() == [[1]] and seen[0][2].tolist() == [[0.5]]
    assert torch.equal(y, h * 3 + (h * 3) * 10)
    lay2, _, seen2 = _grouped_layer(shared=lambda x: x * 10)
    assert torch.equal(lay2(h), h + h * 10) and seen2[0][1].tolist() == [[0]]  # unfused: grouped_top_k's routes


def test_grouped_route_replaced_keeps_the_launches_apart(monkeypatch):
    from freetoken.models.moe_block import GroupedTopKMoELayer

    recorded = []
    plain = GroupedTopKMoELayer.route
    monkeypatch.setattr(GroupedTopKMoELayer, "route", lambda self, x: recorded.append(x) or plain(self, x))
    lay, ops, seen = _grouped_layer()
    lay.add_norm_forward(torch.randn(1, 4), None, None, 1e-6)
    assert ops.grouped_calls == 0 and len(recorded) == 1 and len(seen) == 1
