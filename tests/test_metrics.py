"""Speed statistics over generations: the paired bootstrap interval of a sweep's ratios."""

import pytest

from specdraft.decode.generate import Generation
from specdraft.decode.metrics import paired_speed_interval, timing_stats


def runs(seconds: list[float], tokens: int = 9, ttft: float = 0.1) -> list[Generation]:
    return [Generation(output_ids=[1] * tokens, ttft_s=ttft, total_s=s) for s in seconds]


def test_a_uniform_speed_ratio_has_a_point_interval():
    slow = runs([1.0, 2.0, 3.0, 1.5])
    fast = runs([s / 2 for s in [1.0, 2.0, 3.0, 1.5]], ttft=0.05)  # every prompt twice as fast, prefill too
    assert paired_speed_interval(fast, slow) == pytest.approx((2.0, 2.0))
    assert paired_speed_interval(fast, slow, decode=True) == pytest.approx((2.0, 2.0))
    assert paired_speed_interval(slow, slow) == pytest.approx((1.0, 1.0))


def test_the_interval_holds_the_measured_ratio_and_widens_with_spread():
    slow = runs([1.0] * 12)
    steady = runs([0.9, 0.92, 0.88, 0.91, 0.9, 0.89, 0.9, 0.91, 0.9, 0.9, 0.92, 0.88])
    noisy = runs([0.6, 1.3, 0.7, 1.2, 0.8, 1.1, 0.6, 1.3, 0.9, 1.0, 0.7, 1.0])
    for faster in (steady, noisy):
        ratio = timing_stats(faster)["tokens_per_s"] / timing_stats(slow)["tokens_per_s"]
        low, high = paired_speed_interval(faster, slow)
        assert low <= ratio <= high
    (steady_low, steady_high), (noisy_low, noisy_high) = (paired_speed_interval(r, slow) for r in (steady, noisy))
    assert noisy_high - noisy_low > 5 * (steady_high - steady_low)
    # A narrower level gives a narrower interval; the same seed gives the same interval.
    narrow = paired_speed_interval(noisy, slow, level=0.5)
    assert noisy_low <= narrow[0] <= narrow[1] <= noisy_high
    assert paired_speed_interval(noisy, slow) == (noisy_low, noisy_high)


def test_unpaired_or_single_prompt_runs():
    with pytest.raises(ValueError, match="paired runs differ"):
        paired_speed_interval(runs([1.0, 1.0]), runs([1.0]))
    assert paired_speed_interval(runs([1.0]), runs([2.0])) is None
