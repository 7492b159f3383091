"""How many drafted tokens to verify each step.

A scheduler must be a stopping rule to keep sampling lossless: whether position j is verified may
depend only on what was known before x_j was sampled. DSpark's confidence c_j is computed from the
backbone state and W1[x_{j-1}], so it is known before x_j is drawn; every rule here looks at
c_1..c_j (and the survival a_j = Π_{i≤j} c_i) to decide about position j, decides left to right,
and stops at the first position it rejects. A rule that looked at later positions to decide about
x_j would bias the output (DSpark, App. A; tests/test_schedulers.py shows the bias it would cause).

Rules are plain objects with `verify(confidences) -> bool`: `confidences` holds c_1..c_j (calibrated)
and the answer says whether position j is verified. The proposer asks before sampling x_j, so a
"no" also saves the drafting of later positions; `cut` applies a rule to a finished proposal.
`at(rule, context_length)` is the rule for a step at that context (the cost rule prices the step
there; the context is known before anything of the step is drafted, so this keeps the property).
"""

from __future__ import annotations

import math

from specdraft.decode.backoff import Backoff
from specdraft.decode.proposer import Proposal

SCHEDULERS = ("fixed", "threshold", "cost", "load")


class FixedRule:
    """Verify every drafted position (decode.num_draft bounds the block)."""

    needs_confidence = False

    def verify(self, confidences: list[float]) -> bool:
        return True


class ThresholdRule:
    """Verify while c_j >= threshold; stop at the first position below it."""

    needs_confidence = True

    def __init__(self, threshold: float):
        if not 0 <= threshold <= 1:
            raise ValueError(f"scheduler.threshold={threshold} must be a probability in [0, 1]")
        self.threshold = threshold

    def verify(self, confidences: list[float]) -> bool:
        return confidences[-1] >= self.threshold


def expected_tokens(confidences: list[float]) -> float:
    """1 + Σ_j a_j: the target's own token plus each drafted position's chance of surviving."""
    total, survival = 1.0, 1.0
    for c in confidences:
        survival *= c
        total += survival
    return total


def backoff_count(rule, proposal: Proposal) -> int:
    """What a step tells the backoff: its verified positions, or 0 when they did not pay for the drafting
    (rules that price steps, `pays`); decided after the step is drafted, about the next steps only."""
    if not proposal.tokens or not hasattr(rule, "pays") or proposal.confidence is None:
        return len(proposal.tokens)
    return len(proposal.tokens) if rule.pays(proposal.confidence.tolist()) else 0


def break_even(rule, verified: int, sides: int | None = None) -> float | None:
    """The tokens a finished step that drafted had to produce to pay (rules that price steps), else None.
    `verified`: its drafted positions verified, 0 where the rule cut them all (the drafting was spent);
    `sides`: the side branches it verified (None: the rule's most)."""
    return rule.break_even(verified, sides) if hasattr(rule, "break_even") else None


def at(rule, context_length: int):
    """The rule for one step of a request whose context holds `context_length` tokens."""
    return rule.at(context_length) if hasattr(rule, "at") else rule


def can_pay(rows: int, drafting: int, max_length: int, draft_s, verify_s) -> bool:
    """Whether speculating could beat plain decoding this step at all: True if some verify length
    L <= max_length beats plain decoding's rows / verify_s(rows, 1) even when every one of `drafting`
    requests' L positions surely survived (expected rows + drafting·L tokens, in draft_s(L) +
    verify_s(rows, 1 + L) seconds). Where it cannot (a compute-bound batch, or a step whose one more
    position costs more than a whole token), the scheduler runs no drafter this step: the decision
    reads only shapes and the profile, never a drafted token, so it keeps the stopping-rule property."""
    plain = rows / verify_s(rows, 1)
    return any((rows + drafting * length) / (draft_s(length) + verify_s(rows, 1 + length)) > plain
               for length in range(1, max_length + 1))


