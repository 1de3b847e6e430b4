"""Where one engine step's time goes on CPU: matmuls, attention (KV write + gather + SDPA), other
ops, and Python/dispatch overhead, for tail steps, full-batch steps and a prefill chunk, at 1 and 2
torch threads, for three variants of the same model: `before` (every dense linear through
F.linear, as before the small-row path in engine/model/llama.py, and the torch attention backend
of --baseline-rev), `eager` (today's default) and `compiled` (`--compile`, engine/model/compiled.py).

Each step is what ModelRunner.execute does for a batch: the per-step attention metadata, the
decoder forward and the LM head for the sampled rows, on the real embedded model (SmolLM2-135M).
For every (threads, scenario) the variants are timed interleaved in one process (median and min
of --repeats), then one step of each runs under torch.profiler:

- matmul: self CPU time of the matmul ops (aten::mm/addmm, the int8/int4 weight-only kernels);
- attention: self CPU time of the ops inside the backend's write_kv/attend;
- other ops: every other op (norms, rotary, SiLU, embedding, copies; compiled C++ kernels);
- python/dispatch: the profiled step's wall time minus all op time.
The profiler adds its own per-op cost, so these are shares of a slightly slower step; the
unprofiled wall time is the figure to compare. A second estimate of the overhead: the same step
under a "skeleton" model (same layers, heads and batch, hidden size 32, head_dim 8, vocab 64), whose
ops do almost no arithmetic, so its wall time is the Python + dispatch + metadata cost.

Each thread count runs in its own process (OpenMP's pool and inductor's generated code both depend
on it). OMP_WAIT_POLICY=PASSIVE as `iterserve serve` sets it.

    python -m bench.kernels.step_overhead --json docs/perf/step_overhead.json
    python -m bench.kernels.step_overhead --quick --variants before,eager --threads 1
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as `iterserve serve` does

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.kernels import baseline  # noqa: E402
from iterserve.engine.attention.backend import AttentionMetadata  # noqa: E402
from iterserve.engine.attention.torch_backend import TorchBackend  # noqa: E402
from iterserve.engine.model import llama  # noqa: E402
from iterserve.engine.model.llama import LlamaModel  # noqa: E402
from iterserve.engine.model.loader import ModelConfig, load_model  # noqa: E402
from iterserve.engine.model.registry import resolve_model_path  # noqa: E402

BLOCK = 16
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int8pack_mm",
              "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int4pack_mm"}
ATTENTION_RANGE = "iterserve::attention"


@dataclass(frozen=True)
class Scenario:
    name: str
    seqs: int
    query_len: int  # tokens per sequence this step (1: decode)
    context: int  # tokens in the cache after the step


SCENARIOS = [Scenario("tail-1", 1, 1, 256), Scenario("tail-2", 2, 1, 256), Scenario("tail-4", 4, 1, 256),
             Scenario("full-32", 32, 1, 128), Scenario("full-64", 64, 1, 64), Scenario("prefill-512", 1, 512, 512)]
QUICK = ["tail-2", "full-32", "prefill-512"]


class Profiled:
    """Mixed into an attention backend: its KV write and attention marked for the profiler."""

    profiling = False

    def write_kv(self, key, value, k_cache, v_cache, meta):
        if not Profiled.profiling:
            return super().write_kv(key, value, k_cache, v_cache, meta)
        with torch.profiler.record_function(ATTENTION_RANGE):
            return super().write_kv(key, value, k_cache, v_cache, meta)

    def attend(self, query, k_cache, v_cache, meta, scale, *options):
        if not Profiled.profiling:
            return super().attend(query, k_cache, v_cache, meta, scale, *options)
        with torch.profiler.record_function(ATTENTION_RANGE):
            return super().attend(query, k_cache, v_cache, meta, scale, *options)


class ProfiledBackend(Profiled, TorchBackend):
    pass


def baseline_backend(rev: str):
    """The torch backend as it was at git revision rev, profiled."""
    return type("BaselineBackend", (Profiled, baseline.torch_backend_class(rev)), {})()


def skeleton_model(cfg: ModelConfig, quantization: str) -> LlamaModel:
    """The real model's structure with almost no arithmetic: same layers, heads and op sequence."""
    tiny = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=cfg.num_layers,
                       num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=8,
                       rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=1024,
                       tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(64, 32, generator=gen) * 0.1,
               "model.norm.weight": torch.ones(32)}
    q, kv = tiny.num_heads * 8, tiny.num_kv_heads * 8
    for i in range(tiny.num_layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (q, 32), "self_attn.k_proj": (kv, 32), "self_attn.v_proj": (kv, 32),
                  "self_attn.o_proj": (32, q), "mlp.gate_proj": (32, 32), "mlp.up_proj": (32, 32),
                  "mlp.down_proj": (32, 32)}
        for name, shape in shapes.items():
            weights[p + name + ".weight"] = torch.randn(*shape, generator=gen) * 0.1
        weights[p + "input_layernorm.weight"] = torch.ones(32)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(32)
    return LlamaModel.from_weights(tiny, weights, ProfiledBackend(), torch.device("cpu"), torch.float32,
                                   max_positions=1024, quantization=quantization)


