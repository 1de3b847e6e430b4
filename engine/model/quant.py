"""Quantized linears for CPU models (`--quantization auto|gguf|int8|int4|w8a8`): a GGUF model's own
block formats (GGUFLinear on cpu_gguf.py's kernel: the default for GGUF files on CPU), weight-only
int8 / int4 below, and w8a8 (int8 weights and activations) on iterserve's own kernel (W8A8Linear,
cpu_w8a8.py).

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

`--quantization none` (and an explicit `--dtype float32`) stays the exact-parity fp32 mode.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from iterserve.engine.model import cpu_gguf, cpu_w8a8

# auto: a GGUF file on CPU under --dtype auto runs its own block formats (gguf), anything else none
MODES = ("auto", "none", "gguf", "int8", "int4", "w8a8")
Q4_GROUP = 32
# Rows above which a quantized linear uses the dequantized fp32 weight (see the module docstring).
DENSE_ABOVE = int(os.environ.get("ITERSERVE_QUANT_DENSE_ABOVE", "16"))
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
    """int8 weights times int8 activations (`--quantization w8a8`) on iterserve's own CPU kernel
    (engine/model/cpu_w8a8.py): each activation row is quantized on its own range (127 steps of
    its max |value|), the products are summed in exact int32, and only then scaled back, so a
    row's result never depends on the other rows of its batch, at any batch size or thread count.
    It reads a quarter of fp32's bytes (decode steps of few sequences are bound by reading the
    weights) and computes with 8-bit integer lanes (full batches are bound by compute).

    Weights: per-output-channel symmetric, within +-63 (cpu_w8a8.WEIGHT_MAX): AVX2's u8 x s8
    multiply sums pairs into 16 bits with saturation, and 2 x 255 x 63 is the most that fits
    (halving the activations' range instead doubles their rounding, which dominates the error).
    No fp32 copy of the weight is kept. Without the kernel (no C compiler, no AVX2) the same
    arithmetic runs in torch ops (cpu_w8a8.reference), bit for bit, slowly."""

    kind = "w8a8"

    def __init__(self, weight: torch.Tensor):
        self.qweight, self.wscale, self.wsum = cpu_w8a8.quantize_weight(weight)
        self.shape = self.qweight.shape
        self.fast = cpu_w8a8.supported(self.shape[1])

    @property
    def dense(self) -> torch.Tensor:
        """The dequantized weight (for tests and tools; the forward pass never builds it)."""
        return self.qweight.float() * self.wscale[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.iterserve.w8a8_linear(x, self.qweight, self.wscale, self.wsum)
        return _w8a8(x, self.qweight, self.wscale, self.wsum, self.fast)


def _w8a8(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, wsum: torch.Tensor,
          fast: bool) -> torch.Tensor:
    if not fast:
        return cpu_w8a8.reference(x, qweight, wscale).to(x.dtype)
    x32 = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
    return cpu_w8a8.linear(x32, qweight, wscale, wsum, cpu_w8a8.kernel_threads()).to(x.dtype)


@torch.library.custom_op("iterserve::w8a8_linear", mutates_args=())
def _w8a8_op(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, wsum: torch.Tensor) -> torch.Tensor:
    return _w8a8(x, qweight, wscale, wsum, cpu_w8a8.supported(qweight.shape[1]))


@_w8a8_op.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, wsum: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


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
    if mode not in ("none", "auto") and device.type != "cpu":
        raise ValueError(f"--quantization {mode} runs torch's CPU weight-only kernels; use --device cpu")


def effective_mode(requested: str, gguf_file: bool, device: torch.device, dtype_option: str) -> str:
    """The linears a model runs for --quantization requested: auto is gguf (the file's own block
    formats) for a GGUF file on a CPU under --dtype auto, else none (an explicit --dtype float32
    keeps the exact dequantized fp32 path, as parity tests want; safetensors stay fp32/bf16)."""
    check_supported(requested, device)
    if requested == "auto":
        return "gguf" if gguf_file and device.type == "cpu" and dtype_option == "auto" else "none"
    if requested == "gguf" and not gguf_file:
        raise ValueError("--quantization gguf computes on a GGUF file's own blocks; this model is not a GGUF "
                         "file: use --quantization auto, none, int8, int4 or w8a8")
    return requested


class GGUFLinear(QuantLinear):
    """y = x @ W.T with W in the GGUF file's own block formats (cpu_gguf.py), one part per run of
    output rows sharing a format (a fused q/k/v of Q4_K and Q6_K tensors is two parts). Without the
    kernel (no C compiler, no AVX2) it multiplies by the dequantized weight (logged once)."""

    kind = "gguf"

    def __init__(self, parts: list[tuple[int, torch.Tensor]]):
        merged: list[tuple[int, torch.Tensor]] = []
        for type_id, blocks in parts:
            if merged and merged[-1][0] == type_id:
                merged[-1] = (type_id, torch.cat([merged[-1][1], blocks]))
            else:
                merged.append((type_id, blocks.contiguous()))
        self.parts = merged
        weights, nbytes = cpu_gguf.block_shape(merged[0][0])
        self.shape = (sum(b.shape[0] for _, b in merged), merged[0][1].shape[1] // nbytes * weights)
        self.fast = cpu_gguf.load() is not None and all(
            self.shape[1] % cpu_gguf.block_shape(t)[0] == 0 for t, _ in merged)
        self._dense = None if self.fast else self.dense

    @property
    def dense(self) -> torch.Tensor:
        """The dequantized weight (the fallback's, tests' and tools'; the kernel never builds it)."""
        return torch.cat([cpu_gguf.dequantize(b, t) for t, b in self.parts])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is not None:
            return F.linear(x, self._dense.to(x.dtype))
        x32 = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
        if torch.compiler.is_compiling():
            outs = [torch.ops.iterserve.gguf_linear(x32, b, t) for t, b in self.parts]
        else:
            threads = cpu_w8a8.kernel_threads()
            outs = [cpu_gguf.linear(x32, b, t, threads) for t, b in self.parts]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)).to(x.dtype)


