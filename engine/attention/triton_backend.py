"""Attention backend on the Triton kernels in iterserve.engine.kernels.

Every input is checked before a kernel is launched, so bad input fails with a ValueError that
names the field, not with a wrong answer or a crash inside a kernel. The block table and slot
mapping are range-checked once per step (the first layer that sees a metadata object), since
that needs their values.

On CUDA the kernels run in fp16, bf16 or fp32. On CPU they run through the Triton interpreter,
which must be switched on with TRITON_INTERPRET=1 before triton is first imported, in fp32 or fp16
(the interpreter gets bf16 wrong).
"""

from __future__ import annotations

import functools
import weakref
from types import ModuleType

import torch

from iterserve.engine.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionMetadata,
    AttentionOptions,
)

GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The interpreter computes bfloat16 wrongly (silently), so CPU runs take fp32 or fp16.
CPU_DTYPES = (torch.float32, torch.float16)


@functools.cache
def _kernels() -> ModuleType:
    """The kernels package with its modules, imported on first use so that importing this backend
    needs no triton."""
    import iterserve.engine.kernels.activation
    import iterserve.engine.kernels.decode_attention
    import iterserve.engine.kernels.extend_attention
    import iterserve.engine.kernels.kv_cache
    import iterserve.engine.kernels.rms_norm
    import iterserve.engine.kernels.rotary

    return iterserve.engine.kernels


