"""Turn one step's logits into tokens, per request: greedy, temperature, top-k, top-p, min-p, seed.

Rows that ask for it first have their logits processed, batched (engine/penalties.py: logit_bias,
min_tokens, repetition / frequency / presence penalties); that applies to greedy rows too. Greedy rows are one argmax over the batch; the rest share one temperature/top-k/top-p pass and
then draw one token each from their own generator. Rows of requests with a structured output
(engine/structured) have every token their grammar disallows masked to -inf after the logits
processing, and their matcher advances by the chosen token. A request with a seed owns a generator seeded
from it (so its tokens do not depend on what else is in the batch); the rest share the engine's.

Speculative decoding (engine/spec_decode): `verify` takes a verified chunk's logits, one row after
its last token and one after each proposal, and decides position by position, each position's
logits processed on the history that includes the proposals accepted before it (penalties,
min_tokens, grammar state), with the rules of engine/spec_decode/rejection.py.

A failure is kept to the request it belongs to: if sampling the batch raises, each row is sampled
on its own, and a row that still raises yields a RequestFailed for its request instead of a token.
"""

from __future__ import annotations

import logging

import torch

from iterserve.engine.logprobs import token_logprobs
from iterserve.engine.penalties import apply_min_p, process_logits
from iterserve.engine.sequence import Sequence
from iterserve.engine.spec_decode.rejection import sample_position, verify_position
from iterserve.engine.step_result import RequestFailed
from iterserve.engine.structured import GrammarMatchers, Grammars, NoTokenLeft

