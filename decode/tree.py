"""Token trees for greedy verification: several drafted continuations checked by one target forward.

A drafter's first position is its weakest guess and the one every later position hangs on: on the default
export the target's next token is the drafter's top-1 at 20% of steps but among its top-3 at 35% (held-out
ShareGPT). Where the verify step costs the same for a few more rows (on the 2-core EPYCs a forward of up to
six new tokens costs what one costs, docs/results/), drafting the runners-up for position 1 as sibling
branches of the main chain turns those extra hits into accepted tokens for the price of a wider verify.
Branches may be chains of any length here; the block drafter's are one token (decode/proposer.py says why).

Layout of a verify step over branches b_0 (the main chain) .. b_m, all siblings below the pending token:
row 0 is the pending token, then each branch's tokens in order. A row sees the cached context, the pending
token, and the earlier rows of its own branch; its position is the context length plus its depth. Greedy
acceptance walks from the pending token: the branch whose first token is the target's argmax (first tokens
are distinct), then along it while each token is the target's argmax after its predecessor. The output is
the target's greedy output whatever the branches hold: only target argmaxes are ever kept.

Sampling (T > 0) verifies one chain: exact acceptance over several candidates needs a different rule (the
drafts would have to be sampled and rejected jointly), which this module does not implement.
"""

from __future__ import annotations

import torch


def tree_rows(branches: list[list[int]]) -> tuple[list[int], list[int]]:
    """Drafted tokens in verify order (after the pending token) and each row's depth below it (1 = position 1)."""
    tokens, depths = [], []
    for branch in branches:
        tokens += branch
        depths += list(range(1, len(branch) + 1))
    return tokens, depths


def branch_starts(branches: list[list[int]]) -> list[int]:
    """The verify row of each branch's first token (row 0 is the pending token)."""
    starts, row = [], 1
    for branch in branches:
        starts.append(row)
        row += len(branch)
    return starts


def tree_mask(branches: list[list[int]], past: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The additive mask (1, 1, T, past + T) of a verify step over `branches` after `past` cached tokens,
    T = 1 + every branch's tokens: 0 where a row sees a slot, the dtype's lowest value where it does not."""
    width = 1 + sum(len(branch) for branch in branches)
    visible = torch.zeros((width, past + width), dtype=torch.bool, device=device)
    visible[:, : past + 1] = True  # the context and the pending token, for every row
    for start, branch in zip(branch_starts(branches), branches):
        end = start + len(branch)
        # a branch's rows see its earlier rows and themselves
        visible[start:end, past + start : past + end] = torch.ones((len(branch), len(branch)), dtype=torch.bool,
                                                                    device=device).tril()
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def greedy_tree_accept(branches: list[list[int]], logits: torch.Tensor) -> tuple[int, int, int]:
    """(branch, accepted, next token) of a greedy verify step: the branch the target's argmaxes follow (0 when
    none matches: nothing is accepted), how many of its tokens are accepted, and the target's own token after
    them. logits (T, V) are the step's rows in tree_rows' order, row 0 the pending token's."""
    argmax = logits.argmax(-1).tolist()  # one target token per row
    first = argmax[0]
    for index, (start, branch) in enumerate(zip(branch_starts(branches), branches)):
        if branch and branch[0] == first:
            accepted = 1
            while accepted < len(branch) and branch[accepted] == argmax[start + accepted - 1]:
                accepted += 1
            return index, accepted, argmax[start + accepted - 1]
    return 0, 0, first


def kept_rows(branches: list[list[int]], branch: int, accepted: int) -> list[int]:
    """The verify rows that stay in the cache: the pending token's and the accepted tokens' of `branch`."""
    start = branch_starts(branches)[branch]
    return [0, *range(start, start + accepted)]


class SideRecord:
    """One request's record of its tree steps: how many tokens each side branch rank gave per step it was
    verified (rank r: the proposer's r-th side branch; a one-token branch: how often it held the target's
    token). A scheduler that prices steps (scheduler=cost) adds these rates to a tree step's expected tokens
    and keeps the branches that pay for their rows; it reads finished steps only, so a step's verified set
    never depends on the tokens being verified. The prior (`hits` in `steps`, shared out among the ranks)
    stands for the steps not seen yet: 1 in 8, below the 15% the default export's runners-up hit on held-out
    ShareGPT, so a request starts cautious and earns its own rates. A rank the rule stopped verifying learns
    nothing, so every `probe_every` steps without the whole tree, the next one carries it (`probing`).
    `side_length`: the most tokens a side branch holds (prompt lookup's may be chains; a drafter's are one)."""

    def __init__(self, side_branches: int, hits: float = 1.0, steps: float = 8.0, side_length: int = 1,
                 probe_every: int = 16):
        self.side_branches, self.side_length, self.probe_every = side_branches, side_length, probe_every
        self.hits = [hits / side_branches] * side_branches
        self.steps = [steps] * side_branches
        self.since_whole = 0  # drafting steps in a row whose rule dropped some of the branches drafted

    def rates(self) -> list[float]:
        """Tokens per step from each side branch rank, best first as the proposer ranks them."""
        return [hits / steps for hits, steps in zip(self.hits, self.steps)]

    def rate(self) -> float:
        """Tokens per step from the whole tree's side branches."""
        return sum(self.rates())

    def probing(self) -> bool:
        return self.since_whole >= self.probe_every

    def observe(self, side_tokens: int, branch: int = 0, offered: int | None = None, dropped: int = 0) -> None:
        """After a drafting step that verified the first `offered` side branches (None: all) and dropped
        `dropped` more that were drafted: `side_tokens` drafted tokens accepted from side branch `branch`
        (1-based; 0 where the main chain's first token was the target's, or no branch's was)."""
        offered = self.side_branches if offered is None else offered
        for rank in range(offered):
            self.steps[rank] += 1.0
        if branch and side_tokens:
            self.hits[branch - 1] += float(side_tokens)
        self.since_whole = self.since_whole + 1 if dropped else 0


def side_record(proposer, greedy: bool) -> SideRecord | None:
    """A record for a request whose proposer drafts token trees (proposer.branches > 1, greedy), else None."""
    branches = getattr(proposer, "branches", 1)
    return SideRecord(branches - 1, side_length=getattr(proposer, "side_length", 1)) if greedy and branches > 1 else None


def side_rows(proposer, greedy: bool) -> int:
    """The most verify rows a proposer's token tree adds beside its main chain (0: it drafts one chain)."""
    record = side_record(proposer, greedy)
    return 0 if record is None else record.side_branches * record.side_length