@torch.library.custom_op("iterserve::gguf_linear", mutates_args=())
def _gguf_op(x: torch.Tensor, blocks: torch.Tensor, type_id: int) -> torch.Tensor:
    return cpu_gguf.linear(x, blocks, type_id, cpu_w8a8.kernel_threads())


@_gguf_op.register_fake
def _(x: torch.Tensor, blocks: torch.Tensor, type_id: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], blocks.shape[0]))


def gguf_linear(blocks: dict[str, tuple[int, torch.Tensor]] | None, names: tuple[str, ...],
                pop: bool = True) -> GGUFLinear | None:
    """The file's blocks of the named tensors, fused along the output rows, or None where one of them
    is not in a block format the kernel takes (that linear then stays dense)."""
    if not blocks or not all(n in blocks for n in names):
        return None
    return GGUFLinear([blocks.pop(n) if pop else blocks[n] for n in names])


def gguf_embedding(blocks: dict[str, tuple[int, torch.Tensor]] | None,
                   tied_head: GGUFLinear | None) -> cpu_gguf.BlockRows | None:
    """The token embedding in its file's block format (rows dequantized on lookup): the tied LM head's
    blocks where the head is a GGUFLinear of one part, else the file's own embedding blocks; None where
    the file keeps it in another format (it then stays dense)."""
    if isinstance(tied_head, GGUFLinear) and len(tied_head.parts) == 1:
        return cpu_gguf.BlockRows(*tied_head.parts[0])
    if tied_head is None and blocks and "model.embed_tokens.weight" in blocks:
        return cpu_gguf.BlockRows(*blocks.pop("model.embed_tokens.weight"))
    return None


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
