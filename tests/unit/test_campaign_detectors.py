"""Which steps a campaign run of one detector configuration must train, and which runs need no training.

A sampled detector alone (the ring audit, the weight fingerprint) looks only
at the steps of its cadence, so a faulted run of it may stop after the last
of those; a per-step check, the magnitude trigger, or no detector at all (the
run whose outcome is judged) trains to the end. The non-finite check alone
and the reduced-gradient comparison alone are proved silent by a fact of the
run without detectors; no other configuration is.
"""

from __future__ import annotations

from sdcguard.campaign import detectors


def test_a_sampled_detector_alone_ends_at_its_last_due_step() -> None:
    rows = detectors.configs(audit_every=10, fingerprint_every=5)
    assert detectors.last_alarm_step(rows["ring_audit"], 22, 36) == 30
    assert detectors.last_alarm_step(rows["ring_audit"], 28, 42) == 40
    assert detectors.last_alarm_step(rows["weight_fingerprint"], 22, 36) == 35
    assert detectors.last_alarm_step(rows["weight_fingerprint"], 22, 35) == 30


def test_no_due_step_in_the_range_trains_nothing() -> None:
    rows = detectors.configs(audit_every=10, fingerprint_every=5)
    assert detectors.last_alarm_step(rows["ring_audit"], 21, 29) == 20  # start - 1: no step to train


def test_per_step_checks_and_no_detector_train_to_the_end() -> None:
    rows = detectors.configs(audit_every=10, fingerprint_every=5)
    for name in ("none", "nonfinite", "reduced_grad", "all", "defaults"):
        assert detectors.last_alarm_step(rows[name], 22, 36) == 35, name
    if detectors.has_trigger():
        assert detectors.last_alarm_step(rows["magnitude_trigger"], 22, 36) == 35


def test_only_a_per_step_check_alone_is_proved_silent_by_the_run_without_detectors() -> None:
    rows = detectors.configs(audit_every=10, fingerprint_every=5)
    assert detectors.silence_shown_by(rows["nonfinite"]) == "all_finite"
    assert detectors.silence_shown_by(rows["reduced_grad"]) == "reduced_identical"
    for name in ("none", "ring_audit", "weight_fingerprint", "all", "defaults"):
        assert detectors.silence_shown_by(rows[name]) is None, name
    if detectors.has_trigger():
        assert detectors.silence_shown_by(rows["magnitude_trigger"]) is None
    # Both checks on together are neither alone.
    assert detectors.silence_shown_by({**rows["nonfinite"], "reduced_grad": True}) is None
