"""Adaptive γ (``--gamma auto``): how many tokens to draft each pass, from measured α and costs.

A pass that drafts γ tokens and verifies a block of k = γ + 1 yields on average
τ(γ) = 1 + α₀ + α₀α₁ + … + α₀…α_{γ-1} tokens (= (1 − α^(γ+1)) / (1 − α) for a constant α)
and costs t_draft(γ) + t_verify(k). ``choose_gamma`` maximises τ / cost; γ = 0 is plain decoding
(cost t_verify(1), one token), so speculation is switched off exactly when it would not pay.

``ChainGamma`` feeds that decision with running estimates. Per request row: α per draft
position (a Beta prior, discounted so it follows the text). Per engine, kept across requests
(``CostModel``): the drafter's seconds per draft token and the target's seconds per verify pass as
a function of the tokens it processes (batch × k), interpolated between measured widths. Verify
cost is measured, never assumed: on a CPU a 2-token pass can cost 1.6× a 1-token one while 9
tokens cost barely more than 2, so the first passes of an engine measure the narrowest and the
widest block before trusting the interpolation, and every width used is measured as it is used.
A drafter whose drafts cost nothing (prompt lookup) is asked for its whole budget first, so each
row's γ is chosen knowing the draft's length and its grade (``Proposal.grades``: ngram's matched
n-gram length), weighing only what verifying it costs (its drafting is paid); α is kept per grade,
per row and (as the prior of new rows) per engine.
Rows that do not pay get draft length 0 and are re-tried with the γ the prior would choose, so a
request whose text turns repetitive later gets speculation back. A retry that fails costs what it
cost beyond a plain pass (for a model drafter that includes catching up on the text it skipped),
so the wait before the next one is at least ``RETRY_BUDGET`` times that cost in passes, and at
least ``retry_every`` passes, doubling while retries fail: retries stay within ~3% of the time.

Token trees (EAGLE, Medusa, merged with lookup) are paid for before they are seen, so their
drafting is judged on measured yields: tokens per tree pass against plain passes, drafting
included (``TreeGamma.tree_budget``), with a 10% margin; a new row starts from the yield this
engine's trees have had (``CostModel.tree_tokens``). Each pass then keeps the nodes worth
verifying, by the drafter's scores calibrated per row and depth (``choose_tree``); a row already
drafting verifies at least its best node, so one pessimistic estimate does not switch it off.
A tree drafter whose proposal costs more the more nodes it is asked for (an EAGLE chain on the CPU
kernels: a head step a level) has that cost learnt by the nodes asked (``CostModel.draft_asked``),
its first passes time the narrow widths it is verified at, and it is asked for the nodes its trees
have been verifying, one more every few passes. A tree drafter merged with
prompt lookup (``X+ngram``, ``HybridGamma``) drafts the lookup's chains alone while its trees are off.

The engine sees one interface for chains and trees alike (a chain is a tree of width one):
``plan(room, propose)`` asks the drafter (``propose(budget)``) for the draft tokens or nodes worth
it and returns a ``Plan`` (the proposal, each row's share of it to verify, whether the pass is a
retry); ``learn(proposal, plan, accepted, ...)`` what the pass did. Nothing chosen in one call is
kept for the next: the Plan carries it. ``FixedGamma`` serves a fixed γ the same way; its passes
still teach the engine's costs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .drafters.base import Proposal
from .rows import PerRow
from .tree import depths_of


def expected_tokens(alpha: float | Sequence[float], gamma: int) -> float:
    """τ(γ): expected tokens of one pass. ``alpha`` is one rate or a rate per draft position
    (conditional on the earlier ones being accepted); positions past its end reuse the last rate."""
    if isinstance(alpha, (int, float)):
        a = float(alpha)
        return float(gamma + 1) if a >= 1.0 else (1.0 - a ** (gamma + 1)) / (1.0 - a)
    return expected_tokens_upto(alpha, gamma)[-1]


def expected_tokens_upto(alpha: Sequence[float], most: int) -> list[float]:
    """``expected_tokens(alpha, g)`` for every g in 0..most, in one pass (the same sums, term by
    term: a choice weighs every γ, and their sums one by one cost O(γ²) in Python each pass)."""
    out, total, survive = [1.0], 1.0, 1.0
    for j in range(most):
        survive *= alpha[min(j, len(alpha) - 1)] if len(alpha) else 0.0
        total += survive
        out.append(total)
    return out


@dataclass
class StaticCosts:
    """Seconds of one pass, as the decision sees them: drafting γ tokens and verifying k = γ + 1.
    A block drafter (one forward per proposal) costs ``draft_per_pass`` whatever γ."""

    draft_per_token: float
    verify: Callable[[int], float]  # k -> seconds
    draft_per_pass: float = 0.0
    draft_asked: Callable[[int], float] | None = None  # γ -> seconds: a drafter that deepens with what it is asked
    # made for one decision, which asks each γ's cost several times (an interpolation each)
    _seconds: dict = field(default_factory=dict, repr=False, compare=False)

    def seconds(self, gamma: int) -> float:
        if gamma not in self._seconds:
            if self.draft_asked is not None:
                drafting = self.draft_asked(gamma) if gamma > 0 else 0.0
            else:
                drafting = self.draft_per_token * gamma + (self.draft_per_pass if gamma > 0 else 0.0)
            self._seconds[gamma] = drafting + self.verify(gamma + 1)
        return self._seconds[gamma]


def choose_gamma(alpha: float | Sequence[float], costs, gamma_max: int) -> int:
    """The γ in [0, gamma_max] with the most expected tokens per second (0 = do not speculate)."""
    return choose_batch_gamma([alpha], costs, gamma_max)[0]


def choose_batch_gamma(alphas: Sequence, costs, gamma_max: int) -> tuple[int, list[bool]]:
    """One γ for a batch that shares each pass. A row drafts only if speculation pays for it alone
    (its own best γ > 0); the batch γ maximises the summed expected tokens over the pass cost.
    Returns (γ, which rows draft)."""
    gains = [[expected_tokens(a, g) for g in range(gamma_max + 1)] for a in alphas]
    return choose_batch_width(gains, costs)


def choose_batch_width(gains: Sequence[Sequence[float]], costs) -> tuple[int, list[bool]]:
    """``choose_batch_gamma`` for any gain model: gains[row][g] = expected tokens of the row's pass
    when it drafts g tokens (a chain's γ, or a tree's first g nodes); gains[row][0] = 1."""
    width = min((len(g) for g in gains), default=1) - 1
    # each width's cost asked once (a few calls deep each, run cold after a pass: ~0.2 ms a pass asked per row)
    seconds = [costs.seconds(g) for g in range(width + 1)]
    best_alone = [_best([gain[g] / seconds[g] for g in range(width + 1)]) for gain in gains]
    on = [g > 0 for g in best_alone]
    if not any(on):
        return 0, on
    gamma = _best([_batch_tokens(gains, on, g) / seconds[g] for g in range(width + 1)])
    return gamma, on if gamma > 0 else [False] * len(on)


def batch_rate(gains: Sequence[Sequence[float]], on: Sequence[bool], costs, g: int) -> float:
    """Expected tokens per second of a batch pass at width g: rows that are on draft (gains[row][g]),
    the others take one plain token."""
    return _batch_tokens(gains, on, g) / costs.seconds(g)


def _batch_tokens(gains: Sequence[Sequence[float]], on: Sequence[bool], g: int) -> float:
    """Expected tokens of a batch pass at width g (``batch_rate``'s numerator)."""
    return sum(gain[g] if row_on else 1.0 for gain, row_on in zip(gains, on))


def _argmax(f, gamma_max: int, start: int = 0) -> int:
    return start + _best([f(g) for g in range(start, max(gamma_max, start) + 1)])


def _best(values: Sequence[float]) -> int:
    """The index of the largest value; ties go to the smaller index (the smaller γ)."""
    best, best_value = 0, values[0]
    for g in range(1, len(values)):
        if values[g] > best_value * (1 + 1e-9):
            best, best_value = g, values[g]
    return best


class VerifyTimes:
    """Target seconds per pass as a function of tokens processed (batch × k): an EWMA per width,
    linear interpolation between measured widths, linear extrapolation outside them.

    The widths are kept relative to the machine's running speed, so a width timed minutes ago is
    scaled by how the machine has drifted since: each pass moves its width's estimate as the EWMA
    says, ``speed_share`` of that move (in ratio) taken as the machine's (every width's) and the rest
    as the width's own. The plain pass is timed every pass, a wide one now and then: on a VM whose
    speed swings by 10-20 %, kept as absolute times, the plain pass's estimate had risen above stale
    ones of 2 and 3 rows, drafts then looked free, and γ auto verified drafts it expected to keep 7 %
    of (multi-turn chat, 2-core Xeon). Each width's estimate still converges on its own passes."""

    def __init__(self, prior_slope: float = 0.05, decay: float = 0.7, speed_share: float = 0.9):
        self.points: dict[int, float] = {}
        self.prior_slope, self.decay, self.speed_share = prior_slope, decay, speed_share

    @property
    def points(self) -> dict[int, float]:
        """Each timed width's estimate now (seconds)."""
        return {tokens: self.speed * t for tokens, t in self._points.items()}

    @points.setter
    def points(self, points: dict[int, float]) -> None:
        self._points, self.speed = dict(points), 1.0  # per width: its seconds at the machine's speed 1
        self._all_covered: set[tuple[int, ...]] = set()  # ``covers_all``'s widths that were: they stay covered

    def observe(self, tokens: int, seconds: float) -> None:
        own = self._points.get(tokens)
        if own is None:
            self._points[tokens] = seconds / self.speed
            return
        old = self.speed * own
        seconds = min(seconds, 2 * old)  # a pause (another process, the GC) is not what a pass costs
        new = self.decay * old + (1 - self.decay) * seconds
        if old > 0:  # (a drafter whose drafts cost nothing tells nothing of the machine)
            self.speed *= (new / old) ** self.speed_share
        self._points[tokens] = new / self.speed

    def state(self) -> dict:
        """The widths' times at the machine's speed 1 and that speed, as JSON data."""
        return {"points": {str(tokens): t for tokens, t in self._points.items()}, "speed": self.speed}

    @staticmethod
    def read_state(state: dict) -> tuple[dict[int, float], float]:
        """(points, speed) from ``state()``'s data; ValueError where a time is not one."""
        points = {int(tokens): float(t) for tokens, t in state["points"].items()}
        speed = float(state["speed"])
        if not all(math.isfinite(t) and t >= 0 for t in points.values()) or not (math.isfinite(speed) and speed > 0):
            raise ValueError("times must be finite and non-negative, the speed positive")
        return points, speed

    SMOOTH_FROM = 32  # tokens per pass above which cost grows smoothly with width (no CPU steps)

    def covers(self, tokens: int) -> bool:
        """Whether interpolation can be trusted at this width: one within 10% was timed (a batch that
        lost a row needs no new measurement), or it lies between timed widths at most 2x apart,
        or above SMOOTH_FROM tokens."""
        if any(abs(x - tokens) <= 0.1 * tokens for x in self._points):
            return True
        lo = max((x for x in self._points if x < tokens), default=None)
        hi = min((x for x in self._points if x > tokens), default=None)
        return lo is not None and hi is not None and (hi <= 2 * lo or lo >= self.SMOOTH_FROM)

    def covers_all(self, widths: tuple[int, ...]) -> bool:
        """``covers`` every one of ``widths``: once they are, they stay (observing only adds points,
        and a point between two others only narrows the gaps), so the answer is kept."""
        if widths in self._all_covered:
            return True
        if all(self.covers(tokens) for tokens in widths):
            self._all_covered.add(widths)
            return True
        return False

    def __call__(self, tokens: int) -> float:
        return self.speed * self._at_speed_one(tokens) if self._points else 1.0

    def _at_speed_one(self, tokens: int) -> float:
        points = self._points
        if tokens in points:
            return points[tokens]
        xs = sorted(points)
        if len(xs) == 1:  # one width seen: assume cost grows by prior_slope of itself per extra token
            x, y = xs[0], points[xs[0]]
            return max(y * 0.5, y * (1 + self.prior_slope * (tokens - x) / max(x, 1)))
        lo = max((x for x in xs if x < tokens), default=None)
        hi = min((x for x in xs if x > tokens), default=None)
        if lo is None:
            lo, hi = xs[0], xs[1]
        elif hi is None:
            lo, hi = xs[-2], xs[-1]
        slope = max(0.0, (points[hi] - points[lo]) / (hi - lo))
        return max(1e-9, points[lo] + slope * (tokens - lo))


class CostModel:
    """What passes cost on this engine (target, drafter, device): kept across requests, so only an
    engine's first request pays for measuring them. Drafting is timed per batch size (a drafter's
    pass over 64 rows costs more than over one), interpolated like the verify times."""

    TIMES = ("verify", "draft_token", "draft_pass", "draft_asked")  # its VerifyTimes
    ACCEPTANCE_DECAY = 0.99  # of the acceptance per grade over every row and request

    def __init__(self):
        self.verify = VerifyTimes()  # by tokens verified (batch x block width)
        self.draft_token = VerifyTimes()  # seconds per draft token, by batch size (chain drafters)
        self.draft_pass = VerifyTimes()  # seconds per proposal, by batch size (block and tree drafters)
        # seconds per proposal by batch size x nodes asked, of a drafter whose cost grows with them (a
        # head's chain on the CPU kernels: a head step a level; 1.2 ms asked for one node, 3.5 for 15)
        self.draft_asked = VerifyTimes()
        self.retry_extra = 0.0  # what a failed retry cost beyond a plain pass, in plain passes
        # acceptance per draft grade over every row and request: the prior of a row's own estimate
        self.acceptance: dict[int, RowAlpha] = {}
        # tokens a tree pass yields, over every row and request: where a new row's own estimate starts
        self.tree_tokens = TREE_PRIOR_TOKENS

    def state(self) -> dict:
        """What the model has learnt, as plain JSON data (``restore`` takes it back): a later process
        on the same machine, model and drafter starts from it instead of timing wide blocks again."""
        return {"times": {name: getattr(self, name).state() for name in self.TIMES},
                "retry_extra": self.retry_extra, "tree_tokens": self.tree_tokens,
                "acceptance": {str(g): {"accepted": a.accepted, "drafted": a.drafted}
                               for g, a in self.acceptance.items()}}

    def restore(self, state: dict) -> None:
        """Start from ``state`` (``state()``'s). A value of the wrong kind raises ValueError, TypeError
        or KeyError (a file from another version: the caller starts fresh) and changes nothing."""
        times = {name: VerifyTimes.read_state(state["times"][name]) for name in self.TIMES}
        acceptance = {}
        for g, counts in state["acceptance"].items():
            accepted, drafted = [float(x) for x in counts["accepted"]], [float(x) for x in counts["drafted"]]
            if len(accepted) != len(drafted) or not all(0 <= a <= d for a, d in zip(accepted, drafted)):
                raise ValueError(f"acceptance of grade {g}: counts out of range")
            acceptance[int(g)] = RowAlpha(decay=self.ACCEPTANCE_DECAY, accepted=accepted, drafted=drafted)
        retry_extra, tree_tokens = float(state["retry_extra"]), float(state["tree_tokens"])
        if not (math.isfinite(retry_extra) and math.isfinite(tree_tokens) and tree_tokens >= 1):
            raise ValueError("retry and tree yields must be finite")
        for name, (points, speed) in times.items():
            getattr(self, name).points, getattr(self, name).speed = points, speed
        self.acceptance, self.retry_extra, self.tree_tokens = acceptance, max(0.0, retry_extra), tree_tokens

    def observe_acceptance(self, grade: int, drafted: int, accepted: int) -> None:
        self.acceptance.setdefault(grade, RowAlpha(decay=self.ACCEPTANCE_DECAY)).observe(drafted, accepted)

    def prior(self, grade: int, length: int) -> list[float]:
        """α per position that a row new to drafts of this grade starts from."""
        return (self.acceptance.get(grade) or RowAlpha()).profile(length)

    def observe_tree_tokens(self, tokens: int) -> None:
        self.tree_tokens = 0.98 * self.tree_tokens + 0.02 * tokens

    def observe_retry(self, extra: float) -> None:
        self.retry_extra = max(0.0, extra) if self.retry_extra == 0.0 else 0.5 * self.retry_extra + 0.5 * max(0.0, extra)

    def observe_pass(self, gamma: int, tokens: int, draft_seconds: float, verify_seconds: float,
                     per_pass: bool = False, batch: int = 1, asked: int = 0) -> None:
        """A pass over ``batch`` rows that drafted γ tokens (per row) and verified ``tokens`` (batch ×
        block width); ``per_pass``: the drafter's cost does not grow with γ (block and tree drafters);
        ``asked``: the nodes a drafter that deepens with them was asked for (0: not such a drafter)."""
        if gamma > 0:
            # a pass that also caught the drafter up on many tokens (its lazy prompt prefill, say)
            # is not what drafting costs: VerifyTimes clips it to twice the estimate
            if per_pass:
                self.draft_pass.observe(batch, draft_seconds)
                if asked:
                    self.draft_asked.observe(batch * asked, draft_seconds)
            else:
                self.draft_token.observe(batch, draft_seconds / gamma)
        self.verify.observe(tokens, verify_seconds)

    def for_batch(self, batch: int) -> StaticCosts:
        def at(times: VerifyTimes) -> float:
            return times(batch) if times.points else 0.0  # not timed yet: the first passes will

        return StaticCosts(at(self.draft_token), lambda k: self.verify(batch * k), at(self.draft_pass))


@dataclass
class RowAlpha:
    """Acceptance per draft position for one row: discounted Beta counts, each position's prior
    centred on the previous position's estimate (unseen positions inherit it)."""

    prior_mean: float = 0.6
    prior_strength: float = 2.0
    decay: float = 0.97
    accepted: list[float] = field(default_factory=list)
    drafted: list[float] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        seen = min(drafted, accepted + 1)  # positions after the first rejection were not judged
        while len(self.drafted) < seen:
            self.drafted.append(0.0)
            self.accepted.append(0.0)
        for j in range(seen):
            self.drafted[j] = self.decay * self.drafted[j] + 1
            self.accepted[j] = self.decay * self.accepted[j] + (j < accepted)

    def profile(self, length: int, prior: Sequence[float] | None = None) -> list[float]:
        """α per position; ``prior``: each position's prior mean (else the position before's estimate)."""
        out, prev = [], self.prior_mean
        for j in range(length):
            a = self.accepted[j] if j < len(self.accepted) else 0.0
            d = self.drafted[j] if j < len(self.drafted) else 0.0
            mean = prev if prior is None else prior[j]
            prev = (a + self.prior_strength * mean) / (d + self.prior_strength)
            out.append(prev)
        return out


@dataclass
class RowCalibration:
    """How a row's tree passes turn the drafter's node scores into accepted tokens, per depth: the
    scores estimate each node's chance of being on the target's path, so the scores at depth d sum
    to the chance the path reaches depth d. Per depth, discounted counts of how often it was reached
    over what the scores predicted; each depth's prior is the ratio of the depth above (as RowAlpha)."""

    prior: float = 0.5
    prior_strength: float = 1.0  # in predicted tokens
    decay: float = 0.95
    predicted: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, predicted_by_depth: list[float], accepted_depth: int) -> None:
        while len(self.predicted) < len(predicted_by_depth):
            self.predicted.append(0.0)
            self.accepted.append(0.0)
        for d, pred in enumerate(predicted_by_depth):
            self.predicted[d] = self.decay * self.predicted[d] + pred
            self.accepted[d] = self.decay * self.accepted[d] + (accepted_depth > d)

    def ratios(self, depth: int) -> list[float]:
        """Ratio of accepted to predicted at depths 1..depth (entry d-1)."""
        out, prev = [], self.prior
        for d in range(depth):
            a = self.accepted[d] if d < len(self.accepted) else 0.0
            p = self.predicted[d] if d < len(self.predicted) else 0.0
            prev = min(1.5, (a + self.prior_strength * prev) / (p + self.prior_strength))
            out.append(prev)
        return out


