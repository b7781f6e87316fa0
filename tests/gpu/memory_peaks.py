"""Device memory of long prompts under a GPU memory limit (run on the GPU machine).

For each prefill chunk size (0: the memory plan's own), one engine on FILE with
``--gpu-memory-limit LIMIT`` and ``--max-model-len CTX`` runs prompts of the given lengths
(greedy, 4 new tokens each). A thread samples the device's used memory (``cudaMemGetInfo``:
the whole process when it is alone on the device, CUDA context included) every 20 ms;
torch's allocator reports its own peak. One JSON line per prompt: the plan's parts, the
outcome (tokens, or the error), the prompt's seconds, the whole-device peak and torch's peak,
and each prefill step's growth of torch's peak over what was allocated before it (the step's
activations and workspaces).

With BATCHES (a comma-separated list, e.g. 1,8,32; the seventh argument), each engine then runs that many
concurrent requests at a time (256-token prompts, 48 new tokens each: decode steps of that
batch, through the decode graphs where the backend captures them) and prints the same peaks
per batch: what the step's workspaces and the graphs' pools take of the plan's reserve.

Usage: python3 tests/gpu/memory_peaks.py FILE LIMIT_GIB CTX CHUNKS PROMPTS [THREADS [BATCHES]]
  e.g. python3 tests/gpu/memory_peaks.py m.gguf 16 32768 256,2048,16384 1024,8192,16384,32700 15 1,8,32
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.sampling_params import SamplingParams


class DevicePeak:
    def __init__(self) -> None:
        self.total = torch.cuda.mem_get_info()[1]
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            free, _ = torch.cuda.mem_get_info()
            self.peak = max(self.peak, self.total - free)
            time.sleep(0.02)

    def reset(self) -> None:
        self.peak = 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    path, limit_gib, ctx, chunks, prompts = sys.argv[1:6]
    threads = int(sys.argv[6]) if len(sys.argv) > 6 else 15
    batches = [int(b) for b in sys.argv[7].split(",")] if len(sys.argv) > 7 and sys.argv[7] else []
    peak = DevicePeak()
    for chunk in (int(c) for c in chunks.split(",")):
        t0 = time.time()
        try:
            eng = LLMEngine(EngineConfig(model=path, backend="cuda", gpu_memory_limit=int(float(limit_gib) * 2**30),
                                         max_model_len=int(ctx), prefill_chunk=chunk or None, cpu_threads=threads))
        except Exception as exc:  # noqa: BLE001
            print(json.dumps({"chunk": chunk, "startup_error": f"{type(exc).__name__}: {exc}"}), flush=True)
            continue
        info = eng.backend_info()
        print(json.dumps({"chunk": chunk, "load_s": round(time.time() - t0, 1), "plan": info.get("memory_plan"),
                          "kv_tokens": eng.kv.total_tokens, "allocated_after_load": torch.cuda.memory_allocated()},
                         default=str), flush=True)
        real_forward = eng.session.forward
        growth: list[int] = []

        def measured(ids, pos, meta, _real=real_forward):
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = _real(ids, pos, meta)
            if ids.shape[0] > 1:
                torch.cuda.synchronize()
                growth.append(torch.cuda.max_memory_allocated() - before)
            return out

        eng.session.forward = measured
        for n in (int(p) for p in prompts.split(",")):
            if n >= eng.max_model_len:
                continue
            g = torch.Generator().manual_seed(n)
            ids = torch.randint(100, eng.model_config.vocab_size - 100, (n,), generator=g).tolist()
            growth.clear()
            torch.cuda.synchronize()
            peak.reset()
            torch.cuda.reset_peak_memory_stats()
            t = time.time()
            req = eng.add_request(ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            first = None
            while eng.has_work():
                eng.step()
                if first is None and req.output_ids:
                    first = time.time() - t
            torch.cuda.synchronize()
            time.sleep(0.05)
            print(json.dumps({
                "chunk": chunk, "prompt": n, "finish": req.finish_reason,
                "error": req.error.message if req.error else None, "prompt_s": round(first or 0.0, 3),
                "device_peak_gib": round(peak.peak / 2**30, 3),
                "torch_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
                "step_growth_mib_max": round(max(growth, default=0) / 2**20, 1), "prefill_steps": len(growth),
            }), flush=True)
        eng.session.forward = real_forward
        for batch in batches:
            g = torch.Generator().manual_seed(batch)
            torch.cuda.synchronize()
            peak.reset()
            torch.cuda.reset_peak_memory_stats()
            t = time.time()
            reqs = [eng.add_request(torch.randint(100, eng.model_config.vocab_size - 100, (256,), generator=g).tolist(),
                                    SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
                    for _ in range(batch)]
            while eng.has_work():
                eng.step()
            torch.cuda.synchronize()
            time.sleep(0.05)
            print(json.dumps({
                "chunk": chunk, "batch": batch, "finished": sum(r.finish_reason == "length" for r in reqs),
                "errors": sorted({r.error.message for r in reqs if r.error}), "s": round(time.time() - t, 2),
                "device_peak_gib": round(peak.peak / 2**30, 3),
                "torch_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
                "torch_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 3),
            }), flush=True)
        eng.close()
        del eng
        torch.cuda.empty_cache()
    peak.stop()


if __name__ == "__main__":
    main()
