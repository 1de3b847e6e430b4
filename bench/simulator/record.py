"""Records real single-replica runs of the embedded model for the simulator's checks.

The real LLMEngine (SmolLM2-135M on CPU) is driven by the engine's own loop shape (add what has
arrived, step, sleep when idle) with arrivals from a trace. Each run writes the engine's
--step-log (the profile fit's input: every step's wall duration_s, its engine-thread CPU time
cpu_s and the load average) and a JSON with each request's arrival, first-token and finish
times, and each step's batch composition (request, start, tokens per chunk) together with the
requests added just before it, so the simulator can replay the same arrivals.

Clocks (--clock):
  wall  the run's time is the wall clock: what a user of this machine sees, including whatever
        share of the cores the other processes take.
  cpu   the run's time advances by each step's own engine-thread CPU time (and jumps to the next
        arrival when idle): the run as it would go on a core of its own. Arrivals, TTFT and
        throughput are on that clock; other load on the machine slows the recording down but
        hardly changes its figures. On a dedicated replica the two clocks agree.

--repeat N records N independent runs of the trace (a fresh engine each, so the prefix cache
starts empty); --replays K then replays the FIRST run's arrivals at the same steps K more times
(the same batch composition at every step: parity), so every step of it is measured K+1 times and
its median taken (bench/simulator/validate.py). Outputs: OUT (a JSON with every run) and STEP_LOG
with -rN / -pK suffixes for run N and replay K.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.simulator.record --trace t.csv --clock cpu \\
        --repeat 3 --replays 2 --step-log s.jsonl --out runs.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from iterserve.machine import cpu_model

os.environ.setdefault("OMP_NUM_THREADS", "1")


def suffixed(path: str, suffix: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{suffix}{p.suffix}"))


def record_run(trace, step_log: str, max_num_seqs: int, clock_kind: str, replay: dict | None = None) -> dict:
    """One run on a fresh engine. replay: a recorded run whose requests are added before the same
    steps as there (the clock then only timestamps)."""
    from iterserve.engine.config import EngineConfig
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.engine.sampling_params import SamplingParams
    from iterserve.replica_model.replica import prompt_tokens

    if os.path.exists(step_log):
        os.remove(step_log)
    config = EngineConfig(max_num_seqs=max_num_seqs, step_log=step_log, seed=0)
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

    def add(r: dict, now: float) -> None:
        # The simulator's prompts: no two share a KV block, so no prefix-cache hits on either side.
        engine.add_request(prompt_token_ids=prompt_tokens(int(r["id"]), r["prompt_tokens"]),
                           params=SamplingParams(max_tokens=r["output_tokens"], ignore_eos=True, temperature=0),
                           request_id=r["id"], arrival_time=r["arrival_s"])
        r["added_s"] = now

    # Warm-up outside the timed run (first-call allocations), like a server before it turns ready.
    engine.add_request(prompt_token_ids=[100] * 32, params=SamplingParams(max_tokens=4, ignore_eos=True),
                       request_id="warmup")
    while engine.has_unfinished_requests():
        engine.step()
    with open(step_log, "w"):
        pass  # the warm-up's steps are not part of the run
    engine.executor.execute = recording_execute

    load_before = os.getloadavg()
    started = time.perf_counter()
    virtual = [0.0]  # the cpu clock: the sum of the steps' own CPU time, plus idle jumps
    now_of = (lambda: virtual[0]) if clock_kind == "cpu" else (lambda: time.perf_counter() - started)
    engine.clock = now_of
    next_index = 0
    replay_steps = replay["steps"] if replay else None
    while (next_index < len(requests) or engine.has_unfinished_requests()) if replay is None \
            else len(steps) < len(replay_steps):
        now = now_of()
        added = []
        if replay is None:
            while next_index < len(requests) and requests[next_index]["arrival_s"] <= now:
                add(requests[next_index], now)
                added.append(requests[next_index]["id"])
                next_index += 1
            if not engine.has_unfinished_requests():
                wait = requests[next_index]["arrival_s"] - now
                if clock_kind == "cpu":
                    virtual[0] += max(0.0, wait)
                else:
                    time.sleep(max(0.0, wait))
                continue
        else:
            for request_id in replay_steps[len(steps)]["added"]:
                add(by_id[request_id], now)
                added.append(request_id)
        steps.append({"added": added, "chunks": [], "start": now})
        wall_started, cpu_started = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        cpu = time.thread_time() - cpu_started
        steps[-1]["cpu_s"] = cpu  # the step's own CPU time, whatever else runs
        steps[-1]["wall_s"] = time.perf_counter() - wall_started
        if clock_kind == "cpu":
            virtual[0] += cpu
        t = now_of()
        for output in outputs:
            r = by_id[output.request_id]
            if output.outputs[0].new_token_ids:
                r.setdefault("first_token_s", t)
                r["tokens"] = r.get("tokens", 0) + 1
            if output.finished:
                r["finished_s"] = t
        steps[-1]["end"] = t
    wall = time.perf_counter() - started
    engine.close()
    return {"clock": clock_kind, "replay_of_first_run": replay is not None, "model_load_s": load_s,
            "wall_s": wall, "clock_s": now_of(), "load_average_before": load_before,
            "load_average_after": os.getloadavg(), "step_log": os.path.basename(step_log),
            "requests": requests, "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, help="plain CSV trace (iterserve simulate gen)")
    parser.add_argument("--step-log", required=True, help="step log path (suffixed -rN / -pK per run)")
    parser.add_argument("--out", required=True, help="the runs' JSON")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="wall: real time; cpu: time advances by each step's own CPU time (see below)")
    parser.add_argument("--repeat", type=int, default=1, help="independent runs of the trace (default 1)")
    parser.add_argument("--replays", type=int, default=0,
                        help="replays of the first run's arrivals at the same steps (default 0)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.repeat < 1 or args.replays < 0:
        parser.error("--repeat must be >= 1 and --replays >= 0")

    import torch

    from iterserve.simulate.traces import load_trace

    torch.set_num_threads(args.threads)
    trace = load_trace(args.trace)
    runs, replays = [], []
    for n in range(args.repeat):
        log = args.step_log if args.repeat == 1 and not args.replays else suffixed(args.step_log, f"r{n + 1}")
        runs.append(record_run(trace, log, args.max_num_seqs, args.clock))
        report("run", n + 1, runs[-1])
    for k in range(args.replays):
        replays.append(record_run(trace, suffixed(args.step_log, f"p{k + 1}"), args.max_num_seqs, args.clock,
                                  replay=runs[0]))
        report("replay", k + 1, replays[-1])
    first = runs[0]
    document = {"trace": os.path.basename(args.trace), "max_num_seqs": args.max_num_seqs, "clock": args.clock,
                "machine": {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "torch_threads": args.threads},
                # The first run's fields at the top level (what older readers of this file expect).
                "model_load_s": first["model_load_s"], "wall_s": first["wall_s"],
                "load_average": first["load_average_after"], "requests": first["requests"],
                "steps": first["steps"], "runs": runs, "replays": replays}
    Path(args.out).write_text(json.dumps(document))
    print(f"wrote {args.out}")
    return 0


def report(kind: str, n: int, run: dict) -> None:
    done = [r for r in run["requests"] if "finished_s" in r]
    cpu = sum(s["cpu_s"] for s in run["steps"])
    wall = sum(s["wall_s"] for s in run["steps"])
    load = statistics.mean([run["load_average_before"][0], run["load_average_after"][0]])
    print(f"{kind} {n}: {len(done)}/{len(run['requests'])} requests, {len(run['steps'])} steps, "
          f"{run['clock']} clock {run['clock_s']:.1f} s, steps' CPU {cpu:.1f} s / wall {wall:.1f} s "
          f"(x{wall / cpu:.2f}), load average ~{load:.1f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
