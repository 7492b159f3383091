"""The oracle ceiling: each recorded step priced as run and as a scheduler that knew its outcome would run it."""

from __future__ import annotations

import pytest

from decode.generate import Generation
from decode.oracle import oracle_ceiling, priced_rate, step_contexts
from tests.test_batch import synthetic_profile

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
