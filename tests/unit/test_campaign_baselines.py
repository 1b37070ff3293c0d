"""The baselines the campaign compares against: when they fire, and that a clean run's firing is no catch.

Given series shaped as a training run records them (the mean loss per step,
each rank's local gradient norm per step), the loss-spike test fires on a
spike and on a non-finite loss after its warm-up, the MAD test names the
outlying rank, and a step at which either fires on the clean reference run
is counted as its false alarm there, never as a catch in a faulted run.
"""

from __future__ import annotations

import math

from sdcguard.campaign import baselines
from sdcguard.campaign.outcome import _baselines, clean_firings

STEPS = 40


def smooth_losses() -> list[float]:
    return [2.0 - 0.01 * s + 0.001 * math.sin(s) for s in range(STEPS)]


def spread_norms() -> list[list[float]]:
    # Three ranks whose norms differ as healthy ranks' do: no outlier.
    return [[1.0 + 0.01 * s, 1.1 + 0.01 * s, 1.25 + 0.01 * s] for s in range(STEPS)]


def test_a_clean_series_fires_nothing() -> None:
    assert baselines.loss_spike(smooth_losses()) is None
    assert baselines.mad(spread_norms()) is None
    assert baselines.count_firings(smooth_losses(), spread_norms()) == {"loss_spike": 0, "mad": 0}


def test_a_spike_and_an_outlier_fire_at_their_step() -> None:
    losses = smooth_losses()
    losses[25] = 9.0
    assert baselines.loss_spike(losses) == baselines.Firing(25, [])
    assert baselines.loss_spike(losses, watch_from=26) is None
    norms = spread_norms()
    norms[30][1] = 1e4
    assert baselines.mad(norms) == baselines.Firing(30, [1])
    losses[5] = math.nan  # before the warm-up, a non-finite loss still fires
    assert baselines.loss_spike(losses) == baselines.Firing(5, [])


def test_the_loss_spike_re_arms_after_each_firing() -> None:
    losses = smooth_losses()
    losses[15] = losses[33] = 9.0
    assert baselines.firing_steps(losses, spread_norms())["loss_spike"] == {15, 33}


def test_a_step_the_clean_run_fires_at_is_no_catch() -> None:
    # Given a clean reference on which MAD fires at step 12 by chance (two ranks nearly equal),
    clean_norms = spread_norms()
    clean_norms[12] = [1.0, 1.0 + 1e-9, 1.3]
    reference = {"losses": [[v] * 3 for v in smooth_losses()], "norms": clean_norms}
    assert clean_firings(reference) == {"loss_spike": frozenset(), "mad": frozenset({12})}
    # a faulted run from step 10 that repeats the clean series until its own outlier at step 20
    norms = [list(row) for row in clean_norms[10:]]
    norms[10][2] = 1e4
    found = _baselines(10, 10, reference["losses"][10:], norms, reference, rank=2, checkpoint_every=5)
    # is caught at 20, naming rank 2, and not at 12, where it would have fired without the fault.
    assert (found["mad"].step, found["mad"].suspects, found["mad"].localized) == (20, [2], True)
    assert found["loss_spike"].caught is False
