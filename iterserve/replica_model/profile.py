"""Step-time profiles: how long one engine step takes, as a linear model of what the step did,
fitted by non-negative least squares on a step log the real engine wrote (`--step-log`).

    t = c0 + c1*prefill tokens + c2*decode sequences + c3*context tokens (+ extra terms)

A profile may also carry a floor (`memory_floor_s`): the step then takes
max(floor, everything but the context term) + c3*context tokens, the roofline shape of an
accelerator, where a step reads all the weights once however small the batch (fitted CPU
profiles have no floor).

Extra terms, each kept only when it cuts the relative error by at least a point in a 4-fold
cross-validation on the training steps (greedy forward selection; the held-out steps are only
ever used to report the error):
  num_seqs           per scheduled sequence (a logits row and a sample each);
  padded_context     sequences x longest context, what a padded attention gather costs;
  prefill_attention  sum over prompt chunks of chunk tokens x tokens attended (query-key pairs:
                     prefill attention is quadratic in the prompt);
  multi_token        1 when the step runs more than one token: the matmuls leave the one-row
                     (GEMV) path for the GEMM one, which on a CPU costs a step of its own.
Rows are weighted by 1/t, so the fit minimises relative error, the figure it is judged on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from iterserve.engine.scheduler import SchedulerOutput

BASE_TERMS = ("const", "prefill_tokens", "decode_seqs", "context_tokens")
EXTRA_TERMS = ("num_seqs", "padded_context", "prefill_attention", "multi_token")
CV_FOLDS = 4
EARN_PLACE = 0.01  # an extra term must cut held-out mean relative error by this much (absolute)
TIMINGS = ("step", "cpu", "interval")
PROFILES = ("smollm2-135m-cpu", "modelled-accelerator", "fake-model")
DEFAULT_PROFILE = "smollm2-135m-cpu"


@dataclass(frozen=True, slots=True)
class StepFeatures:
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    num_seqs: int
    max_context_tokens: int
    prefill_attention: int = 0  # sum over prompt chunks of chunk tokens x (chunk start + chunk tokens)

    def value(self, term: str) -> float:
        if term == "const":
            return 1.0
        if term == "padded_context":
            return float(self.num_seqs * self.max_context_tokens)
        if term == "multi_token":
            return 1.0 if self.prefill_tokens + self.decode_seqs > 1 else 0.0
        return float(getattr(self, term))

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepFeatures:
        decode = context = longest = pairs = 0
        for chunk in out.chunks:
            end = chunk.start + chunk.num_tokens
            context += end
            longest = end if end > longest else longest
            if chunk.is_decode:
                decode += 1
            else:
                pairs += chunk.num_tokens * end
        return cls(out.num_batched_tokens - decode, decode, context, len(out.chunks), longest, pairs)

    @classmethod
    def from_record(cls, record: dict, block_size: int = 16) -> StepFeatures:
        """From one step-log line. Logs older than the context fields get the KV blocks in use
        (an upper bound on the context) instead; logs without prefill_attention_pairs leave that
        term out of the fit (see fit_profile)."""
        context = record.get("context_tokens")
        if context is None:
            context = record.get("kv_blocks_used", 0) * block_size
        return cls(int(record["prefill_tokens"]), int(record["decode_tokens"]), int(context),
                   int(record["num_seqs"]), int(record.get("max_context_tokens", context)),
                   int(record.get("prefill_attention_pairs", 0)))


@dataclass(frozen=True)
class StepProfile:
    name: str
    coefficients: dict[str, float]  # term -> seconds per unit
    kv_bytes_per_token: int  # KV bytes one token takes, to size the pool from kvCacheMemory
    model_context_len: int | None = None
    modelled: bool = False  # True: built from published figures, not fitted on a step log here
    source: str = ""
    fit: dict = field(default_factory=dict)  # errors and step counts of the fit
    memory_floor_s: float = 0.0
    citations: tuple[str, ...] = ()

    def step_seconds(self, features: StepFeatures) -> float:
        compute = context = 0.0
        for term, c in self.coefficients.items():
            if term == "context_tokens":
                context = c * features.context_tokens
            else:
                compute += c * features.value(term)
        return (compute if compute > self.memory_floor_s else self.memory_floor_s) + context

    def __call__(self, out: SchedulerOutput) -> float:
        return self.step_seconds(StepFeatures.of(out))

    def decode_steps_seconds(self, num_seqs: int, context_tokens: int, max_context_tokens: int,
                             steps: int) -> np.ndarray:
        """step_seconds of `steps` consecutive decode-only steps of the same `num_seqs` sequences,
        the first with these context figures (each later step: every sequence one token longer),
        as float64: the same operations in the same order as step_seconds, so the same bits (a
        term constant over the steps stays a Python float; numpy broadcasts it unchanged)."""
        j = np.arange(steps, dtype=np.int64)
        features = StepFeatures(0, num_seqs, 0, num_seqs, 0)
        compute, context = 0.0, 0.0
        for term, c in self.coefficients.items():
            if term == "context_tokens":
                context = c * (context_tokens + num_seqs * j).astype(np.float64)
            elif term == "padded_context":
                compute = compute + c * (num_seqs * (max_context_tokens + j)).astype(np.float64)
            else:
                compute = compute + c * features.value(term)
        if isinstance(compute, float):
            floor = compute if compute > self.memory_floor_s else self.memory_floor_s
            return floor + context if isinstance(context, np.ndarray) else np.full(steps, floor + context)
        return np.where(compute > self.memory_floor_s, compute, self.memory_floor_s) + context

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> StepProfile:
        data = dict(data)
        data["citations"] = tuple(data.get("citations", ()))
        return cls(**data)


def load_profile(name_or_path: str | None) -> StepProfile:
    """A JSON file, or the name of a profile that ships with iterserve (see PROFILES)."""
    name = name_or_path or DEFAULT_PROFILE
    if name in PROFILES:
        text = resources.files("iterserve.replica_model").joinpath("profiles", f"{name}.json").read_text()
    else:
        text = Path(name).read_text()
    return StepProfile.from_dict(json.loads(text))


def read_step_log(path: str | Path) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if line:
                records.append(json.loads(line))
    return records


# ----------------------------------------------------------------------------------------- NNLS


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0: scipy's when installed, else Lawson-Hanson in numpy."""
    try:
        from scipy.optimize import nnls as scipy_nnls
    except ImportError:
        return _lawson_hanson(a, b)
    return scipy_nnls(a, b)[0]


