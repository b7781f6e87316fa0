"""Placement: which (token, k) route of a hybrid MoE layer runs on the GPU, which on the CPU.

A route goes to the GPU when its expert is resident in the GPU expert cache, else to the
CPU. The split is computed on the device with tensor ops only (no host sync), so it is
captured into decode graphs and follows the routes of every replay. Each side gets the
full ``[tokens, top_k]`` id matrix with ``-1`` where the route belongs to the other side
(the layout the hand-off task and the CPU kernels take).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional


@dataclasses.dataclass
class Placement:
    """``resident``: bool ``[num_experts]`` on the layer's device (True = expert on the GPU).

    ``cpu_routes_per_token`` (benchmarks, tests): when set, the last n routes of every
    token go to the CPU whatever the residency, e.g. "one CPU expert per token".
    """

    resident: Any
    cpu_routes_per_token: Optional[int] = None
    #: the hand-off must get the CPU routes as an explicit mask (not the resident rule)
    explicit_mask: ClassVar[bool] = False

    @classmethod
    def all_gpu(cls, num_experts: int, device: Any) -> "Placement":
        import torch

        return cls(torch.ones(num_experts, dtype=torch.bool, device=device))

    @classmethod
    def from_cpu_experts(cls, num_experts: int, cpu_experts: list[int], device: Any) -> "Placement":
        import torch

        resident = torch.ones(num_experts, dtype=torch.bool)
        for e in cpu_experts:
            if not 0 <= e < num_experts:
                raise ValueError(f"CPU expert {e} outside 0..{num_experts - 1}")
            resident[e] = False
        return cls(resident.to(device))

    def cpu_mask(self, ids: Any) -> Any:
        """bool ``[tokens, top_k]``: True where the route runs on the CPU."""
        import torch

        if self.cpu_routes_per_token is not None:
            n = self.cpu_routes_per_token
            k = ids.shape[1]
            if not 0 <= n <= k:
                raise ValueError(f"cpu_routes_per_token={n} outside 0..top_k={k}")
            mask = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
            if n:
                mask[:, k - n :] = True
            return mask
        return ~self.resident[ids.long()]


def split_routes(ids: Any, cpu_mask: Any) -> tuple[Any, Any]:
    """(gpu_ids, cpu_ids) as int32, each with -1 where the route belongs to the other side."""
    import torch

    ids32 = ids.to(torch.int32)
    minus_one = torch.full_like(ids32, -1)
    gpu_ids = torch.where(cpu_mask, minus_one, ids32)
    cpu_ids = torch.where(cpu_mask, ids32, minus_one)
    return gpu_ids, cpu_ids


LayerSpec = tuple[str, Any]


def parse_layer_spec(spec: str) -> LayerSpec:
    """Parse ``--moe-cpu-layers``: ``all``, a count ``N`` (the first N MoE layers), or layer
    indices and ranges (``0-11,40``; one index alone: ``7,``). Raises ValueError with the
    accepted forms."""
    text = str(spec).strip().lower()
    forms = "expected 'all', a count like '24', or layer indices like '0-11,40' (a single index: '7,')"
    if text == "all":
        return ("all", None)
    if text.isdigit():
        return ("count", int(text))
    layers: set[int] = set()
    parts = [p.strip() for p in text.split(",")]
    if len(parts) < 2 and "-" not in text:
        raise ValueError(f"--moe-cpu-layers {spec!r}: {forms}")
    for part in parts:
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"--moe-cpu-layers {spec!r}: bad item {part!r}; {forms}")
        a, b = int(lo), int(hi) if dash else int(lo)
        if b < a:
            raise ValueError(f"--moe-cpu-layers {spec!r}: range {part!r} runs backwards")
        layers.update(range(a, b + 1))
    return ("layers", sorted(layers))


def cpu_layers(spec: Optional[str], moe_layers: list[int], default_count: int) -> list[int]:
    """The MoE layers whose routed experts run on the CPU: ``spec`` resolved against the
    model's MoE layer indices (None: the first ``default_count`` of them)."""
    if spec is None:
        kind, value = "count", default_count
    else:
        kind, value = parse_layer_spec(spec)
    if kind == "all":
        return list(moe_layers)
    if kind == "count":
        if value > len(moe_layers):
            raise ValueError(
                f"--moe-cpu-layers {value}: the model has only {len(moe_layers)} MoE layers (use 'all' or a smaller count)"
            )
        return list(moe_layers[:value])
    unknown = [i for i in value if i not in moe_layers]
    if unknown:
        raise ValueError(
            f"--moe-cpu-layers: layers {unknown} are not MoE layers of this model "
            f"(MoE layers: {moe_layers[0]}..{moe_layers[-1]})" if moe_layers else "--moe-cpu-layers: the model has no MoE layers"
        )
    return list(value)


def layers_that_fit(per_layer: dict[int, int], room: int) -> list[int]:
    """The MoE layers whose experts go to the device when ``room`` bytes hold them
    (``per_layer``: each layer's expert bytes), sorted: as many layers as fit, and of those
    sets the one with the most bytes, so that the layers left to the CPU read the fewest
    bytes per token (a GGUF file's quantization mix makes some layers larger: Q4_K_M keeps
    every third layer's down projections in Q6_K). Among layers of one size the last go to
    the device first (as llama.cpp's ``-ncmoe``). Largest count: the smallest layers;
    then a chosen layer is swapped for a larger one left out while the sum still fits."""
    # smallest first; of one size, the last layer first
    by_size = sorted(per_layer, key=lambda i: (per_layer[i], -i))
    chosen: list[int] = []
    used = 0
    for i in by_size:
        if used + per_layer[i] > room:
            break
        chosen.append(i)
        used += per_layer[i]
    kept = set(chosen)
    left = [i for i in per_layer if i not in kept]
    swapped = True
    while swapped:  # each swap adds bytes: it ends
        swapped = False
        left.sort(key=lambda i: (-per_layer[i], -i))  # largest first; of one size the last layer
        chosen.sort(key=lambda i: (per_layer[i], i))  # smallest first; of one size the first layer
        for out in left:
            inside = next((c for c in chosen if 0 < per_layer[out] - per_layer[c] <= room - used), None)
            if inside is not None:
                chosen[chosen.index(inside)] = out
                left[left.index(out)] = inside
                used += per_layer[out] - per_layer[inside]
                swapped = True
                break
    return sorted(chosen)
