"""The coverage campaign on a team's own model (``--job``): a 2-layer MLP with SGD, not the reference TinyGPT.

Given a small campaign (3 gloo ranks, three fault models, one fault each, a
short soak) on the MLP job of ``tests/functional/campaign_job.py``, the model
that trains must be the MLP (its layers are the ones the injectors found),
the report must name the job, the clean runs must be clean, and the faults
must fire and be judged.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from sdcguard.campaign import QUICK, run_campaign
from sdcguard.campaign.job import JobProblem

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

JOB = "tests.functional.campaign_job:mlp_job"
OWN = dataclasses.replace(QUICK, job=JOB, models=("matmul_fwd", "activation", "optimizer"), soak_steps=20)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("own-model")
    result = run_campaign(OWN, out, echo=False)
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    return out, result, records


def test_the_model_that_trained_is_the_jobs(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, _, records = campaign
    reference = next(r for r in records if r["kind"] == "reference")
    assert reference["model"] == "tests.functional.campaign_job.Mlp"
    assert reference["shape"]["linears"] == ["fc1", "fc2"]
    assert [name for name, _ in reference["shape"]["params"]] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert reference["trainable"] == 12 * 24 + 24 + 24 * 4 + 4
    # The product faults had products to pick from, in both directions: in the forward, the two layers'
    # (not the product batch_for computes its labels with, which runs before and outside the model).
    assert reference["shape"]["products"]["fwd"] == 2
    assert reference["shape"]["products"]["bwd"] > 0


def test_the_report_names_the_job(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    out, result, _ = campaign
    header = (out / "coverage.txt").read_text().splitlines()[0]
    assert f"the job {JOB} (model Mlp, 412 trainable parameters" in header
    saved = json.loads((out / "coverage.json").read_text())
    assert saved["job"] == {"spec": JOB, "seed": 0, "model": "tests.functional.campaign_job.Mlp", "trainable": 412}
    assert saved["settings"]["job"] == JOB
    assert result["job"]["spec"] == JOB


def test_the_clean_runs_are_clean(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, result, _ = campaign
    assert result["clean_ok"], result["clean_problems"]
    for name, check in result["clean_checks"]["configs"].items():
        assert check["alarms"] == [], name
        assert check["identical"], name
    assert result["clean_checks"]["restart"]["identical"]
    assert result["soak"]["false_alarms"] == 0
    assert result["soak"]["rank_steps"] == OWN.soak_steps * OWN.world


def test_the_faults_fire_and_are_judged(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, result, _ = campaign
    outcomes = result["outcomes"]
    assert sorted(o["model"] for o in outcomes) == sorted(OWN.models)
    for o in outcomes:
        assert o["fired"] > 0, o["row_id"]
        assert o["size"] in ("benign", "catastrophic", "visible", "tiny"), o["row_id"]
        assert "all" in o["detections"], o["row_id"]
    # A persistent fault in the optimizer's update leaves the replicas apart: sdcguard catches it, on the node.
    optimizer = next(o for o in outcomes if o["model"] == "optimizer")
    assert optimizer["size"] != "benign"
    caught = optimizer["detections"]["all"]
    assert caught["caught"]
    assert caught["suspects"] == [optimizer["rank"]]


def test_a_model_without_what_a_fault_model_corrupts_is_refused(tmp_path: Path) -> None:
    # What a model holds is measured by the ranks on a clean step; they stop, and the parent says why.
    spec = "tests.functional.campaign_job:scale_job"
    settings = dataclasses.replace(OWN, job=spec, models=("matmul_fwd", "activation", "weight"))
    with pytest.raises(JobProblem) as info:
        run_campaign(settings, tmp_path, echo=False)
    message = str(info.value)
    assert f"--job {spec!r}: fault model matmul_fwd: no float32 matrix product" in message
    assert f"--job {spec!r}: fault model activation: the model has no nn.Linear module" in message
    assert "fault model weight" not in message  # it has a float32 weight to corrupt
    assert not (tmp_path / "coverage.json").exists()