logger = logging.getLogger(__name__)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, grammars: Grammars | None = None):
        self.device = device
        self.grammars = grammars
        self._matchers = GrammarMatchers(grammars) if grammars is not None else None
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | RequestFailed]:
        """logits: float32 [N, vocab], one row per sequence in seqs; a token (or the failure) per row.
        Rows whose request asked for logprobs also get them recorded (seq.logprobs)."""
        results = self._sample_rows(logits, seqs)
        if self._matchers is not None:
            self._advance_grammars(results, seqs)
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None
                  and not isinstance(results[i], RequestFailed)]
        if wanted:
            try:
                index = torch.tensor(wanted, device=logits.device)
                entries = token_logprobs(logits[index], torch.tensor([results[i] for i in wanted]).to(logits.device),
                                         [seqs[i].params.logprobs for i in wanted])
            except Exception as error:  # noqa: BLE001 - only the requests that asked for logprobs fail
                logger.exception("computing logprobs failed")
                for i in wanted:
                    results[i] = RequestFailed(f"logprobs failed: {type(error).__name__}: {error}")
            else:
                for i, entry in zip(wanted, entries, strict=True):
                    if seqs[i].logprobs is None:
                        seqs[i].logprobs = []
                    seqs[i].logprobs.append(entry)
        return results

    def _advance_grammars(self, results: list[int | RequestFailed], seqs: list[Sequence]) -> None:
        for i, seq in enumerate(seqs):
            if seq.params.structured is None or isinstance(results[i], RequestFailed):
                continue
            try:
                accepted = self._matchers.accept(seq.request_id, results[i])
            except Exception as error:  # noqa: BLE001 - only this request fails
                logger.exception("advancing the grammar of request %s failed", seq.request_id)
                results[i] = RequestFailed(f"structured output failed: {type(error).__name__}: {error}")
                continue
            if not accepted:
                results[i] = RequestFailed(f"structured output: token {results[i]} does not match the grammar")

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | RequestFailed]:
        try:
            return self.sample_batch(logits, seqs)
        except Exception:  # noqa: BLE001 - find the request at fault, row by row
            if len(seqs) > 1:
                logger.warning("sampling a batch of %d failed; sampling its rows one by one", len(seqs))
        results: list[int | RequestFailed] = []
        for row, seq in enumerate(seqs):
            try:
                results.append(self.sample_batch(logits[row : row + 1], [seq])[0])
            except NoTokenLeft as error:  # the request's own settings: a 400 naming the field
                results.append(RequestFailed(str(error), error.field))
            except Exception as error:  # noqa: BLE001 - this request fails, the batch goes on
                logger.exception("sampling failed for request %s (%s)", seq.request_id, seq.params)
                results.append(RequestFailed(f"sampling failed: {type(error).__name__}: {error}"))
        return results

    def sample_batch(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Sample every row at once; raises if any row cannot be sampled."""
        logits = self._processed(logits, seqs)
        random_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        tokens = logits.argmax(dim=-1)
        if not random_rows:
            return tokens.tolist()
        probs = self._probs(logits, seqs, random_rows)
        drawn = torch.cat([
            torch.multinomial(probs[j], 1, generator=self._generator(seqs[i]))
            for j, i in enumerate(random_rows)
        ])
        tokens[random_rows] = drawn
        return tokens.tolist()

    def _processed(self, logits: torch.Tensor, seqs) -> torch.Tensor:
        """logits after the logits processors and the grammar masks (a copy if anything applied)."""
        processed = process_logits(logits, seqs)
        constrained = [i for i, seq in enumerate(seqs) if seq.params.structured is not None]
        if constrained:
            if self._matchers is None:
                raise ValueError("structured outputs need a model with a tokenizer (not the fake model)")
            if processed is logits:
                processed = logits.clone()  # the raw logits stay for logprobs
            self._matchers.mask(processed, constrained, seqs)
        if processed is not logits:
            _check_some_token_left(processed, seqs)
        return processed

    @staticmethod
    def _probs(logits: torch.Tensor, seqs, random_rows: list[int]) -> torch.Tensor:
        """The sampling distribution of each of random_rows: temperature, top-k, top-p, min_p."""
        params = [seqs[i].params for i in random_rows]
        rows = logits[random_rows] if len(random_rows) < len(seqs) else logits
        rows = rows / torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
        if any(p.top_k != -1 or p.top_p < 1.0 for p in params):
            rows = apply_top_k_top_p(rows, [p.top_k for p in params], [p.top_p for p in params])
        if any(p.min_p > 0 for p in params):
            rows = apply_min_p(rows, [p.min_p for p in params])
        return rows.softmax(dim=-1)

    # -- speculative decoding ------------------------------------------------------------------
    def verify(self, logits: list[torch.Tensor], seqs: list[Sequence]) -> list[list[int] | RequestFailed]:
        """logits[i]: [1 + k, vocab] for seqs[i] with k = len(seqs[i].spec_token_ids). Per sequence, the
        accepted proposals followed by one sampled token (or the request's failure). Positions are
        batched across sequences; a sequence leaves at its first rejection, after its bonus token,
        or at a token that ends it."""
        results: list = [[] for _ in seqs]
        live = list(range(len(seqs)))
        position = 0
        while live:
            views = [_WithAccepted(seqs[i], results[i]) for i in live]
            rows = torch.stack([logits[i][position] for i in live])
            try:
                decided = self._verify_rows(rows, views, position)
            except Exception:  # noqa: BLE001 - find the request at fault, row by row
                decided = []
                for j, view in enumerate(views):
                    try:
                        decided += self._verify_rows(rows[j : j + 1], [view], position)
                    except NoTokenLeft as error:  # the request's own settings: a 400 naming the field
                        decided.append((RequestFailed(str(error), error.field), False))
                    except Exception as error:  # noqa: BLE001 - this request fails, the batch goes on
                        logger.exception("verifying request %s failed", view.request_id)
                        decided.append((RequestFailed(f"sampling failed: {type(error).__name__}: {error}"), False))
            next_live = []
            for i, (token, go_on) in zip(live, decided, strict=True):
                if isinstance(token, RequestFailed):
                    results[i] = token
                    continue
                results[i].append(token)
                if go_on:
                    next_live.append(i)
            live, position = next_live, position + 1
        return results

    def _verify_rows(self, raw: torch.Tensor, views: list[_WithAccepted], position: int) -> list[tuple]:
        """One position of several sequences: (token or RequestFailed, whether to verify the next)."""
        logits = self._processed(raw, views)
        tokens = logits.argmax(dim=-1).tolist()
        random_rows = [j for j, view in enumerate(views) if not view.params.greedy]
        probs = self._probs(logits, views, random_rows) if random_rows else None
        prob_row = {j: row for row, j in enumerate(random_rows)}
        decided: list[tuple] = []
        for j, view in enumerate(views):
            seq = view.seq
            proposed = seq.spec_token_ids[position] if position < len(seq.spec_token_ids) else None
            if view.params.greedy:
                token, accepted = tokens[j], tokens[j] == proposed
            elif proposed is None:
                token, accepted = sample_position(probs[prob_row[j]], self._generator(seq)), False
            else:
                draft = seq.spec_draft_probs[position] if seq.spec_draft_probs is not None else None
                token, accepted = verify_position(probs[prob_row[j]], proposed, draft, self._generator(seq))
            decided.append((token, accepted and not _ends(view, token)))
        results = [token for token, _ in decided]
        if self._matchers is not None:
            self._advance_grammars(results, views)
        wanted = [j for j, view in enumerate(views) if view.params.logprobs is not None
                  and not isinstance(results[j], RequestFailed)]
        if wanted:
            entries = token_logprobs(raw[torch.tensor(wanted, device=raw.device)],
                                     torch.tensor([results[j] for j in wanted], device=raw.device),
                                     [views[j].params.logprobs for j in wanted])
            for j, entry in zip(wanted, entries, strict=True):
                if views[j].seq.logprobs is None:
                    views[j].seq.logprobs = []
                views[j].seq.logprobs.append(entry)
        return [(results[j], go_on and not isinstance(results[j], RequestFailed))
                for j, (_, go_on) in enumerate(decided)]

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self._shared
        generator = self._generators.get(seq.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seq.params.seed)
            self._generators[seq.request_id] = generator
        return generator

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)
        if self._matchers is not None:
            self._matchers.release(request_ids)


def _check_some_token_left(logits: torch.Tensor, seqs) -> None:
    """Raise NoTokenLeft (the request's own input at fault, a 400) for a row whose processors and
    grammar together left every logit at -inf: nothing could be drawn, and the sampler would fail on
    NaN probabilities (a grammar complete but held open by min_tokens, a logit_bias against every
    allowed token)."""
    empty = torch.isneginf(logits).all(dim=-1)
    if not bool(empty.any()):
        return
    seq = seqs[int(empty.nonzero()[0])]
    params = seq.params
    field = (params.structured.field if params.structured is not None
             else "logit_bias" if params.logit_bias else "min_tokens")
    raise NoTokenLeft(f"{field}: after {len(seq.output_token_ids)} generated tokens the request's own settings "
                         f"(structured output, min_tokens, logit_bias, bad words) exclude every token, so none "
                         f"can be drawn; the request was stopped", field)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and outside its top-p nucleus
    (the smallest set of most likely tokens whose probability reaches top_p; never empty)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending: the kept tokens are at the end
    k = torch.tensor([vocab if n == -1 else min(n, vocab) for n in top_k], device=logits.device)
    kth_largest = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= 1 - p
    outside[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class _WithAccepted:
    """A sequence as it stands after the proposals accepted so far this step: what the logits
    processors, grammar masks and generators read."""

    __slots__ = ("seq", "params", "prompt_token_ids", "output_token_ids", "eos_token_id", "request_id")

    def __init__(self, seq: Sequence, accepted: list[int]):
        self.seq, self.params, self.eos_token_id = seq, seq.params, seq.eos_token_id
        self.request_id, self.prompt_token_ids = seq.request_id, seq.prompt_token_ids
        self.output_token_ids = seq.output_token_ids + accepted if accepted else seq.output_token_ids


def _ends(view: _WithAccepted, token: int) -> bool:
    """Whether token ends the sequence by a token rule (engine/stop.py): nothing after it is verified."""
    params = view.params
    return ((not params.ignore_eos and token == view.eos_token_id) or token in params.stop_token_set
            or len(view.output_token_ids) + 1 >= params.max_tokens)