class Case:
    """A model, its KV caches and one scenario's inputs; step() runs what ModelRunner.execute runs."""

    def __init__(self, model: LlamaModel, caches, scenario: Scenario, seed: int, small_rows: int | None = None):
        self.model, self.caches, self.s = model, caches, scenario
        self.small_rows = llama.SMALL_ROWS if small_rows is None else small_rows
        blocks = -(-scenario.context // BLOCK)
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(caches[0][0]), generator=gen).tolist()  # scattered blocks, as in a real pool
        self.tables = [order[i * blocks:(i + 1) * blocks] for i in range(scenario.seqs)]
        n = scenario.seqs * scenario.query_len
        self.ids = torch.randint(0, min(model.config.vocab_size, 20000), (n,), generator=gen)
        self.positions = torch.arange(scenario.context - scenario.query_len, scenario.context).repeat(scenario.seqs)
        self.sample_rows = torch.arange(scenario.query_len - 1, n, scenario.query_len)

    def step(self) -> tuple[float, float]:
        s, default = self.s, llama.SMALL_ROWS
        llama.SMALL_ROWS = self.small_rows
        try:
            return self._step(s)
        finally:
            llama.SMALL_ROWS = default

    def _step(self, s: Scenario) -> tuple[float, float]:
        start = time.perf_counter()
        meta = AttentionMetadata.build([s.query_len] * s.seqs, [s.context] * s.seqs, self.tables, BLOCK)
        built = time.perf_counter()
        hidden = self.model(self.ids, self.positions, self.caches, meta)
        rows = hidden if s.query_len == 1 else hidden[self.sample_rows]
        self.model.compute_logits(rows).argmax(-1)
        return time.perf_counter() - start, built - start


def kv_caches(cfg: ModelConfig, blocks: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shape = (blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.randn(*shape, generator=gen) * 0.1, torch.randn(*shape, generator=gen) * 0.1)
            for _ in range(cfg.num_layers)]


def breakdown(case: Case) -> dict:
    """One profiled step: ms of matmul / attention / other ops / python+dispatch."""
    Profiled.profiling = True
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            wall, _ = case.step()
    finally:
        Profiled.profiling = False
    totals = {"matmul": 0.0, "attention": 0.0, "other_ops": 0.0}
    for event in prof.events():
        name = event.name
        if not (name.startswith("aten::") or "cpp_fused" in name or name.startswith("torch_ops")):
            continue
        parent, in_attention = event.cpu_parent, False
        while parent is not None:
            if parent.name == ATTENTION_RANGE:
                in_attention = True
                break
            parent = parent.cpu_parent
        kind = "attention" if in_attention else "matmul" if name in MATMUL_OPS else "other_ops"
        totals[kind] += event.self_cpu_time_total / 1e3
    ops = sum(totals.values())
    return {**{k: round(v, 3) for k, v in totals.items()}, "python_dispatch": round(wall * 1e3 - ops, 3),
            "profiled_wall": round(wall * 1e3, 3)}