def _lawson_hanson(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    gradient = a.T @ (b - a @ x)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    for _ in range(max_iter or 3 * n):
        if passive.all() or gradient[~passive].max(initial=-np.inf) <= tol:
            break
        candidates = np.where(~passive, gradient, -np.inf)
        passive[int(np.argmax(candidates))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        gradient = a.T @ (b - a @ x)
    return x


# ------------------------------------------------------------------------------------------ fit


@dataclass(frozen=True)
class Errors:
    """Relative errors |predicted - measured| / measured over a set of steps."""

    steps: int
    mean: float
    median: float
    p90: float
    total: float  # |sum predicted - sum measured| / sum measured: error on a run's total time

    @classmethod
    def of(cls, predicted: np.ndarray, measured: np.ndarray) -> Errors:
        if len(measured) == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        rel = np.abs(predicted - measured) / measured
        return cls(len(measured), float(rel.mean()), float(np.median(rel)), float(np.percentile(rel, 90)),
                   float(abs(predicted.sum() - measured.sum()) / measured.sum()))


def _matrix(features: Sequence[StepFeatures], terms: Sequence[str]) -> np.ndarray:
    return np.array([[f.value(t) for t in terms] for f in features], dtype=float)


def _solve(features, times, terms) -> np.ndarray:
    return _solve_matrix(_matrix(features, terms), times)


def _solve_matrix(matrix: np.ndarray, times: np.ndarray) -> np.ndarray:
    a = matrix / times[:, None]
    coef = nnls(a, np.ones(len(times)))
    # Robust refit: steps the machine stalled on (another process, the GC) are not the model's to explain.
    rel = np.abs(matrix @ coef - times) / times
    keep = rel < max(0.5, float(np.percentile(rel, 98)))
    if keep.sum() >= matrix.shape[1] and not keep.all():
        coef = nnls(a[keep], np.ones(int(keep.sum())))
    return coef


def split(records: Sequence[dict], every: int = 4) -> tuple[list[dict], list[dict]]:
    """Every `every`-th step held out for testing, the rest for fitting."""
    train = [r for i, r in enumerate(records) if i % every != every - 1]
    test = [r for i, r in enumerate(records) if i % every == every - 1]
    return train, test


def evaluate(profile: StepProfile, records: Sequence[dict], block_size: int = 16) -> dict[str, Errors]:
    """Errors on decode-only steps, on mixed steps (any prefill token), and on all of them."""
    features = [StepFeatures.from_record(r, block_size) for r in records]
    measured = np.array([r["duration_s"] for r in records], dtype=float)
    predicted = np.array([profile.step_seconds(f) for f in features])
    decode = np.array([f.prefill_tokens == 0 for f in features], dtype=bool)
    return {"decode_only": Errors.of(predicted[decode], measured[decode]),
            "mixed": Errors.of(predicted[~decode], measured[~decode]),
            "all": Errors.of(predicted, measured)}


def _cv_error(matrix: np.ndarray, times: np.ndarray, folds: int = CV_FOLDS) -> float:
    """Mean relative error over `folds` interleaved folds, each predicted by a fit on the others."""
    index = np.arange(len(times))
    errors = []
    for k in range(folds):
        held = index % folds == k
        if held.sum() == 0 or (~held).sum() < matrix.shape[1]:
            continue
        coef = _solve_matrix(matrix[~held], times[~held])
        errors.append(np.abs(matrix[held] @ coef - times[held]) / times[held])
    return float(np.concatenate(errors).mean()) if errors else math.inf


def fit_profile(train: Sequence[dict], test: Sequence[dict], name: str, kv_bytes_per_token: int,
                model_context_len: int | None = None, block_size: int = 16, source: str = "") -> StepProfile:
    """Fits the base terms, then adds, one at a time, the extra term that cuts the training steps'
    cross-validated error most, while it cuts it by EARN_PLACE. `test` only reports the error."""
    features = [StepFeatures.from_record(r, block_size) for r in train]
    times = np.array([r["duration_s"] for r in train], dtype=float)
    if len(times) < len(BASE_TERMS) + len(EXTRA_TERMS):
        raise ValueError(f"{len(times)} steps to fit on; record a longer step log")
    candidates = [t for t in EXTRA_TERMS
                  if t != "prefill_attention" or all("prefill_attention_pairs" in r for r in train)]

    def make(terms) -> StepProfile:
        coef = _solve(features, times, terms)
        return StepProfile(name, {t: float(c) for t, c in zip(terms, coef, strict=True)}, kv_bytes_per_token,
                           model_context_len, source=source)

    terms = list(BASE_TERMS)
    best_error = _cv_error(_matrix(features, terms), times)
    rounds = [{"terms": list(terms), "cv_error": round(best_error, 4)}]
    while True:
        trials = {extra: _cv_error(_matrix(features, [*terms, extra]), times)
                  for extra in candidates if extra not in terms}
        if not trials:
            break
        extra = min(trials, key=trials.get)
        rounds.append({"considered": {k: round(v, 4) for k, v in trials.items()}, "best": extra})
        if trials[extra] >= best_error - EARN_PLACE:
            break
        terms.append(extra)
        best_error = trials[extra]
    best = make(terms)
    errors = evaluate(best, test, block_size)
    fit = {"train_steps": len(train), "test_steps": len(test), "selection": rounds,
           "cv_error": round(best_error, 4),
           "base_terms_test_error": round(evaluate(make(list(BASE_TERMS)), test, block_size)["all"].mean, 4),
           "test_errors": {k: {f: round(v, 4) if isinstance(v, float) else v for f, v in asdict(e).items()}
                           for k, e in errors.items()}}
    return StepProfile(best.name, best.coefficients, kv_bytes_per_token, model_context_len, False, source, fit)


def format_errors(errors: dict[str, Errors]) -> str:
    lines = [f"{'steps':<12}{'n':>6}{'mean':>9}{'median':>9}{'p90':>9}{'total':>9}"]
    for kind, e in errors.items():
        lines.append(f"{kind:<12}{e.steps:>6}{e.mean:>9.1%}{e.median:>9.1%}{e.p90:>9.1%}{e.total:>9.1%}")
    return "\n".join(lines)


def step_log_records(paths: Iterable[str | Path], timing: str = "step") -> list[dict]:
    """Steps that did something. timing "step": each step's own duration (what step() took);
    "cpu": each step's engine-thread CPU time (cpu_s): the step's own compute, which is its
    duration on a core of its own, so a profile fitted on a busy node describes a dedicated
    replica; "interval": the time from the previous step's end to this one's, for steps that
    followed a busy step back to back, so the serving loop's own per-step cost (streaming tokens
    to HTTP clients, the event loop) is in the profile too."""
    if timing not in TIMINGS:
        raise ValueError(f"timing {timing!r}: use one of {', '.join(TIMINGS)}")
    records = []
    for path in paths:
        previous = None
        for r in read_step_log(path):
            if timing == "cpu":
                if "cpu_s" not in r:
                    raise ValueError(f"{path}: step {r.get('step')} has no cpu_s (a log from an engine "
                                     "older than the CPU-time field); fit it with --timing step")
                if r.get("num_seqs", 0) > 0 and r["cpu_s"] > 0:
                    records.append(dict(r, duration_s=r["cpu_s"], wall_duration_s=r["duration_s"]))
            elif timing == "interval":
                busy = previous is not None and (previous.get("running", 0) or previous.get("waiting", 0))
                gap = r["time"] - previous["time"] if busy else 0.0
                # a gap far above the step itself means the loop sat idle in between: not a step's cost
                if busy and r["duration_s"] <= gap < r["duration_s"] + 0.05:
                    records.append(dict(r, duration_s=gap))
                previous = r
            elif r.get("num_seqs", 0) > 0 and r.get("duration_s", 0) > 0:
                records.append(r)
    return [r for r in records if r.get("num_seqs", 0) > 0]
