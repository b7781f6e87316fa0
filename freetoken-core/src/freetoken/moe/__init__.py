"""The MoE layers on a GPU backend: routed experts on the device or on the CPU workers, in one step.

Read top-down, the way a decode step flows:

* :mod:`.session` -- the model session of a GPU backend (:class:`~.session.gpu_session.GpuModelSession`):
  the memory plan, decode graphs, stage trace, host threads;
* :mod:`.qualify` -- the startup qualification of the hand-off paths;
* :mod:`.handoff` -- per MoE layer, the routes split between GPU and CPU workers
  (:class:`~.handoff.hybrid.HybridMoEExecutor`) and what moves experts between host and device
  (:class:`~.handoff.expert_traffic.ExpertTraffic`: pinned banks, the cache, locked fetch,
  prompt streaming, statistics);
* :mod:`.experts` -- the routed experts the GPU computes: resident (BF16 or packed blocks),
  cached, fetched from locked host memory, streamed for prompts;
* :mod:`.placement` -- which routes run where, and the ``--moe-cpu-layers`` spec.

The MoE layer as the model sees it is :mod:`freetoken.models.moe_layer`; the Triton kernels are
in :mod:`freetoken.kernels`; the native GPU backend both GPU plugins build on is
:mod:`freetoken.native_gpu`.
"""
