"""Engine configuration and its start-up rules.

Every rule refuses to start with a message that names the options involved and how to fix them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, fields, replace

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
# Requests one engine queues before it answers 429; the router's default per-replica queue bound is the
# same number, so routed traffic builds the engine queue that the autoscaler and the backlog alert read.
DEFAULT_MAX_WAITING_REQUESTS = 256
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
               "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


# The help groups of serve's flags (engine/server/cli.py declares each group once).
MODEL = "model"
SCHEDULING = "scheduling and KV cache"
PD = "prefill/decode disaggregation"
LORA = "LoRA adapters"


def flag(group: str, help: str, choices: tuple[str, ...] = (), metavar: str | None = None) -> dict:
    """A field's `iterserve serve` flag (engine/config_flags.py builds it): its help group, help text,
    allowed values, and metavar (PATH for a flag naming a file). A field without it has no flag."""
    return {"group": group, "help": help, "choices": choices, "metavar": metavar}


class ConfigError(ValueError):
    """Contradictory or out-of-range engine options."""


def parse_size(value: str | int, option: str) -> int:
    """'512MiB', '2GiB', '1e9' or an int, in bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"{option}: cannot read {value!r} as a size; write e.g. 512MiB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class EngineConfig:
    """The engine's options. Immutable: `resolve()` returns a new value with every model-dependent
    default filled in and every rule checked, and the engine runs on that value alone."""

    model: str = DEFAULT_MODEL  # serve's --model / --fake-model (the server CLI declares them)
    max_num_seqs: int = field(default=64, metadata=flag(SCHEDULING, "cap on running sequences"))
    max_num_batched_tokens: int | None = field(default=None, metadata=flag(
        SCHEDULING, "token budget per step (default 512 with chunked prefill, else max-model-len)"))
    max_model_len: int | None = field(default=None, metadata=flag(
        SCHEDULING, "context length (default: the model's, at most 2048)"))
    block_size: int = field(default=16, metadata=flag(SCHEDULING, "tokens per KV block"))
    kv_cache_memory: str | int | None = field(default=None, metadata=flag(
        SCHEDULING, "KV pool size, e.g. 512MiB or 2GiB (default: sized from the memory left after the weights: "
                    "--gpu-memory-utilization on CUDA; on a CPU a quarter of the available memory, at most 4 GiB "
                    "and what --max-num-seqs full-length sequences use; engine/kv_memory.py)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=flag(
        SCHEDULING, "CUDA: share of the device's memory this engine may use, weights and activations "
                    "included; the KV pool gets the rest (unless --kv-cache-memory is given)"))
    num_kv_blocks: int | None = field(default=None, metadata=flag(
        SCHEDULING, "KV pool size in blocks (overrides --kv-cache-memory; tests, simulations)"))
    swap_space: str | int = field(default="256MiB", metadata=flag(
        SCHEDULING, "CPU swap pool size for --preemption-mode swap"))
    num_cpu_blocks: int | None = None  # overrides swap_space (tests, simulations; no flag)
    chunked_prefill: bool = field(default=True, metadata=flag(
        SCHEDULING, "split long prompts into chunks that share steps with decodes"))
    # vLLM's long_prefill_token_threshold: a long prompt cannot hold the whole budget for many steps.
    long_prefill_token_threshold: int | None = field(default=None, metadata=flag(
        SCHEDULING, "most prompt tokens one sequence prefills per step while others wait "
                    "(default: an eighth of the step budget, at least 16; 0: no cap)"))
    preemption_mode: str = field(default="recompute", metadata=flag(
        SCHEDULING, "what a preempted sequence loses: its KV (recompute) or nothing (swap to CPU)",
        ("recompute", "swap")))
    scheduling: str = field(default="continuous", metadata=flag(
        SCHEDULING, "static = the request-level batching baseline", ("continuous", "static")))
    attention_backend: str = field(default="auto", metadata=flag(
        SCHEDULING, "attention kernels", ("auto", "torch", "triton")))
    device: str = field(default="auto", metadata=flag(MODEL, "where the model runs", ("auto", "cpu", "cuda")))
    dtype: str = field(default="auto", metadata=flag(
        MODEL, "weights' and activations' type (auto: bf16 on CUDA; on a CPU fp32, or bf16 where it "
               "measures faster)",
        ("auto", "float32", "float16", "bfloat16")))
    quantization: str = field(default="auto", metadata=flag(
        MODEL, "quantized linears on CPU (engine/model/quant.py): auto (default): a GGUF model on a CPU under "
               "--dtype auto computes on the file's own blocks (gguf: Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q2_K/Q3_K/Q4_K/"
               "Q5_K/Q6_K, activations in int8 blocks of 32, as llama.cpp, and measured at least as accurate as "
               "llama.cpp), anything else (safetensors, CUDA, a sharded model, an explicit --dtype) as none; "
               "none: the exact dequantized fp32 (or bf16) model, for parity; int8 (weight-only, bf16 activations), int4 "
               "(weight-only, from the GGUF's Q4_1 blocks), w8a8 (int8 weights and int8 activations per row); "
               "see docs/performance.md for the accuracy and speed of each",
        ("auto", "none", "gguf", "int8", "int4", "w8a8")))
    compile: bool = field(default=False, metadata=flag(
        MODEL, "CPU: torch.compile the decoder's dense work between attentions (inductor C++ code, fused "
               "norms/rotary/SiLU); compiles at start-up, cached in ~/.cache/iterserve/inductor (see "
               "docs/performance.md for what it gains)"))
    seed: int = field(default=0, metadata=flag(MODEL, "seed of the sampling of requests that send none"))
    # engine/distributed: one process per rank on this node, torch.distributed (gloo on CPU, NCCL on CUDA).
    tensor_parallel_size: int = field(default=1, metadata=flag(
        MODEL, "ranks the model is split across (heads, MLP and vocabulary sharded; one process per rank on "
               "this node; see docs/parallelism.md)"))
    pipeline_parallel_size: int = field(default=1, metadata=flag(
        MODEL, "pipeline stages the layers are split into (one process per stage and tensor-parallel rank; "
               "see docs/parallelism.md)"))
    pipeline_micro_batches: int | None = field(default=None, metadata=flag(
        MODEL, "micro-batches a pipeline step's batch is split into, so stage s works on one while stage s+1 "
               "works on the previous (default: --pipeline-parallel-size; 1: no overlap)"))
    # 64: on a 2-core CPU over gloo a 256-token step gained 1.29x from two micro-batches and 4- and
    # 16-row decode steps lost (0.76x, 0.83x); a linear fit of stage time puts the break-even at
    # 25-45 tokens, and 64 stays clear of it on the side of not cutting (docs/parallelism.md#performance).
    pipeline_micro_batch_min_tokens: int = field(default=64, metadata=flag(
        MODEL, "a pipeline step of fewer query tokens runs as one micro-batch: a small (decode) step does not "
               "earn back each micro-batch's extra sends and kernel launches (0: cut every step)"))
    # Several nodes (engine/distributed/multinode.py): each node's serve starts its share of the ranks.
    nnodes: int = field(default=1, metadata=flag(
        MODEL, "nodes the ranks span (tensor x pipeline divisible by it); node 0 is the leader (scheduler, HTTP "
               "API), the others run ranks only (see docs/parallelism.md)"))
    node_rank: int = field(default=0, metadata=flag(MODEL, "this node's index among --nnodes (0: the leader)"))
    master_addr: str = field(default="127.0.0.1", metadata=flag(
        MODEL, "the leader node's address or DNS name (resolved with retries until --rendezvous-timeout)",
        metavar="HOST"))
    master_port: int = field(default=29500, metadata=flag(
        MODEL, "port of the rendezvous store the leader opens for the other nodes"))
    rendezvous_timeout: float = field(default=600.0, metadata=flag(
        MODEL, "seconds a node waits for the leader and for every rank to join (the log names missing ones)"))
    worker_health_port: int = field(default=8001, metadata=flag(
        MODEL, "--node-rank above 0: port of the worker node's GET /health and /ready (it has no API port)"))
    step_log: str | None = field(default=None, metadata=flag(
        SCHEDULING, "write one JSON line per engine step to this file", metavar="PATH"))
    watermark: float = 0.01  # share of the KV pool admission keeps free (no flag)
    # engine/spec_decode: vLLM's --speculative-config JSON; None: no speculative decoding.
    speculative_config: str | None = field(default=None, metadata=flag(
        SCHEDULING, 'speculative decoding as vLLM spells it, JSON: {"method": "ngram" | "draft_model", '
                    '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, '
                    '"model": DRAFT, "disable_by_batch_size": N, "min_acceptance_rate": 0.2} (default off; N defaults '
                    "per device type; see docs/spec_decode.md)", metavar="JSON"))
    # engine/prefix_cache.py. None: on, except for the static-batching baseline and the fake model.
    enable_prefix_caching: bool | None = field(default=None, metadata=flag(
        SCHEDULING, "reuse the KV blocks of cached prompt prefixes (default: on, except with "
                    "--scheduling static or --fake-model)"))
    fake_step_time_scale: float = field(default=1.0, metadata=flag(
        MODEL, "multiply the fake model's step time (2: a replica twice as slow)"))
    # Prefill/decode disaggregation (engine/kv_transfer).
    role: str = field(default="both", metadata=flag(
        PD, "both: plain requests only (no kv_transfer_params); prefill: runs prompts and leases their KV "
            "(the only role with a KV listener); decode: pulls KV and generates", ("both", "prefill", "decode")))
    kv_lease_seconds: float = field(default=30.0, metadata=flag(
        PD, "a prefill engine frees leased KV blocks no decode engine released after this"))
    kv_transfer_timeout: float = field(default=10.0, metadata=flag(
        PD, "seconds a decode engine waits for a KV pull before its failure policy applies"))
    kv_failure_policy: str = field(default="recompute", metadata=flag(
        PD, "after a failed or timed-out pull: recompute the prompt locally or fail the request (HTTP 500)",
        ("recompute", "fail")))
    # engine/kv_transfer/auth.py: kv_transfer_params are trusted only with this key's MAC.
    kv_auth_key_file: str | None = field(default=None, metadata=flag(
        PD, "file holding the InferenceService's KV key (required by roles prefill and decode): "
            "kv_transfer_params are accepted only with its HMAC, made by the router or a prefill engine; "
            "role both accepts none", metavar="PATH"))
    kv_max_leased_fraction: float = field(default=0.5, metadata=flag(
        PD, "most of the KV pool a prefill engine keeps leased to decode engines; beyond it a prefill call "
            "is answered without a lease"))

    # engine/lora: adapters in PEFT's format served beside the base model, chosen by a request's `model`.
    enable_lora: bool = field(default=False, metadata=flag(
        LORA, "serve LoRA adapters (on when --lora-modules names any); adapters can then also be loaded at run "
              "time through POST /v1/load_lora_adapter (see docs/lora.md)"))
    lora_modules: tuple[str, ...] = field(default=(), metadata=flag(
        LORA, "adapters loaded at start, as NAME=PATH (a PEFT adapter directory) ...", metavar="NAME=PATH"))
    max_loras: int = field(default=4, metadata=flag(
        LORA, "adapters one step can mix (the device's adapter slots)"))
    max_lora_rank: int = field(default=16, metadata=flag(LORA, "largest adapter rank accepted (slots are this wide)"))
    max_cpu_loras: int | None = field(default=None, metadata=flag(
        LORA, "adapters kept read in host memory, least recently used dropped (default: 4 x --max-loras)"))

    def lora_module_paths(self) -> dict[str, str]:
        """--lora-modules as {name: path}. One argument may hold several items separated by
        whitespace before a NAME= (how the operator passes a list through one env var), or none."""
        modules = {}
        for item in (part for arg in self.lora_modules for part in _LORA_ITEM_BREAK.split(arg.strip()) if part):
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules takes NAME=PATH items, got {item!r}")
            if name in modules:
                raise ConfigError(f"--lora-modules names adapter {name!r} twice")
            modules[name] = path
        return modules

    def resolve(self, model_context_len: int | None = None) -> EngineConfig:
        """A copy with the defaults that depend on the model filled in, every rule checked."""
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(model_context_len or 2048, 2048)
        elif model_context_len is not None and max_model_len > model_context_len:
            raise ConfigError(
                f"--max-model-len {max_model_len} exceeds the model's context length "
                f"{model_context_len}; lower --max-model-len"
            )
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = max(512, self.max_num_seqs) if self.chunked_prefill else max(max_model_len, self.max_num_seqs)
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            threshold = max(16, budget // 8) if self.chunked_prefill else 0
        prefix_caching = self.enable_prefix_caching
        if prefix_caching is None:
            prefix_caching = self.scheduling == "continuous" and self.model != "fake"
        elif prefix_caching and self.scheduling == "static":
            logger.info("prefix caching is off with --scheduling static (the baseline recomputes every prompt)")
            prefix_caching = False
        resolved = replace(self, max_model_len=max_model_len, max_num_batched_tokens=budget,
                           long_prefill_token_threshold=threshold, enable_prefix_caching=prefix_caching,
                           lora_modules=tuple(self.lora_modules), enable_lora=self.enable_lora or bool(self.lora_modules),
                           max_cpu_loras=self.max_cpu_loras or 4 * self.max_loras)
        resolved.validate()
        return resolved

    def validate(self) -> None:
        _positive("--max-num-seqs", self.max_num_seqs)
        _positive("--max-model-len", self.max_model_len)
        _positive("--max-num-batched-tokens", self.max_num_batched_tokens)
        _positive("--block-size", self.block_size)
        _positive("--max-loras", self.max_loras)
        _positive("--max-lora-rank", self.max_lora_rank)
        if self.max_lora_rank > 256:
            raise ConfigError(f"--max-lora-rank must be at most 256, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})")
        self.lora_module_paths()
        if self.enable_lora and self.pipeline_parallel_size > 1:
            raise ConfigError("--enable-lora / --lora-modules with --pipeline-parallel-size above 1: LoRA over "
                              "pipeline stages is not implemented; use --pipeline-parallel-size 1 "
                              "(--tensor-parallel-size works with adapters)")
        _positive("--tensor-parallel-size", self.tensor_parallel_size)
        _positive("--pipeline-parallel-size", self.pipeline_parallel_size)
        self.validate_nodes()
        if self.block_size > 256 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two up to 256, got {self.block_size}")
        for f in fields(self):  # the allowed values of every field with choices, as its flag declares
            if f.metadata.get("choices"):
                _choice(f"--{f.name.replace('_', '-')}", getattr(self, f.name), f.metadata["choices"])
        if not self.kv_lease_seconds > 0:
            raise ConfigError(f"--kv-lease-seconds must be above 0, got {self.kv_lease_seconds}")
        if not self.kv_transfer_timeout > 0:
            raise ConfigError(f"--kv-transfer-timeout must be above 0, got {self.kv_transfer_timeout}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 < self.kv_max_leased_fraction <= 1:
            raise ConfigError(f"--kv-max-leased-fraction must be in (0, 1], got {self.kv_max_leased_fraction}")
        if self.role != "both" and self.scheduling == "static":
            raise ConfigError(f"--role {self.role} needs --scheduling continuous (the static baseline has no "
                              "KV transfer)")
        if self.role != "both" and not self.kv_auth_key_file:
            raise ConfigError(f"--role {self.role} needs --kv-auth-key-file: the file holding the InferenceService's "
                              "KV key (the operator mounts Secret <name>-kv-auth at /etc/iterserve/kv-auth/key), so "
                              "only the router and peer engines can drive KV transfers")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is below --max-model-len "
                f"({self.max_model_len}) with chunked prefill off: a full-length prompt could never be "
                "scheduled. Raise --max-num-batched-tokens, lower --max-model-len, or enable chunked prefill."
            )
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ConfigError(
                f"--max-num-seqs ({self.max_num_seqs}) exceeds --max-num-batched-tokens "
                f"({self.max_num_batched_tokens}): each running sequence needs at least one token of the "
                "step budget. Lower --max-num-seqs or raise --max-num-batched-tokens."
            )
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ConfigError(
                f"--long-prefill-token-threshold must be 0 (no cap) or a positive integer, "
                f"got {self.long_prefill_token_threshold!r}"
            )
        if self.speculative_config is not None:
            from iterserve.engine.spec_decode import config as spec

            try:
                spec.SpeculativeConfig.parse(self.speculative_config)
            except spec.SpeculativeConfigError as error:
                raise ConfigError(str(error)) from None
        if not 0 <= self.watermark < 0.5:
            raise ConfigError(f"watermark must be in [0, 0.5), got {self.watermark}")

    def validate_nodes(self) -> None:
        """--pipeline-micro-batches, --pipeline-micro-batch-min-tokens and the multi-node options
        (engine/distributed/multinode.py)."""
        if self.pipeline_micro_batches is not None:
            _positive("--pipeline-micro-batches", self.pipeline_micro_batches)
        if not isinstance(self.pipeline_micro_batch_min_tokens, int) or self.pipeline_micro_batch_min_tokens < 0:
            raise ConfigError("--pipeline-micro-batch-min-tokens must be a non-negative integer (0: cut every step), "
                              f"got {self.pipeline_micro_batch_min_tokens!r}")
        _positive("--nnodes", self.nnodes)
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.nnodes > 1 and world == 1:
            raise ConfigError(f"--nnodes {self.nnodes} needs more than one rank: set --tensor-parallel-size or "
                              "--pipeline-parallel-size")
        if world % self.nnodes:
            raise ConfigError(f"--nnodes {self.nnodes} does not divide the {world} ranks (--tensor-parallel-size "
                              f"{self.tensor_parallel_size} x --pipeline-parallel-size {self.pipeline_parallel_size}): "
                              "every node runs the same number of ranks")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), "
                              f"got {self.node_rank!r}")
        for option, port in (("--master-port", self.master_port), ("--worker-health-port", self.worker_health_port)):
            if not isinstance(port, int) or not 0 < port < 65536:
                raise ConfigError(f"{option} must be in 1..65535, got {port!r}")
        if not self.master_addr or len(self.master_addr) > 253:
            raise ConfigError(f"--master-addr must be a host name or address of at most 253 characters, "
                              f"got {self.master_addr!r}")
        if not 0 < self.rendezvous_timeout <= 86400:
            raise ConfigError(f"--rendezvous-timeout must be in (0, 86400] seconds, got {self.rendezvous_timeout}")

    def check_kv_capacity(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Called once the pool is sized: a max-length sequence must fit in it, beside the watermark
        (the blocks admission keeps free), or it could never be admitted."""
        usable = num_blocks - int(self.watermark * num_blocks)
        if usable * self.block_size < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks x {self.block_size} tokens, of which {usable} blocks = "
                f"{usable * self.block_size} tokens are usable beyond the {self.watermark:g} watermark, fewer than "
                f"--max-model-len ({self.max_model_len}): a full-length sequence could never run. "
                "Raise --kv-cache-memory (or --gpu-memory-utilization on CUDA) or lower --max-model-len."
            )
        if self.preemption_mode == "swap" and num_cpu_blocks == 0:
            raise ConfigError("--preemption-mode swap needs a CPU swap pool; set --swap-space above 0")


# The KV pool of an engine that cannot measure its memory (the fake model, the simulator) when
# --kv-cache-memory is not given; the real model runner sizes it from memory (engine/kv_memory.py).
DEFAULT_KV_CACHE_MEMORY = 512 * 2**20


def kv_pool_blocks(config: EngineConfig, kv_bytes_per_token: int, auto_bytes: int | None = None) -> tuple[int, int]:
    """The KV pools' sizes in blocks, (GPU, CPU swap), for a model that stores kv_bytes_per_token:
    --num-kv-blocks, --kv-cache-memory, else auto_bytes (sized from memory by the caller) or
    DEFAULT_KV_CACHE_MEMORY; the CPU pool only with swap preemption (--num-cpu-blocks or
    --swap-space). Every executor and the simulator size their pools here."""
    bytes_per_block = kv_bytes_per_token * config.block_size
    if config.kv_cache_memory is not None:
        memory = parse_size(config.kv_cache_memory, "--kv-cache-memory")
    else:
        memory = DEFAULT_KV_CACHE_MEMORY if auto_bytes is None else auto_bytes
    num_blocks = config.num_kv_blocks or memory // bytes_per_block
    num_cpu_blocks = 0
    if config.preemption_mode == "swap":
        num_cpu_blocks = config.num_cpu_blocks
        if num_cpu_blocks is None:
            num_cpu_blocks = parse_size(config.swap_space, "--swap-space") // bytes_per_block
    return num_blocks, num_cpu_blocks


# Whitespace that starts another --lora-modules NAME=PATH item inside one argument.
_LORA_ITEM_BREAK = re.compile(r"\s+(?=[A-Za-z0-9][A-Za-z0-9._:/-]*=)")


def _positive(option: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{option} must be a positive integer, got {value!r}")


def _choice(option: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{option} must be one of {', '.join(allowed)}; got {value!r}")
