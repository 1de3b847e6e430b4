"""The throughput cost of structured outputs (grammar-constrained decoding, engine/structured).

The embedded SmolLM2-135M generates a batch of sampled answers under a nested JSON schema (the one
tests/integration/test_openai_structured.py validates), then the same prompts, seeds and batch
without the schema, each request generating exactly as many tokens as its constrained twin
(ignore_eos, max_tokens = that length). Reported: generated tokens per second for each, their ratio,
the time spent filling and applying the token bitmasks per step, and the grammar compile times
(the first compile builds xgrammar's view of the vocabulary; a repeated schema hits the cache).
Runs alternate (unconstrained, constrained, ...) so a change in the machine's load does not favour
one; compare ratios within one run.

    python -m bench.engine.structured_outputs --json docs/perf/structured_outputs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench import common
from iterserve.engine import LLM, SamplingParams
from iterserve.engine.structured import Grammars, StructuredOutput
from tests.integration.test_openai_structured import ASK, PERSON  # (the schema the test validates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--batch", type=int, help="requests per run, all at once (default 16; quick: 4)")
    parser.add_argument("--repeats", type=int, help="runs of each kind, alternating (default 3; quick: 1)")
    args = parser.parse_args(argv)
    batch = args.batch or (4 if args.quick else 16)
    repeats = args.repeats or (1 if args.quick else 3)
    common.set_threads(args.threads)
    info = common.machine(args.threads)

    llm = LLM(max_model_len=1024, max_num_seqs=batch)
    runner = llm.engine.executor
    grammars: Grammars = runner.grammars
    prompt = llm.engine.tokenizer.apply_chat_template(ASK)
    structured = StructuredOutput.json_schema(PERSON)

    started = time.perf_counter()
    grammars.compile(structured)
    first_compile = time.perf_counter() - started
    started = time.perf_counter()
    grammars.compile(StructuredOutput.json_schema(json.loads(json.dumps(PERSON))))
    cached_compile = time.perf_counter() - started

    matchers = runner.sampler._matchers
    mask_times: list[float] = []
    real_mask = matchers.mask

    def timed_mask(*a, **k):
        t = time.perf_counter()
        real_mask(*a, **k)
        mask_times.append(time.perf_counter() - t)

    matchers.mask = timed_mask
    runs: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    for repeat in range(repeats):
        seeds = [args.seed + repeat * batch + i for i in range(batch)]
        constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=400, structured=structured)
                       for s in seeds]
        mask_times.clear()
        started = time.perf_counter()
        outs = llm.generate([prompt] * batch, constrained, use_tqdm=False)
        wall = time.perf_counter() - started
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = sum(_valid(o.outputs[0].text) for o in outs)
        runs["constrained"].append({"wall_s": wall, "tokens": sum(lengths), "tokens_per_s": sum(lengths) / wall,
                                    "valid": valid, "steps_masked": len(mask_times),
                                    "mask_ms_per_step": 1000 * statistics.mean(mask_times) if mask_times else 0.0,
                                    "mask_share": sum(mask_times) / wall})
        free = [SamplingParams(temperature=1.0, seed=s, max_tokens=n, ignore_eos=True)
                for s, n in zip(seeds, lengths, strict=True)]
        started = time.perf_counter()
        outs = llm.generate([prompt] * batch, free, use_tqdm=False)
        wall = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        runs["unconstrained"].append({"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall})
        print(f"repeat {repeat}: constrained {runs['constrained'][-1]['tokens_per_s']:.1f} tok/s "
              f"({valid}/{batch} valid), unconstrained {runs['unconstrained'][-1]['tokens_per_s']:.1f} tok/s",
              flush=True)

    free_tps = statistics.median(r["tokens_per_s"] for r in runs["unconstrained"])
    cons_tps = statistics.median(r["tokens_per_s"] for r in runs["constrained"])
    summary = {
        "batch": batch, "repeats": repeats,
        "unconstrained_tokens_per_s": free_tps, "constrained_tokens_per_s": cons_tps,
        "throughput_ratio": cons_tps / free_tps,
        "mask_ms_per_step": statistics.median(r["mask_ms_per_step"] for r in runs["constrained"]),
        "mask_share_of_wall": statistics.median(r["mask_share"] for r in runs["constrained"]),
        "valid": sum(r["valid"] for r in runs["constrained"]), "generations": batch * repeats,
        "first_compile_s": first_compile, "cached_compile_s": cached_compile,
    }
    print(common.format_table(["measure", "value"], [[k, v] for k, v in summary.items()]))
    if args.json:
        payload = {"summary": summary, "runs": runs, "machine": common.finish_machine(info)}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
