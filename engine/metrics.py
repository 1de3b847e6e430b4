"""Every metric name the engine exports, defined once. The server, the operator's metric readers,
the Helm chart's alerts and the Grafana dashboard all take names from here, so a rename breaks a
test instead of silently breaking a dashboard or an autoscaler."""

# The engine's metric names.
WAITING_REQUESTS = "llm_scheduler_waiting_requests"
RUNNING_SEQS = "llm_scheduler_running_seqs"
PREEMPTIONS_TOTAL = "llm_scheduler_preemptions_total"
KV_CACHE_USAGE = "llm_gpu_kv_cache_usage_fraction"
THROUGHPUT_TOKENS_PER_SECOND = "llm_throughput_tokens_per_second"
MAX_NUM_SEQS = "llm_scheduler_max_num_seqs"

# Latency histograms and counters.
TIME_TO_FIRST_TOKEN = "llm_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "llm_inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "llm_e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "llm_request_queue_time_seconds"
PROMPT_TOKENS_TOTAL = "llm_prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "llm_generation_tokens_total"
REQUESTS_TOTAL = "llm_requests_total"

MODEL_LABEL = "model_name"

# vLLM-compatible aliases, for existing dashboards, KEDA triggers and the Gateway API
# Inference Extension's endpoint picker.
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
VLLM_CACHE_CONFIG_INFO = "vllm:cache_config_info"
VLLM_TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
VLLM_INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
VLLM_E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"

ENGINE_METRIC_NAMES = [
    WAITING_REQUESTS, RUNNING_SEQS, PREEMPTIONS_TOTAL, KV_CACHE_USAGE, THROUGHPUT_TOKENS_PER_SECOND,
    MAX_NUM_SEQS, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_REQUEST_LATENCY, REQUEST_QUEUE_TIME,
    PROMPT_TOKENS_TOTAL, GENERATION_TOKENS_TOTAL, REQUESTS_TOTAL,
]

# The operator's own metrics, labelled `namespace` and `inferenceservice` (plus `pod` where
# per engine pod) like the engine series, so alerts can join the two.
AUTOSCALER_DESIRED_REPLICAS = "iterserve_autoscaler_desired_replicas"
# The InferenceService's spec.autoscaling.maxReplicas, so an alert can tell "pinned at max".
AUTOSCALER_MAX_REPLICAS = "iterserve_autoscaler_max_replicas"
AUTOSCALER_DECISIONS_TOTAL = "iterserve_autoscaler_decisions_total"
METRICS_SCRAPE_ERRORS_TOTAL = "iterserve_metrics_scrape_errors_total"
EFFECTIVE_MAX_NUM_SEQS = "iterserve_effective_max_num_seqs"

# The reconcile loop's own health (operator/metrics.py).
OPERATOR_RECONCILES_TOTAL = "iterserve_operator_reconciles_total"
OPERATOR_RECONCILE_SECONDS = "iterserve_operator_reconcile_duration_seconds"
OPERATOR_OBJECT_WRITES_TOTAL = "iterserve_operator_object_writes_total"
OPERATOR_CONFLICTS_TOTAL = "iterserve_operator_conflicts_total"

OPERATOR_METRIC_NAMES = [
    AUTOSCALER_DESIRED_REPLICAS, AUTOSCALER_MAX_REPLICAS, AUTOSCALER_DECISIONS_TOTAL,
    METRICS_SCRAPE_ERRORS_TOTAL, EFFECTIVE_MAX_NUM_SEQS,
    OPERATOR_RECONCILES_TOTAL, OPERATOR_RECONCILE_SECONDS, OPERATOR_OBJECT_WRITES_TOTAL,
    OPERATOR_CONFLICTS_TOTAL,
]

