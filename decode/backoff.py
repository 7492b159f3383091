"""The fallback to plain decoding where a drafter does not pay: skip it for 1, 2, 4, ... steps, then probe.

Its own module so that both the schedulers and the hybrid proposer (which backs off its drafter part only,
never its free prompt lookup) can use it without importing each other.
"""

from __future__ import annotations


class Backoff:
    """The fallback to plain decoding: after a step whose speculation did not pay (nothing verified, or
    too little to repay the drafting: `backoff_count`), skip the drafter
    (backbone pass included) for 1, 2, 4, ... steps (at most `max_skip`), then draft again to probe.

    Where the rule can price a step after the fact (`settle`), the realized record takes over from the first
    settled step: a running mean of what the drafter's steps produced beyond the break-even (the tokens plain
    decoding makes in the same time), starting from 0 (no evidence either way). While it is below
    -`tolerance` the drafter is not paying whatever its confidences promised (an optimistic head), and every
    such step counts as a failure. It decides from finished steps only, before anything of the current step
    is drafted, so the verified set never depends on the tokens being verified (a proposal may depend on the
    past in any way; the acceptance rule stays exact).

    Why a long memory: a step's gain is far noisier than its mean. The default export's token-tree steps on
    held-out ShareGPT made +0.9 tokens beyond break-even at a third of the steps and -0.1 at the rest (mean
    +0.26); a mean over about 5 steps (decay 0.8) went negative after a few misses in a row, and the backoff
    skipped 62% of the steps of a drafter that paid. Over about 20 steps (0.95) such a mean stays above zero,
    and a drafter that never pays still falls below the tolerance within about 5 steps."""

    def __init__(self, max_skip: int, decay: float = 0.95, tolerance: float = 0.02):
        self.max_skip, self.streak, self.skip = max_skip, 0, 0
        self.decay = decay  # weight of the past in the running mean: about 1 / (1 - decay) steps remembered
        self.tolerance = tolerance  # tokens per step below break-even that the running mean may show
        self.net: float | None = None  # running mean of tokens beyond break-even; None until a step settles

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

    def settle(self, tokens: int, break_even: float | None) -> None:
        """After a step that drafted, whatever it verified (a step cut to no position still paid for its
        drafting): the tokens it produced (accepted + the target's) against `break_even`, the tokens plain
        decoding makes in the time the step took (None: not priced)."""
        if break_even is None:
            return
        gain = tokens - break_even
        self.net = self.decay * (self.net or 0.0) + (1 - self.decay) * gain
        if self.net >= -self.tolerance:
            self.streak = 0
        else:
            self._fail()

    def _fail(self) -> None:
        self.streak += 1
        self.skip = min(2 ** (self.streak - 1), self.max_skip)
