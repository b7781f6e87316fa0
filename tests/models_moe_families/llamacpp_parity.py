"""FreeToken against llama.cpp on one GGUF: the next-token distribution after random prompts.

llama.cpp's ``llama-server`` (the independent reference: its own GGUF reader, tensor layouts,
dequantization and model graph) and FreeToken's engine on the cpu backend read the same file
(``freetoken bench make-model --vocab bpe``: llama-server needs token texts). For each of
``--prompts`` prompts of ``--len`` random token ids, both give the log-probabilities of the
next token (llama.cpp: ``/completion`` with ``n_probs``, before sampling; FreeToken:
``top_logprobs``). Printed as one JSON line: how often the most likely token agrees, and the
largest and mean difference of the log-probabilities of llama.cpp's five most likely tokens
(those FreeToken also ranks in its top 20). Not a test (CI builds no llama.cpp): run it by
hand, e.g.

    python tests/models_moe_families/llamacpp_parity.py glm-tiny-bpe.gguf /tmp/llama-cpu/bin/llama-server

The two differ by design in how activations are quantized for the K-quant dot products
(llama.cpp: Q8_K per 256 values; FreeToken: int8 per 32 or per 256 values, by ISA tier) and
in float summation order; a wrong tensor, layout or hyper-parameter shows as disagreement
far beyond that.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import urllib.request
from typing import Any

TOP = 5
FREETOKEN_TOP = 20


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _wait_health(url: str, proc: subprocess.Popen, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("llama-server did not become healthy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("llama_server")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--len", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=18471)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-args", default="", help="more llama-server arguments, e.g. \"-ctk f32 -fa off\"")
    args = ap.parse_args()

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine
    from freetoken.engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=args.gguf, backend="cpu", max_model_len=args.len + 8, cpu_threads=args.threads))
    vocab = eng.model_config.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(300, vocab - 1) for _ in range(args.len)] for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=True,
                            top_logprobs=FREETOKEN_TOP)
    ours = []
    for ids in prompts:
        req = eng.add_request(ids, params)
        while eng.has_work():
            eng.step()
        ours.append(dict(req.logprobs[0].top))
    eng.close()

    url = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen([args.llama_server, "-m", args.gguf, "-t", str(args.threads), "-c", str(4 * (args.len + 8)),
                             "--host", "127.0.0.1", "--port", str(args.port), *args.llama_args.split()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_health(url, proc, 120)
        theirs = []
        for ids in prompts:
            # a few tokens: llama-server holds a token back (and its probabilities) while its
            # bytes end inside a UTF-8 character; the first entry is the first token's
            out = _post(url + "/completion", {"prompt": ids, "n_predict": 4, "n_probs": TOP, "temperature": 0.0,
                                              "post_sampling_probs": False, "cache_prompt": False,
                                              "ignore_eos": True})
            theirs.append([(int(p["id"]), float(p["logprob"])) for p in out["completion_probabilities"][0]["top_logprobs"]])
    finally:
        proc.terminate()
        proc.wait(30)

    agree, diffs, missing = 0, [], 0
    for mine, ref in zip(ours, theirs):
        agree += max(mine, key=mine.get) == ref[0][0]
        for tid, lp in ref:
            if tid in mine:
                diffs.append(abs(mine[tid] - lp))
            else:
                missing += 1
    print(json.dumps({
        "gguf": args.gguf, "prompts": len(prompts), "prompt_len": args.len, "top1_agree": agree,
        "compared": len(diffs), "missing_from_top20": missing,
        "max_abs_logprob_diff": round(max(diffs, default=float("nan")), 4),
        "mean_abs_logprob_diff": round(sum(diffs) / max(len(diffs), 1), 4),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
