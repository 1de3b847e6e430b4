"""The cost of serving LoRA adapters: throughput of a batch mixing 8 adapters against the base model
alone, on the same engine, prompts and output lengths, in one run.

Eight rank-8 adapters on every linear (q/k/v/o, gate/up/down) of the embedded model, written in
PEFT's format with random weights (the cost does not depend on the values); --max-loras 8, so
every step mixes up to eight adapters and runs the batched LoRA op on each linear. Requests are
all submitted at once (offline throughput); prefix caching is off so repeated prompts are
recomputed in every configuration. Configurations alternate order over rounds; compare the ratio
within one run (the machine is shared: absolute figures are noisy).

    python -m bench.engine.lora --json docs/perf/lora.json --plot docs/perf/lora.png
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common
from iterserve.engine import LLM, SamplingParams
from iterserve.engine.lora.adapter import module_shapes

NUM_ADAPTERS = 8
RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIGS = ("base", "mixed-8-adapters")


def write_adapters(root: Path, model_config, count: int, rank: int) -> dict[str, str]:
    from safetensors.torch import save_file

    shapes = module_shapes(model_config)
    paths = {}
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(model_config.num_layers):
            for module in TARGETS:
                fan_in, fan_out = shapes[module]
                block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.05
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.05
        folder = root / f"adapter{i}"
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank,
                                                                "target_modules": list(TARGETS)}))
        paths[f"adapter{i}"] = str(folder)
    return paths


def run(llm: LLM, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = {engine.add_request(None, params, p, lora_name=a) for p, a in zip(prompts, adapters, strict=True)}
    generated = 0
    while ids:
        for out in engine.step():
            if out.finished:
                ids.discard(out.request_id)
                generated += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_second": generated / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--requests", type=int, help="requests per configuration and round (default 32; quick: 16)")
    parser.add_argument("--max-tokens", type=int, help="tokens generated per request (default 32; quick: 16)")
    parser.add_argument("--rounds", type=int, help="rounds, alternating the order (default 2; quick: 1)")
    args = parser.parse_args(argv)
    num_requests = args.requests or (16 if args.quick else 32)
    max_tokens = args.max_tokens or (16 if args.quick else 32)
    rounds = args.rounds or (1 if args.quick else 2)
    common.set_threads(args.threads)
    machine = common.machine(args.threads)
    with tempfile.TemporaryDirectory(prefix="iterserve-bench-lora-") as tmp:
        llm = LLM(device="cpu", dtype="float32", quantization="none", enable_lora=True, max_loras=NUM_ADAPTERS,
                  max_lora_rank=RANK, max_num_seqs=num_requests, enable_prefix_caching=False, max_model_len=512)
        paths = write_adapters(Path(tmp), llm.engine.executor.model.config, NUM_ADAPTERS, RANK)
        for name, path in paths.items():
            llm.engine.lora.register(name, path)
        rng = random.Random(args.seed)
        prompts = [[rng.randint(100, 20000) for _ in range(rng.randint(32, 96))] for _ in range(num_requests)]
        names = list(paths)
        adapters = {"base": [None] * num_requests,
                    "mixed-8-adapters": [names[i % NUM_ADAPTERS] for i in range(num_requests)]}
        for name in CONFIGS:  # warm-up: every slot written once, the base path run once
            run(llm, prompts[:NUM_ADAPTERS], adapters[name][:NUM_ADAPTERS] if name == "base" else names, 4)
        results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
        for round_index in range(rounds):
            order = CONFIGS if round_index % 2 == 0 else tuple(reversed(CONFIGS))
            for name in order:
                print(f"round {round_index + 1}/{rounds}: {name} ...", file=sys.stderr, flush=True)
                results[name].append(run(llm, prompts, adapters[name], max_tokens))
        llm.engine.close()
    summary = {name: statistics.median(r["tokens_per_second"] for r in runs) for name, runs in results.items()}
    report = {
        "benchmark": "lora",
        "provisional": "one shared, loaded machine: compare the ratio within this run, not the absolute figures",
        "machine": common.finish_machine(machine),
        "arguments": {"requests": num_requests, "max_tokens": max_tokens, "rounds": rounds, "adapters": NUM_ADAPTERS,
                      "rank": RANK, "targets": list(TARGETS), "dtype": "float32", "threads": args.threads},
        "runs": results,
        "tokens_per_second": summary,
        "mixed_over_base": summary["mixed-8-adapters"] / summary["base"],
    }
    print(common.format_table(["configuration", "tok/s (median)", "rounds"],
                              [[name, summary[name], len(results[name])] for name in CONFIGS]))
    print(f"mixed 8 adapters / base: {report['mixed_over_base']:.3f}")
    common.write_json(args.json, report)
    if args.plot:
        plt = common.pyplot()
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(list(CONFIGS), [summary[name] for name in CONFIGS], color=["#777777", "#3a7bd5"])
        ax.set_ylabel("generated tokens / s (median)")
        ax.set_title(f"LoRA: {NUM_ADAPTERS} rank-{RANK} adapters mixed vs base\n"
                     f"ratio {report['mixed_over_base']:.2f} (provisional, shared machine)", fontsize=9)
        common.save_figure(fig, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
