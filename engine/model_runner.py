"""The real executor: owns the model, the paged KV pools and the sampler, and runs one scheduled
step (block swaps, a flat batch through the model, sampling) at a time."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from iterserve.engine.attention.backend import AttentionMetadata, get_backend
from iterserve.engine.config import ConfigError, EngineConfig, kv_pool_blocks
from iterserve.engine.executor import KVTransferCapable
from iterserve.engine.kv_memory import activation_reserve, auto_kv_bytes, kv_zeros
from iterserve.engine.kv_transfer.layout import KVLayout
from iterserve.engine.logprobs import record_prompt_logprobs
from iterserve.engine.model import cpu_dtype
from iterserve.engine.model.architectures import model_class
from iterserve.engine.model.loader import ModelConfig, load_model
from iterserve.engine.model.quant import effective_mode
from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.split_step import StepSplit, chunk_cost, original_order
from iterserve.engine.model.threads import apply_split_threads, apply_step_threads, split_steps
from iterserve.engine.model.tokenizer import Tokenizer
from iterserve.engine.sampler import Sampler
from iterserve.engine.scheduler import SchedulerOutput
from iterserve.engine.spec_decode.config import SpeculativeConfig
from iterserve.engine.spec_decode.proposer import HiddenStates
from iterserve.engine.structured import Grammars

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(option: str) -> torch.device:
    if option == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if option == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no CUDA device is visible; use --device cpu or auto")
    return torch.device(option)


def pick_dtype(option: str, device: torch.device, model_config: ModelConfig | None = None,
               quantization: str = "none", attention_backend: str = "auto") -> torch.dtype:
    """--dtype: auto is bf16 on CUDA; on a CPU fp32, or bf16 where it measures faster (cpu_dtype.py);
    quantized CPU models are fp32 models, and so are models under the Triton backend on a CPU
    (the Triton interpreter computes bf16 wrongly)."""
    if option != "auto":
        return _DTYPES[option]
    if device.type == "cuda":
        return torch.bfloat16
    if quantization != "none" or model_config is None or attention_backend == "triton":
        return torch.float32
    return cpu_dtype.auto_cpu_dtype(model_config.hidden_size, model_config.intermediate_size)


class ModelRunner(KVTransferCapable):
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        path, self.model_name = resolve_model_path(config.model)
        self.device = pick_device(config.device)
        try:  # auto: the GGUF's own block formats on CPU (quant.effective_mode)
            self.quantization = quantization = effective_mode(config.quantization, Path(path).is_file(), self.device,
                                                              config.dtype)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        loaded = load_model(path, show_progress, keep_q4_1=quantization == "int4", keep_blocks=quantization == "gguf")
        if quantization == "gguf" and not loaded.gguf_blocks and config.quantization == "auto":
            self.quantization = quantization = "none"  # an F32/F16 GGUF: nothing in a block format
        self.tokenizer = Tokenizer.from_path(path, loaded.gguf_reader)
        model_config = self.shard(loaded, config)  # this rank's slice under tensor parallelism, else all of it
        self.dtype = pick_dtype(config.dtype, self.device, model_config, quantization, config.attention_backend)
        self.config = config = config.resolve(model_config.max_position_embeddings)
        self.block_size = config.block_size
        backend = get_backend(config.attention_backend, self.device)
        if quantization != "none" and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ConfigError(f"--quantization {quantization} runs torch's CPU weight-only kernels on "
                              "an fp32 model; use --device cpu --dtype float32 (or auto on CPU)")
        self.model = model_class(model_config).from_weights(
            model_config, loaded.weights, backend, self.device, self.dtype, max_positions=config.max_model_len,
            quantization=quantization, q4_1=loaded.q4_1, gguf_blocks=loaded.gguf_blocks)
        self.parallelize(loaded.config)
        self.lora = self._lora_manager(config, loaded.config) if config.enable_lora else None
        del loaded
        if config.compile and self.device.type != "cpu":
            raise ConfigError("--compile compiles the CPU path (inductor's C++ code); on CUDA the Triton "
                              "backend already runs fused kernels: drop --compile")

        kv_shape = (config.block_size, model_config.num_kv_heads, model_config.head_dim)
        bytes_per_block = 2 * model_config.num_layers * kv_shape[0] * kv_shape[1] * kv_shape[2] * self.dtype.itemsize
        per_token, auto_bytes, sized = bytes_per_block // config.block_size, None, "--kv-cache-memory/--num-kv-blocks"
        if config.kv_cache_memory is None and config.num_kv_blocks is None:  # from memory (engine/kv_memory.py)
            reserve = activation_reserve(config.max_num_batched_tokens, config.max_num_seqs, model_config.hidden_size,
                                         model_config.intermediate_size, model_config.vocab_size, self.dtype.itemsize)
            auto_bytes, sized = auto_kv_bytes(self.device.type, per_token, config.max_num_seqs, config.max_model_len,
                                              reserve, config.gpu_memory_utilization)
        self.num_kv_blocks, self.num_cpu_blocks = kv_pool_blocks(config, per_token, auto_bytes)
        logger.info("KV pool: %d blocks = %d tokens (%.0f MiB; %s)", self.num_kv_blocks,
                    self.num_kv_blocks * config.block_size, self.num_kv_blocks * bytes_per_block / 2**20, sized)
        config.check_kv_capacity(self.num_kv_blocks, self.num_cpu_blocks)
        self._kv_layout = KVLayout(model=f"{self.model_name}/{quantization}", dtype=str(self.dtype).removeprefix(
            "torch."), num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
            head_size=model_config.head_dim, block_size=config.block_size, itemsize=self.dtype.itemsize)
        # Zeros, not empty: padded decode attention multiplies unused slots by 0, and 0 * NaN is NaN.
        self.kv_caches = [
            (kv_zeros((self.num_kv_blocks, *kv_shape), self.dtype, self.device),
             kv_zeros((self.num_kv_blocks, *kv_shape), self.dtype, self.device))
            for _ in range(model_config.num_layers)
        ]
        pin = self.device.type == "cuda"
        self.cpu_caches = [
            (torch.zeros((self.num_cpu_blocks, *kv_shape), dtype=self.dtype, pin_memory=pin),
             torch.zeros((self.num_cpu_blocks, *kv_shape), dtype=self.dtype, pin_memory=pin))
            for _ in range(model_config.num_layers)
        ]
        self.grammars = Grammars(self.tokenizer, model_config.vocab_size)
        self.sampler = Sampler(self.device, config.seed, self.grammars)
        self.proposer = None  # engine/spec_decode: a draft model beside this one, when configured
        spec = SpeculativeConfig.parse(config.speculative_config)
        if spec is not None and spec.method == "draft_model":
            from iterserve.engine.spec_decode.draft_model import DraftModelProposer

            self.proposer = DraftModelProposer.load(spec.model, model_config.vocab_size, self.device, self.dtype,
                                                    config, self.num_kv_blocks * config.block_size)
        logger.info(
            "model %s (%s): %d layers, %s on %s, %s attention; KV pool %d blocks x %d = %d tokens "
            "(%.0f MiB), swap pool %d blocks",
            self.model_name, path, model_config.num_layers, str(self.dtype).removeprefix("torch."),
            self.device, backend.name, self.num_kv_blocks, config.block_size,
            self.num_kv_blocks * config.block_size, self.num_kv_blocks * bytes_per_block / 2**20,
            self.num_cpu_blocks,
        )
        # --threads auto on a CPU server: big multi-sequence steps run as two 1-thread halves.
        self.split = StepSplit() if split_steps() and self.device.type == "cpu" and not config.compile else None
        if self.split is not None:
            logger.info("CPU steps of >= %d tokens run as two 1-thread halves of the batch (split execution)",
                        self.split.min_tokens)
        if config.compile:
            from iterserve.engine.model.compiled import compile_model

            compile_model(self.model)  # compiles (or loads from the cache) now, not during the first requests

    def _lora_manager(self, config: EngineConfig, model_config: ModelConfig):
        """engine/lora's adapters for this model (model_config: the whole model's), with --lora-modules
        registered; under tensor parallelism each rank's slots hold its part (lora_shard)."""
        from iterserve.engine.lora.adapter import LoraError
        from iterserve.engine.lora.manager import LoraManager, check_lora_model

        try:
            check_lora_model(self.model, self.quantization)
            manager = LoraManager(model_config, self.model.layers, config.max_loras, config.max_lora_rank,
                                  config.max_cpu_loras, self.device, self.dtype, shard=self.lora_shard())
            for name, path in config.lora_module_paths().items():
                manager.register(name, path)
        except LoraError as exc:
            raise ConfigError(f"--lora-modules / --enable-lora: {exc}") from None
        return manager

    def shard(self, loaded, config: EngineConfig) -> ModelConfig:
        """The config the model is built with (engine/distributed overrides it to slice the weights)."""
        return loaded.config

    def lora_shard(self):
        """This rank's engine/model/parallel.Shard of LoRA adapters (engine/distributed), None: all of them."""
        return None

    def parallelize(self, full_config: ModelConfig) -> None:
        """After the model is built: engine/distributed's hook to make its layers talk to the other ranks."""

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[int | None]:
        if out.swap_out:
            self._copy_blocks(out.swap_out, self.kv_caches, self.cpu_caches)
        if out.swap_in:
            self._copy_blocks(out.swap_in, self.cpu_caches, self.kv_caches)
        if out.kv_loads:
            self._load_kv(out.kv_loads)
        chunks = out.chunks
        if not chunks:
            return []
        total = sum(chunk.num_tokens for chunk in chunks)
        groups = None
        speculative = any(chunk.num_spec for chunk in chunks)
        observe = self.proposer is not None and self.proposer.needs_hidden_states  # the EAGLE seam
        if (self.split is not None and not speculative and not observe
                and not any(chunk.seq.lora_name for chunk in chunks)):
            groups = self.split.plan([chunk_cost(c.start, c.num_tokens, c.sample) for c in chunks], total)
        if groups is None:
            apply_step_threads(total)  # --threads auto: more threads for a bigger step (CPU server only)
            hidden, logits = self._forward(chunks)
            self._record_prompt_logprobs(chunks, hidden)
            if observe and logits is not None:
                self.proposer.observe_hidden(sampled_hidden_states(chunks, hidden))
        else:
            logits = self.forward_split(chunks, groups)
        if logits is None:
            return [None] * len(chunks)
        if speculative:
            return self._sample_verified(chunks, logits)
        tokens = iter(self.sampler.sample(logits, [chunk.seq for chunk in chunks if chunk.sample]))
        return [next(tokens) if chunk.sample else None for chunk in chunks]

    def _sample_verified(self, chunks, logits: torch.Tensor) -> list:
        """A step with verified chunks: logits hold 1 + num_spec rows per verified chunk, 1 per other
        sampled chunk (in chunk order). Plain rows are sampled as ever; verified ones verified."""
        plain_rows, plain_seqs, spec_logits, spec_seqs, row = [], [], [], [], 0
        for chunk in chunks:
            if not chunk.sample:
                continue
            if chunk.num_spec:
                spec_logits.append(logits[row : row + 1 + chunk.num_spec])
                spec_seqs.append(chunk.seq)
                row += 1 + chunk.num_spec
            else:
                plain_rows.append(row)
                plain_seqs.append(chunk.seq)
                row += 1
        plain = iter(self.sampler.sample(logits[torch.tensor(plain_rows, device=logits.device)], plain_seqs)
                     if plain_rows else [])
        verified = iter(self.sampler.verify(spec_logits, spec_seqs))
        return [None if not chunk.sample else next(verified) if chunk.num_spec else next(plain) for chunk in chunks]

    def _forward(self, chunks) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over these chunks as one flat batch: (hidden states of every row, logits of the
        sampled chunks' last rows in chunk order, or None when no chunk samples)."""
        input_ids: list[int] = []
        row_adapters: list[str | None] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            input_ids += seq.token_slice(start, end)
            row_adapters += [seq.lora_name] * (len(input_ids) - len(row_adapters))
            positions += range(start, end)
            query_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            block_tables.append(seq.block_table)
            if chunk.sample:  # the last row, or with proposals the rows after the last token and each proposal
                sample_rows.extend(range(len(input_ids) - 1 - chunk.num_spec, len(input_ids)))
        device = self.device
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size, device)
        self.model.lora_step = self.lora.step(row_adapters) if self.lora is not None else None
        try:
            hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=device),
                                torch.tensor(positions, dtype=torch.long, device=device), self.kv_caches, meta)
        finally:
            self.model.lora_step = None
        if not sample_rows:
            return hidden, None
        rows = hidden[torch.tensor(sample_rows, device=device)] if len(sample_rows) < len(input_ids) else hidden
        return hidden, self.model.compute_logits(rows)

    @torch.inference_mode()
    def forward_split(self, chunks, groups: tuple[list[int], list[int]]) -> torch.Tensor | None:
        """The model over two groups of the chunks at once (engine/model/split_step.py), one torch
        thread each; returns the sampled rows' logits in chunk order, exactly as _forward would.

        Safe to run concurrently: each group writes only its own sequences' KV slots (a block is
        written by the one sequence that owns it; prefix-cache blocks shared between sequences are
        full, hence only read), and no group reads a slot the other writes this step, because a
        sequence's chunks all sit in one group (one chunk per sequence per step)."""
        apply_split_threads()
        parts = [[chunks[i] for i in group] for group in groups]
        results = self.split.run([lambda part=part: self._forward(part) for part in parts])
        for part, (hidden, _) in zip(parts, results, strict=True):
            self._record_prompt_logprobs(part, hidden)
        logits = [group_logits for _, group_logits in results if group_logits is not None]
        if not logits:
            return None
        order = original_order(groups, [chunk.sample for chunk in chunks])
        joined = torch.cat(logits) if len(logits) > 1 else logits[0]
        return joined.index_select(0, torch.tensor(order, device=joined.device))

    def _record_prompt_logprobs(self, chunks, hidden: torch.Tensor) -> None:
        """Prompt logprobs (engine/logprobs.py) for the prompt chunks of requests that asked for them."""
        offset = 0
        for chunk in chunks:
            seq = chunk.seq
            if seq.params.prompt_logprobs is not None and chunk.start < seq.num_prompt_tokens - 1:
                rows = hidden[offset : offset + chunk.num_tokens]
                record_prompt_logprobs(seq, chunk.start, self.model.compute_logits(rows))
            offset += chunk.num_tokens

    def _copy_blocks(self, pairs: list[tuple[int, int]], source: list, target: list) -> None:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=source[0][0].device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=target[0][0].device)
        for (src_k, src_v), (dst_k, dst_v) in zip(source, target, strict=True):
            dst_k[dst] = src_k[src].to(dst_k.device)
            dst_v[dst] = src_v[src].to(dst_v.device)

    # -- KV transfer (engine/kv_transfer) ----------------------------------------------------------
    def kv_layout(self) -> KVLayout:
        return self._kv_layout

    def enable_kv_store(self) -> None:
        pass  # the KV pool is the store: read_kv reads the blocks in place

    def read_kv(self, block_ids: list[int]):
        """Per layer, (K bytes, V bytes) of these blocks; runs on a KV transfer thread, reading only
        blocks a lease pins (no step writes into them)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for k, v in self.kv_caches:
            yield (_raw_bytes(k.index_select(0, index)), _raw_bytes(v.index_select(0, index)))

    def _load_kv(self, loads) -> None:
        """Copy pulled KV (per layer K bytes then V bytes) into the blocks the scheduler gave it."""
        for load in loads:
            index = torch.tensor(load.block_ids, dtype=torch.long, device=self.device)
            for (k, v), payload in zip(self.kv_caches, load.layers, strict=True):
                data = torch.frombuffer(payload, dtype=self.dtype).view(2, len(load.block_ids), *k.shape[1:])
                k[index] = data[0].to(self.device)
                v[index] = data[1].to(self.device)

    def release(self, request_ids: list[str]) -> None:
        self.sampler.release(request_ids)
        if self.proposer is not None:
            self.proposer.release(request_ids)


def sampled_hidden_states(chunks, hidden: torch.Tensor) -> list[HiddenStates]:
    """Per sampled chunk, the hidden rows whose logits were sampled (engine/spec_decode/proposer.py)."""
    states, end = [], 0
    for chunk in chunks:
        end += chunk.num_tokens
        if chunk.sample:
            first = chunk.start + chunk.num_tokens - 1 - chunk.num_spec
            states.append(HiddenStates(chunk.seq, first, hidden[end - 1 - chunk.num_spec : end]))
    return states


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
