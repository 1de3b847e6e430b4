"""Weight-only quantized linears for CPU decode (`--quantization int8|int4`).

A decode step with few sequences reads every weight once per token; fp32 SmolLM2-135M is 540 MB
of weights per step, so a small-batch step is bound by memory bandwidth. These linears keep the
weights in int8 (per-output-channel scales) or int4 (the GGUF's own Q4_1 blocks: 32 weights
sharing a scale d and a minimum m, w = q * d + m) and run torch's CPU weight-only kernels
(`torch._weight_int8pack_mm`, `torch._weight_int4pack_mm_for_cpu`). Those kernels have fast paths
for bf16 activations only (fp32 activations fall back to a slow loop), so the activations are
rounded to bf16 for the matmul and the result comes back in the model dtype.

Large batches are compute-bound, and there MKL's fp32 sgemm beats the weight-only kernels on AVX2,
so a linear with more than `dense_above` rows multiplies by the dequantized weight instead (the
same quantized values in fp32: a row's result does not depend on the kernel beyond rounding).

fp32 without --quantization stays the exact-parity mode.
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref

import torch
import torch.nn.functional as F

MODES = ("none", "int8", "int4", "w8a8")
Q4_GROUP = 32
# Rows above which a quantized linear uses the dequantized fp32 weight (see the module docstring).
DENSE_ABOVE = int(os.environ.get("ITERSERVE_QUANT_DENSE_ABOVE", "16"))
W8A8_WEIGHT_MAX = 63  # w8a8 weights in -63..63 (see W8A8Linear)
STREAM_ROWS = 32  # dense path: up to this many rows as W @ x.T (see QuantLinear.__call__)


class QuantLinear:
    """y = x @ W.T for W held quantized; called like F.linear(x, W)."""

    kind = "none"

    def __init__(self, dense: torch.Tensor, dense_above: int):
        self.dense = dense  # the dequantized weight, fp32 [out, in]
        self.dense_above = dense_above
        self.shape = dense.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.dense_above:
            return self.quantized(x)
        if rows <= STREAM_ROWS:
            # MKL's x @ W.T packs all of W first, which costs more than the product for a few rows;
            # W @ x.T streams W once (PEERS-STEP's measurement: LM head at 2 rows 32 ms -> 15 ms).
            return torch.mm(self.dense, x.t()).t().contiguous()
        return F.linear(x, self.dense)

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8Linear(QuantLinear):
    kind = "int8"

    def __init__(self, weight: torch.Tensor, dense_above: int = DENSE_ABOVE):
        weight = weight.float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        # bf16 scales: the kernel wants the activations' dtype; dequantize with the rounded scales so
        # the dense path and the kernel agree.
        self.scales = scales.to(torch.bfloat16)
        super().__init__(self.qweight.float() * self.scales.float()[:, None], dense_above)

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales).to(x.dtype)


class Int4Linear(QuantLinear):
    """From Q4_1 blocks along the input dim: q [out, in] in 0..15, d and m [out, in / 32]."""

    kind = "int4"

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dense_above: int = DENSE_ABOVE):
        out_features, in_features = q.shape
        # The kernel computes w = (q - 8) * scale + zero per group: zero = m + 8 d gives q * d + m.
        d16, zero16 = d.to(torch.bfloat16), (m + 8 * d).to(torch.bfloat16)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.scales_and_zeros = torch.stack([d16.t(), zero16.t()], dim=-1).contiguous()  # [in/32, out, 2]
        dense = ((q.float().view(out_features, -1, Q4_GROUP) - 8) * d16.float()[..., None]
                 + zero16.float()[..., None]).view(out_features, in_features)
        super().__init__(dense, dense_above)

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, Q4_GROUP,
                                                 self.scales_and_zeros).to(x.dtype)


class W8A8Linear(QuantLinear):
    """int8 weights times int8 activations (`--quantization w8a8`), through fbgemm's dynamic int8
    linear (`torch.ops.quantized.linear_dynamic`: activations quantized on the fly, int32
    accumulation, AVX2 u8 x s8 kernels). It is faster than fp32 sgemm at every row count measured
    (bench/quant_linear.py), from one decode row (it reads a quarter of the bytes) to full batches
    (it computes with 8-bit integer lanes).

    fbgemm quantizes the activations with ONE scale for the whole batch (over its min..max), so one
    large row would coarsen every other row, and a row's result would depend on its batch. Each row
    is therefore divided by its own max |value| first and the result multiplied back (exact: the
    linear has no bias), and one constant row [1, -1, 0, ...] is added, so the batch's range is
    always exactly [-1, 1]: every row is quantized with the same step, 2/255 of its own max |value|
    (uint8 with a zero point), and a row's result never depends on the other rows of a batch. A
    single row (a decode step with one sequence) skips the scaling: fbgemm's own range for it,
    [min(x, 0), max(x, 0)], is at most as wide, so it is rounded at least as finely (its result
    can differ from the same row's in a batch by that rounding, as fp32's gemv and gemm differ). Weights:
    per-output-channel symmetric, within +-63 (W8A8_WEIGHT_MAX): AVX2's u8 x s8 multiply sums pairs
    into 16 bits with saturation, and 2 x 255 x 64 is the most that fits; fbgemm's other remedy,
    `reduce_range` (7-bit activations), doubles the activation rounding, which dominates the error
    (measured on the real model: mean relative error per linear 3-4% this way, 4-6% with
    reduce_range). No fp32 copy of the weight is kept."""

    kind = "w8a8"

    def __init__(self, weight: torch.Tensor):
        weight = weight.float()
        out_features, in_features = weight.shape
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / W8A8_WEIGHT_MAX
        self.qweight = torch.round(weight / scales[:, None]).clamp(-W8A8_WEIGHT_MAX, W8A8_WEIGHT_MAX).to(
            torch.int8).contiguous()
        self.wscale = scales
        self.shape = self.qweight.shape
        self.packed = _fbgemm_prepack(self.qweight, scales)
        # torch.compile cannot pass fbgemm's packed weight (a TorchScript object) through a graph: the
        # compiled path calls the custom op below with qweight, which finds the packed weight here.
        _PACKED[self.qweight.data_ptr()] = self.packed
        weakref.finalize(self, _PACKED.pop, self.qweight.data_ptr(), None)

    @property
    def dense(self) -> torch.Tensor:
        """The dequantized weight (for tests and tools; the forward pass never builds it)."""
        return self.qweight.float() * self.wscale[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.iterserve.w8a8_linear(x, self.qweight)
        return _w8a8(x, self.packed)


_PACKED: dict[int, object] = {}  # W8A8Linear.qweight.data_ptr() -> its fbgemm packed weight


@functools.cache
def _sentinel(in_features: int) -> torch.Tensor:
    row = torch.zeros(in_features)
    row[0], row[min(1, in_features - 1)] = 1.0, -1.0
    return row


def _w8a8(x: torch.Tensor, packed) -> torch.Tensor:
    """fbgemm's dynamic int8 linear with each row quantized on its own range (see W8A8Linear)."""
    rows, in_features = x.shape
    if rows == 1:
        # One row already gets a range of its own from fbgemm ([min(x, 0), max(x, 0)]: no coarser
        # than the +-max|x| of the batched path below), which saves ~6 small ops (~0.06 ms per linear,
        # bench/quant_linear.py: w8a8 vs w8a8-fbgemm at 1 row).
        return torch.ops.quantized.linear_dynamic(x.float(), packed, False).to(x.dtype)
    # abs().amax(): linalg.vector_norm(ord=inf) took 5-10x longer at 64 rows (26 ms of a 355 ms step).
    row_max = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)
    scaled = torch.cat([_sentinel(in_features)[None], x / row_max])
    out = torch.ops.quantized.linear_dynamic(scaled, packed, False)[1:]  # reduce_range off: 8-bit x
    return out.mul_(row_max).to(x.dtype)


