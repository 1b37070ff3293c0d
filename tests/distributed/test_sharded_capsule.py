"""Replay capsules under HSDP and FSDP2 (issue 26): 6 ranks as 3 simulated nodes of 2, a 3 x 2 mesh (gloo, CPU).

Rank 0's hardware computes its head wrong from step 1 on (a persistent
fault); the ring audit and the confirmations on the other replica groups
localise it, so rank 1 (the lowest rank that is not a suspect) publishes. With
``capsule_factory`` set, every rank gathers the unsharded state and rank 1
writes a capsule of rank 0's step in DDP's format: the full weights as the
failing step started from them (the shards' gathered values), rank 0's
micro-batch, and the expected bits of its step recomputed on the factory's
plain model. ``sdcguard replay`` in a fresh, healthy, unsharded process gets
those bits every time; with a defective device installed it reproduces the
fault. The same on a 1-D mesh of 6 (pure FSDP). Over ``capsule_max_bytes``
the alarm says so and nothing is written; a clean run writes none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from sdcguard.agent.capsule import load_capsule
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.sharded_capsule import gather_full_state
from sdcguard.agent.testing.inject import Injection
from sdcguard.agent.testing.train import SyntheticData, init_process_group, shutdown
from sdcguard.agent.testing.train import loss_fn as next_token_loss
from sdcguard.cli import main
from tests.capsules import SHAPE, faulty_device, tiny_model
from tests.distributed.sharded_scenarios import LAUNCHER_IMPORTS, clean_env, make_mesh, rank_env
from tests.forked import launch_forked
from tests.outbox import Outbox

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
WORLD, RANKS_PER_NODE, MESH = 6, 2, (3, 2)
FACTORY = "tests.capsules:tiny_model"
FAULT = "kind=finite_activation,rank=0,step=1,factor=1e4,repeat=5"
SUSPECT, PUBLISHER, STEP = 0, 1, 1
CAPSULE = f"capsules/step-{STEP:09d}-rank-{SUSPECT:05d}"
CASES: dict[str, dict[str, Any]] = {
    "capsule": {"inject": FAULT, "cap": 10**8},
    "fsdp": {"inject": FAULT, "cap": 10**8, "mesh": [WORLD]},
    "over_cap": {"inject": FAULT, "cap": 1000},
    "clean": {"inject": None, "cap": 10**8},
}


def _run(work: str, case: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank: a fresh HSDP model and guard, up to 3 steps (stopping at the first alarm)."""
    os.makedirs(work, exist_ok=True)
    mesh = make_mesh(tuple(case.get("mesh", MESH)))
    torch.manual_seed(0)
    model, _ = tiny_model()  # the same weights on every rank
    for block in cast("Any", model).blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    config = GuardConfig(on_alarm="continue", ranks_per_node=RANKS_PER_NODE, audit_every=1, fingerprint_every=0,
                         trigger_ratio=0.0, spool_dir=os.path.join(work, "spool"),
                         checkpoint_prefix=os.path.join(work, "ckpt"), job_name="sharded-capsule-test",
                         capsule_factory=FACTORY, capsule_max_bytes=case["cap"])
    outbox = Outbox(config)
    guard = SDCGuard(cast("Any", model), optimizer, loss_fn=next_token_loss,
                     batch_for=SyntheticData(SHAPE, torch.device("cpu")), config=config, publisher=outbox,
                     injection=Injection.parse(case["inject"]) if case["inject"] else None, mesh=mesh)
    for step in range(3):
        if guard.step(step).alarm is not None:
            break
    # The update was skipped: the gathered state now is the one the failing step started from.
    state = gather_full_state(model, keep=dist.get_rank() == 0)
    return {"alarms": [a.model_dump(mode="json") for a in guard.alarms],
            "published": [a.model_dump(mode="json") for a in outbox.sent],
            "state": {k: v.reshape(-1).tolist() for k, v in state.items()}}


def ranks(out_dir: str) -> None:
    """Every rank: each case in turn, then ``out_dir/rank-R.json``."""
    init_process_group()
    rank = dist.get_rank()
    results = {}
    for name, case in CASES.items():
        results[name] = _run(os.path.join(out_dir, name), case)
        dist.barrier()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(results))
    shutdown()


@pytest.fixture(scope="module")
def hsdp_world() -> Any:
    with tempfile.TemporaryDirectory() as out:
        env = {**clean_env(), **rank_env(WORLD, RANKS_PER_NODE)}
        codes = launch_forked(WORLD, ranks, (out,), env=env, preload=(*LAUNCHER_IMPORTS, "sdcguard.agent.guard"))
        assert codes == [0] * WORLD
        yield Path(out), [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(WORLD)]


