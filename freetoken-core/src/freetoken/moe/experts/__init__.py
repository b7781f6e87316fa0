"""The routed experts the GPU computes: resident as BF16 stacks (:mod:`.gpu_experts`) or in
their block formats (:mod:`.gpu_packed_experts`), the global cache of CPU layers' experts
(:mod:`.expert_cache`, :mod:`.route_slots`), locked fetch (:mod:`.locked_fetch`,
:mod:`.expert_gather`, :mod:`.route_split`), host-to-device copies (:mod:`.copy_queue`) and
prompts streamed through the GPU (:mod:`.prefill_stream`)."""
