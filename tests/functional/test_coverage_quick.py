"""The coverage campaign's quick variant: its table rows are computed from real runs of the guard.

Given the quick campaign (3 gloo ranks as 3 nodes, every fault model with one
fault of each persistence, the null control, a short soak), the outcomes must
come from the runs: a fault that fires but changes nothing (the null control)
is counted benign, a configuration with every detector off raises nothing,
a detector switched on alone raises only its own alarms, the counts of every
table add up, the two process groups shared the faults (each ran once, both
trained the same clean run), a sampled detector's run ends after its last
due step, a detector's run is derived without training only where the run
without detectors proves it silent, and a row replayed from its id (one
group, which trains the trigger's clean history itself and every detector's
run) gives the same outcome. The
judging itself is shown able to say "silent" and "caught" on doctored records.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from sdcguard.campaign import QUICK, run_campaign
from sdcguard.campaign.outcome import judge_fault

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ALONE = {"nonfinite": "nonfinite_grad", "reduced_grad": "reduced_grad", "ring_audit": "ring_audit",
         "weight_fingerprint": "weight_fingerprint"}


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("coverage")
    result = run_campaign(QUICK, out, echo=False)
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    return out, result, records


def test_outputs_are_written(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    out, result, _ = campaign
    assert (out / "coverage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "coverage.json").read_text())["tables"] == result["tables"]
    text = (out / "coverage.txt").read_text()
    for model in QUICK.models:
        assert f"\n{model}: " in text
        assert result["tables"][model], model
    assert len(result["outcomes"]) == len(QUICK.models) * QUICK.faults_per_model


def test_the_clean_runs_are_clean(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, result, _ = campaign
    assert result["clean_ok"], result["clean_problems"]
    assert result["clean_checks"]["restart"]["identical"]
    assert result["soak"]["false_alarms"] == 0
    assert result["soak"]["rank_steps"] == QUICK.soak_steps * QUICK.world


def test_a_fault_that_changes_nothing_is_benign(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, result, _ = campaign
    nulls = [o for o in result["outcomes"] if o["model"] == "null"]
    assert nulls
    for o in nulls:
        assert o["fired"] > 0, o["row_id"]  # it ran...
        assert o["size"] == "benign", o["row_id"]  # ...and changed nothing
        assert not any(d["caught"] for d in o["detections"].values()), o["row_id"]


def test_a_detector_that_is_off_catches_nothing(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, result, records = campaign
    faults = [r for r in records if r["kind"] == "fault"]
    assert all(r["none"]["alarm"] is None for r in faults)
    for table in result["tables"].values():
        assert next(row for row in table if row["detector"] == "none")["caught"] == 0
    seen: set[str] = set()
    for r in faults:
        for config, detector in ALONE.items():
            alarm = r["runs"][config]["alarm"]
            if alarm is not None:
                assert alarm["detector"] == detector, (r["fault"]["row_id"], config, alarm)
                seen.add(config)
    # The check above had something to check: detectors alone did raise alarms.
    assert {"reduced_grad", "weight_fingerprint"} <= seen


def test_the_rows_add_up(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, result, _ = campaign
    outcomes = result["outcomes"]
    for model, table in result["tables"].items():
        mine = [o for o in outcomes if o["model"] == model]
        silent = [o for o in mine if o["size"] in ("catastrophic", "visible", "tiny")]
        for row in table:
            assert row["silent"] == len(silent)
            assert 0 <= row["caught"] <= row["silent"]
            assert row["localized"] <= row["caught"]
            assert row["rollback_ok"] <= row["caught"]
            assert row["persistence_right"] <= row["persistence_judged"] <= row["caught"]
            assert sum(row[f"{s}_total"] for s in ("catastrophic", "visible", "tiny")) == len(silent)
    for o in outcomes:
        for d in o["detections"].values():
            if d["caught"]:
                assert d["latency"] is not None, o["row_id"]
                assert d["latency"] >= 0, o["row_id"]
    # Silent corruptions exist and the combined detectors catch some: the counts are not stuck at zero.
    silent = [o for o in outcomes if o["size"] in ("catastrophic", "visible", "tiny")]
    assert silent
    assert any(o["detections"]["all"]["caught"] for o in silent if "all" in o["detections"])


def test_two_process_groups_shared_the_faults(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, result, records = campaign
    faults = [r for r in records if r["kind"] in ("fault", "checkpoint_fault")]
    assert sorted(r["fault"]["row_id"] for r in faults) == sorted(o["row_id"] for o in result["outcomes"])
    assert len({r["fault"]["row_id"] for r in faults}) == len(faults)  # each fault ran once
    assert {r["world"] for r in faults} == {0, 1}
    # The second group trained its own clean reference, and it is the first group's, bit for bit.
    assert [r["world"] for r in records if r["kind"] == "world_reference"] == [1]
    assert "2 process groups sharing the faults" in result["text"].splitlines()[0]


def test_a_sampled_detector_alone_stops_after_its_last_due_step(
        campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, _, records = campaign
    silent_runs = [(r, r["runs"]["weight_fingerprint"]) for r in records if r["kind"] == "fault"
                   and r["runs"]["weight_fingerprint"]["alarm"] is None and r["none"]["benign_at"] is None]
    assert silent_runs
    for record, run in silent_runs:
        end = record["end"]
        assert run["last_step"] == (end - 1) // QUICK.fingerprint_every * QUICK.fingerprint_every
        assert run["last_step"] <= record["none"]["last_step"]


def test_a_run_is_derived_only_from_the_fact_that_proves_it_silent(
        campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, result, records = campaign
    faults = [r for r in records if r["kind"] == "fault"]
    for r in faults:
        for config, fact in (("nonfinite", "all_finite"), ("reduced_grad", "reduced_identical")):
            run = r["runs"][config]
            assert run.get("derived") in (None, fact), (r["fault"]["row_id"], config)
            assert (run.get("derived") == fact) == r["none"][fact], (r["fault"]["row_id"], config)
        assert all("derived" not in r["runs"][c] for c in ("ring_audit", "weight_fingerprint", "all"))
    # The all-reduce fault is the one whose ranks received different reduced gradients: trained, and caught.
    allreduce = next(r for r in faults if r["fault"]["model"] == "allreduce")
    assert not allreduce["none"]["reduced_identical"]
    assert allreduce["runs"]["reduced_grad"]["alarm"]["detector"] == "reduced_grad"
    counts = result["detector_runs"]
    assert counts["derived"] == counts["all_finite"] + counts["reduced_identical"] > 0
    assert counts["trained"] + counts["derived"] == len(faults) * len(faults[0]["runs"])


def test_a_row_replays_from_its_id(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]],
                                  tmp_path: Path) -> None:
    _, result, records = campaign
    row = next(o for o in result["outcomes"]
               if o["size"] != "benign" and o["model"] != "checkpoint" and o["detections"]["all"]["caught"])
    record = next(r for r in records if r["kind"] == "fault" and r["fault"]["row_id"] == row["row_id"])
    assert any("derived" in run for run in record["runs"].values())  # the campaign derived some of its runs
    replayed = run_campaign(QUICK, tmp_path, replay=row["row_id"], soak=False, echo=False)["outcomes"]
    assert len(replayed) == 1
    again = replayed[0]
    for key in ("row_id", "rank", "step", "fired", "size", "weight_rel", "detections"):
        assert again[key] == row[key], key
    # ...which the replay trained: a derived run says what training it says.
    (trained,) = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()
                  if json.loads(line)["kind"] == "fault"]
    assert not any("derived" in run for run in trained["runs"].values())


def test_a_checkpoint_row_replays_from_its_id(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]],
                                             tmp_path: Path) -> None:
    # Where its flipped byte lands depends on the objects' bytes, Python's random state among them: the same
    # every run, or the row's outcome (benign, loud, silent) would change from run to run.
    _, result, records = campaign
    row = next(o for o in result["outcomes"] if o["model"] == "checkpoint")
    record = next(r for r in records if r["kind"] == "checkpoint_fault")
    again = run_campaign(QUICK, tmp_path, replay=row["row_id"], soak=False, echo=False)["outcomes"][0]
    for key in ("row_id", "rank", "fired", "size", "detections"):
        assert again[key] == row[key], key
    (replayed,) = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()
                   if json.loads(line)["kind"] == "checkpoint_fault"]
    assert record["landed"] is not None
    assert replayed["landed"] == record["landed"]  # the same object size, the same byte


def test_judging_can_say_silent_and_caught(campaign: tuple[Path, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, _, records = campaign
    reference = next(r for r in records if r["kind"] == "reference")
    benign = next(r for r in records if r["kind"] == "fault" and r["fault"]["model"] == "null")
    assert judge_fault(benign, reference, QUICK.checkpoint_every).size == "benign"
    changed = copy.deepcopy(benign)
    changed["none"]["exact_final"] = False
    changed["none"]["weight_rel"] = 0.5
    assert judge_fault(changed, reference, QUICK.checkpoint_every).size == "visible"
    changed["none"]["alarm"] = {"step": benign["fault"]["step"] + 2, "detector": "ring_audit",
                                "suspects": [benign["fault"]["rank"]], "localized": True, "rollback_ok": True}
    caught = judge_fault(changed, reference, QUICK.checkpoint_every).detections["none"]
    assert caught.caught
    assert caught.latency == 2
    assert caught.localized
