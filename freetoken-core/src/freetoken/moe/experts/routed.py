"""What the hybrid executor asks of a layer's GPU experts (:class:`GpuRoutedExperts`)."""

from __future__ import annotations

import abc
from typing import Any, ClassVar


class GpuRoutedExperts(abc.ABC):
    """A layer's routed experts the GPU computes: resident, cached, or fetched.

    :meth:`forward` takes ids that are ``-1`` where a route is not this side's. Where
    :attr:`takes_whole_routing` is set, :meth:`forward_routes` takes the layer's whole
    routing instead and skips by itself what it does not hold (no split kernels on the GPU
    side); :attr:`splits_routes` says the split is by position (locked fetch: the first
    routes of a step), so the executor hands it the whole routing even where the CPU mask
    is given."""

    takes_whole_routing: ClassVar[bool] = False
    splits_routes: ClassVar[bool] = False

    @abc.abstractmethod
    def forward(self, x: Any, gpu_ids: Any, w: Any, out: Any = None) -> Any:
        """``y[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t])`` over the routes with ``ids >= 0``."""

    @abc.abstractmethod
    def warmup(self, batch_sizes: Any, top_k: int, x_dtype: Any = None) -> None:
        """Compile every kernel variant the batch sizes need (before graph capture)."""

    def forward_routes(self, x: Any, ids: Any, w: Any) -> Any:
        """The layer's whole routing (only where :attr:`takes_whole_routing`)."""
        raise NotImplementedError(f"{type(self).__name__} takes only its own routes (forward)")
