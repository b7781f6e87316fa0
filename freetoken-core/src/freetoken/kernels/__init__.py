"""The engine's Triton kernels, shared by the model parts (:mod:`freetoken.models`) and the
GPU side of the MoE layers (:mod:`freetoken.moe`) through their public names.

* :mod:`.availability` -- whether the kernels run on a device (else the torch paths)
* :mod:`.moe_experts` -- routed experts held as BF16/FP16 stacks (fused gate/up, down)
* :mod:`.moe_packed` -- routed experts in their GGUF block formats; :mod:`.packed_int8` their
  int8-dot variants; :mod:`.moe_grouped` prompt-sized batches grouped by expert
* :mod:`.route_slots` -- expert ids mapped to expert-cache slots on the device
* :mod:`.packed_linear` -- dense projections in GGUF block formats (GEMV and tiles)
* :mod:`.dense_ops` -- fused norms, RoPE, router and top-k of the dense part
* :mod:`.decode_attention` -- paged split-K decode attention
* :mod:`.counters` -- launch counters the tests and profiles read
"""
