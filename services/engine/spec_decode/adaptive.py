"""Adaptive speculation: how many drafts each request gets, from its acceptance and the measured
costs of verifying and of drafting.

*Value.* With a per-draft acceptance rate a, a request verifying k drafts emits on average
E(k) = 1 + a + ... + a^k tokens per step (Leviathan et al. 2023, eq. 1): its drafts are worth
g(k) = a + ... + a^k tokens beyond the one every step emits. A draft tree's k is its depth and a
the chance that a depth's node is accepted after its parent; it costs its nodes to that depth.

*Cost*, learned online from the engine's own steps by nonnegative least squares:

- the step, fitted apart for decode steps (CUDA graphs on a GPU) and for steps that carry prefill
  chunks (run eagerly, where a drafting model's chain is hundreds of kernel launches): its time
  less host drafting and less its host gap (below) is fitted as
      T = step_fixed + per_request_s * R + verify_s * n + per_emitted_s * e + per_chain_step_s * L
  for R requests (the host's work per request: scheduling, bookkeeping), n tokens in the target
  forward (each draft is one more), e tokens emitted (the host's work per output token:
  detokenizing, stop strings, streaming) and a drafting model's chain of L forwards, which runs
  inside the step's tail (the MTP head, the draft model). Without the first and third terms the
  host's work would be charged to the drafts, whose count moves with them;
- host drafting: a host proposer's `propose()` (suffix decoding) is timed apart and fitted as
      D = fixed_s + per_request_s * R + per_draft_s * K + per_forward_s * F + per_context_token_s * C
  for R requests drafting K drafts in all, in F chained forwards, after reading C tokens the
  drafter had not seen. The terms are what such methods pay: host work per request (suffix-index
  look-ups), work per draft, work per new token (suffix decoding takes a step's tokens into its
  per-request indexes inside `propose()`). A fit of the whole step against its tokens sees none of the
  per-request cost, which at high concurrency can exceed what the accepted drafts save.
  A device method's chain is priced by the step fit's chain slope (per_forward_s);
- the lost overlap: a step that verifies host drafts cannot be launched ahead of the last step's
  landing (services/engine/run_ahead.py), so the device idles while the host applies that step,
  drafts, plans and launches. The engine measures that gap, less the drafting, on every step that
  waited so (`HostGapModel`: fixed + per request); host drafting pays it once a step, as part of
  its method's chain cost, but after a step with prefill chunks (which the next step waits for
  anyway). It is why a few drafting requests can lose at 16 requests where many would not.

*Choice.* The ks maximise the batch's tokens per second

    rate(k) = (N + sum_i g_i(k_i)) / (T(n_0) + sum_i c_i(k_i) + sum_m chain_m(L_m))

for N requests and n_0 tokens that are not drafts, where a request drafting k > 0 costs
c_i(k) = per_request_s + (verify_s + per_draft_s) * k + per_context_token_s * (1 + g_i(k)) * (1 + b_i / r_i)
+ per_emitted_s * g_i(k), and
method m, whose longest k is L_m, pays chain_m(L) = fixed_s + per_forward_s * forwards_m(L) once
(chain_m(0) = 0; host-drafted methods add the lost overlap). A drafting request's drafter catches up
next step on the 1 + g tokens it emits; its backlog b_i (tokens it has not taken in beyond the last
step's: a prompt suffix decoding's `prepare` has not indexed yet) is paid once, at its next draft,
and paid back over the r_i output tokens it has left, so its share a step is what the step emits of
those.
These per-request and per-method costs make draft-by-draft greedy granting wrong (a first draft
carries its request's whole cost); Dinkelbach's method solves the ratio exactly: rate(k) >= lambda
iff sum_i [g_i(k_i) - lambda c_i(k_i)] - lambda sum_m chain_m(L_m) >= lambda T(n_0) - N, and for a
given lambda the left side is maximised per method by trying each L, every request taking its
best k <= L (or none). From lambda = rate(no drafts), lambda is set to the rate of each new choice
until none beats it: that choice is the optimum. In words, a request's j-th draft pays when
a^j > lambda * (verify_s + per_draft_s) (the tokens it adds against those its time yields at the
batch's rate), and its drafts must also pay its per-request cost. A lightly loaded GPU with cheap
drafting gets full k; a saturated step or costly drafting gets k = 0. Drafts' costs are counted
DRAFT_COST_MARGIN above the fits: the choice that looks best on noisy estimates tends to be one
whose gain was overestimated, and speculation should not lose to plain decoding.
A solved choice is kept for the next steps (KEEP_CHOICE_STEPS at most) while what it was solved
from holds: the same requests, the same fits, each request's acceptance within KEEP_CHOICE_DRIFT.
A choice of k = 0 for a batch that drafts only on the host also holds as requests come and go,
while most of its requests remain: a batch where host drafting does not pay costs the host about
what a plain batch does, instead of a solve on every step a request joins or leaves (probe steps
still solve, and probe the requests idle longest, newcomers among them).

*Exploration*: the estimates only see what is tried.
- Every EXPLORE_EVERY_STEPS-th step nobody drafts, so the step fit always sees two sizes; so does
  the first decode step after one that drafted while the fit holds no plain decode step (a server's
  first steps, or a batch that drafted ever since): without one a step's cost cannot be told apart
  from its drafts', and drafting would look free for the EXPLORE_EVERY_STEPS steps until the next.
- The fits are redone every REFIT_EVERY_STEPS steps, and sooner while their samples are few: each
  time a model's samples have doubled since its fit, so the first steps' choices rest on what the
  first steps measured.
- Every PROBE_EVERY_STEPS steps, requests left at k = 0 (acceptance below `min_acceptance`, or
  drafting not worth it) draft anyway, those idle longest first, as many as the predicted loss
  allows within PROBE_SHARE of the time until the next probe (at least one, unless a host-drafted
  method's one-request cost is measured, PRICED_PROBE_SAMPLES times: then a probe dearer than that
  share waits for the shares of the probe steps that probed nothing). Their results refresh their acceptance and the drafting
  cost, so drafting resumes once it pays again.
- Drafting samples expire after DRAFT_COST_MAX_AGE_STEPS steps, so an estimate does not outlive
  the conditions it was measured in. A term the remaining samples cannot tell apart (probes that
  all drafted for as many requests) goes to the fixed cost, which would make drafting for the whole
  batch look cheap; a sample at a new scale is refitted at once.
- A host-drafted method (suffix decoding: its time per drafting request is host time, which can
  cost more than a whole plain step's share per request) drafts for at most RAMP_FACTOR times as
  many requests as its live samples measured, one while it has none, those whose drafts are worth
  most kept. A scale never timed is not trusted: the batch reaches full scale in a few steps where
  drafting is cheap, and where it is dear no step pays for more than twice what was measured (one
  step drafting for every request at an unknown cost can lose more than a short run gains). Where
  the step would lose its overlap, the requests a ramp leaves draft only if they pay for it; probe
  steps, which pay it anyway, then grow the measured scale.
- The audit: every AUDIT_EVERY_STEPS steps, where a batch drafts only on the host, the measured
  time per emitted token of its decode steps that verified drafts (their drafting included) is set
  against that of its plain decode steps; where drafting lost, host drafting pauses, for longer
  after each loss in a row. It catches what the fits cannot express, whatever its cause.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np

from services.engine.sequence import Sequence

logger = logging.getLogger(__name__)

ACCEPTANCE_SMOOTHING = 0.3
PROBE_EVERY_STEPS = 16
PROBE_SHARE = 0.01
"""Share of the time between probe steps that probes may lose (predicted), beyond the first probe."""
PRICED_PROBE_SAMPLES = 4
"""Live one-request drafting samples after which a host-drafted method's probes are priced."""
MAX_UNSPENT_PROBE_SHARES = 16
"""A probe waits for at most this many probe steps' shares (a dearer one waits for its cost's samples
to expire, after which the first probe of a probe step goes again)."""
COST_WINDOW = 256
DRAFT_COST_WINDOW = 64
DRAFT_COST_MAX_AGE_STEPS = 256
EXPLORE_EVERY_STEPS = 32
"""Every this many steps nobody drafts: a step of another size, so the cost slope stays measurable
even when a busy server otherwise runs the same number of tokens every step."""
REFIT_EVERY_STEPS = 32
"""The cost models are refitted this often, and otherwise only while their samples are few (each
time they double): a fit is a least-squares solve per model, too dear to redo on every step of a
fast GPU decode (~0.1 ms each on the host)."""
KEEP_CHOICE_STEPS = 16
"""A solved choice is kept for at most this many steps while its batch, its fits and its requests'
acceptance hold (solving costs ~0.2 ms of host time, as much as a draft's verification at batch 1)."""
KEEP_CHOICE_DRIFT = 0.5
"""A kept choice is solved again once a request's acceptance moved more than this since."""
KEEP_ZERO_SHARE = 0.5
"""A kept choice of k = 0 on the host holds while more than this share of its batch remains."""
DRAFT_COST_MARGIN = 0.1
"""Drafts' time (verifying and drafting) is counted this much above the fitted costs."""
RAMP_FACTOR = 2
"""A host-drafted method drafts for at most this many times the requests its live samples measured."""
AUDIT_EVERY_STEPS = 32
"""How often the measured time per token of steps that verified host drafts is set against that of
steps that verified none (the audit)."""
AUDIT_MIN_SAMPLES = 2
"""Drafting steps since the last audit below which it judges nothing."""
AUDIT_LOSS = 0.05
"""Audited steps taking this share longer than plain steps would have for their tokens are a loss
(what "never a loss" allows, and above the jitter of a step's time)."""
AUDIT_GAIN = 0.05
"""Audited steps taking this share less than plain steps would have for their tokens are a gain."""
AUDIT_BATCH_RATIO = 1.25
"""Steps compared by the audit have batch sizes within this factor of the drafting steps' median."""
STALL_FACTOR = 3.0
"""An audited step taking this many times the median step's time per request stalled: it is left out."""
MAX_PAUSE_STEPS = 16 * AUDIT_EVERY_STEPS
"""The longest a loss found by the audit stops host drafting."""
TRIAL_LOSS_SHARE = 0.02
"""A pause is long enough that the trial after it, if it loses as much as the last, loses at most
this share of the time of the two."""
MAX_DINKELBACH_ITERATIONS = 32
COLLINEAR = 1e-4
"""A term is told apart from those already fitted only if they leave more than this share of its
squared norm over the samples unexplained (1 - R^2 of the term on them)."""
TIE = 1e-3
"""Terms whose claims to enter the fit differ by less than this (relative) tie; the earlier enters."""


