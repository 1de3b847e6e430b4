"""Speculative decoding inside continuous batching.

A proposer (engine/spec_decode/proposer.py) guesses up to k next tokens for a decoding sequence;
the scheduler gives that sequence 1 + k query tokens in the step's flat batch (its last token and
the proposals, like a small prefill chunk over its own KV), the model runs once, and the sampler
verifies the proposals position by position (engine/spec_decode/rejection.py): greedy requests keep
a proposal while it is the argmax, sampled ones by rejection sampling with the residual
distribution, so the output distribution is exactly that of plain decoding. Penalties, logit bias,
min_tokens, min_p, structured-output masks and logprobs are applied at every position on the
history that includes the proposals accepted before it. The accepted tokens plus one more (the
correction, or a bonus token when all were accepted) are appended; the rejected positions' KV is
rolled back (the block table is cut to the computed tokens and emptied blocks are freed).

Whether a step speculates is decided per step and per sequence (engine/spec_decode/policy.py):
only while the running batch is at most `disable_by_batch_size` sequences, and only for a
sequence whose measured acceptance rate pays for its extra query tokens.
"""

from iterserve.engine.spec_decode.config import SpeculativeConfig
from iterserve.engine.spec_decode.policy import SpecDecodeStats, SpecPolicy
from iterserve.engine.spec_decode.proposer import NgramProposer, Proposer

__all__ = ["NgramProposer", "Proposer", "SpecDecodeStats", "SpecPolicy", "SpeculativeConfig"]