@functools.cache
def interpreter_enabled() -> bool:
    """Whether the kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    import triton.language as tl

    ours = type(_kernels().activation._silu_and_mul_kernel).__name__ == "InterpretedFunction"
    library = type(tl.zeros).__name__ == "InterpretedFunction"
    if ours and not library:
        # The interpreter cannot call triton.language's own helpers compiled for the GPU.
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so the interpreter "
                           "cannot run; set TRITON_INTERPRET=1 in the environment before starting Python")
    return ours


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, decode_splits: int | None = None) -> None:
        """decode_splits fixes the flash-decoding split count (None: chosen per step)."""
        self.decode_splits = decode_splits
        self._checked_meta: weakref.ref | None = None
        self._checked_shape: tuple | None = None
        self._checked_positions: weakref.ref | None = None

    @property
    def kernels(self) -> ModuleType:
        return _kernels()

    # -- AttentionBackend ----------------------------------------------------------------------

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        _check_device_dtype("key", key)
        _check_same("value", value, "key", key)
        _check_cache(k_cache, v_cache, key)
        if key.dim() != 3 or key.shape[1:] != k_cache.shape[2:]:
            raise ValueError(f"key has shape {tuple(key.shape)}; expected [num_tokens, {k_cache.shape[2]}, "
                             f"{k_cache.shape[3]}] to match the cache's [num_kv_heads, head_dim]")
        if value.shape != key.shape:
            raise ValueError(f"value has shape {tuple(value.shape)} but key has {tuple(key.shape)}")
        self._check_meta(meta, key.shape[0], k_cache, key.device)
        key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
        self.kernels.kv_cache.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               options: AttentionOptions = FULL_ATTENTION) -> torch.Tensor:
        _check_device_dtype("query", query)
        _check_cache(k_cache, v_cache, query)
        if query.dim() != 3:
            raise ValueError(f"query has shape {tuple(query.shape)}; expected [num_tokens, num_heads, head_dim]")
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = k_cache.shape[2]
        if head_dim != k_cache.shape[3]:
            raise ValueError(f"query head_dim {head_dim} differs from the cache's head_dim {k_cache.shape[3]}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) "
                             "for grouped-query attention")
        self._check_meta(meta, query.shape[0], k_cache, query.device)
        query = _last_dim_contiguous(query)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if meta.num_seqs == 0:
            return out
        args = (query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, scale)
        extra = {"window": options.sliding_window, "softcap": options.logit_softcap}
        if any(n == 1 for n in meta.query_lens_list):
            self.kernels.decode_attention.paged_decode_attention(
                *args, max_seq_len=meta.max_seq_len, num_splits=self.decode_splits, **extra)
        if meta.max_query_len > 1:
            self.kernels.extend_attention.extend_attention(*args, max_query_len=meta.max_query_len, **extra)
        return out

    def rms_norm(self, x, weight, eps, residual=None):
        _check_device_dtype("x", x)
        _check_same("weight", weight, "x", x)
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(f"weight has shape {tuple(weight.shape)}; expected [{x.shape[-1]}] "
                             "(the hidden size, x's last dim)")
        if residual is not None:
            _check_same("residual", residual, "x", x)
            if residual.shape != x.shape:
                raise ValueError(f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")
            residual = residual.contiguous()
        return self.kernels.rms_norm.rms_norm(x.contiguous(), weight.contiguous(), float(eps), residual)

    def rotary(self, query, key, positions, cos_sin):
        _check_device_dtype("query", query)
        _check_same("key", key, "query", query)
        if query.dim() != 3 or key.dim() != 3:
            raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must be "
                             "[num_tokens, heads, head_dim]")
        if key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
            raise ValueError(f"key has shape {tuple(key.shape)}; expected [{query.shape[0]}, num_kv_heads, "
                             f"{query.shape[2]}] to match query {tuple(query.shape)}")
        if positions.shape != (query.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions must be an int32/int64 tensor of shape [{query.shape[0]}]; "
                             f"got {positions.dtype} {tuple(positions.shape)}")
        if cos_sin.dim() != 2 or cos_sin.shape[1] != query.shape[2]:
            raise ValueError(f"cos_sin has shape {tuple(cos_sin.shape)}; expected [max_position, "
                             f"{query.shape[2]}] (cos then sin, head_dim wide)")
        if not cos_sin.is_floating_point():
            raise ValueError(f"cos_sin must be floating point; got {cos_sin.dtype}")
        for name, t in (("positions", positions), ("cos_sin", cos_sin)):
            if t.device != query.device:
                raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
        if query.shape[2] % 2:
            raise ValueError(f"rotary needs an even head_dim; got {query.shape[2]}")
        self._check_positions(positions, cos_sin.shape[0])
        return self.kernels.rotary.rotary(_last_dim_contiguous(query), _last_dim_contiguous(key),
                                             positions.contiguous(), cos_sin.contiguous())

    def silu_and_mul(self, gate_up):
        _check_device_dtype("gate_up", gate_up)
        if gate_up.shape[-1] % 2:
            raise ValueError(f"gate_up's last dim must be even (gate then up); got {gate_up.shape[-1]}")
        return self.kernels.activation.silu_and_mul(gate_up.contiguous())

    # -- checks --------------------------------------------------------------------------------

    def _check_positions(self, positions: torch.Tensor, max_position: int) -> None:
        """Once per positions tensor (every layer of a step passes the same one)."""
        if self._checked_positions is not None and self._checked_positions() is positions:
            return
        if positions.numel():
            low, high = torch.aminmax(positions)
            low, high = int(low), int(high)
            if low < 0 or high >= max_position:
                raise ValueError(f"positions range over [{low}, {high}] but cos_sin covers positions "
                                 f"0..{max_position - 1}; build it for max_model_len positions")
        self._checked_positions = weakref.ref(positions)

    def _check_meta(self, meta: AttentionMetadata, num_tokens: int, k_cache: torch.Tensor,
                    device: torch.device) -> None:
        num_blocks, block_size = k_cache.shape[:2]
        shape = (num_tokens, num_blocks, block_size, device)
        if self._checked_meta is not None and self._checked_meta() is meta and self._checked_shape == shape:
            return
        _check_meta_values(meta, num_tokens, num_blocks, block_size, device)
        self._checked_meta = weakref.ref(meta)
        self._checked_shape = shape


def _check_device_dtype(name: str, t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        allowed = GPU_DTYPES
    elif t.device.type == "cpu":
        if not interpreter_enabled():
            raise ValueError(f"{name} is a CPU tensor but the Triton interpreter is off: set "
                             "TRITON_INTERPRET=1 before triton is imported, or use attention_backend='torch'")
        allowed = CPU_DTYPES
    else:
        raise ValueError(f"{name} is on {t.device}; the triton backend runs on cuda (or cpu via the interpreter)")
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        hint = " (the Triton interpreter computes bfloat16 wrongly)" if t.dtype == torch.bfloat16 else ""
        raise ValueError(f"{name} has dtype {t.dtype}; the triton backend on {t.device.type} supports {names}{hint}")


def _check_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, ref: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)}; expected [num_blocks, block_size, "
                         "num_kv_heads, head_dim]")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}")
    _check_same("k_cache", k_cache, "the input", ref)
    _check_same("v_cache", v_cache, "the input", ref)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def _check_meta_values(meta: AttentionMetadata, num_tokens: int, num_blocks: int, block_size: int,
                       device: torch.device) -> None:
    num_seqs = meta.num_seqs
    if len(meta.query_lens_list) != num_seqs:
        raise ValueError(f"metadata.query_lens_list has {len(meta.query_lens_list)} entries for {num_seqs} sequences")
    if sum(meta.query_lens_list) != num_tokens:
        raise ValueError(f"metadata.query_lens_list sums to {sum(meta.query_lens_list)} but the input has "
                         f"{num_tokens} tokens")
    expected = {"query_start_loc": ((num_seqs + 1,), torch.int32), "seq_lens": ((num_seqs,), torch.int32),
                "slot_mapping": ((num_tokens,), torch.int64)}
    for field, (shape, dtype) in expected.items():
        t = getattr(meta, field)
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"metadata.{field} is {t.dtype} {tuple(t.shape)}; expected {dtype} {shape}")
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list, strict=True)):
        if q_len < 1 or q_len > s_len:
            raise ValueError(f"sequence {i}: query length {q_len} must be between 1 and its seq_len {s_len}")
    table = meta.block_tables
    if table.dim() != 2 or table.shape[0] != num_seqs or table.dtype != torch.int32:
        raise ValueError(f"metadata.block_tables is {table.dtype} {tuple(table.shape)}; expected int32 "
                         f"[{num_seqs}, max_blocks]")
    needed = -(-meta.max_seq_len // block_size)
    if table.shape[1] < needed:
        raise ValueError(f"metadata.block_tables has {table.shape[1]} columns but a sequence of "
                         f"{meta.max_seq_len} tokens needs {needed} blocks of {block_size}")
    for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        if getattr(meta, field).device != device:
            raise ValueError(f"metadata.{field} is on {getattr(meta, field).device}; expected {device}")
    if num_seqs == 0:
        return
    # Only the blocks a sequence uses must be in the pool; the table's padding may be anything.
    used_blocks = (meta.seq_lens.long() + block_size - 1) // block_size
    in_use = torch.arange(table.shape[1], device=device)[None, :] < used_blocks[:, None]
    bad = in_use & ((table < 0) | (table >= num_blocks))
    slots = meta.slot_mapping
    bad_slots = (slots < 0) | (slots >= num_blocks * block_size)
    any_bad_block, any_bad_slot = torch.stack([bad.any(), bad_slots.any()]).tolist()  # one sync
    if any_bad_block:
        seq, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"metadata.block_tables[{seq}, {col}] = {int(table[seq, col])} points outside the "
                         f"KV pool of {num_blocks} blocks")
    if any_bad_slot:
        t = int(bad_slots.nonzero()[0, 0])
        raise ValueError(f"metadata.slot_mapping[{t}] = {int(slots[t])} is outside the KV pool of "
                         f"{num_blocks} blocks x {block_size} slots")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