def nonnegative_least_squares(features: np.ndarray, targets: np.ndarray) -> list[float]:
    """argmin ||features @ coef - targets|| over coef >= 0, for [num_samples, num_terms] features,
    by Lawson and Hanson's active-set method ("Solving Least Squares Problems", 1974, ch. 23).

    Terms enter the fit one at a time, the one whose residual correlation (gradient over its norm)
    is largest first, and a term whose coefficient would turn negative steps back out. A term the
    samples cannot tell apart from those already in (COLLINEAR) stays out, and ties go to the
    earlier term: with the intercept first, a count that never varied leaves its cost in the
    fixed term.
    """
    num_terms = features.shape[1]
    gram = (features.T @ features).tolist()  # [num_terms][num_terms]
    moments = (features.T @ targets).tolist()  # [num_terms]
    norms = [gram[t][t] ** 0.5 for t in range(num_terms)]
    tolerance = 1e-9 * float(targets @ targets) ** 0.5
    coef = [0.0] * num_terms
    fitted: list[int] = []
    left_out: set[int] = set()
    for _ in range(4 * num_terms):
        claims = {
            t: (moments[t] - sum(gram[t][f] * coef[f] for f in fitted)) / norms[t]
            for t in range(num_terms)
            if t not in fitted and t not in left_out and norms[t] > 0  # a term always 0 gets 0
        }
        if not claims or max(claims.values()) <= tolerance:
            break
        top = max(claims.values())
        entering = min(t for t, claim in claims.items() if claim >= top * (1 - TIE))
        solution = _least_squares(gram, moments, [*fitted, entering])
        if solution is None or solution[-1] <= 0:
            left_out.add(entering)  # collinear with the fitted terms, or numerically no help
            continue
        fitted.append(entering)
        while solution and min(solution) <= 0:  # move toward it until a coefficient reaches 0: drop that
            step = min(coef[t] / (coef[t] - x) for t, x in zip(fitted, solution) if x <= 0)
            for t, x in zip(fitted, solution):
                coef[t] += step * (x - coef[t])
            dropped = [t for t in fitted if coef[t] <= tolerance / norms[t]]
            fitted = [t for t in fitted if t not in dropped]
            for t in dropped:
                coef[t] = 0.0
            left_out.clear()  # with fewer terms in, one left out may be told apart again
            solution = _least_squares(gram, moments, fitted) or []
        for t, x in zip(fitted, solution):
            coef[t] = x
    return coef


