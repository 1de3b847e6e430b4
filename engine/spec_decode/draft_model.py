"""A draft model proposer: a smaller model with the target's tokenizer guesses k tokens.

It runs on the engine's own machinery: the same decoder class, attention backend and flat-batch
metadata, with its own KV pool and BlockManager (no prefix caching). Per request it keeps a block
table and the tokens its KV was computed from. Each step, per proposing sequence: the draft KV is
cut back to the longest prefix still true (rejected proposals roll back, as in the target), the
tokens it has not seen are computed as one flat batch (a catch-up chunk per sequence, usually the
last accepted tokens), then k - 1 more single-token rounds, all sequences batched. Greedy requests
get the draft's argmax (a point mass); sampled ones a draw from the draft's softmax at the
request's temperature, whose distribution goes with the proposal for rejection sampling.

A sequence the draft pool cannot hold proposes nothing that step (its draft state is dropped and
rebuilt later); `release` frees a finished request's draft blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from iterserve.engine.attention.backend import AttentionMetadata, get_backend
from iterserve.engine.block_manager import BlockManager
from iterserve.engine.sequence import Sequence
from iterserve.engine.spec_decode.proposer import Proposal, Proposer

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _DraftState:
    """What BlockManager needs of a sequence (block_table, num_computed_tokens), plus the tokens the
    draft KV holds."""

    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    known: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    cpu_block_table: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, model, vocab_size: int, device: torch.device, dtype: torch.dtype, num_blocks: int,
                 block_size: int, kv_shape: tuple[int, int], num_layers: int, seed: int = 0):
        self.model = model
        self.vocab_size = vocab_size
        self.device = device
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size)
        self.kv = [(torch.zeros((num_blocks, block_size, *kv_shape), dtype=dtype, device=device),
                    torch.zeros((num_blocks, block_size, *kv_shape), dtype=dtype, device=device))
                   for _ in range(num_layers)]
        self.states: dict[str, _DraftState] = {}
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @classmethod
    def load(cls, model_name: str, target_vocab: int, device: torch.device, dtype: torch.dtype, config,
             num_tokens: int) -> DraftModelProposer:
        """The draft from a path or registry name, checked against the target's vocabulary, with a
        KV pool of num_tokens (the target's: every running sequence can keep its draft KV)."""
        from iterserve.engine.config import ConfigError
        from iterserve.engine.model.llama import LlamaModel
        from iterserve.engine.model.loader import load_model
        from iterserve.engine.model.registry import resolve_model_path

        path, _ = resolve_model_path(model_name)
        loaded = load_model(path, False)
        mc = loaded.config
        if mc.vocab_size != target_vocab:
            raise ConfigError(f"--speculative-config: the draft model {model_name} has a vocabulary of {mc.vocab_size} "
                              f"tokens, the target {target_vocab}; a draft must share the target's tokenizer")
        model = LlamaModel.from_weights(mc, loaded.weights, get_backend(config.attention_backend, device), device,
                                        dtype, max_positions=config.max_model_len)
        num_blocks = -(-num_tokens // config.block_size)
        logger.info("draft model %s: %d layers, KV pool %d blocks", model_name, mc.num_layers, num_blocks)
        return cls(model, mc.vocab_size, device, dtype, num_blocks, config.block_size,
                   (mc.num_kv_heads, mc.head_dim), mc.num_layers, config.seed)

    # -- Proposer --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        live = []  # (index, state, tokens to feed this round)
        for i, seq in enumerate(seqs):
            state = self._catch_up(seq)
            if state is not None:
                live.append((i, state, state.known[state.num_computed_tokens:]))
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for round_ in range(max(num_tokens, default=0)):
            if not live:
                break
            logits = self._forward([(state, feed) for _, state, feed in live])
            next_live = []
            for row, (i, state, feed) in enumerate(live):
                state.num_computed_tokens += len(feed)
                token, dist = self._draw(logits[row], seqs[i])
                proposals[i].tokens.append(token)
                if dist is not None:
                    probs[i].append(dist)
                state.known.append(token)
                if round_ + 1 < num_tokens[i] and self.blocks.can_allocate(state, 1):
                    self.blocks.allocate(state, 1)
                    next_live.append((i, state, [token]))
            live = next_live
        for i, seq in enumerate(seqs):
            if not seq.params.greedy and probs[i]:
                proposals[i].probs = torch.stack(probs[i])
        return proposals

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.blocks.free(state)

    # -- internals -------------------------------------------------------------------------------
    def _catch_up(self, seq: Sequence) -> _DraftState | None:
        """seq's draft state with its KV cut to the prefix still true and blocks for the tokens
        not seen yet (at least the last one); None when the pool cannot hold them."""
        tokens = seq.prompt_token_ids + seq.output_token_ids
        state = self.states.setdefault(seq.request_id, _DraftState())
        valid = 0
        limit = min(state.num_computed_tokens, len(tokens) - 1)
        known = state.known
        while valid < limit and known[valid] == tokens[valid]:
            valid += 1
        state.num_computed_tokens = valid
        state.known = tokens
        self.blocks.truncate(state)
        feed = len(tokens) - valid
        if not self.blocks.can_allocate(state, feed):
            self.release([seq.request_id])
            return None
        self.blocks.allocate(state, feed)
        return state

    def _forward(self, batch: list[tuple[_DraftState, list[int]]]) -> torch.Tensor:
        input_ids, positions, query_lens, seq_lens, tables, rows = [], [], [], [], [], []
        for state, feed in batch:
            start = state.num_computed_tokens
            input_ids += feed
            positions += range(start, start + len(feed))
            query_lens.append(len(feed))
            seq_lens.append(start + len(feed))
            tables.append(state.block_table)
            rows.append(len(input_ids) - 1)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=self.device),
                            torch.tensor(positions, dtype=torch.long, device=self.device), self.kv, meta)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()

    def _draw(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None]:
        if seq.params.greedy:
            return int(logits.argmax()), None
        dist = (logits / seq.params.temperature).softmax(-1)
        return int(torch.multinomial(dist, 1, generator=self.generator)), dist