def worth_drafting(rule, limit: int, proposer=None) -> bool:
    """False when the rule knows from its profile that no draft of at most `limit` positions can pay. For a
    `cheap` proposer (prompt lookup, a hybrid that may look up) drafting is priced at nothing."""
    if getattr(proposer, "cheap", False) and hasattr(rule, "without_drafting"):
        rule = rule.without_drafting()
    return limit > 0 and (not hasattr(rule, "can_pay") or rule.can_pay(limit))


def make_backoff(rule, proposer=None) -> Backoff | None:
    """One per request, for rules that ask for it (max_skip > 0). None for a proposer whose drafting costs
    nothing next to a verify step (`cheap`: prompt lookup): skipping it would save nothing and miss matches."""
    max_skip = getattr(rule, "max_skip", 0)
    return Backoff(max_skip) if max_skip and not getattr(proposer, "cheap", False) else None


class CostRule:
    """Latency mode for one request: extend the verify length while the expected tokens per second
    (1 + Σ_{j≤ℓ} a_j) / (t_draft(ℓ) + t_verify(1 + ℓ)) improves; stop at the first non-improvement.
    Times come from a measured cost profile (decode/profile.py), at the step's context when the
    profile has curves at several contexts (`at`; None: the profile's base context). ℓ = 0 (plain
    decoding this step) is chosen from c_1 alone, which needs only the backbone pass and the known anchor.

    A step that drafts a token tree (`with_tree`: greedy, proposer.branches > 1) may verify up to
    len(side_hits) side branches of up to `side_length` tokens (at most ℓ) beside any ℓ >= 1: s of them widen
    the verify to 1 + ℓ + s * min(ℓ, side_length) rows and add side_hits[0] + .. + side_hits[s-1], the tokens
    the proposer's first s branches gave per step (the request's record so far: decode/tree.py SideRecord), to
    the expected tokens. The events are disjoint (the main chain's first token or one side branch's), so the
    expectation adds. Each ℓ is priced with its best s (`side_count`): on a flat verify curve every branch
    rides free, on a steep one a branch stays only where its hit rate buys its rows. `probing` prices the
    step with every branch (the record learns the rates of branches it would otherwise stop verifying).
    Greedy only, so which branches are verified never changes the output, only the speed."""

    needs_confidence = True

    def __init__(self, profile, rows: int = 1, max_skip: int = 16, context: int | None = None, drafting: bool = True,
                 side_hits: tuple[float, ...] = (), side_length: int = 1, probing: bool = False):
        self.profile, self.rows, self.max_skip, self.context = profile, rows, max_skip, context
        self.drafting = drafting  # False: price the step without the profile's drafting time
        self.side_hits, self.side_length, self.probing = tuple(side_hits), side_length, probing

    @property
    def side_branches(self) -> int:
        """The most side branches a step of this rule may verify."""
        return len(self.side_hits)

    def _with(self, **changes) -> "CostRule":
        fields = dict(profile=self.profile, rows=self.rows, max_skip=self.max_skip, context=self.context,
                      drafting=self.drafting, side_hits=self.side_hits, side_length=self.side_length,
                      probing=self.probing)
        return CostRule(**{**fields, **changes})

    def at(self, context_length: int) -> "CostRule":
        return self._with(context=context_length)

    def without_drafting(self) -> "CostRule":
        """The same rule for a proposal whose drafting costs nothing next to the profile's drafter (a hybrid's
        prompt lookup): only the verify time prices it. Lookup drafts no tree, so no side branches either."""
        return self._with(drafting=False, side_hits=())

    def with_tree(self, side_hits, side_length: int = 1, probing: bool = False) -> "CostRule":
        """The rule for a step whose drafts carry up to len(side_hits) side branches of up to `side_length`
        tokens, the r-th giving side_hits[r] tokens per step (known before the step: a record of earlier steps)."""
        return self._with(side_hits=tuple(side_hits), side_length=side_length, probing=probing)

    def _width(self, length: int, sides: int | None = None) -> int:
        """Verify rows of a step that drafts `length` main-chain positions and `sides` side branches (None: all)."""
        sides = self.side_branches if sides is None else sides
        return 1 + length + sides * min(length, self.side_length)

    def _step_rate(self, tokens: float, length: int, sides: int) -> float:
        drafting = self.profile.draft_s(length, self.context) if self.drafting else 0.0
        return (tokens + sum(self.side_hits[:sides])) / (drafting + self._verify(self._width(length, sides)))

    def side_count(self, confidences: list[float]) -> int:
        """How many of the side branches a step verifying len(confidences) positions should carry: the count
        with the best expected rate (every one while probing; none beside ℓ = 0)."""
        if not confidences:
            return 0
        if self.probing:
            return self.side_branches
        tokens = expected_tokens(confidences)
        rates = [self._step_rate(tokens, len(confidences), sides) for sides in range(self.side_branches + 1)]
        return max(range(len(rates)), key=lambda sides: (rates[sides], -sides))  # a tie: fewer rows

    def rate(self, confidences: list[float]) -> float:
        """Expected tokens per second of this step verifying len(confidences) positions (with its best side
        branches). The backbone pass that produced c_1 is already spent when the rule is asked, so ℓ = 0
        counts it too (draft_s(0)): the step's decision is the best one given its probe. Whether probing paid
        is `pays`' question."""
        return self._step_rate(expected_tokens(confidences), len(confidences), self.side_count(confidences))

    def _verify(self, length: int) -> float:
        return self.profile.verify_s(self.rows, length, context=self.context)

    def verify(self, confidences: list[float]) -> bool:
        return self.rate(confidences) > self.rate(confidences[:-1])

    def pays(self, confidences: list[float]) -> bool:
        """Whether verifying these positions beat plain decoding with the drafting counted in full (the
        backoff's question: a step that speculates only because its probe is already paid for does not
        justify probing again on the next step)."""
        return bool(confidences) and self.rate(confidences) > 1 / self._verify(1)

    def break_even(self, verified: int, sides: int | None = None) -> float:
        """Tokens a step verifying `verified` drafted positions and `sides` side branches (None: all) must
        produce to match plain decoding in the time it takes (drafting included): the backoff's bar for a
        finished step (`Backoff.settle`)."""
        drafting = self.profile.draft_s(verified, self.context) if self.drafting else 0.0
        return (drafting + self._verify(self._width(verified, sides))) / self._verify(1)

    def can_pay(self, limit: int) -> bool:
        """Whether some ℓ <= limit could beat plain decoding at this context if every position survived."""
        draft_s = (lambda length: self.profile.draft_s(length, self.context)) if self.drafting else (lambda length: 0.0)
        return can_pay(self.rows, 1, limit, draft_s,
                       lambda rows, length: self.profile.verify_s(rows, length, context=self.context))