def run_child(args) -> dict:
    torch.set_num_threads(args.threads)
    from iterserve.engine.model.compiled import compile_model

    scenarios = [s for s in SCENARIOS if s.name in (QUICK if args.quick else args.scenarios.split(","))]
    loaded = load_model(resolve_model_path(None)[0], show_progress=False, keep_q4_1="int4" in args.modes)
    cfg = loaded.config
    blocks = max(s.seqs * -(-s.context // BLOCK) for s in scenarios) + 8
    caches = kv_caches(cfg, blocks, args.seed)
    results, compile_s = [], {}
    for mode in args.modes.split(","):
        real = LlamaModel.from_weights(cfg, dict(loaded.weights), ProfiledBackend(), torch.device("cpu"),
                                       torch.float32, max_positions=1024, quantization=mode,
                                       q4_1=dict(loaded.q4_1 or {}))
        skeleton = skeleton_model(cfg, mode)
        skeleton_caches = kv_caches(skeleton.config, blocks, args.seed)
        variants, small_rows = {}, {"before": 0}
        for variant in args.variants.split(","):
            if variant == "compiled":
                # Separate model objects sharing the weights: one eager, one compiled.
                real_c = LlamaModel(cfg, real.backend, real.layers, real.embed_tokens, real.norm, real.lm_head,
                                    1024, mode)
                skel_c = LlamaModel(skeleton.config, skeleton.backend, skeleton.layers, skeleton.embed_tokens,
                                    skeleton.norm, skeleton.lm_head, 1024, mode)
                t0 = time.perf_counter()
                compile_model(real_c)
                compile_s[mode] = round(time.perf_counter() - t0, 1)
                compile_model(skel_c)
                variants[variant] = (real_c, skel_c)
            elif variant == "before":
                old = baseline_backend(args.baseline_rev)
                variants[variant] = tuple(LlamaModel(m.config, old, m.layers, m.embed_tokens, m.norm, m.lm_head, 1024,
                                                     mode) for m in (real, skeleton))
            elif variant == "eager":
                variants[variant] = (real, skeleton)
            else:
                raise SystemExit(f"unknown variant {variant!r}; choose from before, eager, compiled")
        for scenario in scenarios:
            cases = {v: (Case(m, caches, scenario, args.seed, small_rows.get(v)),
                         Case(sk, skeleton_caches, scenario, args.seed, small_rows.get(v)))
                     for v, (m, sk) in variants.items()}
            times = {v: [] for v in cases}
            meta_times = {v: [] for v in cases}
            skel_times = {v: [] for v in cases}
            with torch.inference_mode():
                for case, skel in cases.values():  # warm: first-call allocations, any late compile
                    case.step()
                    skel.step()
                for _ in range(args.repeats):
                    for v, (case, skel) in cases.items():
                        wall, meta = case.step()
                        times[v].append(wall)
                        meta_times[v].append(meta)
                        skel_times[v].append(skel.step()[0])
                for v, (case, _) in cases.items():
                    row = {"threads": args.threads, "quantization": mode, "variant": v, "scenario": scenario.name,
                           "seqs": scenario.seqs, "query_len": scenario.query_len, "context": scenario.context,
                           "step_ms_median": round(statistics.median(times[v]) * 1e3, 3),
                           "step_ms_min": round(min(times[v]) * 1e3, 3),
                           "metadata_ms_median": round(statistics.median(meta_times[v]) * 1e3, 3),
                           "skeleton_ms_median": round(statistics.median(skel_times[v]) * 1e3, 3),
                           "profile_ms": breakdown(case), "load_average_1m": round(os.getloadavg()[0], 2)}
                    row["tokens_per_s"] = round(scenario.seqs * scenario.query_len / statistics.median(times[v]), 1)
                    results.append(row)
                    p = row["profile_ms"]
                    print(f"t{args.threads} {mode:5} {v:8} {scenario.name:12} {row['step_ms_median']:8.1f} ms "
                          f"(min {row['step_ms_min']:.1f}, meta {row['metadata_ms_median']:.2f}, skeleton "
                          f"{row['skeleton_ms_median']:.1f})  profile: mm {p['matmul']:.1f} attn {p['attention']:.1f}"
                          f" other {p['other_ops']:.1f} py {p['python_dispatch']:.1f} of {p['profiled_wall']:.1f}",
                          flush=True)
        del real, variants
    return {"results": results, "compile_s": compile_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"scenarios {', '.join(QUICK)} and 3 repeats")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--threads", default="1,2", help="torch thread counts, each in its own process (default 1,2)")
    parser.add_argument("--modes", default="none", help="quantization modes, e.g. none,int8 (default none)")
    parser.add_argument("--variants", default="before,eager,compiled",
                        help="any of before, eager, compiled (default all three)")
    parser.add_argument("--scenarios", default=",".join(s.name for s in SCENARIOS))
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per variant (default 7)")
    parser.add_argument("--baseline-rev", default="138bf3a",
                        help="git revision whose torch attention backend the `before` variant runs (default "
                             "%(default)s, the attention backend before its per-step plan)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 3)
    if args.child_out:
        args.threads = int(args.threads)
        with open(args.child_out, "w") as out:
            json.dump(run_child(args), out)
        return 0
    info = common.machine(0)
    info["torch_threads"] = args.threads
    info["omp_wait_policy"] = os.environ["OMP_WAIT_POLICY"]
    results, compile_s = [], {}
    for threads in args.threads.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            child = [sys.executable, "-m", "bench.kernels.step_overhead", "--threads", threads, "--modes", args.modes, "--variants", args.variants,
                     "--scenarios", args.scenarios, "--repeats", str(args.repeats), "--seed", str(args.seed),
                     "--baseline-rev", args.baseline_rev,
                     "--child-out", tmp.name] + (["--quick"] if args.quick else [])
            env = dict(os.environ, OMP_NUM_THREADS=threads)
            subprocess.run(child, check=True, env=env, cwd=common.REPO)
            data = json.load(open(tmp.name))
        results += data["results"]
        compile_s[f"t{threads}"] = data["compile_s"]
    print()
    headers = ["threads", "mode", "variant", "scenario", "step ms", "tok/s", "mm", "attn", "other", "py+disp",
               "skeleton"]
    print(common.format_table(headers, [[r["threads"], r["quantization"], r["variant"], r["scenario"],
                                         r["step_ms_median"], r["tokens_per_s"], r["profile_ms"]["matmul"],
                                         r["profile_ms"]["attention"], r["profile_ms"]["other_ops"],
                                         r["profile_ms"]["python_dispatch"], r["skeleton_ms_median"]]
                                        for r in results]))
    speedups = []
    by_key = {(r["threads"], r["quantization"], r["scenario"], r["variant"]): r["step_ms_median"] for r in results}
    for (threads, mode, scenario, variant), ms in by_key.items():
        base = {"eager": "before", "compiled": "eager"}.get(variant)
        if base and (threads, mode, scenario, base) in by_key:
            speedups.append({"threads": threads, "quantization": mode, "scenario": scenario,
                             "change": f"{variant} vs {base}",
                             "speedup": round(by_key[(threads, mode, scenario, base)] / ms, 3)})
    for t2 in [k for k in by_key if k[0] == 2]:
        if (1, *t2[1:]) in by_key:
            speedups.append({"threads": "2 vs 1", "quantization": t2[1], "scenario": t2[2],
                             "change": f"{t2[3]}: 2 threads vs 1",
                             "speedup": round(by_key[(1, *t2[1:])] / by_key[t2], 3)})
    if speedups:
        print()
        print(common.format_table(["threads", "mode", "scenario", "change", "speedup"],
                                  [[x["threads"], x["quantization"], x["scenario"], x["change"], x["speedup"]]
                                   for x in speedups]))
    if compile_s:
        print("compile + warm-up seconds:", compile_s)
    common.write_json(args.json, {"benchmark": "step_overhead", "machine": common.finish_machine(info),
                                  "compile_s": compile_s, "speedups": speedups, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