def _least_squares(gram: list[list[float]], moments: list[float], terms: list[int]) -> list[float] | None:
    """Solves the normal equations on `terms` by Cholesky; None where a term's pivot (the part of
    its squared norm the earlier terms leave unexplained) is at most COLLINEAR of its squared norm."""
    n = len(terms)
    lower = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            rest = gram[terms[i]][terms[j]] - sum(lower[i][m] * lower[j][m] for m in range(j))
            if i > j:
                lower[i][j] = rest / lower[j][j]
            elif rest <= COLLINEAR * gram[terms[i]][terms[i]]:
                return None
            else:
                lower[i][i] = rest**0.5
    forward: list[float] = []
    for i in range(n):
        forward.append((moments[terms[i]] - sum(lower[i][m] * forward[m] for m in range(i))) / lower[i][i])
    coef = [0.0] * n
    for i in reversed(range(n)):
        coef[i] = (forward[i] - sum(lower[m][i] * coef[m] for m in range(i + 1, n))) / lower[i][i]
    return coef


class SampleWindow:
    """The last `window` samples (step, terms, seconds), each at most `max_age_steps` old when fitted."""

    def __init__(self, num_terms: int, window: int, max_age_steps: int | None = None):
        self.rows = np.zeros((window, num_terms + 3))  # [window, (step, 1, terms..., seconds)]
        self.num_recorded = 0
        self.max_age_steps = max_age_steps

    def record(self, step: int, terms: tuple[float, ...], seconds: float) -> None:
        self.rows[self.num_recorded % len(self.rows)] = (step, 1.0, *terms, max(seconds, 0.0))
        self.num_recorded += 1

    def fit(self, step: int = 0) -> list[float] | None:
        """(fixed, per term...) seconds; None without samples."""
        rows = self._live(step)
        if not len(rows):
            return None
        return nonnegative_least_squares(rows[:, 1:-1], rows[:, -1])

    def covers(self, step: int, term: int, value: float) -> bool:
        """Whether `value` of term number `term` lies within the values the live samples hold."""
        values = self._live(step)[:, 2 + term]
        return len(values) > 0 and values.min() <= value <= values.max()

    def num_at(self, step: int, term: int, value: float) -> int:
        """Live samples whose term number `term` is `value`."""
        return int((self._live(step)[:, 2 + term] == value).sum())

    def largest(self, step: int, term: int) -> float:
        """The largest value of term number `term` over the live samples (0 without samples)."""
        values = self._live(step)[:, 2 + term]
        return float(values.max()) if len(values) else 0.0

    def _live(self, step: int) -> np.ndarray:  # [num_live, num_terms + 3]
        rows = self.rows[: min(self.num_recorded, len(self.rows))]
        if self.max_age_steps is not None:
            rows = rows[rows[:, 0] > step - self.max_age_steps]
        return rows


@dataclass(frozen=True)
class StepCost:
    """T = fixed_s + per_request_s * R + verify_s * n + per_emitted_s * e + per_chain_step_s * L
    (the module docstring)."""

    fixed_s: float = 1.0
    per_request_s: float = 0.0
    verify_s: float = 0.0
    per_emitted_s: float = 0.0
    per_chain_step_s: float = 0.0


class StepCostModel:
    """The step's time less its host drafting and its host gap against its requests, the tokens in
    the target forward, the tokens it emitted and the drafting model's chained forwards inside the
    step."""

    def __init__(self, window: int = COST_WINDOW):
        self.samples = SampleWindow(num_terms=4, window=window)
        self.last_drafted = 0
        self.last_plain = 0
        """The number (from 1) of the last sample with drafts, and without (0: none yet)."""

    def record(
        self, num_requests: int, num_tokens: int, num_emitted: int, num_chain_steps: int, seconds: float
    ) -> None:
        self.samples.record(0, (num_requests, num_tokens, num_emitted, num_chain_steps), seconds)
        if num_tokens > num_requests:
            self.last_drafted = self.samples.num_recorded
        else:
            self.last_plain = self.samples.num_recorded

    def lacks_plain_step(self) -> bool:
        """Whether the live samples hold a step with drafts but none without: the drafts' cost is then
        not told apart from the step's."""
        window = len(self.samples.rows)
        recorded = self.samples.num_recorded
        plain_live = self.last_plain > 0 and recorded - self.last_plain < window
        return self.last_drafted > 0 and not plain_live

    def fit(self) -> StepCost:
        """A slope stays 0 until its count has varied."""
        coef = self.samples.fit()
        if coef is None:
            return StepCost()
        return StepCost(max(float(coef[0]), 1e-9), *(float(c) for c in coef[1:]))


@dataclass(frozen=True)
class DraftCost:
    """One method's drafting time (zero until measured) for R requests drafting K drafts in all,
    in F chained forwards, after reading C context tokens:
    fixed_s + per_request_s * R + per_draft_s * K + per_forward_s * F + per_context_token_s * C."""

    fixed_s: float = 0.0
    per_request_s: float = 0.0
    per_draft_s: float = 0.0
    per_forward_s: float = 0.0
    per_context_token_s: float = 0.0


