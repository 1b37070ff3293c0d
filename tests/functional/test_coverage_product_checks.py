"""The campaign with the product checks on: a transient fault in a matrix product is caught at its own step.

Given one transient bit flip (a high mantissa bit) in a forward, or a backward, matrix product of one rank,
replayed through the campaign's machinery with ``product_checks`` on (the rows ``product_checks`` alone and
``all_products``, beside ``all`` without them), the product checks raise their alarm at the fault's very
step and name the faulty node; ``all`` without them (the ring audit every 10 steps, the weight
fingerprints, the magnitude trigger) does not see it at that step. Each row is one replay: the reference
run, then every configuration's run of the fault (a few seconds of three gloo ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdcguard.campaign import Settings, run_campaign

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TINY = Settings(
    faults_per_model=1,
    models=("matmul_fwd", "matmul_bwd"),
    horizon=4,
    span=4,
    first_step=12,
    soak_steps=0,
    worlds=1,
    product_checks=True,
    timeout_s=500.0,
)
"""Faults at steps 12-15, each run 4 steps from its fault: no ring audit falls on a fault's step (every 10)."""


@pytest.mark.parametrize(
    ("row", "seed"), [("matmul_fwd/transient/000", 24), ("matmul_bwd/transient/000", 47)]
)
def test_a_transient_product_fault_is_caught_at_its_own_step_only_with_the_product_checks(
    row: str, seed: int, tmp_path: Path
) -> None:
    # Given: a seed whose draw of the row flips a high mantissa bit (below the trigger, above rounding).
    settings = Settings(**{**TINY.__dict__, "seed": seed})
    # When
    result = run_campaign(settings, tmp_path, replay=row, soak=False, echo=False)
    # Then
    (record,) = [
        json.loads(line)
        for line in (tmp_path / "runs.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "fault"
    ]
    fault = record["fault"]
    assert (fault["bit_class"], fault["persistence"]) == ("mantissa", "transient")
    assert fault["bit"] >= 20
    assert fault["step"] % settings.audit_every  # no audit on its step
    (outcome,) = result["outcomes"]
    assert outcome["fired"] == 1
    assert outcome["size"] != "benign"
    for name in ("product_checks", "all_products"):
        alarm = record["runs"][name]["alarm"]
        assert alarm is not None, name
        assert alarm["detector"] == "product_check", name
        assert alarm["step"] == fault["step"], name
        assert alarm["suspects"] == [fault["rank"]], name
        assert alarm["localized"], name
        assert outcome["detections"][name]["latency"] == 0, name
    without = record["runs"]["all"]["alarm"]
    assert without is None or without["step"] > fault["step"], without
    assert record["runs"]["all"]["fired"] == 1  # the same fault ran there
    # The report's own-step table has the rows.
    own = {(r["model"], r["detector"]): r for r in result["own_step"]}
    assert own[(fault["model"], "product_checks")]["own_step"] == 1
    assert own[(fault["model"], "all")]["own_step"] == 0
    assert "all + product checks" in result["text"]
