"""Output-length distributions: the long tail the planner's cost model and simulator sample."""

import numpy as np
import pytest

from hexrl.plan.lengths import long_tail


def test_long_tail_matches_requested_mean_and_sampling():
    d = long_tail(1000, 8000)
    assert d.mean() == pytest.approx(1000, rel=1e-3) and d.max() <= 8000
    draws = d.sample(np.random.default_rng(0), 200_000)
    assert draws.mean() == pytest.approx(1000, rel=0.02)
    # E[max of n] against a simulation of the same distribution
    sims = d.sample(np.random.default_rng(1), 64 * 2000).reshape(2000, 64).max(1)
    assert d.expected_max(64) == pytest.approx(sims.mean(), rel=0.05)
