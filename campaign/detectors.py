"""Which sdcguard detectors a campaign run switches on: one ``GuardConfig`` override set per row.

Each detector alone is every other detector off; ``all`` is GuardConfig's
defaults with the campaign's cadences; ``none`` is everything off (the guard
then only all-reduces, so every configuration trains with the same
arithmetic and the runs are comparable bit for bit); ``defaults`` is
GuardConfig's defaults untouched (the soak). The per-step magnitude trigger,
when GuardConfig has one (``trigger_ratio``, 0 = off), is a row of its own
and off in the others' "alone" rows; the confirmation by recomputation
(``confirm``), when there is one, belongs to every detector and is off only
in ``none``. The product checks (``product_checks``: checksums on every
matrix product, off in GuardConfig's defaults for their cost) are rows only
when the campaign asks for them: ``product_checks`` alone, and
``all_products``, ``all`` with them on, beside ``all`` with them off.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sdcguard.agent.config import GuardConfig

SAMPLED = {"ring_audit": "audit_every", "weight_fingerprint": "fingerprint_every"}
PER_STEP = {"nonfinite": "nonfinite", "reduced_grad": "reduced_grad", "product_checks": "product_checks"}


_FIELDS = {f.name: f.default for f in dataclasses.fields(GuardConfig)}
TRIGGER = "trigger_ratio"
CONFIRM = "confirm"
PRODUCTS = "product_checks"


def has_trigger() -> bool:
    """Whether this agent has the magnitude trigger."""
    return TRIGGER in _FIELDS


def trigger_on(overrides: dict[str, Any]) -> bool:
    """Whether a configuration runs the magnitude trigger (it then needs clean history before the fault)."""
    return has_trigger() and bool(overrides.get(TRIGGER, _FIELDS[TRIGGER]))


def configs(audit_every: int, fingerprint_every: int, product_checks: bool = False) -> dict[str, dict[str, Any]]:
    """Row name -> GuardConfig overrides, in table order (``none`` first, ``all`` (and ``all_products``) last,
    then ``defaults``). ``product_checks`` adds the product checks' rows."""
    off: dict[str, Any] = {"nonfinite": False, "reduced_grad": False, "audit_every": 0, "fingerprint_every": 0}
    if has_trigger():
        off[TRIGGER] = 0.0
    if product_checks or _FIELDS[PRODUCTS]:
        off[PRODUCTS] = False
    alone = dict(off)
    if CONFIRM in _FIELDS:
        off[CONFIRM] = False
        alone[CONFIRM] = _FIELDS[CONFIRM]
    rows: dict[str, dict[str, Any]] = {"none": off}
    rows["nonfinite"] = {**alone, "nonfinite": True}
    rows["reduced_grad"] = {**alone, "reduced_grad": True}
    rows["ring_audit"] = {**alone, "audit_every": audit_every}
    rows["weight_fingerprint"] = {**alone, "fingerprint_every": fingerprint_every}
    if has_trigger():
        rows["magnitude_trigger"] = {**alone, TRIGGER: _FIELDS[TRIGGER]}
    if product_checks:
        rows["product_checks"] = {**alone, PRODUCTS: True}
    rows["all"] = {"audit_every": audit_every, "fingerprint_every": fingerprint_every}
    if product_checks:
        rows["all"][PRODUCTS] = False
        rows["all_products"] = {**rows["all"], PRODUCTS: True}
    rows["defaults"] = {}
    return rows


def last_alarm_step(overrides: dict[str, Any], start: int, end: int) -> int:
    """The last step of ``start .. end - 1`` at which a configuration can raise an alarm.

    ``end - 1`` when it runs a per-step check (non-finite gradients, reduced
    gradients, the product checks, the magnitude trigger) or no detector at all; for sampled
    detectors alone, the last step of their cadence in the range (``start - 1``
    when there is none). A faulted run may stop after it: later steps train
    what the run without detectors trains, and nothing of that configuration
    looks at them.
    """
    value = {**_FIELDS, **overrides}
    if any(value[field] for field in PER_STEP.values()) or trigger_on(overrides):
        return end - 1
    cadences = [value[field] for field in SAMPLED.values() if value[field]]
    if not cadences:
        return end - 1
    return max(max((end - 1) // every * every, start - 1) for every in cadences)


def silence_shown_by(overrides: dict[str, Any]) -> str | None:
    """Which fact of the run without detectors proves that this configuration stays silent on a fault's steps.

    ``all_finite`` for the non-finite check alone: it raises nothing while
    every rank's loss, local and reduced gradients are finite. ``reduced_identical``
    for the reduced-gradient comparison alone: it raises nothing while every
    rank receives bit-identical reduced gradients. Both read what the run
    without detectors computed (the same steps: a configuration changes no
    arithmetic of training, as the clean checks show). None for every other
    configuration: its run is trained.
    """
    value = {**_FIELDS, **overrides}
    if any(value[field] for field in SAMPLED.values()) or trigger_on(overrides):
        return None
    on = [row for row, field in PER_STEP.items() if value[field]]
    if on == ["nonfinite"]:
        return "all_finite"
    if on == ["reduced_grad"]:
        return "reduced_identical"
    return None
