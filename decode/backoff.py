"""The fallback to plain decoding where a drafter does not pay: skip it for 1, 2, 4, ... steps, then probe.

Its own module so that both the schedulers and the hybrid proposer (which backs off its drafter part only,
never its free prompt lookup) can use it without importing each other.
"""

from __future__ import annotations


class Backoff:
    """The fallback to plain decoding: after a step whose speculation did not pay (nothing verified, or
    too little to repay the drafting: `backoff_count`), skip the drafter
    (backbone pass included) for 1, 2, 4, ... steps (at most `max_skip`), then draft again to probe.
    It decides from finished steps only, before anything of the current step is drafted, so the
    verified set never depends on the tokens being verified."""

    def __init__(self, max_skip: int):
        self.max_skip, self.streak, self.skip = max_skip, 0, 0

    def should_skip(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    def observe(self, verified: int) -> None:
        """After a step that drafted: how many positions the scheduler chose to verify."""
        if verified > 0:
            self.streak = 0
            return
        self.streak += 1
        self.skip = min(2 ** (self.streak - 1), self.max_skip)
