"""Exact resume on the multi-process CPU job: 2N steps straight == N, checkpoint, restart from the pointer, N more.

Two gloo ranks train a tiny DDP model whose step consumes every kind of state a
checkpoint must carry: weights and AdamW moments, the torch RNG (dropout,
seeded differently per rank), Python's ``random`` (a per-step loss scale) and a
data position that advances by a step-dependent amount. The checkpoint goes to
the local stand-in's S3 through the agent's real save/load path, and the
restarted processes find it through the resume pointer alone.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sdcguard.agent import fingerprint as fp
from sdcguard.agent.checkpoint import CheckpointWriter
from sdcguard.contract.checkpoint import checkpoint_dir
from sdcguard.infra.local.standin import LocalStandIn
from sdcguard.lineage.pointer import read_pointer
from sdcguard.lineage.store import open_store
from sdcguard.lineage.verify import manifest_key, read_manifest
from tests.forked import launch_forked

WORLD = 2
N = 6
pytestmark = pytest.mark.slow


def _batch(position: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * position + rank)
    x = torch.randn(4, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def _state_hex(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    tensors = [p.detach() for p in model.parameters()]
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors += [v for _, v in sorted(optimizer.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
    return fp.to_hex(fp.combine(fp.fingerprint_many(tensors)))


def _worker(mode: str, prefix: str, env: dict[str, str], out: str) -> None:
    os.environ.update(env)
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    # A file rendezvous: no port to pick, so no race with other servers of the suite.
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous-{mode}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(100 + rank)
        random.seed(200 + rank)
        writer = CheckpointWriter(prefix, written_by=f"test rank {rank}")
        start, position = 0, 0
        result: dict[str, Any] = {}
        if mode in ("resume", "refuse"):
            try:
                loaded = writer.load(model=model, optimizer=optimizer, fingerprint_fn=lambda: _state_hex(model, optimizer))
            except Exception as exc:
                result = {"refused": type(exc).__name__, "message": str(exc)}
                loaded = None
            if loaded is not None:
                start, position = loaded.step, loaded.data_position["position"]
                result["source"] = loaded.source
        if "refused" not in result:
            stop = N if mode == "first" else 2 * N
            for step in range(start, stop):
                x, y = _batch(position, rank)
                scale = 0.5 + random.random()
                optimizer.zero_grad()
                (scale * (model(x) - y).square().mean()).backward()
                optimizer.step()
                position += 1 + step % 3
            if mode == "first":
                writer.save(N, model=model, optimizer=optimizer, fingerprint=_state_hex(model, optimizer),
                            data_position={"position": position}, last_clean_fingerprint_step=N)
            result["fingerprint"] = _state_hex(model, optimizer)
            result["position"] = position
        Path(out, f"{mode}-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _run(mode: str, prefix: str, env: dict[str, str], out: Path) -> list[dict[str, Any]]:
    # Forked by a fresh launcher (tests/forked.py): the ranks start in a fraction of a second without
    # inheriting the threads and locks of this process (the stand-in's servers run here), and a rank
    # that hangs is stopped at the time limit instead of holding the test until pytest's.
    codes = launch_forked(WORLD, _worker, (mode, prefix, env, str(out)), timeout=180)
    assert codes == [0] * WORLD, f"{mode}: ranks exited with {codes}"
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture
def job(standin: LocalStandIn) -> str:
    bucket = f"resume-{uuid.uuid4().hex[:12]}"
    s3 = standin.client("s3")
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    return f"s3://{bucket}/jobs/tiny"


def test_resume_from_the_pointer_is_bit_identical(standin: LocalStandIn, job: str, tmp_path: Path) -> None:
    straight = _run("straight", f"{job}-straight", standin.env, tmp_path)
    first = _run("first", job, standin.env, tmp_path)
    store = open_store(job, client=standin.client("s3"))
    pointer, _ = read_pointer(store)
    assert pointer is not None
    assert pointer.checkpoint == checkpoint_dir(N)
    manifest = read_manifest(store, N)
    assert manifest.world_size == WORLD
    assert manifest.fingerprint == first[0]["fingerprint"] == first[1]["fingerprint"]

    resumed = _run("resume", job, standin.env, tmp_path)

    assert [r["source"] for r in resumed] == ["pointer", "pointer"]
    assert straight[0]["position"] == resumed[0]["position"]
    assert straight[0]["fingerprint"] != first[0]["fingerprint"]
    assert [r["fingerprint"] for r in resumed] == [s["fingerprint"] for s in straight]
    assert resumed[0]["fingerprint"] == resumed[1]["fingerprint"]


def test_every_rank_refuses_a_manifest_that_lies_about_the_fingerprint(
    standin: LocalStandIn, job: str, tmp_path: Path
) -> None:
    _run("first", job, standin.env, tmp_path)
    store = open_store(job, client=standin.client("s3"))
    manifest = read_manifest(store, N)
    lie = manifest.model_copy(update={"fingerprint": "0" * len(manifest.fingerprint)})
    store.put_bytes(manifest_key(N), lie.model_dump_json().encode())

    refused = _run("refuse", job, standin.env, tmp_path)

    assert [r.get("refused") for r in refused] == ["CheckpointCorrupt", "CheckpointCorrupt"]
    assert "differs from the manifest's" in refused[0]["message"]
    assert "refusing to train" in refused[0]["message"]
