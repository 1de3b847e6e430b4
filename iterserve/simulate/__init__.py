"""An autoscaling simulator: the real engine scheduler and the real autoscaling decision, on a
simulated clock, replaying a request trace against one InferenceService.

In: a trace (traces.py: Azure, BurstGPT, Mooncake, plain CSV, or generated Poisson / gamma /
diurnal load), an InferenceService spec, and a step-time profile (profile.py: fitted by
non-negative least squares on the engine's own `--step-log`, or one that ships here).
Inside: each replica is the real LLMEngine + Scheduler + BlockManager with the spec's KV pool,
stepping in the profile's time (replica.py); the fleet (cluster.py) starts, readies and drains
pods, routes requests, samples engine metrics and ticks the operator's `policy.decide` through
the operator's own memory and max_num_seqs bookkeeping.
Out: per-request TTFT / ITL / E2E, SLO attainment, replica-seconds, scale events, retunes and
preemptions as JSON, and a timeline plot (report.py). `iterserve simulate` is the command (cli.py).
"""
