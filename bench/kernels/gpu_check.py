"""The checks that need a CUDA GPU, as one command (`make gpu-check`), writing one JSON:

1. kernels compiled for real: the embedded SmolLM2 (dense fp32) through the Triton backend against
   the torch reference backend on the same GPU: greedy tokens (32 per prompt, chunked prefill)
   and the prompt logprobs (every prefill row goes through the attention, norm, rotary, SiLU and
   KV-write kernels), max difference;
2. the model's greedy parity on CUDA: the same tokens as on the CPU (torch backend, fp32);
3. tensor parallelism on NCCL where two GPUs are visible: TP=2 gives TP=1's greedy tokens (a random
   Llama of SmolLM2's shape with 8 heads: SmolLM2's own 9 do not split in 2);
4. step time: the model time of one decode step at several batch sizes (Triton backend, bf16),
   and the per-kernel benchmark (bench/kernels/triton_kernels.py) with its own grid.

Sized to finish in under 8 minutes on one GPU. Without a CUDA device it says so, writes nothing,
and exits 0: nothing here ran.

    python -m bench.kernels.gpu_check --json bench/results/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common

PROMPTS = ["Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker",
           "The capital of France is", "def fibonacci(n):", "List three colours of the rainbow:"]
NEW_TOKENS = 32


def greedy(device: str, backend: str, dtype: str = "float32", tp: int = 1, model: str = "smollm2-135m") -> dict:
    from iterserve.engine import LLM, SamplingParams

    llm = LLM(model=model, device=device, attention_backend=backend, dtype=dtype, quantization="none",
              tensor_parallel_size=tp, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=512)
    try:
        started = time.perf_counter()
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, prompt_logprobs=1),
                               use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "prompt_logprobs": [[p.logprob for p in o.prompt_logprobs if p is not None] for o in outputs],
                "seconds": time.perf_counter() - started}
    finally:
        llm.engine.close()


def compare(a: dict, b: dict) -> dict:
    same = sum(x == y for x, y in zip(a["tokens"], b["tokens"], strict=True))
    diffs = [abs(x - y) for pa, pb in zip(a["prompt_logprobs"], b["prompt_logprobs"], strict=True)
             for x, y in zip(pa, pb, strict=True)]
    return {"prompts_with_equal_tokens": same, "prompts": len(PROMPTS),
            "max_prompt_logprob_diff": max(diffs) if diffs else None}


def decode_step_ms(batch: int, steps: int = 20) -> float:
    from iterserve.engine.config import EngineConfig
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(model="smollm2-135m", device="cuda", attention_backend="triton",
                                                dtype="bfloat16", quantization="none", max_num_seqs=batch,
                                                max_model_len=512, enable_prefix_caching=False))
    try:
        params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
        for i in range(batch):
            engine.add_request(None, params, [100 + (i * 7 + j) % 150 for j in range(64)])
        for _ in range(4):
            engine.step()
        times = []
        for _ in range(steps):
            engine.step()
            times.append(engine.last_timing.model_s)
        return 1000 * statistics.median(times)
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", default="bench/results/gpu_check.json")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible on this machine; nothing ran and nothing was written.")
        return 0
    started = time.perf_counter()
    result: dict = {"benchmark": "gpu_check", "device": torch.cuda.get_device_name(0),
                    "cuda_devices": torch.cuda.device_count(), "torch": torch.__version__, "checks": {}}
    checks = result["checks"]

    def run(name, fn):
        try:
            checks[name] = fn()
        except Exception as error:  # noqa: BLE001 - one failed check is reported, the rest still run
            checks[name] = {"error": f"{type(error).__name__}: {error}"}
        checks[name]["ok"] = checks[name].get("ok", "error" not in checks[name])
        print(f"gpu-check {name}: {json.dumps(checks[name])[:400]}", flush=True)

    cache: dict = {}

    def cuda_torch():
        return cache.setdefault("cuda_torch", greedy("cuda", "torch"))

    def kernels():
        triton = cache.setdefault("cuda_triton", greedy("cuda", "triton"))
        out = compare(triton, cuda_torch())
        out["ok"] = out["max_prompt_logprob_diff"] is not None and out["max_prompt_logprob_diff"] < 1e-3
        return out

    def parity():
        out = compare(cuda_torch(), greedy("cpu", "torch"))
        out["ok"] = out["prompts_with_equal_tokens"] == len(PROMPTS)
        return out

    def nccl():
        if torch.cuda.device_count() < 2:
            return {"skipped": f"{torch.cuda.device_count()} CUDA device visible; TP=2 needs 2", "ok": None}
        from bench.engine.tp_step import random_llama  # SmolLM2's 9 heads do not split in 2

        with tempfile.TemporaryDirectory(prefix="iterserve-gpu-check-") as folder:
            model = str(random_llama(Path(folder)))
            out = compare(greedy("cuda", "triton", tp=2, model=model), greedy("cuda", "triton", model=model))
        out["ok"] = out["prompts_with_equal_tokens"] == len(PROMPTS)
        return out

    def step_time():
        return {"decode_step_ms_bf16_triton": {str(b): decode_step_ms(b) for b in (1, 16, 64)}}

    def kernel_bench():
        with tempfile.TemporaryDirectory(prefix="iterserve-gpu-check-") as folder:
            path = Path(folder) / "kernels.json"
            proc = subprocess.run([sys.executable, "-m", "bench.kernels.triton_kernels", "--json", str(path)],
                                  capture_output=True, text=True, timeout=240)
            if proc.returncode != 0:
                return {"error": proc.stderr[-2000:]}
            return {"result": json.loads(path.read_text())}

    for name, fn in (("kernels_vs_torch", kernels), ("greedy_cuda_vs_cpu", parity), ("tp2_nccl", nccl),
                     ("step_time", step_time), ("kernel_bench", kernel_bench)):
        run(name, fn)
    result["seconds"] = time.perf_counter() - started
    result["ok"] = all(c["ok"] is not False for c in checks.values())
    common.write_json(args.json, result)
    print(f"gpu-check: {'passed' if result['ok'] else 'FAILED'} in {result['seconds']:.0f} s; {args.json}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