# The router's own metrics (iterserve/router/metrics.py), at the router's GET /metrics.
ROUTER_PICKS_TOTAL = "iterserve_router_picks_total"  # label reason: picking.PICK_REASONS
ROUTER_RETRIES_TOTAL = "iterserve_router_retries_total"  # requests re-sent to another replica
ROUTER_EJECTIONS_TOTAL = "iterserve_router_ejections_total"  # label endpoint
ROUTER_REQUESTS_TOTAL = "iterserve_router_requests_total"  # label code: the status sent to the client
ROUTER_STALE_ENDPOINTS = "iterserve_router_stale_endpoints"  # routable on local counts only
ROUTER_ENDPOINT_LOAD = "iterserve_router_endpoint_load"  # label endpoint: the load picks compare
ROUTER_ENDPOINT_IN_FLIGHT = "iterserve_router_endpoint_in_flight"  # label endpoint
ROUTER_ENDPOINT_ROUTABLE = "iterserve_router_endpoint_routable"  # label endpoint: 0 while ejected
ROUTER_ENDPOINT_LABEL = "endpoint"
ROUTER_HELD_REQUESTS = "iterserve_router_held_requests"  # gauge: held while no replica is ready (activator)
ROUTER_HOLDS_TOTAL = "iterserve_router_holds_total"  # label outcome: activator.HELD_OUTCOMES

# The router's P/D path (iterserve/router/disagg.py).
ROUTER_PD_DECISIONS_TOTAL = "iterserve_router_pd_decisions_total"  # label reason: disagg.PD_REASONS
ROUTER_PD_FALLBACKS_TOTAL = "iterserve_router_pd_fallbacks_total"  # label reason: disagg.FALLBACK_REASONS
ROUTER_PD_PREFILL_SECONDS = "iterserve_router_pd_prefill_seconds"  # histogram: successful remote prefill calls

# Prefix caching. Queries and hits count prompt tokens, looked up and found cached when a
# request is admitted (vLLM's meaning); the hit rate is hits/queries over the last 1000 admissions.
# The KV breakdown: KV_CACHE_USAGE counts only blocks that sequences hold; KV_CACHE_CACHED_FRACTION
# the cached blocks no sequence holds (free for allocation, their KV kept for reuse until evicted).
PREFIX_CACHE_QUERIES_TOTAL = "llm_prefix_cache_queries_total"
PREFIX_CACHE_HITS_TOTAL = "llm_prefix_cache_hits_total"
PREFIX_CACHE_HIT_RATE = "llm_prefix_cache_hit_rate"
KV_CACHE_CACHED_FRACTION = "llm_gpu_kv_cache_cached_fraction"
VLLM_PREFIX_CACHE_QUERIES_TOTAL = "vllm:prefix_cache_queries_total"
VLLM_PREFIX_CACHE_HITS_TOTAL = "vllm:prefix_cache_hits_total"
ENGINE_METRIC_NAMES += [PREFIX_CACHE_QUERIES_TOTAL, PREFIX_CACHE_HITS_TOTAL, PREFIX_CACHE_HIT_RATE,
                        KV_CACHE_CACHED_FRACTION]

# Fault isolation. A request that failed on its own finished with an error while the
# engine carried on; an engine failure means the engine loop died (GET /health then answers 503).
REQUEST_FAILURES_TOTAL = "iterserve_request_failures_total"
ENGINE_FAILURES_TOTAL = "iterserve_engine_failures_total"
ENGINE_METRIC_NAMES += [REQUEST_FAILURES_TOTAL, ENGINE_FAILURES_TOTAL]

# The autoscaler's trust: pods carrying an InferenceService's engine labels that are
# not its Deployment's (look-alikes), ignored at its last tick: never read, never sent the token.
AUTOSCALER_UNTRUSTED_PODS = "iterserve_autoscaler_untrusted_pods"
OPERATOR_METRIC_NAMES += [AUTOSCALER_UNTRUSTED_PODS]