class HostGapModel:
    """The lost overlap, as the engine measures it: the time the device idles between a step's
    landing and the launch of a next decode step that waited for the host (its host drafts, say)
    instead of being launched ahead of that landing, less the host drafting in between (the
    drafting cost prices that), fitted as fixed_s + per_request_s * R for R requests in the batch.
    A step launched ahead loses none of it: the host's apply, planning and launch then run while
    the device works."""

    def __init__(self) -> None:
        self.samples = SampleWindow(1, DRAFT_COST_WINDOW)

    def record(self, num_requests: int, seconds: float) -> None:
        self.samples.record(0, (num_requests,), seconds)

    def predict(self, num_requests: float) -> float:
        """Seconds a step of `num_requests` requests waiting for the host adds; 0 before any sample."""
        coef = self.samples.fit()
        return 0.0 if coef is None else coef[0] + coef[1] * num_requests


class DraftCostModel:
    """A method's `propose()` times against what each call drafted."""

    def __init__(self) -> None:
        self.samples = SampleWindow(4, DRAFT_COST_WINDOW, DRAFT_COST_MAX_AGE_STEPS)

    def record(
        self,
        step: int,
        num_requests: int,
        num_drafts: int,
        num_forwards: int,
        num_context_tokens: int,
        seconds: float,
    ) -> bool:
        """Books a sample; True where its request count lies outside those of the live samples (a
        fit without it may have priced the cost per request as a fixed cost, or the reverse)."""
        new_scale = not self.samples.covers(step, 0, num_requests)
        self.samples.record(step, (num_requests, num_drafts, num_forwards, num_context_tokens), seconds)
        return new_scale

    def fit(self, step: int) -> DraftCost:
        coef = self.samples.fit(step)
        return DraftCost() if coef is None else DraftCost(*(float(c) for c in coef))

    def max_requests(self, step: int) -> int:
        """The most requests one live sample drafted for (0 without samples)."""
        return int(self.samples.largest(step, 0))


class RealizedRate:
    """Seconds per emitted token of whole decode steps as measured: those that verified host drafts
    (their drafting included) and those that verified none (the audit's two sides), both over the
    last AUDIT_EVERY_STEPS steps, so that what moves the step's time meanwhile (longer contexts,
    another load on the host) moves both. A step's time runs from the last step's landing to its
    own: a plain step launched ahead costs what its overlap with the last leaves, a step that
    waited for host drafts its planning and launch as well."""

    def __init__(self) -> None:
        self.plain = SampleWindow(num_terms=1, window=AUDIT_EVERY_STEPS, max_age_steps=AUDIT_EVERY_STEPS)
        """(step, 1, requests, seconds): steps without drafts (at least the explore step's)."""
        self.drafting = SampleWindow(num_terms=2, window=AUDIT_EVERY_STEPS, max_age_steps=AUDIT_EVERY_STEPS)
        """(step, 1, requests, emitted tokens, seconds): steps that verified drafts."""

    def record(self, step: int, num_requests: int, num_emitted: int, drafted: bool, seconds: float) -> None:
        if drafted:
            self.drafting.record(step, (num_requests, num_emitted), seconds)
        else:
            self.plain.record(step, (num_requests,), seconds)

    def ratio(self, step: int) -> tuple[float, float] | None:
        """(the time the audited steps took over the time plain steps would have taken for their
        tokens at the plain steps' seconds per token, the drafting steps' median batch size): steps
        at batch sizes within AUDIT_BATCH_RATIO of that median, stalled steps left out (`unstalled`);
        None without enough samples. A few probe steps that lose move it little; drafting that
        loses on most steps does."""
        drafting, plain = self.drafting._live(step), self.plain._live(step)  # [n, (step, 1, R, ..., s)]
        if len(drafting) < AUDIT_MIN_SAMPLES or not len(plain):
            return None
        batch = float(np.median(drafting[:, 2]))

        def near(rows: np.ndarray) -> np.ndarray:
            return rows[near_batch(rows[:, 2], batch)]

        drafting, plain = near(drafting), near(plain)
        if not len(plain):
            return None
        drafting, plain = unstalled(drafting), unstalled(plain)
        plain_s = plain[:, -1].sum() / plain[:, 2].sum()  # per token: a plain step emits one a request
        took_s = drafting[:, -1].sum() + plain[:, -1].sum()
        plain_would_s = drafting[:, 3].sum() * plain_s + plain[:, -1].sum()
        return (float(took_s / plain_would_s), batch) if plain_would_s > 0 else None


def _backlog_shares(seqs: list[Sequence], backlogs: list[int] | None) -> np.ndarray:
    """[num_seqs] each request's backlog (context its drafter has not taken in) over the output
    tokens it has left: times the tokens a step emits, the backlog's share of that step. A backlog
    is paid once, at the request's next draft, and drafting then pays it back over the request's
    remaining steps, so a request close to its end does not start drafting on a long backlog."""
    if backlogs is None:
        return np.zeros(len(seqs))
    remaining = [max(1, seq.params.max_tokens - seq.num_output_tokens) for seq in seqs]
    return np.array(backlogs, dtype=float) / np.array(remaining, dtype=float)


def near_batch(num_requests: np.ndarray | int, batch: float) -> np.ndarray | bool:
    """Whether a batch of `num_requests` is within AUDIT_BATCH_RATIO of `batch`."""
    return (num_requests * AUDIT_BATCH_RATIO >= batch) & (num_requests <= batch * AUDIT_BATCH_RATIO)


def unstalled(rows: np.ndarray) -> np.ndarray:
    """Audit samples (step, 1, requests, ..., seconds) less those whose seconds per request exceed
    STALL_FACTOR times the median's: steps a garbage collection or another process stalled."""
    per_request_s = rows[:, -1] / rows[:, 2]
    return rows[per_request_s <= STALL_FACTOR * np.median(per_request_s)]