TREE_PRIOR_TOKENS = expected_tokens(RowAlpha().prior_mean, 3)  # a tree pass's yield before any is seen


def _width(prop: Proposal) -> tuple[list[int], int]:
    """Drafts (or nodes) per row and the verified block's width (the pass's first token + the longest)."""
    lens = prop.row_lengths()
    return lens, max(lens, default=0) + 1


def kept_scores(prop: Proposal) -> list[list[float]]:
    """Per row and depth, the summed scores of a tree's verified nodes: the drafter's estimate of
    the chance the accepted path reaches that depth. (In Python lists: a few nodes a row, where
    tensor ops run cold after a pass, ~0.2 ms a pass.)"""
    B, N = prop.tokens.shape
    if prop.scores is None or N == 0:
        return [[] for _ in range(B)]
    out = []
    for scores, parents, n in zip(prop.scores.float().tolist(), prop.parents.tolist(), prop.lengths.tolist()):
        node_depths = depths_of(parents)[:n]
        by_depth = [0.0] * max(node_depths, default=0)
        for score, depth in zip(scores, node_depths):
            by_depth[depth - 1] += score
        out.append(by_depth)
    return out


@dataclass
class Plan:
    """One pass's drafting as the γ control chose it: the drafter's proposal, each row's cap (its
    γ, or the tree nodes worth verifying), and whether the pass only re-tries rows that were off
    (what it costs beyond a plain pass sets how long the next retry waits). ``learn`` reads it back:
    nothing is kept between the calls."""

    prop: Proposal
    caps: list[int]
    retry: bool = False
    timing: bool = False  # the pass verifies a width to time it, not one chosen for what it yields
    asked: int = 0  # the nodes the tree drafter was asked for
    lookup: bool = False  # the drafter's lookup alone drafted (HybridGamma: its trees are off)