# Prefill/decode disaggregation, engine side (engine/kv_transfer). A decode engine observes
# each finished pull (seconds from start to the last byte, bytes received) and counts failed pulls
# (then the prompt is recomputed or the request fails, per --kv-failure-policy) and the requests
# whose KV is in flight; a prefill engine counts leases that expired unreleased and the blocks
# pinned under leases. Both roles serve every name (zeros where a role never moves).
KV_TRANSFER_SECONDS = "iterserve_kv_transfer_seconds"
KV_TRANSFER_BYTES = "iterserve_kv_transfer_bytes"
KV_TRANSFER_FAILURES_TOTAL = "iterserve_kv_transfer_failures_total"
KV_TRANSFER_EXPIRED_TOTAL = "iterserve_kv_transfer_expired_leases_total"
KV_PINNED_BLOCKS = "iterserve_kv_pinned_blocks"
WAITING_FOR_KV_REQUESTS = "iterserve_scheduler_waiting_for_kv_requests"
ENGINE_METRIC_NAMES += [KV_TRANSFER_SECONDS, KV_TRANSFER_BYTES, KV_TRANSFER_FAILURES_TOTAL, KV_TRANSFER_EXPIRED_TOTAL,
                        KV_PINNED_BLOCKS, WAITING_FOR_KV_REQUESTS]

# Prefill work queued on an engine (the prefill pool's scaling signal): prompt tokens not
# computed yet, of waiting requests and of running ones still prefilling (a decode engine leaves
# out prompts whose KV it pulls from a prefill engine). The operator scales a disaggregated
# InferenceService's prefill pool on it per replica (spec.disaggregation.prefill.scalingSignal).
QUEUED_PROMPT_TOKENS = "iterserve_scheduler_queued_prompt_tokens"
ENGINE_METRIC_NAMES += [QUEUED_PROMPT_TOKENS]

# Speculative decoding (engine/spec_decode), counted since start (vLLM's meaning): verification
# rounds with proposals (drafts), proposed tokens, accepted tokens, and accepted tokens per
# proposal position (label position: 0 is the first proposed token). Acceptance rate =
# accepted / draft tokens; mean accepted length = 1 + accepted / drafts.
SPEC_DECODE_DRAFTS_TOTAL = "llm_spec_decode_drafts_total"
SPEC_DECODE_DRAFT_TOKENS_TOTAL = "llm_spec_decode_draft_tokens_total"
SPEC_DECODE_ACCEPTED_TOKENS_TOTAL = "llm_spec_decode_accepted_tokens_total"
SPEC_DECODE_ACCEPTED_TOKENS_PER_POS_TOTAL = "llm_spec_decode_accepted_tokens_per_pos_total"
VLLM_SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SPEC_DECODE_POSITION_LABEL = "position"
ENGINE_METRIC_NAMES += [SPEC_DECODE_DRAFTS_TOTAL, SPEC_DECODE_DRAFT_TOKENS_TOTAL, SPEC_DECODE_ACCEPTED_TOKENS_TOTAL,
                        SPEC_DECODE_ACCEPTED_TOKENS_PER_POS_TOTAL]

# LoRA adapters (engine/lora). vLLM's info gauge, exactly as vLLM exposes it (no model_name label;
# the value is the Unix time of the sample; adapter names comma-joined), which the Gateway API
# Inference Extension's endpoint picker routes on; and requests accepted per adapter since start.
VLLM_LORA_REQUESTS_INFO = "vllm:lora_requests_info"
LORA_RUNNING_LABEL = "running_lora_adapters"
LORA_WAITING_LABEL = "waiting_lora_adapters"
LORA_MAX_LABEL = "max_lora"
LORA_REQUESTS_TOTAL = "iterserve_lora_requests_total"
LORA_NAME_LABEL = "lora_name"
LORA_METRIC_NAMES = [VLLM_LORA_REQUESTS_INFO, LORA_REQUESTS_TOTAL]  # series only while LoRA adapters are served
