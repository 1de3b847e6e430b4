"""Reference attention backend in plain torch: gathers each sequence's KV from its blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from iterserve.engine.attention.backend import AttentionBackend, AttentionMetadata


class TorchBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        num_blocks, block_size, heads, dim = k_cache.shape
        k_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, meta.slot_mapping, value)

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        output = torch.empty_like(query)
        decode_rows = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
        if len(decode_rows) > 1:
            self._attend_decodes(query, k_cache, v_cache, meta, scale, decode_rows, output)
            decode_set = set(decode_rows)
        else:
            decode_set = set()
        starts = meta.query_start_loc.tolist() if meta.num_seqs else [0]
        for i in range(meta.num_seqs):
            if i in decode_set:
                continue
            q_start, q_end = starts[i], starts[i + 1]
            output[q_start:q_end] = self._attend_one(query[q_start:q_end], k_cache, v_cache, meta, i, scale)
        return output

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
        _, block_size, heads, dim = cache.shape
        return cache[blocks].reshape(-1, heads, dim)[:length]

    def _attend_one(self, q, k_cache, v_cache, meta, i, scale) -> torch.Tensor:
        seq_len, q_len = meta.seq_lens_list[i], meta.query_lens_list[i]
        num_blocks = -(-seq_len // k_cache.shape[1])
        blocks = meta.block_tables[i, :num_blocks].long()
        k = self._gather(k_cache, blocks, seq_len).transpose(0, 1)  # [Hkv, L, D]
        v = self._gather(v_cache, blocks, seq_len).transpose(0, 1)
        q = q.transpose(0, 1)  # [H, q_len, D]
        # Query j sits at position seq_len - q_len + j and sees keys up to and including it.
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[0] != k.shape[0])
        return out.transpose(0, 1)

    def _attend_decodes(self, query, k_cache, v_cache, meta, scale, rows, output) -> None:
        """All single-token queries at once: pad their contexts to the longest and mask."""
        index = torch.tensor(rows, device=query.device)
        lens = meta.seq_lens[index].long()
        max_len = max(meta.seq_lens_list[i] for i in rows)
        block_size = k_cache.shape[1]
        width = -(-max_len // block_size)
        tables = meta.block_tables[index, :width].long()  # [S, width]
        _, _, heads, dim = k_cache.shape
        k = k_cache[tables].reshape(len(rows), width * block_size, heads, dim).transpose(1, 2)
        v = v_cache[tables].reshape(len(rows), width * block_size, heads, dim).transpose(1, 2)
        mask = torch.arange(width * block_size, device=query.device)[None, :] < lens[:, None]
        q_rows = meta.query_start_loc[index].long()
        q = query[q_rows].unsqueeze(2)  # [S, H, 1, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        output[q_rows] = out.squeeze(2)

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
        hidden = x.float()
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + eps)
        return weight * hidden.to(x.dtype), x

    def rotary(self, query, key, positions, cos_sin):
        half = cos_sin.shape[-1] // 2
        cos = cos_sin[positions, :half].unsqueeze(1)
        sin = cos_sin[positions, half:].unsqueeze(1)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def silu_and_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