class FixedGamma(PerRow):
    """A fixed γ: every row drafts γ tokens (or a tree of γ nodes) a pass, within the room left
    (nothing per row)."""

    def __init__(self, gamma: int, costs: CostModel, per_pass: bool = False):
        self.gamma, self.cost_model, self.per_pass = gamma, costs, per_pass

    def plan(self, room: int, propose: Callable[[int], Proposal]) -> Plan:
        budget = max(0, min(self.gamma, room))
        prop = propose(budget)
        return Plan(prop, [budget] * len(prop.lengths))

    def learn(self, prop: Proposal, plan: Plan, accepted: list[int], draft_seconds: float,
              verify_seconds: float) -> None:
        """Fixed-γ passes teach the engine's costs too (a later "auto" request starts from them)."""
        lens, width = _width(prop)
        self.cost_model.observe_pass(max(plan.caps, default=0), len(lens) * width, draft_seconds, verify_seconds,
                                     self.per_pass, batch=len(lens))


class AutoGamma(PerRow):
    """What the chain and tree policies of ``gamma="auto"`` share: which rows draft (``on``), how
    long a row that is off waits for a retry, the engine's costs, and the passes that verified no
    draft. ``per_pass``: the drafter's cost does not grow with the draft's length (a tree, a block
    drafter)."""

    RETRY_BUDGET = 32  # wait at least this many times a failed retry's extra cost (in passes)
    # per-row state, in batch-slot order (rows that join bring what they have learnt so far)
    row_fields = ("off_for", "wait", "on")

    def __init__(self, rows: int, gamma_max: int = 8, retry_every: int = 16, costs: CostModel | None = None,
                 per_pass: bool = False):
        self.per_pass, self.gamma_max, self.retry_every = per_pass, gamma_max, retry_every
        self.cost_model = costs if costs is not None else CostModel()
        self.off_for = [0] * rows  # passes each row has gone without drafting
        self.wait = [self._first_wait()] * rows  # passes until a row that is off is re-tried
        self.on = [True] * rows
        self.gammas_used: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.on)

    def _first_wait(self) -> int:
        return max(self.retry_every, math.ceil(self.RETRY_BUDGET * self.cost_model.retry_extra))

    @property
    def verify(self) -> VerifyTimes:
        return self.cost_model.verify

    def costs(self, batch: int) -> StaticCosts:
        return self.cost_model.for_batch(batch)

    def verifying(self, batch: int) -> StaticCosts:
        """What a pass costs once its drafts are made: verifying them."""
        return StaticCosts(0.0, lambda k: self.verify(batch * k))

    def _unmeasured(self, cap: int, full: bool | None = None) -> int | None:
        """A γ whose verify width this batch size has never timed, narrowest and widest first.
        ``full``: the pass may draft all it has (default: cap is the whole budget), so the short
        passes near a request's end are not taken for the widths to time; a tree smaller than the
        budget (a head unsure past its first depth) is timed at its own size."""
        full = cap == self.gamma_max if full is None else full
        gammas = self._timed_gammas(cap, full)
        if self.verify.covers_all(tuple(self.rows * (gamma + 1) for gamma in gammas)):
            return None
        for gamma in gammas:
            if not self.verify.covers(self.rows * (gamma + 1)):
                return gamma
        return None

    def _timed_gammas(self, cap: int, full: bool) -> tuple[int, ...]:
        """The γs whose widths the first passes time: plain, the widest and half of it."""
        return (0, cap, cap // 2) if full else (0,)

    def _retry_due(self) -> list[bool]:
        """Per row: whether it has waited long enough to be re-tried if it is off."""
        return [off + 1 >= wait for off, wait in zip(self.off_for, self.wait)]

    def _back_off(self, row: int) -> None:
        """A retry of this row failed: wait twice as long (up to 8 x retry_every) before the next."""
        self.wait[row] = max(min(8 * self.retry_every, 2 * self.wait[row]), self._first_wait())

    def observe(self, gamma: int, width: int, lengths: list[int], accepted: list[int], draft_seconds: float,
                verify_seconds: float, per_pass: bool = False, retry: bool = False,
                grades: list[int] | None = None) -> None:
        """What a chain pass did (or a pass that verified no tree): requested γ, verified block
        width k, drafts and acceptances per row (and the drafts' grades); ``retry``: the pass
        re-tried rows that were off."""
        self.gammas_used.append(gamma)
        self._observe_retry(retry, len(lengths), draft_seconds, verify_seconds)
        self.cost_model.observe_pass(gamma, len(lengths) * width, draft_seconds, verify_seconds, per_pass,
                                     batch=len(lengths))
        for row, (d, n) in enumerate(zip(lengths, accepted)):
            if d > 0:
                self._observe_row(row, d, n, grades[row] if grades else 0)
                self.off_for[row] = 0
            else:
                self.off_for[row] += 1

    def _observe_row(self, row: int, drafted: int, accepted: int, grade: int = 0) -> None:
        """A row's chain of ``drafted`` drafts of this grade kept ``accepted`` of them."""

    def _observe_retry(self, retry: bool, batch: int, draft_seconds: float, verify_seconds: float) -> None:
        """A pass chosen to re-try rows that were off (a chain's, or a tree drafted for them, even
        one then cut to nothing): what it cost beyond a plain pass sets how long the next waits."""
        if retry:
            plain = self.verify(batch)
            self.cost_model.observe_retry((draft_seconds + verify_seconds) / plain - 1 if plain > 0 else 0.0)

    @property
    def mean_gamma(self) -> float:
        return sum(self.gammas_used) / len(self.gammas_used) if self.gammas_used else 0.0


class ChainGamma(AutoGamma):
    """γ for a chain drafter, chosen each pass of one request from each row's α per draft
    position and the engine's costs; rows that do not pay draft nothing and are re-tried.
    ``sees_drafts``: drafting costs (next to) nothing, so the drafter is asked for the whole budget
    and each row's γ chosen with its draft in view (length, grade)."""

    row_fields = AutoGamma.row_fields + ("alphas",)

    def __init__(self, rows: int, gamma_max: int = 8, retry_every: int = 16, costs: CostModel | None = None,
                 per_pass: bool = False, sees_drafts: bool = False):
        super().__init__(rows, gamma_max, retry_every, costs, per_pass)
        self.sees_drafts = sees_drafts
        self.alphas: list[dict[int, RowAlpha]] = [{} for _ in range(rows)]  # per row: grade -> α

    def plan(self, room: int, propose: Callable[[int], Proposal]) -> Plan:
        """The pass's γ and per-row caps, chosen before drafting (or, for drafts that cost nothing,
        after seeing them); the drafter's chains."""
        if self.sees_drafts:
            prop = propose(max(0, min(self.gamma_max, room)))
            return Plan(prop, *self.choose(room, prop.row_lengths(), prop.grades)[1:])
        gamma, caps, retry = self.choose(room)
        return Plan(propose(gamma), caps, retry)

    def learn(self, prop: Proposal, plan: Plan, accepted: list[int], draft_seconds: float,
              verify_seconds: float) -> None:
        """What the pass did (``prop`` as verified: capped), for the estimates and the costs."""
        lens, width = _width(prop)
        self.observe(max(plan.caps, default=0), width, lens, accepted, draft_seconds, verify_seconds, self.per_pass,
                     plan.retry, prop.grades)

    def _observe_row(self, row: int, drafted: int, accepted: int, grade: int = 0) -> None:
        self.alphas[row].setdefault(grade, RowAlpha()).observe(drafted, accepted)
        self.cost_model.observe_acceptance(grade, drafted, accepted)

    def _gains(self, profiles: list[list[float]], cap: int, lengths: list[int] | None) -> list[list[float]]:
        """Per row, the expected tokens of a pass drafting 0..cap (a seen draft: at most its length)."""
        lengths = lengths or [cap] * len(profiles)
        upto = [expected_tokens_upto(p, min(cap, n)) for p, n in zip(profiles, lengths)]
        return [[row[min(g, n)] for g in range(cap + 1)] for row, n in zip(upto, lengths)]

    def choose(self, room: int, lengths: list[int] | None = None,
               grades: list[int] | None = None) -> tuple[int, list[int], bool]:
        """(γ for the pass, per-row draft caps, whether it only re-tries rows that are off), γ <= room.
        ``lengths``, ``grades``: each row's draft when it is seen before choosing."""
        cap = max(0, min(self.gamma_max, room))
        explore = self._unmeasured(cap)
        if explore is not None:
            return explore, [explore] * self.rows, False
        if lengths is not None:  # no row verifies past its draft: weigh the widths up to the longest
            cap = min(cap, max(lengths, default=0))
        if cap == 0:  # nothing drafted (no lookup match): a plain pass, and
            gamma, on = 0, [False] * self.rows  # no expected tokens to weigh (~0.1 ms of a 4 ms q8 pass)
        else:
            # drafts in hand cost nothing more: only verifying them does (beside a tree drafter's
            # lookup, X+ngram, the engine's drafting cost is the tree's, ~2 ms a pass on q8: counted,
            # it had kept the lookup's chains from ever paying there)
            costs = self.costs(self.rows) if lengths is None else self.verifying(self.rows)
            grades = grades or [0] * self.rows
            priors = [self.cost_model.prior(g, cap) for g in grades]
            profiles = [(alphas.get(g) or RowAlpha()).profile(cap, prior)
                        for alphas, g, prior in zip(self.alphas, grades, priors)]
            gamma, on = choose_batch_width(self._gains(profiles, cap, lengths), costs)
        for row, row_on in enumerate(on):
            if row_on:
                self.wait[row] = self.retry_every  # it was paying: re-try soon if it stops
            elif self.on[row] is False and self.off_for[row] == 0:  # the last pass was a retry, and it failed
                self._back_off(row)
        self.on = on
        retry = [not row_on and due and (lengths is None or n > 0)
                 for row_on, due, n in zip(on, self._retry_due(), lengths or [cap] * self.rows)]
        retrying = any(retry) and gamma == 0 and cap > 0
        if retrying:
            # re-try with the γ the engine's prior belief would pick (at least 1): cheap for a drafter
            # whose misses cost nothing (ngram), short for an expensive one
            gains = self._gains(priors, cap, lengths)
            gamma = _argmax(lambda g: batch_rate(gains, retry, costs, g), cap, start=1)
        return gamma, [gamma if (row_on or r) else 0 for row_on, r in zip(on, retry)], retrying


class TreeGamma(AutoGamma):
    """The nodes per pass for a drafter of token trees. Trees are paid for before they are seen:
    the budget is asked for while the trees' measured yields pay (``tree_budget``), then each pass
    keeps the nodes worth verifying by the drafter's scores calibrated per row and depth
    (``choose_tree``)."""

    row_fields = AutoGamma.row_fields + ("calibration", "judged", "tree_tokens")

    def __init__(self, rows: int, gamma_max: int = 8, retry_every: int = 16, costs: CostModel | None = None,
                 per_pass: bool = True, deepens: bool = False):
        super().__init__(rows, gamma_max, retry_every, costs, per_pass)
        self.deepens = deepens  # the drafter's cost grows with the nodes asked for (Drafter.deepens_with_budget)
        self.calibration = [RowCalibration() for _ in range(rows)]
        self.judged = [False] * rows  # whether the prior has been weighed for the row
        self.tree_tokens: list[float | None] = [None] * rows  # tokens per tree pass, a running mean
        self.tree_width: float | None = None  # block width of tree passes, a running mean
        self.widest_tree: int | None = None  # the most nodes a proposal has held (a head may never fill the budget)
        self.asks = 0  # passes a tree was asked for

    def plan(self, room: int, propose: Callable[[int], Proposal]) -> Plan:
        """The whole budget asked of the drafter, then the nodes per row worth verifying."""
        return self._plan_tree(self.tree_budget(room), propose)

    def _plan_tree(self, budget: int, propose: Callable[[int], Proposal]) -> Plan:
        prop = propose(budget)
        if prop.parents is None:  # no tree this pass
            return Plan(prop, [budget] * len(prop.lengths))
        scores = None if prop.scores is None else prop.scores.float().tolist()
        timing = self._timing_width(scores, budget) is not None
        caps, retry = self.choose_tree(scores, [depths_of(row) for row in prop.parents.tolist()],
                                       prop.lengths.tolist(), budget)
        return Plan(prop, caps, retry, timing, asked=budget)

    def learn(self, prop: Proposal, plan: Plan, accepted: list[int], draft_seconds: float,
              verify_seconds: float) -> None:
        """What the pass did (``prop`` as verified: capped), for the estimates and the costs."""
        lens, width = _width(prop)
        if prop.parents is not None:
            self.observe_tree(width, lens, accepted, kept_scores(prop), draft_seconds, verify_seconds, plan.retry,
                              plan.timing, plan.asked)
        else:
            self.observe(max(plan.caps, default=0), width, lens, accepted, draft_seconds, verify_seconds,
                         self.per_pass, plan.retry)

    # trees stop when their measured yield loses to plain passes by this factor. 0.7 left trees on at
    # batch 8 where they cost ~15% (155 tok/s against 169 with 0.9, `none` 183; bf16 CPU, 24
    # prompts), while at batch 1 both ran the same (58.5 and 57.9 tok/s side by side)
    TREE_MARGIN = 0.9
    # for a drafter that deepens with its budget (the EAGLE chain beside q8): at 0.9 it stayed on
    # where it lost (0.90-0.95x plain on 3 of 8 categories), then judged by one mean over every
    # proposal's cost (wide timing ones included, 2-4 ms against ~1.1 for one node); the engine's
    # steps outside the draft and verify timings cost a tree pass ~0.1-0.2 ms more than a plain one
    DEEPENING_MARGIN = 1.1

    def tree_budget(self, room: int) -> int:
        """Nodes to ask a tree drafter for this pass: its whole budget (``choose_tree`` then keeps
        what pays), or none while every row is off and none is due for a retry: the tree would be
        cut to nothing, so its drafting (an EAGLE head's forwards for every row) is not paid.
        Drafting is paid before the tree is seen, so it is weighed here: new rows start on only if
        a tree could pay at this batch size on the prior belief, and rows go off while the tokens
        their trees have been yielding do not pay for drafting and verifying them (a large batch)."""
        cap = max(0, min(self.gamma_max, room))
        # while the widths a tree would be verified at are untimed, draft it whole, or as deep as a
        # deepening drafter is asked to draft (choose_tree times them)
        if self._unmeasured(min(cap, self.widest_tree or cap), full=cap == self.gamma_max) is not None:
            return self._asked(cap)
        batch = self.rows
        if not all(self.judged):
            # at the full budget: a pass near a row's end (little room) says nothing of the rows' prospects
            prior_pays = choose_batch_gamma([[RowAlpha().prior_mean]], self.costs(batch), self.gamma_max)[0] > 0
            for row, judged in enumerate(self.judged):
                if not judged and not prior_pays:
                    self._switch_off(row)
            self.judged = [True] * batch
        if any(self.on) and not self._trees_pay(batch):
            for row, on in enumerate(self.on):
                if on:
                    self._switch_off(row)
        if any(self.on) or any(self._retry_due()):
            self.asks += 1
            return self._asked(cap, probe=self.asks % self.PROBE_EVERY == 0)
        return 0

    # a deepening drafter is asked for one node more than its trees verify every this many passes
    PROBE_EVERY = 4

    def _asked(self, cap: int, probe: bool = False) -> int:
        """The nodes to ask for: all of them, or where drafting deeper costs more, as many as the
        trees verified lately (two before any was verified), one more when ``probe`` (room to grow
        as the text gets easier). Two more every pass, as before, had the head draft levels that
        the 1-2 nodes a CPU verifies never used (~0.45 ms of its ~1.7 a pass, q8 on a Zen 4)."""
        if not self.deepens:
            return cap
        if self.tree_width is None:
            return min(cap, 2)
        return min(cap, max(1, math.ceil(self.tree_width - 1.25)) + probe)

    def _timed_gammas(self, cap: int, full: bool) -> tuple[int, ...]:
        """A deepening drafter's trees stay as narrow as what it is asked for: its first passes time
        the widths of 2 and 1 nodes (not the budget's: a q8 pass of 16 rows costs ~5 of one, and
        these widths' costs, interpolated from it, were taken as ~0.3-1 ms dearer than they are)."""
        if self.deepens:
            return tuple(g for g in (0, 2, 1) if g <= cap)
        return super()._timed_gammas(cap, full)

    def costs(self, batch: int) -> StaticCosts:
        costs = super().costs(batch)
        if self.deepens and self.cost_model.draft_asked.points:
            costs.draft_asked = lambda gamma: self._draft_seconds(batch, gamma)
        return costs

    def _draft_seconds(self, batch: int, asked: int) -> float:
        """What a proposal costs: per proposal, or for a deepening drafter at the nodes asked."""
        if self.deepens and self.cost_model.draft_asked.points:
            return self.cost_model.draft_asked(batch * asked)
        return self.cost_model.draft_pass(batch)

    def _switch_off(self, row: int) -> None:
        self.on[row], self.off_for[row] = False, 0
        self.wait[row] = max(self.wait[row], self._first_wait())

    def _trees_pay(self, batch: int) -> bool:
        """Whether the rows that are on yield, per second of tree passes (drafting included), at least
        TREE_MARGIN of what the passes without trees yield (``_rate_without_trees``); True until tree
        passes at this engine have been timed."""
        if not self.cost_model.draft_pass.points or self.tree_width is None:
            return True
        prior = self.cost_model.tree_tokens
        tokens = sum((prior if t is None else t) if on else 1.0  # rows new to trees: what trees have yielded here
                     for t, on in zip(self.tree_tokens, self.on))
        drafting = self._draft_seconds(batch, self._asked(self.gamma_max))
        tree = tokens / (drafting + self.verify(round(batch * self.tree_width)))
        return tree >= (self.DEEPENING_MARGIN if self.deepens else self.TREE_MARGIN) * self._rate_without_trees(batch)

    def _rate_without_trees(self, batch: int) -> float:
        """Tokens a second of the passes the batch makes while its trees are off: plain ones."""
        return batch / self.verify(batch)

    def _timing_width(self, scores, budget: int) -> int | None:
        """The width ``choose_tree`` verifies only to time it, or None."""
        cap = min(budget, len(scores[0]) if len(scores) else 0) if scores is not None else 0
        return self._unmeasured(cap, full=budget == self.gamma_max)

    def choose_tree(self, scores, depths, lengths, budget: int) -> tuple[list[int], bool]:
        """Nodes to verify per row from a best-first tree proposal (scores [B][N], sorted by the
        drafter, each node's estimated chance to be on the target's path; depths [B][N]; lengths [B];
        as lists: a few numbers a row, where tensor ops run cold after a pass), and whether
        the tree was drafted only to re-try rows that were off: the width maximising expected tokens
        per second, where a row's pass yields 1 + the sum over its kept nodes of score x the row's
        calibration at that node's depth, over the measured cost of a pass of that width. A row
        already drafting stays on and verifies at least its best node (tree_budget switches the
        batch's drafting off on the yields its trees measure); rows that are off, or have no node
        this pass, are re-tried with the prior calibration now and then, and verify nothing if the
        retry does not look worth it."""
        batch = self.rows
        cap = min(budget, len(scores[0]) if len(scores) else 0) if scores is not None else 0
        if budget == self.gamma_max:
            self.widest_tree = max(self.widest_tree or 0, cap)
        explore = self._timing_width(scores, budget)
        if explore is not None:
            return [explore] * batch, False
        if scores is None or cap == 0:
            return [0] * batch, False
        retry = [not on and due for on, due in zip(self.on, self._retry_due())]
        gains = self._gains(scores, depths, lengths, cap, retry)
        # the tree is drafted already: only verifying it costs from here
        verifying = self.verifying(batch)
        width, on = choose_batch_width(gains, verifying)
        for row, row_on in enumerate(on):
            if row_on:
                self.wait[row] = self.retry_every
            elif retry[row]:  # the retry did not look worth it: wait longer
                self._back_off(row)
                self.off_for[row] = 0
        # A row that was drafting stays on and verifies at least its best node: only the yields the
        # batch's trees measure switch drafting off (tree_budget), and its calibration keeps learning.
        # Estimates from an answer's first few misses (calibration at ~0.15) had switched rows off
        # for 16+ passes: 53.9 before against 56.3 tok/s side by side (bf16 CPU, eagle+ngram, 24
        # prompts), where a fixed γ 8 ran 57.2.
        has_nodes = [n > 0 for n in lengths]  # a model-free tree (suffix) may have none for a row: it goes off
        retrying = any(retry) and not any(self.on)  # drafted only to re-try rows that were off
        on = [row_on or (was_on and nodes) for row_on, was_on, nodes in zip(on, self.on, has_nodes)]
        if any(on) and width == 0:
            width = _argmax(lambda g: batch_rate(gains, on, verifying, g), min(len(g) for g in gains) - 1, start=1)
        self.on = on
        return [width if row_on else 0 for row_on in on], retrying

    def _gains(self, scores, depths, lengths, cap: int, retry: list[bool]) -> list[list[float]]:
        """Per row, the expected tokens of a pass keeping its first 0, 1, ... nodes (a row re-tried:
        by the prior calibration); scores, depths [B][N] and lengths [B] as lists."""
        gains = []
        for row in range(self.rows):
            dp = depths[row][:cap]
            ratios = (RowCalibration() if retry[row] else self.calibration[row]).ratios(max(dp, default=0))
            gain = [1.0]
            for j, (score, depth) in enumerate(zip(scores[row][:cap], dp)):
                gain.append(gain[-1] + (score if j < lengths[row] else 0.0) * ratios[depth - 1])
            gains.append(gain)
        return gains

    def observe_tree(self, width: int, lengths: list[int], accepted: list[int], predicted: list[list[float]],
                     draft_seconds: float, verify_seconds: float, retry: bool = False, timing: bool = False,
                     asked: int = 0) -> None:
        """What a tree pass did: block width, nodes verified, accepted depth, and per row the summed
        scores of its verified nodes at each depth; ``retry``: drafted to re-try rows that were off;
        ``timing``: its width was chosen to time it (the widest first), so it says nothing of the
        widths trees are verified at (a q8 pass of 9 rows costs 2.5 of one: counted, the first passes
        switched an EAGLE head off before it verified a tree of its own choosing)."""
        self.gammas_used.append(width - 1)
        self._observe_retry(retry, len(lengths), draft_seconds, verify_seconds)
        self.cost_model.observe_pass(width - 1, len(lengths) * width, draft_seconds, verify_seconds, per_pass=True,
                                     batch=len(lengths), asked=asked if self.deepens else 0)
        if not timing:
            self.tree_width = float(width) if self.tree_width is None else 0.8 * self.tree_width + 0.2 * width
        for row, (d, n, pred) in enumerate(zip(lengths, accepted, predicted)):
            if d > 0:
                self.calibration[row].observe(pred, n)
                old = self.tree_tokens[row]
                if old is None:  # a prior worth several passes: one unlucky tree does not switch a row off
                    old = self.cost_model.tree_tokens
                self.tree_tokens[row] = 0.9 * old + 0.1 * (n + 1)
                self.cost_model.observe_tree_tokens(n + 1)
                self.off_for[row] = 0
            else:
                self.off_for[row] += 1


class HybridGamma(TreeGamma):
    """A tree drafter merged with prompt lookup (``X+ngram``): TreeGamma's passes while its trees
    pay, and while they do not (every row off, none due for a retry) the lookup's chains alone, as
    ChainGamma chooses them for a drafter whose drafts cost nothing. Switching the head off beside
    q8 (where it rarely pays) had switched the lookup off with it: `eagle+ngram` ran 1.04x plain
    decoding where `ngram` alone ran 1.16x (translation 1.06x against 1.42x). Trees stay on only
    while they yield more a second than the lookup's passes have (plain passes' before any): judged
    against plain passes, the head's trees stayed on where the lookup alone did better (`eagle+ngram`
    1.07x plain q8 where `ngram` ran 1.13x, 2-core Zen 4). While the trees are on, every
    LOOKUP_EVERY-th pass drafts the lookup alone to time it."""

    LOOKUP_EVERY = 16

    row_fields = TreeGamma.row_fields + ("lookup", "lookup_tokens")

    def __init__(self, rows: int, gamma_max: int = 8, retry_every: int = 16, costs: CostModel | None = None,
                 per_pass: bool = True, deepens: bool = False):
        super().__init__(rows, gamma_max, retry_every, costs, per_pass, deepens)
        self.lookup = ChainGamma(rows, gamma_max, retry_every, self.cost_model, sees_drafts=True)
        self.lookup_tokens: list[float | None] = [None] * rows  # per row: tokens a lookup pass, a running mean
        self.lookup_seconds: float | None = None  # what a lookup pass costs (drafting and verifying), a running mean
        self.tree_passes = 0  # since the last lookup pass

    def plan(self, room: int, propose: Callable[..., Proposal]) -> Plan:
        """A tree pass (``propose(budget)``), or while the trees are off, the lookup's chains
        (``propose(γ, lookup=True)``)."""
        budget = self.tree_budget(room)
        if budget > 0 and self.tree_passes + 1 < self.LOOKUP_EVERY:
            self.tree_passes += 1
            return self._plan_tree(budget, propose)
        self.tree_passes = 0
        plan = self.lookup.plan(room, lambda gamma: propose(gamma, lookup=True))
        plan.lookup = True
        return plan

    def learn(self, prop: Proposal, plan: Plan, accepted: list[int], draft_seconds: float,
              verify_seconds: float) -> None:
        if not plan.lookup:
            return super().learn(prop, plan, accepted, draft_seconds, verify_seconds)
        self.lookup.learn(prop, plan, accepted, draft_seconds, verify_seconds)
        self.gammas_used.append(max(plan.caps, default=0))
        self.off_for = [n + 1 for n in self.off_for]  # the trees' rows count the passes toward their retry
        self.lookup_tokens = [n + 1.0 if old is None else 0.8 * old + 0.2 * (n + 1)
                              for old, n in zip(self.lookup_tokens, accepted)]
        seconds = draft_seconds + verify_seconds
        old = self.lookup_seconds
        self.lookup_seconds = seconds if old is None else 0.8 * old + 0.2 * min(seconds, 2 * old)  # a pause is not a pass

    def _rate_without_trees(self, batch: int) -> float:
        """The lookup's passes' tokens a second where they have been timed, if more than plain ones'."""
        plain = super()._rate_without_trees(batch)
        if self.lookup_seconds is None:
            return plain
        return max(plain, sum(1.0 if t is None else t for t in self.lookup_tokens) / self.lookup_seconds)
