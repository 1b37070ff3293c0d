"""The reduced shards' non-finite check under FSDP2, in real process groups (gloo on CPU, 6 ranks).

A NaN or an infinity that appears only in one rank's reduced shard (after the
reduce-scatter and the replicas' all-reduce, every local gradient finite) is
caught at its own step and names that rank, under HSDP (a 3 x 2 mesh) and
under pure FSDP (a 1-D mesh of 6, where the shards are not fingerprinted); a
clean run of each stays silent. One launch of its own, smaller than
``sharded_world``'s.
"""

from __future__ import annotations

from typing import Any

import pytest

from sdcguard.contract import Alarm
from sdcguard.contract.alarm import NonFiniteEvidence
from tests.distributed import sharded_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# name, injection, mesh. rank 5's reduced shard of the first parameter, at step 1.
FAULTS = [
    ("reduced_nan", "kind=reduced_grad_corrupt,rank=5,step=1,factor=nan", [3, 2]),
    ("reduced_inf", "kind=reduced_grad_corrupt,rank=5,step=1,factor=inf", [3, 2]),
    ("fsdp_reduced_minus_inf", "kind=reduced_grad_corrupt,rank=5,step=1,factor=-inf", [6]),
]
CLEAN = [("hsdp_clean", [3, 2]), ("fsdp_clean", [6])]
STEPS = 4


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("sharded-nonfinite")
    listed = [{"name": n, "inject": i, "steps": STEPS, "mesh": m} for n, i, m in FAULTS]
    listed += [{"name": n, "steps": STEPS, "mesh": m, "stop_at_alarm": False} for n, m in CLEAN]
    return sharded_world.run_world(tmp, listed, timeout=500)


@pytest.mark.parametrize("name", [f[0] for f in FAULTS])
def test_a_non_finite_reduced_shard_is_caught_at_its_step_and_names_its_rank(
        world: list[dict[str, Any]], name: str) -> None:
    alarms = [Alarm.model_validate(r[name]["alarm"]) for r in world if r[name]["alarm"]]
    assert len(alarms) == sharded_world.WORLD, "every rank reaches the same verdict"
    alarm = alarms[0]
    assert alarm.detector.value == "nonfinite_grad", alarm.message
    assert alarm.step == 1
    assert alarm.suspect_ranks == [5]
    assert "the reduction delivered non-finite gradients" in alarm.message
    assert isinstance(alarm.evidence, NonFiniteEvidence)
    assert all(r[name]["alarm_step_updated"] is False and r[name]["weights_unchanged"] for r in world)


@pytest.mark.parametrize("name", [c[0] for c in CLEAN])
def test_a_clean_sharded_run_stays_silent(world: list[dict[str, Any]], name: str) -> None:
    for r in world:
        assert r[name]["alarms"] == 0
        assert r[name]["updated"] == STEPS
