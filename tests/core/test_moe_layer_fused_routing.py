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
