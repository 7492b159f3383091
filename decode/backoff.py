"""The fallback to plain decoding where a drafter does not pay: skip it for 1, 2, 4, ... steps, then probe.

Its own module so that both the schedulers and the hybrid proposer (which backs off its drafter part only,
never its free prompt lookup) can use it without importing each other.
"""

from __future__ import annotations

import math


class Backoff:
    """The fallback to plain decoding: after a step whose speculation did not pay, skip the drafter
    (backbone pass included) for 1, 2, 4, ... steps (at most `max_skip`), then draft again to probe.

    Before any step settles, a step pays when the rule verified something (`observe`). Where the rule can
    price a finished step (`settle`), the realized record takes over: each drafting step's gain, the tokens
    it made beyond break-even (what plain decoding makes in the same time), enters an exponentially weighted
    record (about 1 / (1 - decay) steps), and the drafter fails while that record shows it losing beyond its
    noise: mean gain + z · standard error < 0. It decides from finished steps only, before anything of the
    current step is drafted, so the verified set never depends on the tokens being verified (a proposal may
    depend on the past in any way; the acceptance rule stays exact).

    Why a test, not a threshold on the mean: a step's gain is far noisier than its mean, and the more so the
    rarer its hits. At T=1 the default export kept its first drafted token at a fifth of its steps: most steps
    lost 0.1 tokens, the others won 0.9 or 1.9, a mean of +0.14 with a standard deviation of 0.5. A running
    mean from 0 held to -0.02 crossed it after four misses in a row (a chance of 0.4 at the start of every
    request) and, replayed on that export's held-out steps, skipped 37% of the steps of a drafter that paid.
    The standard error is the larger of the record's own and that of a drafter exactly at break-even
    (`null_variance`), so a short run of misses is not mistaken for a drafter that never pays; one that never
    pays (0.1 tokens lost at every step) is found within about two dozen steps, one whose loss has no spread
    (its steps cut to no position) at once, and either is then skipped for up to `max_skip` steps at a time."""

    def __init__(self, max_skip: int, decay: float = 0.95, z: float = 1.64):
        self.max_skip, self.streak, self.skip = max_skip, 0, 0
        self.decay = decay  # weight of the past in the record: about 1 / (1 - decay) steps remembered
        self.z = z  # standard errors below zero that count as losing (1.64: one-sided 95%)
        # decayed sums over settled steps: weights, squared weights, gains, squared gains, null variances
        self.weight = self.weight_sq = self.gains = self.gains_sq = self.null = 0.0

    @property
    def net(self) -> float | None:
        """Mean gain of the settled record (tokens per step beyond break-even); None until a step settles."""
        return self.gains / self.weight if self.weight else None

    def should_skip(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    def observe(self, verified: int) -> None:
        """After a step that drafted: how many positions the scheduler chose to verify (0 where they did not
        promise to pay). It counts only until a step settles; from then on the realized record alone decides.
        A promise is not a payoff either way, and one step's low confidences say little about the next
        step's: at T=1 the default export's head put a fifth of its steps below break-even while its
        verified steps paid on average, and skipping after each of them cost 4% of the decode speed."""
        if self.net is not None:
            return
        if verified > 0:
            self.streak = 0
        else:
            self._fail()

    def settle(self, tokens: int, break_even: float | None, verified: int = 1) -> None:
        """After a step that drafted, whatever it verified (a step cut to no position still paid for its
        drafting): the tokens it produced (accepted + the target's) against `break_even`, the tokens plain
        decoding makes in the time the step took (None: not priced), and its `verified` drafted positions."""
        if break_even is None:
            return
        gain, decay = tokens - break_even, self.decay
        self.weight = decay * self.weight + 1
        self.weight_sq = decay * decay * self.weight_sq + 1
        self.gains = decay * self.gains + gain
        self.gains_sq = decay * self.gains_sq + gain * gain
        self.null = decay * self.null + null_variance(break_even - 1, verified)
        if self.losing():
            self._fail()
        else:
            self.streak = 0

    def losing(self) -> bool:
        """Whether the settled record shows the drafter below break-even beyond its noise."""
        if not self.weight:
            return False
        mean = self.gains / self.weight
        variance = max(self.gains_sq / self.weight - mean * mean, self.null / self.weight)
        effective_steps = self.weight * self.weight / self.weight_sq  # as many equal-weight steps
        return mean + self.z * math.sqrt(variance / effective_steps) < 0

    def _fail(self) -> None:
        self.streak += 1
        self.skip = min(2 ** (self.streak - 1), self.max_skip)


def null_variance(extra: float, verified: int) -> float:
    """Variance of the tokens of a step that verifies `verified` positions and makes `extra` of them survive
    on average, exactly break-even, were its positions to survive independently (binomial): e (1 - e / ℓ).
    A step that verified nothing, or needed more than it verified, makes a sure number of tokens (0)."""
    if verified <= 0 or not 0 < extra < verified:
        return 0.0
    return extra * (1 - extra / verified)
