"""Load a model's config and weights from a GGUF file or a HuggingFace directory (sharded
safetensors with their index; bf16/fp16/fp32), its family found in the architecture registry
(architectures.py).

Either way the result uses HuggingFace tensor names and layouts (model.layers.N.self_attn.q_proj
.weight as [out, in], rotate-half rotary), so the decoder has one weight format to understand.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from iterserve.engine.model.gguf_file import GGUFFile

if TYPE_CHECKING:
    from iterserve.engine.model.moe import MoeSettings

logger = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The model named by --model is missing, unreadable or not something this engine can run."""


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    name: str = ""
    # Which family runs it (engine/model/architectures.py) and the options the families use.
    architecture: str = "llama"
    # HF's rope_parameters: {"rope_type": "llama3", "factor": 8.0, ...}; None is plain rotary (rope.py)
    rope_scaling: dict | None = None
    attention_bias: bool = False  # q/k/v projections have biases (Qwen2, Llama's attention_bias)
    attention_out_bias: bool = False  # o_proj has a bias (Llama's attention_bias)
    mlp_bias: bool = False  # gate/up/down projections have biases (Llama's mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    sliding_window: int | None = None  # a query at position p sees keys p - window + 1 .. p
    # Per layer "full_attention" or "sliding_attention"; None: every layer slides when sliding_window is set
    layer_types: tuple[str, ...] | None = None
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 instead of head_dim ** -0.5
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh
    local_rope_theta: float | None = None  # the sliding layers' own rope base (Gemma 3), unscaled
    norm_weight_offset: float = 0.0  # norms scale by offset + w: 1 for Gemma's checkpoints (a GGUF stores 1 + w)
    moe: MoeSettings | None = None  # the experts of a mixture-of-experts family (engine/model/moe.py)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of this layer's attention, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    path: Path
    format: str  # "gguf" or "hf"
    gguf_reader: object | None = None  # kept so the tokenizer can read the same file's metadata
    # With keep_q4_1: each Q4_1 tensor's blocks as (q uint8 [out, in], d, m float32 [out, in / 32]),
    # rows in HF order, for the int4 linears (engine/model/quant.py).
    q4_1: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # With keep_blocks: each linear tensor in a block format cpu_gguf.py computes on, as (ggml type,
    # blocks uint8 [out, row bytes]), rows in HF order (`--quantization auto` / gguf, quant.GGUFLinear).
    gguf_blocks: dict[str, tuple[int, torch.Tensor]] | None = None


def load_model(path: Path, show_progress: bool = True, keep_q4_1: bool = False,
               keep_blocks: bool = False) -> LoadedModel:
    path = Path(path)
    if path.is_dir():
        return load_hf_dir(path, show_progress)
    if path.is_file():
        return load_gguf(path, show_progress, keep_q4_1, keep_blocks)
    raise ModelLoadError(f"model path {path} does not exist")


# -- GGUF -------------------------------------------------------------------------------------------


_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.scores")


def gguf_metadata(reader) -> dict:
    """Scalar and string metadata as Python values (token arrays are left out: read them on demand)."""
    return {key: field.contents() for key, field in reader.fields.items() if key not in _TOKENIZER_ARRAYS}


def open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as exc:  # GGUFFormatError is a ValueError
        raise ModelLoadError(f"cannot read {path} as a GGUF file: {exc}") from exc


def load_gguf(path: Path, show_progress: bool = True, keep_q4_1: bool = False,
              keep_blocks: bool = False) -> LoadedModel:
    from iterserve.engine.model import architectures, cpu_gguf

    reader = open_gguf(path)
    q4_1: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    file_blocks: dict[str, tuple[int, torch.Tensor]] = {}
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    family = architectures.for_gguf(arch, path)
    config = family.gguf_config(meta, arch, path)
    weights: dict[str, torch.Tensor] = {}
    tensors = tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", disable=not show_progress,
                   leave=False)
    for tensor in tensors:
        if tensor.name == "rope_freqs.weight":  # llama.cpp's form of Llama 3's rope scaling
            config.rope_scaling = {"rope_type": "freq_factors",
                                   "factors": _dequantize(tensor, path).reshape(-1).tolist()}
            continue
        name = _hf_name(tensor.name, family)
        if name is None:
            continue
        array = _dequantize(tensor, path)
        blocks = _q4_1_blocks(tensor) if keep_q4_1 else None
        raw = cpu_gguf.file_blocks(tensor) if keep_blocks else None
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name.split(".")[-2])
        if heads is not None and family.gguf_permuted_qk:
            array = unpermute_rows(array, heads)
            if raw is not None:
                raw = (raw[0], torch.from_numpy(np.ascontiguousarray(unpermute_rows(raw[1].numpy(), heads))))
            if blocks is not None:  # a row permutation: each row keeps its blocks
                blocks = tuple(unpermute_rows(b, heads) for b in blocks)
        if blocks is not None:
            q4_1[name] = tuple(torch.from_numpy(np.ascontiguousarray(b)) for b in blocks)
        if raw is not None:
            file_blocks[name] = raw
        if not array.flags.writeable:  # F32/F16 tensors come back as views of the memory-mapped file
            array = array.copy()
        weights[name] = torch.from_numpy(np.ascontiguousarray(array))
    before = dict(weights)
    if family.adapt_weights is not None:
        family.adapt_weights(weights, config)
    _check_complete(weights, config, path, family)
    # a family whose adapt_weights rewrites weights after loading (renames, splits) computes on the
    # rewritten dense ones; one that left every tensor in place (Gemma's GGUF) keeps the file's blocks
    unchanged = weights.keys() == before.keys() and all(weights[n] is t for n, t in before.items())
    blocks_kept = file_blocks if keep_blocks and unchanged else None
    return LoadedModel(config, weights, path, "gguf", reader, q4_1 if keep_q4_1 else None, blocks_kept)