def with_tree(rule, side_hits, side_length: int = 1, probing: bool = False):
    """The rule for a step that drafts a token tree of up to len(side_hits) side branches (rules that price
    steps; others are returned as they are)."""
    return rule.with_tree(side_hits, side_length, probing) if hasattr(rule, "with_tree") else rule


def side_count(rule, proposal: Proposal) -> int:
    """How many of a drafted tree's side branches to verify: the pricing rule's choice for the positions it
    kept, else all of them."""
    if not proposal.alternatives or not hasattr(rule, "side_count") or proposal.confidence is None:
        return len(proposal.alternatives)
    return min(len(proposal.alternatives), rule.side_count(proposal.confidence.tolist()))


def cut(proposal: Proposal, rule) -> int:
    """How many positions of a finished proposal the rule verifies (it stops at its first "no")."""
    if not proposal.tokens:
        return 0
    if proposal.confidence is None and rule.needs_confidence:
        raise ValueError(
            f"this scheduler ({type(rule).__name__}) needs a proposer with a confidence head "
            "(proposer=ngram, or proposer=drafter with a dspark export); use scheduler=fixed otherwise"
        )
    # Without a confidence head every position counts as c = 1 for rules that do not need it.
    values = proposal.confidence.tolist() if proposal.confidence is not None else [1.0] * len(proposal.tokens)
    for j in range(len(values)):
        if not rule.verify(values[: j + 1]):
            return j
    return len(values)


