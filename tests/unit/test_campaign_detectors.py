"""Which steps a campaign run of one detector configuration must train: up to the last step that can alarm.

A sampled detector alone (the ring audit, the weight fingerprint) looks only
at the steps of its cadence, so a faulted run of it may stop after the last
of those; a per-step check, the magnitude trigger, or no detector at all (the
run whose outcome is judged) trains to the end.
"""

from __future__ import annotations

from campaign import detectors


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
