"""What every rank of the campaign runs: one process per simulated node, many faults per process lifetime.

Starting processes and process groups dominates on a small machine, so the
ranks start once and then, in lockstep, run the phases (``phases/``):
(1) the clean reference run, keeping the state at the start of every step;
(2) every detector configuration on the clean run (no alarm allowed, final
state bit-identical to the reference), keeping the magnitude trigger's
history at every step, and a run restarted from a snapshot that must
reproduce the clean run; (3) the clean soak; (4) for every fault, the
faulted training with no detector (the outcome: benign or silent, and its
size; the series the baselines read), then once per detector configuration
(until its first alarm, or the last step at which it could raise one).
Every faulted run starts from the reference's state, and the trigger's
history, a few steps before its fault, since training before the fault is
the clean run.

Several process groups ("worlds", ``launch(worlds=N)``) may share the work:
each trains its own reference, the first runs the clean checks, the last the
soak, and all take the faults in plan order, each claiming the next one not
yet claimed (``fault_queue.py``). On a machine with fewer cores than ranks,
one group computes while another waits in a collective.

Rank 0 of each world appends one JSON line per finished unit to
``runs.<world>.jsonl`` (``records.py``); the parent merges and judges them
(``outcome.py``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sdcguard.agent.testing.train import WORLD_INDEX_ENV, shutdown
from sdcguard.campaign.fault_queue import FaultQueue
from sdcguard.campaign.faults import FaultSpec
from sdcguard.campaign.job import JobProblem
from sdcguard.campaign.phases import checkpoint_fault, clean_checks, compute_fault, reference, soak
from sdcguard.campaign.rank import Rank, device_for
from sdcguard.campaign.rank_plan import RankPlan
from sdcguard.campaign.records import CheckpointFaultRecord, FaultRecord

PROBLEM_EXIT_CODE = 3
"""A rank's exit status when the job cannot be measured; it leaves the reason in ``job_problem.<rank>``."""


def run_fault(rank: Rank, fault: FaultSpec, number: int, total: int) -> None:
    """Every run of one fault (the ``number``-th of ``total`` in the plan); rank 0 writes its record."""
    started = time.perf_counter()
    if fault.model == "checkpoint":
        record: CheckpointFaultRecord | FaultRecord = checkpoint_fault.run(rank, fault)
    else:
        record = compute_fault.run(rank, fault)
    record = dataclasses.replace(record, seconds=time.perf_counter() - started, world=rank.index)
    rank.write(record)
    rank.say(f"fault {number} of {total} ({fault.row_id}) in {record.seconds:.1f} s")
    gc.collect()


def rank_main(plan_path: str) -> None:
    """The entry of every spawned rank: read the plan, run its phases, leave the process group.

    When the job cannot be measured (JobProblem), the rank writes why to ``job_problem.<rank>`` in the
    plan's folder and exits with PROBLEM_EXIT_CODE, without the teardown's collectives."""
    logging.basicConfig(level=logging.CRITICAL)
    for name in ("sdcguard.agent", "sdcguard.lineage", "sdcguard.campaign"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.pop("SDCGUARD_INJECT", None)
    plan = RankPlan.read(plan_path)
    index = int(os.environ.get(WORLD_INDEX_ENV, "0"))
    device = device_for(plan.settings.device, index * int(os.environ["WORLD_SIZE"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # Every configuration must run the same kernels, the audit's or not.
    torch.use_deterministic_algorithms(True)
    try:
        rank = Rank(plan, index)
        if "faults" in plan.phases or "clean" in plan.phases:
            reference.run(rank)
    except JobProblem as exc:
        (Path(plan.out) / f"job_problem.{index}.{dist.get_rank()}").write_text(str(exc))
        raise SystemExit(PROBLEM_EXIT_CODE) from None
    if "clean" in plan.phases and index == 0:
        clean_checks.run(rank)
    if "soak" in plan.phases and index == plan.worlds - 1:
        soak.run(rank)
    if "faults" in plan.phases:
        clean_checks.trigger_histories(rank)
        queue = FaultQueue(plan.faults, rank.out / "claims", rank.group)
        for place, fault in queue.claimed():
            run_fault(rank, fault, place + 1, len(plan.faults))
    shutdown()
