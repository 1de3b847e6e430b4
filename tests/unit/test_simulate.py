"""The autoscaling simulator: trace loaders and generators, the step-time fit, the replica model's
KV sizing, the fleet's autoscaling through the operator's decide(), and byte-for-byte determinism."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from iterserve.cli import main as iterserve_main
from iterserve.engine.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.operator.engine_config import engine_config_for
from iterserve.operator.models import InferenceServiceSpec
from iterserve.replica_model import profile as profiles
from iterserve.replica_model.replica import Replica, fake_model_profile
from iterserve.simulate import traces
from iterserve.simulate.cluster import ClusterSim, Delay, SimOptions
from iterserve.simulate.report import Slo, to_json

# ------------------------------------------------------------------------------------- traces


def test_loaders_read_each_format(tmp_path):
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:46.1805900,100,7\n"
                     "2023-11-16 18:15:50.0000000,2000,0\n")
    burst = tmp_path / "burst.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5,ChatGPT,472,18,490,Conversation log\n"
                     "45,ChatGPT,1087,0,1087,Conversation log\n"
                     "47,GPT-4,417,276,693,API log\n")
    mooncake = tmp_path / "mooncake.jsonl"
    mooncake.write_text('{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}\n'
                        '{"timestamp": 30535, "input_length": 6472, "output_length": 26, "hash_ids": [46]}\n')
    plain = tmp_path / "plain.csv"
    plain.write_text("timestamp_s,prompt_tokens,output_tokens\n0.5,10,20\n1.25,30,40\n")

    a = traces.load_trace(azure)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in a] == [
        (0.0, 100, 7), (0.5, 374, 44), (3.819410, 2000, 1)]  # sorted, relative, at least one output token
    b = traces.load_trace(burst)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in b] == [(0.0, 472, 18), (42.0, 417, 276)]
    m = traces.load_trace(mooncake)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in m] == [(0.0, 6955, 52), (3.053, 6472, 26)]
    p = traces.load_trace(plain)
    assert [(r.arrival_s, r.prompt_tokens) for r in p] == [(0.0, 10), (0.75, 30)]
    assert [traces.detect_format(f) for f in (azure, burst, mooncake, plain)] == ["azure", "burstgpt", "mooncake", "csv"]


def test_loader_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp_s,prompt_tokens,output_tokens\n0,ten,5\n")
    with pytest.raises(traces.TraceError, match=r"bad.csv:2: bad prompt_tokens 'ten'"):
        traces.load_trace(bad)
    unknown = tmp_path / "what.csv"
    unknown.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(traces.TraceError, match="cannot tell the trace format"):
        traces.load_trace(unknown)


def test_generators_are_seeded_and_shaped():
    fixed, zipf = traces.Lengths("fixed", 32), traces.Lengths.parse("zipf:256")
    a = traces.poisson(5.0, 400, fixed, zipf, seed=3)
    assert a == traces.poisson(5.0, 400, fixed, zipf, seed=3)
    assert a != traces.poisson(5.0, 400, fixed, zipf, seed=4)
    assert 1800 < len(a) < 2200
    outputs = [r.output_tokens for r in a]
    assert max(outputs) <= 256 and np.median(outputs) < 20 < max(outputs)  # Zipf: mostly short, long tail

    def cv(trace):
        gaps = np.diff([r.arrival_s for r in trace])
        return gaps.std() / gaps.mean()

    assert 0.9 < cv(a) < 1.1
    assert cv(traces.gamma(5.0, 3.0, 400, fixed, fixed, seed=1)) > 2.0
    day = traces.diurnal(2.0, 5.0, period=1000, duration=1000, prompt=fixed, output=fixed, seed=2)
    arrivals = [r.arrival_s for r in day]
    trough = sum(1 for t in arrivals if t < 100 or t > 900)
    peak = sum(1 for t in arrivals if 400 < t < 600)
    assert peak > 2.5 * trough


# ------------------------------------------------------------------------------------ the fit


def test_nnls_matches_the_known_answer():
    rng = np.random.default_rng(0)
    a = rng.random((50, 4))
    x = np.array([2.0, 0.0, 0.5, 3.0])
    assert np.allclose(profiles._lawson_hanson(a, a @ x), x, atol=1e-8)
    # A negative unconstrained answer is clamped to zero, and the residual is no worse than any
    # other non-negative point nearby.
    b = a @ np.array([1.0, -2.0, 1.0, 1.0])
    solved = profiles._lawson_hanson(a, b)
    assert (solved >= 0).all() and solved[1] == 0
    for _ in range(20):
        other = np.clip(solved + rng.normal(0, 0.05, 4), 0, None)
        assert np.linalg.norm(a @ solved - b) <= np.linalg.norm(a @ other - b) + 1e-9


def _synthetic_log(path, coefficients, steps=400, noise=0.02, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(steps):
            decode = rng.randint(0, 32)
            prefill = rng.choice([0, 0, 0, rng.randint(1, 512)])
            seqs = decode + (1 if prefill else 0)
            if seqs == 0:
                continue
            context = decode * rng.randint(20, 400) + prefill
            t = (coefficients["const"] + coefficients["prefill_tokens"] * prefill
                 + coefficients["decode_seqs"] * decode + coefficients["context_tokens"] * context)
            t *= 1 + rng.gauss(0, noise)
            handle.write(json.dumps({"step": i, "duration_s": t, "prefill_tokens": prefill, "decode_tokens": decode,
                                     "num_seqs": seqs, "context_tokens": context,
                                     "max_context_tokens": 400}) + "\n")


def test_fit_recovers_the_coefficients_and_the_cli_writes_the_profile(tmp_path, capsys):
    truth = {"const": 0.05, "prefill_tokens": 0.004, "decode_seqs": 0.003, "context_tokens": 2e-6}
    log = tmp_path / "steps.jsonl"
    _synthetic_log(log, truth)
    out = tmp_path / "profile.json"
    assert iterserve_main(["simulate", "fit", "--step-log", str(log), "--out", str(out), "--name", "synthetic"]) == 0
    printed = capsys.readouterr().out
    assert "decode_only" in printed and "mixed" in printed
    fitted = profiles.load_profile(str(out))
    for term, value in truth.items():
        assert fitted.coefficients[term] == pytest.approx(value, rel=0.15), term
    errors = fitted.fit["test_errors"]
    assert errors["decode_only"]["mean"] < 0.05 and errors["mixed"]["mean"] < 0.05


def test_shipped_profiles_load():
    cpu = profiles.load_profile("smollm2-135m-cpu")
    assert not cpu.modelled and cpu.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4
    accel = profiles.load_profile("modelled-accelerator")
    assert accel.modelled and accel.citations
    flat = [accel.step_seconds(profiles.StepFeatures(0, b, 0, b, 0)) for b in (1, 16, 64, 128)]
    assert max(flat) == min(flat)  # flat in the batch until compute-bound
    assert accel.step_seconds(profiles.StepFeatures(0, 512, 0, 512, 0)) > 2 * flat[0]


# ------------------------------------------------------------------------------- replica model


def test_replica_kv_pool_matches_the_fake_engines():
    spec = InferenceServiceSpec.model_validate({"model": {"uri": "x"}, "engine": {
        "maxNumSeqs": 8, "maxModelLen": 512, "kvCacheMemory": "29MiB", "extraArgs": ["--fake-model"]}})
    config, server = engine_config_for(spec, 6)
    assert config.max_num_seqs == 6 and config.model == "fake" and server.drain_timeout == 30
    replica = Replica("p", config, fake_model_profile())
    real = LLMEngine.from_config(EngineConfig(model="fake", kv_cache_memory="29MiB", max_model_len=512))
    assert replica.num_kv_blocks == real.block_manager.num_blocks == 41


# ----------------------------------------------------------------------------------- the fleet

SPEC = {  # the whole loop's InferenceService (e2e/wholeloop/scenario.py), fake model
    "model": {"uri": "smollm2-135m"},
    "engine": {"maxNumSeqs": 8, "maxModelLen": 512, "kvCacheMemory": "29MiB", "drainSeconds": 30,
               "extraArgs": ["--fake-model", "--max-waiting-requests", "1000"]},
    "replicas": 1,
    "autoscaling": {"mode": "Builtin", "minReplicas": 1, "maxReplicas": 3, "targetWaitingPerReplica": 4,
                    "intervalSeconds": 1, "warmupSeconds": 3, "coldStartSeconds": 120,
                    "scaleDown": {"stabilizationWindowSeconds": 10},
                    "kvRetune": {"threshold": 0.95, "consecutiveSamples": 3, "stepFactor": 0.75, "floor": 4,
                                 "recoveryWindowSeconds": 600}},
}


def _run(spec_dict, trace, **options):
    spec = InferenceServiceSpec.model_validate(spec_dict)
    profile = fake_model_profile(options.pop("scale", 1.0))
    options.setdefault("router", "round-robin")  # the whole loop's own routing (the ready endpoints in turn)
    result = ClusterSim(spec, profile, trace, SimOptions(**options)).run()
    return to_json(result, Slo(), {})


@pytest.mark.slow
def test_heavy_load_scales_up_after_startup_and_back_down():
    heavy = traces.poisson(30.0, 40, traces.Lengths("fixed", 32), traces.Lengths("fixed", 128), seed=0)
    light = [traces.TraceRequest(40 + i, 32, 16) for i in range(60)]
    doc = _run(SPEC, heavy + light, startup=Delay.parse(10), tail_s=60, scale=4.0)
    summary = doc["summary"]
    assert len(doc["requests"]) == len(heavy) + len(light)
    ups = [e for e in summary["scale_events"] if e["to"] > e["from"]]
    downs = [e for e in summary["scale_events"] if e["to"] < e["from"]]
    assert ups and ups[0]["reason"] in ("waiting_above_target", "preemptions")
    assert max(e["to"] for e in ups) <= 3 and downs and downs[-1]["to"] == 1
    # A new pod is ready no sooner than the start-up delay after the scale-up that asked for it.
    rows = doc["timeline"]
    first_ready = next(r["t"] for r in rows if r["replicas_ready"] >= 2)
    assert first_ready >= ups[0]["t"] + 10
    # The KV pool is thrashed at max_num_seqs 8 (41 blocks, 10 per request): the retune lowers it.
    assert summary["preemptions"] > 0
    assert any(r["reason"] == "kv_pressure" and r["to"] < r["from"] for r in summary["retunes"])
    assert summary["statuses"].get("ok", 0) == len(doc["requests"])
    assert summary["replica_seconds"] > doc["summary"]["simulated_seconds"]


def test_requests_wait_for_a_cold_replica_and_ttft_counts_it():
    trace = [traces.TraceRequest(0.0, 16, 4), traces.TraceRequest(1.0, 16, 4)]
    spec = dict(SPEC, autoscaling=None)
    doc = _run(spec, trace, startup=Delay.parse(20), initial_pods_ready=False)
    assert [r["status"] for r in doc["requests"]] == ["ok", "ok"]
    assert doc["requests"][0]["ttft_s"] >= 20 and doc["requests"][1]["ttft_s"] >= 19


def test_same_seed_same_bytes(tmp_path):
    trace_path = tmp_path / "t.csv"
    traces.write_csv(traces.gamma(20.0, 2.0, 20, traces.Lengths("fixed", 32), traces.Lengths.parse("zipf:128"),
                                  seed=5), trace_path)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(json.dumps({"apiVersion": "iterserve.dev/v1alpha1", "kind": "InferenceService",
                                     "metadata": {"name": "chat"}, "spec": SPEC}))
    outputs = []
    for seed in (1, 1, 2):
        out = tmp_path / f"out{len(outputs)}.json"
        argv = ["simulate", "--trace", str(trace_path), "--spec", str(spec_path), "--json", str(out),
                "--seed", str(seed), "--startup-delay", "lognormal:10:5", "--tail", "20", "--no-progress"]
        assert iterserve_main(argv) == 0
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2]  # the seed draws the start-up delays
    document = json.loads(outputs[0])
    assert len(document["requests"]) == len(traces.load_trace(trace_path))
    assert {"ttft_s", "itl_mean_s", "e2e_s"} <= set(document["requests"][0])
    assert document["summary"]["slo"]["attainment"] is not None


def test_least_load_routing_uses_the_routers_pick():
    # Two replicas; long requests every second and short ones in between: round robin alternates
    # blindly, the router's pick sends each request to the replica with less in flight. The long ones
    # outlast the second between them (scale 4), so loads differ when they arrive.
    trace = []
    for i in range(20):
        trace.append(traces.TraceRequest(i * 1.0, 16, 400))
        trace.append(traces.TraceRequest(i * 1.0 + 0.5, 16, 2))
    spec = dict(SPEC, replicas=2, autoscaling=None)
    rr = _run(spec, trace, router="round-robin", scale=4.0)
    ll = _run(spec, trace, router="least-load", scale=4.0)
    assert {r["pod"] for r in rr["requests"][::2]} == {"pod-1"}  # round robin: every long one on pod 1
    assert {r["pod"] for r in ll["requests"][::2]} == {"pod-1", "pod-2"}
    assert ll["summary"]["statuses"] == rr["summary"]["statuses"] == {"ok": 40}


def test_interval_timing_takes_back_to_back_gaps_only(tmp_path):
    log = tmp_path / "steps.jsonl"
    rows = [  # time = when the step ended; a 5 s gap is an idle engine, not a step's cost
        {"time": 10.0, "duration_s": 0.01, "running": 2, "waiting": 0},
        {"time": 10.02, "duration_s": 0.01, "running": 2, "waiting": 0},
        {"time": 10.05, "duration_s": 0.02, "running": 0, "waiting": 0},
        {"time": 15.05, "duration_s": 0.01, "running": 1, "waiting": 0},
        {"time": 15.07, "duration_s": 0.01, "running": 1, "waiting": 0},
    ]
    log.write_text("".join(json.dumps(dict(r, prefill_tokens=0, decode_tokens=1, num_seqs=1, context_tokens=9))
                           + "\n" for r in rows))
    step = profiles.step_log_records([log], "step")
    interval = profiles.step_log_records([log], "interval")
    assert [r["duration_s"] for r in step] == [0.01, 0.01, 0.02, 0.01, 0.01]
    assert [round(r["duration_s"], 6) for r in interval] == [0.02, 0.03, 0.02]


@pytest.mark.parametrize("mode", ["Off", "External"])
def test_modes_that_own_no_replicas_never_scale(mode):
    heavy = traces.poisson(30.0, 8, traces.Lengths("fixed", 32), traces.Lengths("fixed", 64), seed=0)
    spec = dict(SPEC, autoscaling=dict(SPEC["autoscaling"], mode=mode))
    doc = _run(spec, heavy, scale=4.0)
    assert doc["summary"]["scale_events"] == [] and doc["summary"]["retunes"] == []
    assert doc["summary"]["pods_created"] == 1


def test_a_fleet_held_at_zero_replicas_gives_up_and_says_so():
    spec = dict(SPEC, replicas=0, autoscaling=dict(SPEC["autoscaling"], mode="Off"))
    doc = _run(spec, [traces.TraceRequest(0.0, 16, 4)], give_up_after_s=60)
    assert [r["status"] for r in doc["requests"]] == ["unfinished"]
    assert doc["summary"]["simulated_seconds"] == pytest.approx(60, abs=1)


def test_a_fleet_at_zero_comes_back_for_a_held_request_and_goes_back_to_zero_when_idle():
    spec = dict(SPEC, replicas=0, autoscaling=dict(SPEC["autoscaling"], minReplicas=0, scaleToZeroAfterSeconds=30))
    doc = _run(spec, [traces.TraceRequest(5.0, 16, 4)], startup=Delay.parse(10), tail_s=120)
    request = doc["requests"][0]
    assert request["status"] == "ok" and request["ttft_s"] >= 10  # the cold start: held until the pod is ready
    events = [(e["from"], e["to"], e["reason"]) for e in doc["summary"]["scale_events"]]
    assert events == [(0, 1, "held_requests"), (1, 0, "idle_scale_to_zero")]


def test_the_router_holds_requests_while_every_replica_is_full_then_answers_429():
    # One replica, maxNumSeqs 8, spec.routing.maxQueue 16: the router's capacity is 8 + 16 queued;
    # 60 long requests at once.
    burst = [traces.TraceRequest(0.0, 16, 2000 if i < 30 else 4) for i in range(60)]
    spec = dict(SPEC, autoscaling=None, engine=dict(SPEC["engine"], maxModelLen=4096, kvCacheMemory="512MiB"),
                routing={"mode": "Router", "maxQueue": 16})
    doc = _run(spec, burst, router="least-load", scale=4.0)
    statuses = [r["status"] for r in doc["requests"]]
    assert statuses.count("ok") >= 24 and "rejected" in statuses
    assert all("saturated" in r["error"] for r in doc["requests"] if r["status"] == "rejected")
    served_late = [r for r in doc["requests"][24:] if r["status"] == "ok"]
    assert all(r["ttft_s"] > 0 for r in served_late)


@pytest.mark.slow
def test_the_real_models_step_log_carries_cpu_time_and_the_fits_features(tmp_path, capsys):
    """The embedded model writes each step's engine-thread CPU time beside its wall time, and the
    features the fit reads from the log are the ones the simulator computes from the same batch."""
    from iterserve.engine.sampling_params import SamplingParams

    log = tmp_path / "steps.jsonl"
    engine = LLMEngine.from_config(EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, step_log=str(log)))
    seen, chunks = [], []
    real_execute = engine.executor.execute

    def capture(out):
        seen.append(profiles.StepFeatures.of(out))
        chunks.append([(c.start, c.num_tokens, c.is_decode) for c in out.chunks])
        return real_execute(out)

    engine.executor.execute = capture
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    engine.add_request(prompt_token_ids=[100 + i for i in range(40)], params=params, request_id="a")
    engine.add_request(prompt_token_ids=[300 + i for i in range(9)], params=params, request_id="b")
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 3:
            engine.add_request(prompt_token_ids=[500 + i for i in range(12)], params=params, request_id="c")
    engine.close()
    records = profiles.read_step_log(log)
    assert len(records) == len(seen) >= 12
    for record, features in zip(records, seen, strict=True):
        # one thread's CPU time cannot exceed the wall time it ran in
        assert 0 < record["cpu_s"] <= record["duration_s"] + 1e-3
        assert profiles.StepFeatures.from_record(record) == features
    # query-key pairs: each prompt chunk's tokens times the positions they attend to (start + tokens)
    pairs = [sum(n * (start + n) for start, n, decode in step if not decode) for step in chunks]
    assert [r["prefill_attention_pairs"] for r in records] == pairs
    assert pairs[0] > 0 and pairs[-1] == 0
    assert any(start > 0 and not decode for step in chunks for start, _, decode in step)  # a chunked prompt
    assert [f.value("multi_token") for f in seen] == [float(sum(n for _, n, _ in step) > 1) for step in chunks]
    assert {f.value("multi_token") for f in seen} == {0.0, 1.0}  # c decodes alone at the end
    cpu = profiles.step_log_records([log], "cpu")
    assert [r["duration_s"] for r in cpu] == [r["cpu_s"] for r in records]
    out = tmp_path / "p.json"
    code = iterserve_main(["simulate", "fit", "--step-log", str(log), "--timing", "cpu", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed
    assert "relative error" in printed.out
    assert profiles.load_profile(str(out)).fit["train_steps"] + profiles.load_profile(str(out)).fit["test_steps"] \
        == len(records)


def test_cpu_timing_needs_a_log_with_cpu_time(tmp_path):
    log = tmp_path / "old.jsonl"
    log.write_text(json.dumps({"step": 3, "duration_s": 0.1, "prefill_tokens": 0, "decode_tokens": 1,
                               "num_seqs": 1, "context_tokens": 9}) + "\n")
    with pytest.raises(ValueError, match="no cpu_s.*--timing step"):
        profiles.step_log_records([log], "cpu")


def test_extra_terms_earn_their_place_by_cross_validation():
    """A step cost with a jump from one token to two (the GEMV to GEMM switch on a CPU) and a
    prefill attention cost quadratic in the prompt: the fit takes both terms, and no others."""
    rng = random.Random(3)
    rows = []
    for _ in range(300):
        decode = rng.randint(0, 12)
        prompt = rng.choice([0, 0, rng.randint(8, 400)])
        if decode + prompt == 0:
            continue
        context = decode * rng.randint(20, 300) + prompt
        multi = 1.0 if decode + prompt > 1 else 0.0
        t = 0.05 + 0.004 * prompt + 0.01 * decode + 1e-5 * context + 0.06 * multi + 1e-5 * prompt * prompt
        rows.append({"duration_s": t * (1 + rng.gauss(0, 0.01)), "prefill_tokens": prompt, "decode_tokens": decode,
                     "num_seqs": decode + (1 if prompt else 0), "context_tokens": context,
                     "max_context_tokens": max(context // max(decode, 1), prompt),
                     "prefill_attention_pairs": prompt * prompt})
    train, test = profiles.split(rows)
    fitted = profiles.fit_profile(train, test, "t", 1)
    assert set(fitted.coefficients) == {*profiles.BASE_TERMS, "multi_token", "prefill_attention"}
    assert fitted.coefficients["multi_token"] == pytest.approx(0.06, rel=0.2)
    assert fitted.fit["test_errors"]["all"]["mean"] < 0.03


@pytest.mark.parametrize("router", ["round-robin", "least-load"])
def test_the_index_of_accepting_pods_gives_the_same_run_as_scanning_every_pod(router):
    # Scale-ups with start-up delays (pods ready out of creation order), scale-downs and drains.
    heavy = traces.poisson(20.0, 20, traces.Lengths("fixed", 32), traces.Lengths("fixed", 64), seed=1)
    light = [traces.TraceRequest(20 + i, 32, 16) for i in range(40)]
    spec = dict(SPEC, autoscaling=dict(SPEC["autoscaling"], maxReplicas=4))
    runs = [_run(spec, heavy + light, startup=Delay.parse("uniform:3:9"), tail_s=40, scale=4.0, router=router,
                 plain_loop=plain) for plain in (True, False)]
    assert len(runs[0]["summary"]["scale_events"]) >= 2
    assert json.dumps(runs[0], sort_keys=True) == json.dumps(runs[1], sort_keys=True)
