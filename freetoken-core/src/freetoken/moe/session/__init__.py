"""A whole model on a GPU backend: :class:`~.gpu_session.GpuModelSession` (the entry), its
memory plan (:mod:`.gpu_memory_plan`), decode graphs (:mod:`.decode_graphs`), stage trace
(:mod:`.stage_trace`) and host threads (:mod:`.host_threads`)."""