def _hf_name(gguf_name: str, family) -> str | None:
    from iterserve.engine.model.architectures import GGUF_GLOBAL_NAMES

    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in family.gguf_layer_names:
        return f"model.layers.{parts[1]}.{family.gguf_layer_names[parts[2]]}.{parts[3]}"
    return None


# Block types whose gguf.quants class dequantizes plain blocks (no lookup grids to set up first).
_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_BLOCKS_PER_CALL = 1 << 16  # bounds the float32 temporaries of one call (~2M weights)


def _dequantize(tensor, path: Path) -> np.ndarray:
    import gguf.quants
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype.name in _BLOCK_TYPES:
        # gguf.quants.dequantize runs the same per-block function over groups of 16 rows, which
        # took 2 of the 2.5 s of dequantizing SmolLM2's Q4_1 tensors; over 64k blocks at a time
        # the arithmetic (and so every weight) is the same.
        quant = getattr(gguf.quants, qtype.name)
        block_bytes = GGML_QUANT_SIZES[qtype][1]
        blocks = np.asarray(tensor.data).reshape(-1, block_bytes)
        out = np.empty((blocks.shape[0], GGML_QUANT_SIZES[qtype][0]), dtype=np.float32)
        for start in range(0, blocks.shape[0], _BLOCKS_PER_CALL):
            out[start:start + _BLOCKS_PER_CALL] = quant.dequantize_blocks(blocks[start:start + _BLOCKS_PER_CALL])
        return out.reshape(shape)
    try:
        array = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name} has type {qtype.name}, which cannot be "
                             "dequantized; convert the model to F16, Q8_0, Q4_0/1 or a K-quant") from exc
    return np.asarray(array, dtype=np.float32).reshape(shape)


def _q4_1_blocks(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A Q4_1 tensor's raw blocks: 2-byte f16 d, 2-byte f16 m, 16 bytes holding 32 nibbles (element
    j in the low nibble of byte j, element j + 16 in the high one); w = q * d + m."""
    from gguf import GGMLQuantizationType

    if GGMLQuantizationType(tensor.tensor_type) != GGMLQuantizationType.Q4_1:
        return None
    rows = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1
    cols = int(tensor.shape[0])
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, cols // 32, 20)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = raw[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return q, d, m


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert permute(), which interleaves each head's two rotary halves.

    convert: w.reshape(heads, 2, dim // heads // 2, in).swapaxes(1, 2); this is its inverse, back
    to the rotate-half layout HuggingFace checkpoints use.
    """
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert permute() (HF -> GGUF layout); used to write test files."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


# -- HuggingFace directory -------------------------------------------------------------------------


def load_hf_dir(path: Path, show_progress: bool = True) -> LoadedModel:
    from safetensors import safe_open

    from iterserve.engine.model import architectures

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} is a directory without config.json; give a HuggingFace model "
                             "directory (config.json + *.safetensors) or a .gguf file")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {config_file}: {exc}") from exc
    family = architectures.for_hf_config(raw, path)
    config = family.hf_config(raw, path)
    files = _safetensors_files(path)
    weights: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc=f"loading {path.name}", unit="file", disable=not show_progress, leave=False):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    # (language_model.: a multimodal checkpoint's text model, Gemma 3's older layout)
                    if name.startswith(("model.", "lm_head.", "language_model.")) and "rotary_emb" not in name:
                        weights[name] = handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise ModelLoadError(f"cannot read weights from {file}: {exc}") from exc
    if family.adapt_weights is not None:
        family.adapt_weights(weights, config)
    _check_complete(weights, config, path, family)
    return LoadedModel(config, weights, path, "hf")


INDEX_FILE = "model.safetensors.index.json"


def _safetensors_files(path: Path) -> list[Path]:
    """The shards the index names (model.safetensors.index.json's weight_map), else every
    *.safetensors file in the directory."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read {index}: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not f.is_file() or f.parent != path]
        if missing:
            raise ModelLoadError(f"{index} names {missing[0].name}, which is not in {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    return files


# -- both ------------------------------------------------------------------------------------------


def _check_complete(weights: dict[str, torch.Tensor], config: ModelConfig, path: Path, family) -> None:
    embed = weights.get("model.embed_tokens.weight")
    if embed is None:
        raise ModelLoadError(f"{path}: the token embedding tensor is missing")
    if not config.vocab_size:
        config.vocab_size = embed.shape[0]
    if "lm_head.weight" not in weights:
        config.tie_word_embeddings = True
    per_layer = family.layer_weights(config)
    missing = [f"model.layers.{i}.{name}" for i in range(config.num_layers) for name in per_layer
               if f"model.layers.{i}.{name}" not in weights]
    if "model.norm.weight" not in weights:
        missing.append("model.norm.weight")
    if missing:
        raise ModelLoadError(f"{path}: {len(missing)} weight tensors missing, e.g. {missing[0]}")
