"""(4) Every run of one checkpoint fault: two checkpoints written with one object's byte flipped, then the
agent's verified resume and a loader that trusts the bytes.

The verified side records what sdcguard does (refuses the checkpoint, and
the pipeline's choice of an older one); the unverified side what a job
without it does (fails to load: loud; or trains on, judged like a compute
fault's run).
"""

from __future__ import annotations

import dataclasses
import io
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdcguard.agent.checkpoint import MODEL, OPTIMIZER, TRAINER, CheckpointWriter, rng_name
from sdcguard.campaign.end_state import compared
from sdcguard.campaign.faults import FaultSpec
from sdcguard.campaign.injectors import checkpoint_corrupter
from sdcguard.campaign.observers import GradNormProbe
from sdcguard.campaign.rank import Rank
from sdcguard.campaign.records import CheckpointFaultRecord, UnverifiedLoad, VerifiedResume
from sdcguard.campaign.training_run import TrainingRun
from sdcguard.contract.checkpoint import checkpoint_dir
from sdcguard.lineage.errors import CheckpointCorrupt, NoSafeCheckpoint
from sdcguard.lineage.selection import select_checkpoint
from sdcguard.lineage.store import LocalStore


def run(rank: Rank, fault: FaultSpec) -> CheckpointFaultRecord:
    """Write the corrupted checkpoints, resume from them verified and unverified; the scratch folder goes."""
    earlier, last = fault.extra["checkpoints"]
    # A rank's RNG object holds Python's random state (sdcguard.agent.checkpoint.rng_state), seeded from the OS at
    # start: its bytes, and so where the fault's byte lands, would differ from run to run. Seed it per row.
    random.seed(f"{rank.settings.seed}/{fault.row_id}/{rank.rank}")
    prefix = rank.scratch / "checkpoints" / fault.row_id.replace("/", "-")
    if rank.rank == 0:
        shutil.rmtree(prefix, ignore_errors=True)
        prefix.mkdir(parents=True)
    dist.barrier()
    fired, landed = _write_corrupted(rank, fault, prefix, earlier, last)
    verified = _verified(rank, fault, prefix, last)
    unverified = _unverified(rank, prefix, last)
    if rank.rank == 0:
        shutil.rmtree(prefix, ignore_errors=True)
    return CheckpointFaultRecord(fault=fault, fired=fired, landed=landed, verified=verified,
                                 unverified=unverified)


def _write_corrupted(rank: Rank, fault: FaultSpec, prefix: Path, earlier: int, last: int,
                     ) -> tuple[int, list[int] | None]:
    """Train from ``earlier`` to ``last``, checkpointing at both through the fault's corrupter: (corruptions,
    all ranks; where the first flipped byte landed, [object size, offset], on the rank that flipped it)."""
    corrupted = [0]
    hits: list[tuple[int, int]] = []
    writer = CheckpointWriter(str(prefix), corrupt=checkpoint_corrupter(fault, rank.rank, corrupted, hits))
    guard, _, _ = rank.guard("none", earlier, checkpoints=writer)
    guard.save_checkpoint(earlier)
    TrainingRun(guard).train(range(earlier, last))
    guard.save_checkpoint(last)
    del guard
    first = hits[0] if hits else (0, 0)
    gathered = rank.group.gather([float(corrupted[0]), float(first[0]), float(first[1])])
    fired = int(sum(r[0] for r in gathered))
    landed = next(([int(r[1]), int(r[2])] for r in gathered if r[0]), None)
    return fired, landed


def _verified(rank: Rank, fault: FaultSpec, prefix: Path, last: int) -> VerifiedResume:
    """sdcguard: the agent's verified resume, and the pipeline's choice for a restart that must not trust the
    refused checkpoint."""
    verifier, _, _ = rank.guard("all" if "all" in rank.configs else "none", 0,
                                checkpoints=CheckpointWriter(str(prefix)))
    try:
        resumed: int | None = verifier.resume_step()
        refused = None
    except CheckpointCorrupt as exc:
        resumed, refused = None, str(exc)[:300]
    del verifier
    chosen: int | None = None
    if rank.rank == 0:
        try:
            chosen = select_checkpoint(LocalStore(prefix), trusted_through_step=last).step
        except NoSafeCheckpoint:
            chosen = None
    return VerifiedResume(resumed=resumed, refused=refused, rollback_step=chosen,
                          rollback_ok=chosen is None or not fault.fires(chosen))


def _unverified(rank: Rank, prefix: Path, last: int) -> UnverifiedLoad:
    """No verification: what a loader that trusts the bytes does, and, when the load works, the training after
    it over the horizon, compared with the clean run."""
    horizon = rank.settings.horizon
    guard, module, optimizer = rank.guard("none", 0)
    problem = None
    try:
        store = LocalStore(prefix)

        def load(name: str) -> Any:
            data, _ = store.get_bytes(f"{checkpoint_dir(last)}/{name}")
            return torch.load(io.BytesIO(data), weights_only=True)

        trainer = load(TRAINER)
        module.load_state_dict(load(MODEL))
        optimizer.load_state_dict(load(OPTIMIZER))
        torch.set_rng_state(load(rng_name(rank.rank))["torch"])
        wrong_step = trainer.get("step") != last
    except Exception as exc:  # a loader without checks fails however the bytes make it fail
        problem = f"{type(exc).__name__}: {str(exc)[:200]}"
        wrong_step = False
    loud = not rank.group.all(problem is None)
    if loud:
        del guard
        return UnverifiedLoad(loud=loud, problem=problem, wrong_step=wrong_step)
    probe = GradNormProbe(module)
    training = TrainingRun(guard, probe)
    training.train(range(last, last + horizon))
    probe.remove()
    end = compared(rank, module, optimizer, last + horizon, training.losses, training.norms, last)
    # exact_final is the same on every rank (gathered): every rank takes, or skips, this collective alike.
    end = dataclasses.replace(end, exact_final=end.exact_final and not rank.group.any(wrong_step))
    del guard, training
    return UnverifiedLoad(loud=loud, problem=problem, wrong_step=wrong_step, end=end)