def load_schedule(survival: list[list[float]], draft_s: float, verify_s) -> list[int]:
    """DSpark's load-aware admission (Algorithm 1) for one batched step.

    survival[r] holds a_{r,1..k_r} (non-increasing) for each request; every request always gets its
    target token. Pairs (r, j) are admitted in order of a_{r,j} (ties: lower j first, then lower r)
    while Θ = expected tokens / step seconds improves, starting from plain decoding's Θ after this step's
    drafting (`draft_s`, already spent when admission runs); the first non-improvement stops admission.
    Admitting (r, j) depends only on pairs ranked above it, which for request r are positions < j:
    nothing about x_{r,j} or later positions enters the decision (the stopping-rule property).
    `verify_s(rows, length)` is the verify-step time of the engine's padded (rows, length) shape.
    Returns the verify length per request.
    """
    rows = len(survival)
    # A NaN survival (a broken confidence head) counts as 0: NaN has no place in a sort's order.
    pairs = sorted(((0.0 if math.isnan(a) else a, j, r) for r, values in enumerate(survival) for j, a in enumerate(values)),
                   key=lambda item: (-item[0], item[1], item[2]))
    lengths = [0] * rows
    expected = float(rows)  # each request's own target token
    # The drafting is spent by now, so the bar is a plain step after it (as for CostRule's ℓ = 0); whether
    # the admitted set paid for the drafting as well is `load_pays`' question, which drives the backoff.
    best = expected / (draft_s + verify_s(rows, 1))
    for a, j, r in pairs:
        if j != lengths[r]:  # a tie broke the prefix order; positions of a request are admitted in order
            break
        longest = max(max(lengths), j + 1)
        rate = (expected + a) / (draft_s + verify_s(rows, 1 + longest))
        if not rate > best or math.isnan(rate):
            break
        lengths[r], expected, best = j + 1, expected + a, rate
    return lengths


def load_admits_any(first: list[list[float]], draft_s: float, verify_s) -> bool:
    """Whether `load_schedule` admits at least one pair, from each request's a_{r,1} alone (`first[r]`: [a_{r,1}],
    or [] for a request that drafts nothing). Its first decision is about the best pair, and that is always a
    position-1 pair: a_{r,j} <= a_{r,1}, and ties go to the lower position. So c_1 of every request, known after
    the backbone pass, settles whether anything is admitted, before any drafted token is drawn."""
    return any(load_schedule(first, draft_s, verify_s))


def load_pays(survival: list[list[float]], lengths: list[int], draft_s: float, verify_s) -> bool:
    """Whether an admitted set beat plain decoding with this step's drafting counted in full."""
    rows, longest = len(survival), max(lengths, default=0)
    if longest == 0:
        return False
    expected = rows + sum(sum(values[:n]) for values, n in zip(survival, lengths))
    return expected / (draft_s + verify_s(rows, 1 + longest)) > rows / verify_s(rows, 1)


class LoadRule(FixedRule):
    """scheduler=load's per-request part: draft the whole block (admission happens batch-wide); its
    max_skip drives the batch-wide backoff after steps where nothing was admitted (decode/engine.py)."""

    def __init__(self, max_skip: int = 16):
        self.max_skip = max_skip


def build_scheduler(name: str, threshold: float = 0.5, profile=None, max_skip: int = 16):
    """The stopping rule for scheduler=NAME (load: the per-request rule drafts whole blocks; admission is batched)."""
    if name == "fixed":
        return FixedRule()
    if name == "load":
        return LoadRule(max_skip)
    if name == "threshold":
        return ThresholdRule(threshold)
    if name == "cost":
        if profile is None:
            raise ValueError("scheduler=cost needs a measured cost profile (decode/profile.py)")
        return CostRule(profile, max_skip=max_skip)
    raise ValueError(f"unknown scheduler {name!r}; choose one of {list(SCHEDULERS)}")
