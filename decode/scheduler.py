"""How many drafted tokens to verify each step.

A scheduler must be a stopping rule to keep sampling lossless: whether position j is verified may
depend only on what was known before x_j was sampled. DSpark's confidence c_j is computed from the
backbone state and W1[x_{j-1}], so "verify while c_j >= threshold, stop at the first c_j below it"
qualifies; a rule that looks at later positions to decide about x_j would not (DSpark, App. A).
"""

from __future__ import annotations

from decode.proposer import Proposal

SCHEDULERS = ("fixed", "threshold")


def threshold_cut(proposal: Proposal, threshold: float) -> int:
    """Verify positions up to the first whose confidence is below `threshold`."""
    if not proposal.tokens:
        return 0
    if proposal.confidence is None:
        raise ValueError("scheduler=threshold needs a proposer with a confidence head (proposer=drafter with a dspark export)")
    for position, confidence in enumerate(proposal.confidence.tolist()):
        if confidence < threshold:
            return position
    return len(proposal.tokens)


def build_scheduler(name: str, threshold: float = 0.5):
    """None for a fixed verify length (decode.num_draft), else a callback Proposal -> tokens to verify."""
    if name == "fixed":
        return None
    if name == "threshold":
        if not 0 <= threshold <= 1:
            raise ValueError(f"scheduler.threshold={threshold} must be a probability in [0, 1]")
        return lambda proposal: threshold_cut(proposal, threshold)
    raise ValueError(f"unknown scheduler {name!r}; choose one of {list(SCHEDULERS)}")
