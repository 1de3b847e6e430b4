"""Compiles every engine kernel ahead of time for a CUDA target, no GPU needed.

The interpreter runs the kernels on CPU but skips the GPU compiler's rules (tl.dot shape minimums,
dtype legality, layouts); this catches those. Run as a script in a process WITHOUT
TRITON_INTERPRET: python -m tests.unit.kernel_gpu_compile [dtype ...]; prints one line per kernel.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402  (a CUDA-capable build; no GPU is needed to compile)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from iterserve.engine.kernels import (  # noqa: E402
    activation,
    decode_attention,
    extend_attention,
    kv_cache,
    moe,
    rms_norm,
    rotary,
)

TARGET = GPUTarget("cuda", 90, 32)


def signature(fn, pointers: dict[str, str], floats: set[str], constexprs: dict) -> ASTSource:
    """Pointers typed by name; floats fp32; constexprs as given; every other argument i32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return ASTSource(fn=fn, signature=sig, constexprs=constexprs)


def sources(dt: str):
    prec = "ieee" if dt == "fp32" else "tf32"
    attn_ptrs = {"q_ptr": f"*{dt}", "k_cache_ptr": f"*{dt}", "v_cache_ptr": f"*{dt}", "out_ptr": f"*{dt}",
                 "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                 "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    floats = {"scale_log2", "scale", "softcap"}  # window is an i32
    for group, splits, page, dim, softcap in ((1, 1, 16, 128, False), (4, 4, 32, 64, True), (3, 8, 8, 64, False)):
        yield f"decode g{group} s{splits} p{page} d{dim} softcap={softcap}", signature(
            decode_attention._paged_decode_kernel, attn_ptrs, floats,
            dict(GROUP=group, GROUP_PAD=16, HEAD_DIM=dim, DIM_PAD=dim, PAGE_SIZE=page,
                 BLOCK_N=64, NUM_SPLITS=splits, DOT_PRECISION=prec, HAS_SOFTCAP=softcap))
    yield "merge splits", signature(decode_attention._merge_splits_kernel, attn_ptrs, set(),
                                    dict(HEAD_DIM=128, DIM_PAD=128, NUM_SPLITS=8))
    for block_m, dim, softcap in ((16, 64, True), (64, 128, False)):
        yield f"extend m{block_m} d{dim} softcap={softcap}", signature(
            extend_attention._extend_attention_kernel, attn_ptrs, floats,
            dict(GROUP=4, HEAD_DIM=dim, DIM_PAD=dim, PAGE_SIZE=16, BLOCK_M=block_m,
                 BLOCK_N=64 if dim <= 64 else 32, MIN_QUERY_LEN=2, DOT_PRECISION=prec, HAS_SOFTCAP=softcap))
    yield "write_kv", signature(
        kv_cache._write_kv_kernel, {"key_ptr": f"*{dt}", "value_ptr": f"*{dt}", "k_cache_ptr": f"*{dt}",
                                    "v_cache_ptr": f"*{dt}", "slot_mapping_ptr": "*i64"}, set(),
        dict(NUM_HEADS=3, HEAD_DIM=64, HEADS_PAD=4, DIM_PAD=64, BLOCK_T=16))
    for has_residual in (True, False):
        yield f"rms_norm residual={has_residual}", signature(
            rms_norm._rms_norm_kernel, {n: f"*{dt}" for n in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr",
                                                               "residual_out_ptr")}, {"eps"},
            dict(HAS_RESIDUAL=has_residual, BLOCK_ROWS=4, BLOCK_H=1024))
    yield "rotary", signature(
        rotary._rotary_kernel, {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "q_out_ptr": f"*{dt}",
                                "k_out_ptr": f"*{dt}", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32"}, set(),
        dict(HALF=32, HALF_PAD=32, Q_HEADS_PAD=16, K_HEADS_PAD=4, BLOCK_T=4))
    yield "silu_and_mul", signature(activation._silu_and_mul_kernel,
                                    {"gate_up_ptr": f"*{dt}", "out_ptr": f"*{dt}"}, set(),
                                    dict(BLOCK_ROWS=8, BLOCK_W=1024))
    for block_m, per_pair in ((16, False), (64, True)):
        yield f"moe m{block_m} rows_per_pair={per_pair}", signature(
            moe._grouped_gemm_kernel, {"a_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}",
                                       "sorted_pairs_ptr": "*i64", "block_experts_ptr": "*i64",
                                       "pair_weights_ptr": f"*{dt}"}, set(),
            dict(TOP_K=8, ROWS_PER_PAIR=per_pair, MUL_WEIGHT=per_pair, PRECISION=prec, BLOCK_M=block_m,
                 BLOCK_N=64, BLOCK_K=32))


def main(dtypes: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET=1: the interpreter builds no GPU code", file=sys.stderr)
        return 2
    for dt in dtypes:
        for name, src in sources(dt):
            compiled = triton.compile(src, target=TARGET)
            print(f"{dt} {name}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["fp16", "bf16"]))
