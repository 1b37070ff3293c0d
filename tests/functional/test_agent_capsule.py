"""The guard writes a replay capsule on a localised recomputation alarm (issue 26), on 3 simulated nodes (gloo).

Rank 1 of a 3-node world (one rank per node) computes every gradient of the
head wrong from step 1 on (a persistent fault); the ring audit and the
confirmation on the other nodes localise it. With ``capsule_factory`` set,
the publishing rank (0) writes a capsule of rank 1's step before it
publishes, and the alarm says where; ``sdcguard replay`` on it, in this
healthy process, gets the healthy bits every time, and with a faulty device
installed in the replaying process it reproduces the fault. Without a
factory, over ``capsule_max_bytes``, or where it cannot be stored, no capsule
is written and the alarm is published all the same (saying why); a clean run
writes none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.testing.inject import Injection
from sdcguard.agent.testing.train import SyntheticData, init_process_group, shutdown
from sdcguard.agent.testing.train import loss_fn as next_token_loss
from sdcguard.cli import main
from tests.capsules import SHAPE, faulty_device, tiny_model
from tests.forked import launch_forked
from tests.outbox import Outbox

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tests.capsules:tiny_model"
FAULT = "kind=grad_bitflip,rank=1,step=1,bit=22,repeat=5"
CAPSULE = "capsules/step-000000001-rank-00001"
CASES: dict[str, dict[str, Any]] = {
    "capsule": {"inject": FAULT, "factory": FACTORY},
    "no_factory": {"inject": FAULT, "factory": None},
    "over_cap": {"inject": FAULT, "factory": FACTORY, "cap": 1000},
    "store_fails": {"inject": FAULT, "factory": FACTORY, "prefix_is_a_file": True},
    "clean": {"inject": None, "factory": FACTORY},
}




def _run(work: str, case: dict[str, Any]) -> dict[str, Any]:
    os.makedirs(work, exist_ok=True)
    if case.get("prefix_is_a_file"):
        Path(work, "ckpt").write_text("not a folder")  # every object stored under it fails
    torch.manual_seed(0)
    model, _ = tiny_model()  # the same weights on every rank
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    config = GuardConfig(on_alarm="continue", ranks_per_node=1, audit_every=1, fingerprint_every=0,
                         trigger_ratio=0.0, spool_dir=os.path.join(work, "spool"),
                         checkpoint_prefix=os.path.join(work, "ckpt"), job_name="capsule-test",
                         capsule_factory=case["factory"], capsule_max_bytes=case.get("cap", 10**8))
    outbox = Outbox(config)
    guard = SDCGuard(ddp, optimizer, loss_fn=next_token_loss, batch_for=data, config=config, publisher=outbox,
                     injection=Injection.parse(case["inject"]) if case["inject"] else None)
    for step in range(3):
        if guard.step(step).alarm is not None:
            break
    return {"alarms": [a.model_dump(mode="json") for a in guard.alarms],
            "published": [a.model_dump(mode="json") for a in outbox.sent]}


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
def three() -> Any:
    with tempfile.TemporaryDirectory() as out:
        codes = launch_forked(3, ranks, (out,), preload=("sdcguard.agent.guard",))
        assert codes == [0, 0, 0]
        yield Path(out), [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(3)]


def _published(three: Any, case: str) -> dict[str, Any]:
    """The one alarm of ``case``, as rank 0 (the publisher) published it."""
    _, results = three
    published = results[0][case]["published"]
    assert len(published) == 1
    assert [len(r[case]["published"]) for r in results[1:]] == [0, 0]
    alarm: dict[str, Any] = published[0]
    assert (alarm["detector"], alarm["localized"], alarm["step"], alarm["publisher_rank"]) == ("ring_audit", True, 1, 0)
    assert [s["global_rank"] for s in alarm["suspects"]] == [1]
    return alarm


def test_a_localised_audit_alarm_carries_a_capsule_that_replays_healthy_here(three: Any) -> None:
    out, _ = three
    alarm = _published(three, "capsule")
    location = out / "capsule" / "ckpt" / CAPSULE
    assert (location / "CAPSULE.json").is_file()
    assert f"replay capsule at {location}" in alarm["message"]
    manifest = json.loads((location / "CAPSULE.json").read_text())
    assert manifest["origin"]["suspect_rank"] == "1"
    assert manifest["origin"]["detector"] == "ring_audit"
    assert (manifest["settings"]["step"], manifest["settings"]["rank"]) == (1, 1)
    # On this healthy CPU, in a fresh process: the healthy bits every time.
    done = subprocess.run([sys.executable, "-m", "sdcguard", "replay", str(location), "--repeat", "2", "--json",
                           "--quiet"], capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["matched"], report["reproduced"], report["outcome"]) == (2, 0, "match")


def test_the_capsule_reproduces_the_fault_on_a_faulty_device(three: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = three
    location = out / "capsule" / "ckpt" / CAPSULE
    with faulty_device(persistent=True):
        code = main(["replay", str(location), "--repeat", "2", "--json", "--quiet"])
    assert code == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["verdict"], report["matched"], report["reproduced"]) == ("reproduced 2/2: persistent", 0, 2)


def test_without_a_factory_the_alarm_is_published_without_a_capsule(three: Any) -> None:
    out, _ = three
    alarm = _published(three, "no_factory")
    assert "capsule" not in alarm["message"]
    assert not (out / "no_factory" / "ckpt" / "capsules").exists()


def test_over_the_cap_the_alarm_says_so_and_nothing_is_written(three: Any) -> None:
    out, _ = three
    alarm = _published(three, "over_cap")
    assert "no replay capsule:" in alarm["message"]
    assert "above capsule_max_bytes (1000)" in alarm["message"]
    assert not (out / "over_cap" / "ckpt" / CAPSULE / "CAPSULE.json").exists()


def test_a_capsule_that_cannot_be_stored_never_stops_the_alarm(three: Any) -> None:
    alarm = _published(three, "store_fails")
    assert "no replay capsule: checkpoint location" in alarm["message"]
    assert "is not a directory" in alarm["message"]


def test_a_clean_run_raises_nothing_and_writes_no_capsule(three: Any) -> None:
    out, results = three
    for rank in results:
        assert rank["clean"]["alarms"] == []
    assert not (out / "clean" / "ckpt" / "capsules").exists()