@dataclass
class DraftChoices:
    """What k drafts would bring and cost each request (row i, column k; column 0: no drafts),
    what a method's chain of L drafts costs per step, and the step without drafts."""

    gain: np.ndarray  # [num_seqs, max_k + 1] g_i(k): expected tokens beyond the step's one
    cost_s: np.ndarray  # [num_seqs, max_k + 1] c_i(k) in seconds; inf past the request's max_k
    method: np.ndarray  # [num_seqs] the request's index into the rows of chain_cost_s
    chain_cost_s: np.ndarray  # [num_methods, max_k + 1] fixed + per-forward cost when the longest k is L
    base_tokens: float
    """N: tokens the step emits without drafts."""
    base_s: float
    """T(n_0): the step's time without drafts."""
    lost_overlap_s: float = 0.0
    """What host drafting adds to the step once, whatever its number of requests (in chain_cost_s):
    the step waits for the host instead of being launched ahead."""

    def rate(self, ks: np.ndarray) -> tuple[float, float]:
        """(tokens per second, step seconds) with ks[i] drafts for request i."""
        rows = np.arange(len(ks))
        chains = np.zeros(len(self.chain_cost_s), dtype=np.int64)
        np.maximum.at(chains, self.method, ks)
        tokens = self.base_tokens + self.gain[rows, ks].sum()
        seconds = (
            self.base_s
            + self.cost_s[rows, ks].sum()
            + self.chain_cost_s[np.arange(len(chains)), chains].sum()
        )
        return float(tokens / seconds), float(seconds)

    def best(self, limits: np.ndarray) -> tuple[np.ndarray, float]:
        """The ks (each at most limits[i]) of the highest rate, and that rate (Dinkelbach's method).

        For a given rate, each method's chain length L is the one that maximises what its requests
        are worth, each with its best k <= L (or none), less the chain's cost; then each request
        takes its best k within its method's L."""
        ks = np.zeros(len(limits), dtype=np.int64)
        rate, _ = self.rate(ks)
        columns = np.arange(self.gain.shape[1])
        allowed = columns[None, :] <= limits[:, None]  # [num_seqs, max_k + 1]
        one_hot = (self.method[None, :] == np.arange(len(self.chain_cost_s))[:, None]).astype(float)
        for _ in range(MAX_DINKELBACH_ITERATIONS):
            value = np.where(allowed, self.gain - rate * self.cost_s, -np.inf)  # tokens net of their time
            best_within = np.maximum.accumulate(value, axis=1)  # [num_seqs, L]: best with k <= L, >= 0
            chains = (one_hot @ best_within - rate * self.chain_cost_s).argmax(axis=1)  # [num_methods]
            within = columns[None, :] <= chains[self.method][:, None]
            candidate = np.where(within, value, -np.inf).argmax(axis=1)
            candidate_rate, _ = self.rate(candidate)
            if candidate_rate <= rate * (1 + 1e-12):
                break
            ks, rate = candidate, candidate_rate
        return ks, rate


@dataclass
class KeptChoice:
    """A choice solved at `step`, for the batch it was solved for (`batch`: each request's id,
    max k and whether its acceptance is trusted), with the fit it used and the acceptances it saw."""

    step: int
    batch: list[tuple[str, int, bool]]
    fits: object
    num_other_tokens: int
    mixed: bool
    acceptance: list[float]
    ks: list[int]

    @functools.cached_property
    def request_ids(self) -> frozenset[str]:
        return frozenset(request_id for request_id, _, _ in self.batch)


