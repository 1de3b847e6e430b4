"""When speculation pays, and what it achieved.

Per step: no speculation while more than `disable_by_batch_size` sequences run (a full batch is
compute-bound: extra query tokens cost as much as real ones, and a rejected one is waste). Per
sequence: an exponential moving average of its acceptance rate (accepted / proposed); below
`min_acceptance_rate` the sequence stops proposing, except for one probe every PROBE_EVERY steps,
so a sequence that enters a repetitive stretch is picked up again.

SpecDecodeStats are vLLM's counters: drafts (verification rounds with at least one proposed
token), draft tokens, accepted tokens, and accepted tokens per position (position i counts the
rounds whose i-th proposal was accepted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.engine.sequence import Sequence

EMA_WEIGHT = 0.3
PROBE_EVERY = 8


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class SpecPolicy:
    def __init__(self, disable_by_batch_size: int, min_acceptance_rate: float):
        self.disable_by_batch_size = disable_by_batch_size
        self.min_acceptance_rate = min_acceptance_rate

    def step_allows(self, num_running: int) -> bool:
        return num_running <= self.disable_by_batch_size

    def seq_allows(self, seq: Sequence) -> bool:
        if seq.spec_acceptance >= self.min_acceptance_rate:
            return True
        seq.spec_skipped += 1
        if seq.spec_skipped >= PROBE_EVERY:
            seq.spec_skipped = 0
            return True
        return False

    @staticmethod
    def observe(seq: Sequence, proposed: int, accepted: int) -> None:
        if proposed > 0:
            seq.spec_acceptance += EMA_WEIGHT * (accepted / proposed - seq.spec_acceptance)
