"""One rank's side of the campaign: its job and data, the clean run it keeps, and a guarded run built at any
step of that clean run.

Every method that trains, gathers or writes is collective: all ranks of a
world call it in the same order.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from sdcguard.agent.checkpoint import CheckpointWriter
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.publisher import Publisher, PublishOutcome
from sdcguard.campaign.collectives import RankGroup
from sdcguard.campaign.injectors import ModelShape
from sdcguard.campaign.job import CampaignJob, built, resolve
from sdcguard.campaign.rank_plan import RankPlan
from sdcguard.campaign.records import Record
from sdcguard.campaign.trajectory import CleanTrajectory
from sdcguard.contract import Alarm


def device_for(name: str, offset: int = 0) -> torch.device:
    """``cpu``, or for ``cuda`` this rank's GPU (``offset + LOCAL_RANK``: one GPU per rank of every world,
    NCCL between a world's ranks)."""
    if name == "cuda":
        return torch.device("cuda", offset + int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


class _Silent(Publisher):
    """Publishes nothing: the campaign reads alarms from the step results."""

    def publish(self, alarm: Alarm) -> PublishOutcome:
        return PublishOutcome()


class MicroBatches:
    """The job's micro-batches on the rank's device, cached (every run of the campaign trains on the same ones)."""

    def __init__(self, job: CampaignJob, device: torch.device) -> None:
        self.source = job.batch_for
        self.device = device
        self.cache: dict[tuple[int, int], Any] = {}

    def __call__(self, step: int, rank: int) -> Any:
        key = (step, rank)
        if key not in self.cache:
            if len(self.cache) > 8192:
                self.cache.clear()
            self.cache[key] = tree_map_only(torch.Tensor, lambda t: t.to(self.device), self.source(step, rank))
        return self.cache[key]


class Rank:
    """One rank of one world (process group) of the campaign."""

    def __init__(self, plan: RankPlan, index: int = 0) -> None:
        self.plan = plan
        self.settings = plan.settings
        self.out = Path(plan.out)
        self.index = index
        """Which of the plan's worlds (process groups) this rank belongs to."""
        self.job = resolve(self.settings.job, self.settings.job_seed)
        self.device = device_for(self.settings.device, index * dist.get_world_size())
        self.group = RankGroup(self.device)
        self.rank = self.group.rank
        self.world = self.group.world
        self.data = MicroBatches(self.job, self.device)
        self.configs = plan.configs
        self.clean = CleanTrajectory()
        self.shape: ModelShape | None = None
        """What the injectors need of the model, measured on the reference's step 1."""
        self.scratch = self.out / f"scratch.{index}"

    def config(self, name: str) -> GuardConfig:
        """The guard's configuration for the row ``name``."""
        return GuardConfig(on_alarm="continue", ranks_per_node=1, seed=self.settings.job_seed,
                           spool_dir=str(self.scratch / "spool"), checkpoint_prefix=str(self.scratch / "unused"),
                           **self.configs[name])

    def guard(self, name: str, start: int | None, checkpoints: CheckpointWriter | None = None,
              ) -> tuple[SDCGuard, torch.nn.Module, torch.optim.Optimizer]:
        """A model at the reference's state at ``start`` (None: as built, for the reference itself), in DDP,
        under a guard configured as ``name``. Raises JobProblem when the job builds something unusable."""
        model, optimizer = built(self.settings.job, self.job.build(self.device), self.device)
        # DDP hands rank 0's weights to the others here; the snapshot then sets every rank's alike, so a
        # build that differs from call to call (an unseeded init) changes nothing.
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if start is not None:
            self.clean.snapshots[start].restore(model, optimizer)
        config = self.config(name)
        guard = SDCGuard(ddp, optimizer, loss_fn=self.job.loss_fn, batch_for=self.data, config=config,
                         publisher=_Silent(config), checkpoints=checkpoints)
        if guard.trigger is not None and start:
            # The trigger watches with the history the clean run gave it up to here (a job that trained from
            # step 0 would have it), not from an empty one.
            guard.trigger.load_state(self.clean.trigger[name][start])
        return guard, model, optimizer

    def write(self, record: Record) -> None:
        """(Rank 0) Append ``record`` as one line to this world's ``runs.<world>.jsonl``."""
        if self.rank == 0:
            with (self.out / f"runs.{self.index}.jsonl").open("a") as f:
                f.write(json.dumps(record.to_dict()) + "\n")

    def say(self, line: str) -> None:
        """A progress line on the launcher's standard error (rank 0 of each world)."""
        if self.rank == 0:
            print(f"coverage [group {self.index}]: {line}", file=sys.stderr, flush=True)