def _published(hsdp_world: Any, case: str) -> dict[str, Any]:
    """The one alarm of ``case``, as the publishing rank published it."""
    _, results = hsdp_world
    assert [len(r[case]["published"]) for r in results] == [1 if r == PUBLISHER else 0 for r in range(WORLD)]
    alarm: dict[str, Any] = results[PUBLISHER][case]["published"][0]
    assert (alarm["localized"], alarm["step"], alarm["publisher_rank"]) == (True, STEP, PUBLISHER)
    assert alarm["detector"] in ("ring_audit", "magnitude_trigger"), alarm["message"]
    assert [s["global_rank"] for s in alarm["suspects"]] == [SUSPECT]
    return alarm


def test_a_localised_alarm_under_hsdp_carries_a_capsule_of_the_full_state(hsdp_world: Any) -> None:
    out, results = hsdp_world
    alarm = _published(hsdp_world, "capsule")
    location = out / "capsule" / "ckpt" / CAPSULE
    assert f"replay capsule at {location}" in alarm["message"]
    capsule = load_capsule(str(location))
    m = capsule.manifest
    assert (m.settings.step, m.settings.rank, m.factory) == (STEP, SUSPECT, FACTORY)
    assert (m.origin["suspect_rank"], m.origin["written_by_rank"]) == (str(SUSPECT), str(PUBLISHER))
    assert m.origin["sharding"] == "HSDP, 3 replicas x 2 shards; the full state gathered"
    # The unsharded weights, bit for bit the shards' values at the start of the failing step.
    gathered = results[0]["capsule"]["state"]
    assert sorted(capsule.state) == sorted(gathered) == sorted(tiny_model()[0].state_dict())
    for name, tensor in capsule.state.items():
        assert tensor.shape == tiny_model()[0].state_dict()[name].shape
        assert torch.equal(tensor.reshape(-1), torch.tensor(gathered[name], dtype=tensor.dtype)), name
    # The suspect's own micro-batch.
    inputs, targets = SyntheticData(SHAPE, torch.device("cpu"))(STEP, SUSPECT)
    assert torch.equal(capsule.batches[0][0], inputs)
    assert torch.equal(capsule.batches[0][1], targets)


def test_the_sharded_capsule_replays_healthy_in_a_fresh_unsharded_process(hsdp_world: Any) -> None:
    out, _ = hsdp_world
    location = out / "capsule" / "ckpt" / CAPSULE
    done = subprocess.run([sys.executable, "-m", "sdcguard", "replay", str(location), "--repeat", "3", "--json",
                           "--quiet"], capture_output=True, text=True, timeout=240, cwd=ROOT, check=False,
                          env={**os.environ, **clean_env()})
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["matched"], report["reproduced"], report["outcome"]) == (3, 0, "match")


def test_the_sharded_capsule_reproduces_the_fault_on_a_defective_device(
        hsdp_world: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = hsdp_world
    with faulty_device(persistent=True):
        code = main(["replay", str(out / "capsule" / "ckpt" / CAPSULE), "--repeat", "2", "--json", "--quiet"])
    assert code == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["verdict"], report["matched"], report["reproduced"]) == ("reproduced 2/2: persistent", 0, 2)


def test_under_pure_fsdp_a_localised_alarm_writes_a_capsule_that_replays(
        hsdp_world: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = hsdp_world
    alarm = _published(hsdp_world, "fsdp")
    location = out / "fsdp" / "ckpt" / CAPSULE
    assert f"replay capsule at {location}" in alarm["message"]
    assert load_capsule(str(location)).manifest.origin["sharding"] == "FSDP, 6 shards; the full state gathered"
    assert main(["replay", str(location), "--repeat", "2", "--json", "--quiet"]) == 0
    with faulty_device(persistent=True):
        assert main(["replay", str(location), "--repeat", "2", "--json", "--quiet"]) == 1
    reports = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [(r["matched"], r["reproduced"]) for r in reports] == [(2, 0), (0, 2)]


def test_over_the_cap_under_hsdp_the_alarm_says_so_and_nothing_is_written(hsdp_world: Any) -> None:
    out, _ = hsdp_world
    alarm = _published(hsdp_world, "over_cap")
    assert "no replay capsule:" in alarm["message"]
    assert "above capsule_max_bytes (1000)" in alarm["message"]
    assert not (out / "over_cap" / "ckpt" / CAPSULE / "CAPSULE.json").exists()


def test_a_clean_hsdp_run_writes_no_capsule(hsdp_world: Any) -> None:
    out, results = hsdp_world
    assert all(r["clean"]["alarms"] == [] for r in results)
    assert not (out / "clean" / "ckpt" / "capsules").exists()