class AdaptiveSpeculation:
    def __init__(
        self,
        enabled: bool,
        min_acceptance: float,
        max_forwards: dict[str, int] | None = None,
        tree_tokens: dict[str, list[int]] | None = None,
        host_methods: frozenset[str] = frozenset(),
    ):
        """`max_forwards`: per method, the most chained forwards one step's drafting runs (a draft
        model one per draft, MTP up to its head steps); methods not named run none. `tree_tokens`:
        per method that drafts a tree, whose k is the tree's depth, the drafts depth k brings
        (index k: the tree's node count to that depth, less its root); others bring k.
        `host_methods`: the methods drafted on the host (their `propose()` timed by
        `record_drafting`), whose drafting requests ramp up (RAMP_FACTOR)."""
        self.enabled = enabled
        self.host_methods = host_methods
        self.min_acceptance = min_acceptance
        self.max_forwards = max_forwards or {}
        self.tree_tokens = tree_tokens or {}
        self.cost = StepCostModel()
        """Decode steps."""
        self.mixed_cost = StepCostModel()
        """Steps with prefill chunks."""
        self.host_gap = HostGapModel()
        self.draft_cost: dict[str, DraftCostModel] = {}
        self.step = 0
        self.last_drafted: dict[str, int] = {}
        """Per request: the last step it drafted (probes go to the requests idle longest)."""
        self._fits: dict[bool, tuple[int, int, StepCost, dict[str, DraftCost]]] = {}
        """Per kind of step (mixed or not): (step fitted at, its step samples then, step cost fit,
        drafting cost fit per method)."""
        self._kept: KeptChoice | None = None
        self._unspent_probe_s = 0.0
        """The probe shares of the probe steps since the last that probed (PROBE_SHARE)."""
        self.realized = RealizedRate()
        self.paused_until = 0
        """Host-drafted methods do not draft before this step: the audit found their drafting steps
        dearer per token than plain ones, a cost the fits cannot express (a tail padded to the
        longest k) or one that moved since they were measured."""
        self._paused_batch: float | None = 0.0
        """The batch size the pause is for: batches beyond AUDIT_BATCH_RATIO of it draft (None: none)."""
        self._pause_steps = AUDIT_EVERY_STEPS
        """The next pause's length: longer after each loss in a row, reset by a gain."""

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Updates the request's acceptance estimate from one verify step (truncated-geometric MLE)."""
        if num_drafts == 0:
            return
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        rate = num_accepted / trials
        seq.spec.acceptance += ACCEPTANCE_SMOOTHING * (rate - seq.spec.acceptance)

    def record_step(
        self,
        num_requests: int,
        num_tokens: int,
        num_emitted: int,
        num_chain_steps: int,
        seconds: float,
        mixed: bool = False,
    ) -> None:
        """A step's time less its host drafting and its host gap, with `num_requests` requests,
        `num_tokens` in the target forward, `num_emitted` output tokens and a drafting model's chain
        of `num_chain_steps` forwards; `mixed`: it carried prefill chunks."""
        model = self.mixed_cost if mixed else self.cost
        model.record(num_requests, num_tokens, num_emitted, num_chain_steps, seconds)

    def record_host_gap(self, num_requests: int, seconds: float) -> None:
        """The device's idle time before a step of `num_requests` requests that waited for the host
        (`HostGapModel`)."""
        self.host_gap.record(num_requests, seconds)

    def record_drafting(self, method: str, ks: list[int], num_context_tokens: int, seconds: float) -> None:
        """One `propose()` of `method` for requests drafting ks (all > 0), after reading
        `num_context_tokens` tokens the drafter had not seen."""
        model = self.draft_cost.setdefault(method, DraftCostModel())
        forwards = min(max(ks), self.max_forwards.get(method, 0))
        if model.record(self.step, len(ks), sum(ks), forwards, num_context_tokens, seconds):
            # drafting at a new scale (a retrial at full scale) is refitted at once, not after
            # REFIT_EVERY_STEPS steps more at a scale the cached fit may have priced wrong
            self._fits.clear()

    def record_realized(self, num_requests: int, num_emitted: int, drafted: bool, seconds: float) -> None:
        """A decode step of a batch drafted on the host (or not at all), for the audit: its whole
        time, its drafting for the next step included where it verified drafts (`drafted`), left
        out where it verified none."""
        self.realized.record(self.step, num_requests, num_emitted, drafted, seconds)

    def forget(self, request_id: str) -> None:
        self.last_drafted.pop(request_id, None)

    def choose(
        self,
        seqs: list[Sequence],
        num_other_tokens: int,
        mixed: bool = False,
        backlogs: list[int] | None = None,
    ) -> list[int]:
        """k per sequence; `num_other_tokens` are the batch's tokens that are not drafts; `mixed`:
        the step that drafts them carries prefill chunks; `backlogs`: per sequence, the context
        tokens its drafter would take in beyond the last step's (`Proposer.backlog`; default none)."""
        self.step += 1
        if not self.enabled:
            return [seq.spec.max_k for seq in seqs]
        if self.step % AUDIT_EVERY_STEPS == AUDIT_EVERY_STEPS // 2:
            self._audit()
        if self._exploring(mixed) or not seqs or self._all_paused(seqs):
            return [0] * len(seqs)
        probing = self.step % PROBE_EVERY_STEPS == 1
        # refitted where due: a kept choice holds only under the fits in force
        for kind in (False, True) if mixed else (False,):
            self._fits_in_force(kind)
        batch = [(seq.request_id, seq.spec.max_k, seq.spec.acceptance >= self.min_acceptance) for seq in seqs]
        if not probing and self._still_holds(seqs, batch, num_other_tokens, mixed):
            assert self._kept is not None
            ks = self._kept.ks
        elif not probing and self._zero_holds(seqs, batch, mixed):
            ks = [0] * len(seqs)
        else:
            choices = self._choices(seqs, num_other_tokens, mixed, backlogs)
            trusted = np.array([t for _, _, t in batch])
            max_ks = np.array([k for _, k, _ in batch])
            chosen, rate = choices.best(np.where(trusted, max_ks, 0))
            chosen = self._paying(seqs, choices, self._ramp(seqs, choices, chosen, rate))
            self._kept = KeptChoice(
                self.step,
                batch,
                self._fits.get(mixed),
                num_other_tokens,
                mixed,
                [seq.spec.acceptance for seq in seqs],
                chosen.tolist(),
            )
            if probing:  # probes are for this step only
                self._probe(seqs, choices, chosen, rate, np.where(trusted, max_ks, np.minimum(max_ks, 1)))
                chosen = self._ramp(seqs, choices, chosen, rate)
            ks = chosen.tolist()
        if self._paused(len(seqs)):
            ks = [0 if seq.spec.method in self.host_methods else k for seq, k in zip(seqs, ks)]
        for seq, k in zip(seqs, ks):
            if k > 0:
                self.last_drafted[seq.request_id] = self.step
        return list(ks)

    def _exploring(self, mixed: bool) -> bool:
        """Whether nobody drafts this step, so that the decode step fit sees a step without drafts
        (the module docstring's *Exploration*)."""
        return self.step % EXPLORE_EVERY_STEPS == 0 or (not mixed and self.cost.lacks_plain_step())

    def pause(self, num_steps: int, batch: float | None) -> None:
        """Stops host drafting for the next `num_steps` steps of batches within AUDIT_BATCH_RATIO of
        `batch` requests (what the audit does where drafting lost); None: of every size."""
        self.paused_until, self._paused_batch = self.step + num_steps, batch

    def _paused(self, num_seqs: int) -> bool:
        """Whether host drafting is paused for a batch of `num_seqs` requests (`_audit`)."""
        batch = self._paused_batch
        return self.step < self.paused_until and (batch is None or bool(near_batch(num_seqs, batch)))

    def _all_paused(self, seqs: list[Sequence]) -> bool:
        """Whether every request drafts on the host and host drafting is paused for their batch:
        nothing to solve (a paused batch then costs the host what a plain one does)."""
        return self._paused(len(seqs)) and all(seq.spec.method in self.host_methods for seq in seqs)

    def _audit(self) -> None:
        """Pauses host drafting for batches of about the audited size where the steps since the
        last audit took longer than plain steps would have for their tokens (AUDIT_LOSS). The first
        pause is AUDIT_EVERY_STEPS long (one noisy verdict costs little); each loss in a row makes
        the next at least twice as long, and long enough that a trial losing as much costs at most
        TRIAL_LOSS_SHARE of the time (at most MAX_PAUSE_STEPS); a gain (AUDIT_GAIN) resets it. The
        steps after a pause are the next trial."""
        verdict = self.realized.ratio(self.step)
        if verdict is None:
            return
        ratio, batch = verdict
        if ratio > 1 + AUDIT_LOSS:
            pause = self._pause_steps
            self.pause(pause, batch)
            logger.info(
                "host drafting paused for %d steps: its last steps took %.2fx what plain steps would have "
                "for their tokens (batch of about %d)",
                pause,
                ratio,
                batch,
            )
            trial_steps = int(AUDIT_EVERY_STEPS * (ratio - 1) / TRIAL_LOSS_SHARE)
            self._pause_steps = min(max(2 * pause, trial_steps), MAX_PAUSE_STEPS)
        elif ratio < 1 - AUDIT_GAIN:
            self._pause_steps = AUDIT_EVERY_STEPS

    def _still_holds(
        self, seqs: list[Sequence], batch: list[tuple[str, int, bool]], num_other_tokens: int, mixed: bool
    ) -> bool:
        """Whether the kept choice is recent and was solved for this batch, with the fit in force,
        for acceptances none of which has moved more than KEEP_CHOICE_DRIFT since."""
        kept = self._kept
        return (
            kept is not None
            and self.step - kept.step < KEEP_CHOICE_STEPS
            and kept.batch == batch
            and kept.num_other_tokens == num_other_tokens
            and kept.mixed == mixed
            and kept.fits is self._fits.get(mixed)
            and all(
                abs(seq.spec.acceptance - a) <= KEEP_CHOICE_DRIFT for seq, a in zip(seqs, kept.acceptance)
            )
        )

    def _zero_holds(self, seqs: list[Sequence], batch: list[tuple[str, int, bool]], mixed: bool) -> bool:
        """Whether a kept choice of k = 0 on the host still holds for a batch that requests joined or
        left since: it is recent, with the fit in force, every request drafts on the host, and more
        than KEEP_ZERO_SHARE of the requests it was solved for remain."""
        kept = self._kept
        if (
            kept is None
            or any(kept.ks)
            or self.step - kept.step >= KEEP_CHOICE_STEPS
            or kept.mixed != mixed
            or kept.fits is not self._fits.get(mixed)
            or not all(seq.spec.method in self.host_methods for seq in seqs)
        ):
            return False
        solved_for = kept.request_ids
        remaining = sum(request_id in solved_for for request_id, _, _ in batch)
        return remaining > KEEP_ZERO_SHARE * len(kept.batch)

    def _fitted(self, mixed: bool = False) -> tuple[StepCost, dict[str, DraftCost]]:
        """The decode step's cost and each method's drafting cost (`_fits_in_force`). A drafting
        model's chain runs inside the step that drafts: its cost per forward is that kind of step's
        chain slope. The rest is the decode step's: drafts are verified in the steps to come, and a
        mixed step's prefill work is no reason to spend more on drafting there (it would be judged
        against a rate that the prefill, not the decoding, holds down)."""
        decode, fitted = self._fits_of(mixed=False)
        if mixed:
            chain_s = self._fits_of(mixed=True)[0].per_chain_step_s
            fitted = {**fitted, **{m: DraftCost(per_forward_s=chain_s) for m in self.max_forwards}}
        return decode, fitted

    def _fits_of(self, mixed: bool) -> tuple[StepCost, dict[str, DraftCost]]:
        """The step fit of one kind of step, with each method's drafting cost."""
        _, _, step_cost, drafting = self._fits_in_force(mixed)
        chained = {m: DraftCost(per_forward_s=step_cost.per_chain_step_s) for m in self.max_forwards}
        return step_cost, {**chained, **drafting}

    def _fits_in_force(self, mixed: bool) -> tuple[int, int, StepCost, dict[str, DraftCost]]:
        """The cached fits of one kind of step (`_fits`), redone where due: every REFIT_EVERY_STEPS
        steps, each time its step samples doubled, or when a method has samples but no fit yet."""
        model = self.mixed_cost if mixed else self.cost
        num_samples = model.samples.num_recorded
        fits = self._fits.get(mixed)
        if (
            fits is None
            or self.step - fits[0] >= REFIT_EVERY_STEPS
            or num_samples >= max(2 * fits[1], fits[1] + 1)
            or fits[3].keys() != self.draft_cost.keys()
        ):
            fits = self._fits[mixed] = (
                self.step,
                num_samples,
                model.fit(),
                {m: c.fit(self.step) for m, c in self.draft_cost.items()},
            )
        return fits

    def _choices(
        self,
        seqs: list[Sequence],
        num_other_tokens: int,
        mixed: bool = False,
        backlogs: list[int] | None = None,
    ) -> DraftChoices:
        """The value and cost matrices, drafts' costs counted DRAFT_COST_MARGIN high."""
        step, fitted = self._fitted(mixed)
        verify_s = step.verify_s
        names = sorted({seq.spec.method for seq in seqs})
        costs = [fitted.get(m, DraftCost()) for m in names]
        method = np.array([names.index(seq.spec.method) for seq in seqs])
        acceptance = np.clip([seq.spec.acceptance for seq in seqs], 0.0, 1.0)
        max_ks = np.array([seq.spec.max_k for seq in seqs])
        num_drafts = np.arange(int(max_ks.max()) + 1)  # [max_k + 1]
        gain = np.cumsum(acceptance[:, None] ** num_drafts, axis=1) - 1.0  # a^0 is the step's own token
        per_request_s = np.array([c.per_request_s for c in costs])[method]
        per_draft_s = verify_s + np.array([c.per_draft_s for c in costs])[method]
        per_context_token_s = np.array([c.per_context_token_s for c in costs])[method]
        draft_tokens = np.stack([self._draft_tokens(m, len(num_drafts)) for m in names])[method]
        context_tokens = 1.0 + gain + _backlog_shares(seqs, backlogs)[:, None] * (1.0 + gain)
        cost_s = (
            per_request_s[:, None]
            + per_draft_s[:, None] * draft_tokens
            + per_context_token_s[:, None] * context_tokens
            + step.per_emitted_s * gain
        )
        cost_s[:, 0] = 0.0
        cost_s[num_drafts[None, :] > max_ks[:, None]] = np.inf
        forwards = np.minimum(num_drafts[None, :], [[self.max_forwards.get(m, 0)] for m in names])
        # after a mixed step the next one waits for the host anyway
        lost_overlap_s = 0.0 if mixed else self.host_gap.predict(num_other_tokens)
        fixed_s = [
            [c.fixed_s + (lost_overlap_s if m in self.host_methods else 0.0)] for m, c in zip(names, costs)
        ]
        chain_cost_s = np.array(fixed_s) + np.array([[c.per_forward_s] for c in costs]) * forwards
        chain_cost_s[:, 0] = 0.0
        return DraftChoices(
            gain=gain,
            cost_s=cost_s * (1 + DRAFT_COST_MARGIN),
            method=method,
            chain_cost_s=chain_cost_s * (1 + DRAFT_COST_MARGIN),
            base_tokens=float(len(seqs)),
            base_s=step.fixed_s
            + verify_s * num_other_tokens
            + (step.per_request_s + step.per_emitted_s) * len(seqs),
            lost_overlap_s=lost_overlap_s,
        )

    def _ramp(self, seqs: list[Sequence], choices: DraftChoices, ks: np.ndarray, rate: float) -> np.ndarray:
        """`ks` with each host-drafted method's drafting requests cut to RAMP_FACTOR times the most
        its live samples drafted for (one without samples), keeping those whose drafts are worth
        most at `rate` (their expected tokens less the tokens their time would yield)."""
        names = sorted({seq.spec.method for seq in seqs})  # the rows of choices.method, as _choices
        rows = np.arange(len(ks))
        value = choices.gain[rows, ks] - rate * choices.cost_s[rows, ks]  # [num_seqs]
        ks = ks.copy()
        for index, name in enumerate(names):
            if name not in self.host_methods:
                continue
            model = self.draft_cost.get(name)
            measured = 0 if model is None else model.max_requests(self.step)
            drafting = np.flatnonzero((choices.method == index) & (ks > 0))
            allowed = max(1, RAMP_FACTOR * measured)
            if len(drafting) > allowed:
                worst_first = drafting[np.argsort(value[drafting], kind="stable")]
                ks[worst_first[: len(drafting) - allowed]] = 0
        return ks

    def _paying(self, seqs: list[Sequence], choices: DraftChoices, ks: np.ndarray) -> np.ndarray:
        """`ks`, or `ks` with no host drafts where those cost more than they bring at the priced
        rates and their step loses its overlap: the few requests a ramp leaves may not pay for the
        overlap, lost whatever their number (probe steps then grow the measured scale). Without that
        cost a ramp's losing step is the price of measuring the next scale."""
        if choices.lost_overlap_s <= 0:
            return ks
        host = np.array([seq.spec.method in self.host_methods for seq in seqs])
        without_host = np.where(host, 0, ks)
        return ks if choices.rate(ks)[0] >= choices.rate(without_host)[0] else without_host

    def _probe_priced(self, method: str) -> bool:
        """Whether a probe's predicted loss can be trusted: a host-drafted method with
        PRICED_PROBE_SAMPLES live samples of one request (with fewer the fit may hold a batch's
        drafting time, or one request's catch-up on its prompt, as a fixed cost: only more probes
        tell them apart)."""
        model = self.draft_cost.get(method)
        return (
            method in self.host_methods
            and model is not None
            and model.samples.num_at(self.step, 0, 1) >= PRICED_PROBE_SAMPLES
        )

    def _draft_tokens(self, method: str, num_ks: int) -> np.ndarray:
        """[num_ks] the drafts a request of `method` verifies at k = 0, 1, ...: k, or a tree's
        nodes to depth k (past its depth: all of them)."""
        tokens = self.tree_tokens.get(method)
        if tokens is None:
            return np.arange(num_ks)
        return np.array([tokens[min(k, len(tokens) - 1)] for k in range(num_ks)])

    def _probe(
        self, seqs: list[Sequence], choices: DraftChoices, ks: np.ndarray, rate: float, limits: np.ndarray
    ) -> None:
        """Drafts for requests left at k = 0, idle longest first, while the predicted loss fits in
        PROBE_SHARE of the time until the next probe step, with the shares of the probe steps
        before that probed nothing; the first probe goes regardless unless its loss is priced
        (`_probe_priced`, or the overlap its step would lose, measured apart, exceeds the budget
        alone: then one dearer than a share waits for several). A probe
        drafts the k that would be best for it if its drafting were worth its fixed costs (one draft
        for a request below `min_acceptance`); its loss is the time it adds (its own cost and any
        longer chain it makes its method run) less the time its expected tokens are worth at the
        batch's rate."""
        _, step_s = choices.rate(ks)
        share_s = PROBE_SHARE * PROBE_EVERY_STEPS * step_s
        budget_s = share_s + self._unspent_probe_s
        chains = np.zeros(len(choices.chain_cost_s), dtype=np.int64)
        np.maximum.at(chains, choices.method, ks)
        idle = [i for i in range(len(seqs)) if ks[i] == 0 and limits[i] > 0]
        idle.sort(key=lambda i: self.last_drafted.get(seqs[i].request_id, -1))
        probed = False
        for i in idle:
            gain, cost_s = choices.gain[i, : limits[i] + 1], choices.cost_s[i, : limits[i] + 1]
            k = 1 + int((gain[1:] - rate * cost_s[1:]).argmax())
            method = int(choices.method[i])
            chain = max(int(chains[method]), k)
            longer_chain_s = (
                choices.chain_cost_s[method, chain] - choices.chain_cost_s[method, chains[method]]
            )
            loss_s = cost_s[k] + longer_chain_s - gain[k] / rate
            host = seqs[i].spec.method in self.host_methods
            lost_s = choices.lost_overlap_s if host and chains[method] == 0 else 0.0
            priced = probed or self._probe_priced(seqs[i].spec.method) or lost_s - gain[k] / rate > budget_s
            if loss_s > budget_s and priced:
                break
            ks[i] = k
            budget_s -= max(loss_s, 0.0)
            chains[method] = chain
            probed = True
        if probed or not idle:
            self._unspent_probe_s = 0.0
        else:
            self._unspent_probe_s = min(self._unspent_probe_s + share_s, MAX_UNSPENT_PROBE_SHARES * share_s)