@torch.library.custom_op("iterserve::w8a8_linear", mutates_args=())
def _w8a8_op(x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    return _w8a8(x, _PACKED[qweight.data_ptr()]).clone()


@_w8a8_op.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _fbgemm_prepack(qweight: torch.Tensor, scales: torch.Tensor):
    """fbgemm's packed int8 weight (per-channel scales) for torch.ops.quantized.linear_dynamic."""
    engine = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():
            # torch marks quantized tensors as deprecated (in favour of torchao); this is only the
            # packing format the fbgemm kernel takes, built once at load.
            warnings.simplefilter("ignore", UserWarning)
            q = torch._make_per_channel_quantized_tensor(qweight, scales.double(),
                                                         torch.zeros(len(scales), dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(q, None)
    except (RuntimeError, AttributeError) as error:
        raise ValueError(f"--quantization w8a8 needs torch's fbgemm int8 kernels (an x86-64 CPU build of torch); "
                         f"this torch has none ({error}); use --quantization int8") from error
    finally:
        torch.backends.quantized.engine = engine


def int4_from_dense(weight: torch.Tensor, dense_above: int = DENSE_ABOVE) -> Int4Linear:
    """Q4_1-style blocks (min/max per 32 weights) from a float weight: for weights the file did not
    store as Q4_1 (tests, HF checkpoints)."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // Q4_GROUP, Q4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / d[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Linear(q.view(out_features, in_features), d, low, dense_above)


def check_supported(mode: str, device: torch.device) -> None:
    if mode not in MODES:
        raise ValueError(f"--quantization must be one of {', '.join(MODES)}; got {mode!r}")
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"--quantization {mode} runs torch's CPU weight-only kernels; use --device cpu")


def quantize_dense(mode: str, weight: torch.Tensor) -> QuantLinear:
    """A decoder linear for --quantization mode, from its float weight (int4: blocks made from it)."""
    if mode == "int8":
        return Int8Linear(weight)
    if mode == "int4":
        return int4_from_dense(weight)
    if mode == "w8a8":
        return W8A8Linear(weight)
    raise ValueError(f"no quantized linear for --quantization {mode!r}")


def quantize_lm_head(mode: str, weight: torch.Tensor) -> QuantLinear:
    """The LM head (run on the sampled rows only): int8 in every mode (the GGUF stores it as Q8_0)."""
    return W8A8Linear(weight) if mode == "w8a8" else Int8Linear(weight)
