"""The oracle ceiling: each recorded step priced as run and as a scheduler that knew its outcome would run it."""

from __future__ import annotations

import pytest

from specdraft.decode.generate import Generation
from specdraft.decode.oracle import confidence_cut, oracle_ceiling, priced_rate, step_contexts
from tests.helpers import synthetic_profile

# synthetic_profile: verify of n tokens 10 + 2n ms, drafting ℓ positions 3 + ℓ ms, one context only.


def test_steps_carry_their_context_and_what_they_kept():
    generation = Generation(output_ids=[1] * 7, drafted=[3, 3, 0], accepted=[0, 3, 0])
    assert step_contexts(5, generation) == [(6, 3, 0, 1), (7, 3, 3, 4), (11, 0, 0, 1)]
    cut = Generation(output_ids=[1] * 4, drafted=[3, 3], accepted=[0, 3])  # the last step stopped at EOS
    assert step_contexts(5, cut) == [(6, 3, 0, 1), (7, 3, 3, 2)]


def test_oracle_drafts_exactly_what_survives_and_no_drafter_when_nothing_does():
    profile = synthetic_profile()
    steps = [(6, 3, 0, 1), (7, 3, 3, 4), (11, 0, 0, 1)]
    # as run: two steps of 6 + 18 ms (3 drafted, 4 verified), one plain step of 12 ms; 6 tokens
    assert priced_rate(steps, profile) == pytest.approx(6 / 0.060)
    # oracle: the first step is plain (12 ms), the second as run (24 ms), the third plain (12 ms)
    assert priced_rate(steps, profile, oracle=True) == pytest.approx(6 / 0.048)


def test_ceiling_compares_the_best_oracle_with_the_best_fixed_length():
    profile = synthetic_profile()
    plain = Generation(output_ids=[1] * 4, drafted=[0, 0, 0], accepted=[0, 0, 0])
    one = Generation(output_ids=[1] * 5, drafted=[1, 1], accepted=[1, 1])  # 2 + 2 tokens
    three = Generation(output_ids=[1] * 5, drafted=[3, 3], accepted=[0, 2])  # 1 + 3 tokens
    ceiling = oracle_ceiling({"plain": [plain], "fixed_1": [one], "fixed_3": [three], "cost": [plain]}, [4], profile)
    priced, oracle = ceiling["priced_decode_tokens_per_s"], ceiling["oracle_decode_tokens_per_s"]
    assert set(priced) == {"plain", "fixed_1", "fixed_3"} and set(oracle) == {"fixed_1", "fixed_3"}
    assert priced["plain"] == pytest.approx(1 / 0.012)
    assert priced["fixed_1"] == pytest.approx(4 / (2 * 0.018))  # (4 + 14) ms per step
    assert priced["fixed_3"] == pytest.approx(4 / (2 * 0.024))
    assert oracle["fixed_3"] == pytest.approx(4 / (0.012 + 0.005 + 0.016))  # plain, then 2 drafted and verified
    assert oracle["fixed_1"] == pytest.approx(priced["fixed_1"])  # every drafted position survived
    assert all(oracle[kind] >= priced[kind] for kind in oracle)  # knowing the outcome never costs
    assert ceiling["best_fixed"] == "fixed_1" and ceiling["oracle_steps_of"] == "fixed_3"
    assert ceiling["oracle_vs_best_fixed"] == pytest.approx(oracle["fixed_3"] / priced["fixed_1"])


def test_no_verify_step_gives_no_ceiling():
    """Outputs that ended at their first token leave nothing to price: no ceiling, no division by nothing."""
    empty = Generation(output_ids=[2])
    ceiling = oracle_ceiling({"plain": [empty], "fixed_1": [empty]}, [4], synthetic_profile())
    assert ceiling["oracle_vs_best_fixed"] is None and ceiling["best_fixed"] is None


def test_confidence_cut_drafts_the_steps_worth_drafting_when_the_head_ranks_them():
    """Steps ranked by z_1: the best cut drafts exactly those whose position 1 survives when the head
    ranks survivors first; when it ranks them last, a cut (a top slice) takes all steps or none."""
    profile = synthetic_profile()  # plain step 12 ms, probe 3 ms, drafted step 4 + 14 = 18 ms
    # four fixed_1 steps: survived, failed, survived, failed -> 2 + 1 + 2 + 1 tokens
    ranked = Generation(output_ids=[1] * 7, drafted=[1] * 4, accepted=[1, 0, 1, 0],
                        confidence_logits=[[2.0], [-1.0], [1.5], [-2.0]])
    probed = confidence_cut([ranked], [4], profile)
    assert probed["drafted_fraction"] == 0.5 and probed["precision"] == 1.0 and probed["cut_logit"] == 1.5
    # drafted survivors: 18 ms for 2 tokens; the others: one probed plain step (15 ms) each
    assert probed["decode_tokens_per_s"] == pytest.approx(6 / (2 * 0.018 + 2 * 0.015))
    assert probed["never_draft_tokens_per_s"] == pytest.approx(6 / (6 * 0.015))
    free = confidence_cut([ranked], [4], profile, probe=False)  # plain steps 12 ms: a failed draft costs 6 ms more
    assert free["drafted_fraction"] == 0.5 and free["decode_tokens_per_s"] == pytest.approx(6 / (2 * 0.018 + 2 * 0.012))
    # Ranked backwards, a cut reaches the survivors only through the failures: with the probe paid anyway
    # drafting everything (+12 ms twice, -3 ms twice) still beats nothing; without it, nothing is best.
    backwards = Generation(output_ids=[1] * 7, drafted=[1] * 4, accepted=[1, 0, 1, 0],
                           confidence_logits=[[-2.0], [1.0], [-1.5], [2.0]])
    assert confidence_cut([backwards], [4], profile)["drafted_fraction"] == 1.0
    nothing = confidence_cut([backwards], [4], profile, probe=False)
    assert nothing["drafted_fraction"] == 0.0 and nothing["precision"] is None and nothing["cut_logit"] is None
    assert nothing["decode_tokens_per_s"] == pytest.approx(nothing["never_draft_tokens_per_s"])


def test_confidence_cut_never_splits_tied_scores_and_needs_recorded_confidences():
    profile = synthetic_profile()
    tied = Generation(output_ids=[1] * 5, drafted=[1, 1], accepted=[1, 0], confidence_logits=[[0.5], [0.5]])
    bound = confidence_cut([tied], [4], profile)
    # drafting both nets +12 - 3 ms; drafting only the survivor would be better, but equal scores cannot be told apart
    assert bound["drafted_fraction"] == 1.0 and bound["precision"] == 0.5
    assert confidence_cut([Generation(output_ids=[1] * 3, drafted=[1], accepted=[1])], [4], profile) is None
