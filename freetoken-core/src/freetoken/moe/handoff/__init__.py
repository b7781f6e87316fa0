"""One MoE layer's step split between the GPU and the CPU workers: the executor
(:class:`~.hybrid.HybridMoEExecutor`, the entry), the traffic of host-resident experts
(:class:`~.expert_traffic.ExpertTraffic`: :mod:`.host_pinning`, the cache, locked fetch,
prompt streaming), the statistics (:mod:`.moe_stats`) and test fault injection (:mod:`.faults`)."""
