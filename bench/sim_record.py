"""Records a real single-replica run of the embedded model for the simulator's checks.

The real LLMEngine (SmolLM2-135M on CPU) is driven on the wall clock by the engine's own loop
shape (add what has arrived, step, sleep when idle) with arrivals from a trace. It writes the
engine's --step-log (the profile fit's input) and a JSON with each request's arrival, first-token
and finish times, and each step's batch composition (request, start, tokens per chunk) together
with the requests added just before it, so the simulator can replay the same arrivals.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sim_record.py --trace t.csv --step-log s.jsonl --out run.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="plain CSV trace (iterserve simulate gen)")
    parser.add_argument("--step-log", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from iterserve.engine.config import EngineConfig
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.engine.sampling_params import SamplingParams
    from iterserve.simulate.replica import prompt_tokens
    from iterserve.simulate.traces import load_trace

    torch.set_num_threads(args.threads)
    trace = load_trace(args.trace)
    if os.path.exists(args.step_log):
        os.remove(args.step_log)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, step_log=args.step_log, seed=0)
    load_started = time.perf_counter()
    engine = LLMEngine.from_config(config)
    load_s = time.perf_counter() - load_started

    steps: list[dict] = []
    real_execute = engine.executor.execute

    def recording_execute(out):
        steps[-1]["chunks"] = [[c.seq.request_id, c.start, c.num_tokens] for c in out.chunks]
        return real_execute(out)

    requests = [{"id": str(i), "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                 "output_tokens": r.output_tokens} for i, r in enumerate(trace)]
    by_id = {r["id"]: r for r in requests}
    # Warm-up outside the timed run (first-call allocations), like a server before it turns ready.
    engine.add_request(prompt_token_ids=[100] * 32, params=SamplingParams(max_tokens=4, ignore_eos=True),
                       request_id="warmup")
    while engine.has_unfinished_requests():
        engine.step()
    with open(args.step_log, "w"):
        pass  # the warm-up's steps are not part of the run
    engine.executor.execute = recording_execute

    started = time.perf_counter()
    engine.clock = lambda: time.perf_counter() - started
    next_index = 0
    while next_index < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter() - started
        added = []
        while next_index < len(requests) and requests[next_index]["arrival_s"] <= now:
            r = requests[next_index]
            # The simulator's prompts: no two share a KV block, so no prefix-cache hits on either side.
            engine.add_request(prompt_token_ids=prompt_tokens(int(r["id"]), r["prompt_tokens"]),
                               params=SamplingParams(max_tokens=r["output_tokens"], ignore_eos=True, temperature=0),
                               request_id=r["id"], arrival_time=r["arrival_s"])
            r["added_s"] = now
            added.append(r["id"])
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[next_index]["arrival_s"] - (time.perf_counter() - started)))
            continue
        steps.append({"added": added, "chunks": [], "start": now})
        cpu_started = time.thread_time()
        outputs = engine.step()
        steps[-1]["cpu_s"] = time.thread_time() - cpu_started  # the step's own CPU time, whatever else runs
        for output in outputs:
            r = by_id[output.request_id]
            t = time.perf_counter() - started
            if output.outputs[0].new_token_ids:
                r.setdefault("first_token_s", t)
                r["tokens"] = r.get("tokens", 0) + 1
            if output.finished:
                r["finished_s"] = t
        steps[-1]["end"] = time.perf_counter() - started
    wall = time.perf_counter() - started
    engine.close()
    with open(args.out, "w") as handle:
        json.dump({"trace": os.path.basename(args.trace), "max_num_seqs": args.max_num_seqs,
                   "model_load_s": load_s, "wall_s": wall, "load_average": os.getloadavg(),
                   "requests": requests, "steps": steps}, handle)
    done = [r for r in requests if "finished_s" in r]
    print(f"{len(done)}/{len(requests)} requests in {wall:.1f} s, {len(steps)} steps, load avg {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
