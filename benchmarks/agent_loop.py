"""The guard in the loop people run: K micro-batches, clipping, bf16 autocast and an LR schedule, against the
same loop without the guard (the "loop" part of ``./dev bench agent``).

Two gloo ranks on the CPU, each its own simulated node (so the audit runs),
one intra-op thread each; the three loops take turns one step at a time, in
an order rotated every round, as the overhead table's configurations do. The
plain loop is what ``examples/gpt_ddp_plain.py`` does: ``no_sync`` for all but
the last micro-batch, each loss divided by K, ``clip_grad_norm_``, the
optimizer, the schedule.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.interleave import launch_timed, ratio_table, timed_rounds, write_timings
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.testing.train import JobShape, SyntheticData, build, init_process_group, loss_fn, shutdown

ROWS = ("plain loop (no guard)", "guarded, defaults (audit /100, weights /10)", "guarded, audit every step")
MAX_GRAD_NORM = 1.0


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))


def _rank_main(out: str, shape: JobShape, k: int, rounds: int, spool: str) -> None:
    init_process_group()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    data = SyntheticData(shape, device)
    rank = dist.get_rank()

    def batch_for(step: int, rank: int) -> list[Any]:
        return [data(step * k + i, rank) for i in range(k)]

    steps: dict[str, Any] = {}
    for name in ROWS:
        ddp, optimizer = build(shape, device)
        scheduler = _schedule(optimizer)
        if name == ROWS[0]:
            steps[name] = _plain_step(ddp, optimizer, scheduler, batch_for, k, rank)
            continue
        config = GuardConfig(on_alarm="raise", ranks_per_node=1, threads=1, spool_dir=spool, grad_accum_steps=k,
                             max_grad_norm=MAX_GRAD_NORM, autocast_dtype="bfloat16",
                             audit_every=1 if name == ROWS[2] else 100)
        guard = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=batch_for, config=config, scheduler=scheduler,
                         injection=None)
        steps[name] = guard.step
    write_timings(out, timed_rounds(steps, rounds))
    steps.clear()
    shutdown()


def _plain_step(ddp: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler, batch_for: Any, k: int, rank: int) -> Any:
    def step(step: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(batch_for(step, rank)):
            with contextlib.nullcontext() if i == k - 1 else ddp.no_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_fn(ddp, batch)
                (loss / k).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        scheduler.step()
    return step


def loop_table(shape: JobShape, k: int, rounds: int) -> int:
    """One interleaved run of the three loops on 2 ranks; prints the rows and their ratios to the plain loop."""
    measured = launch_timed(2, _rank_main, (shape, k, rounds), "loop ranks")
    if measured is None:
        return 1
    print(f"\nthe loop people run: K={k} micro-batches, clip_grad_norm_ {MAX_GRAD_NORM}, bf16 autocast, an LR "
          f"schedule; TinyGPT dim={shape.dim} layers={shape.layers} seq={shape.seq} micro-batch={shape.batch}; "
          f"2 gloo ranks on 2 simulated nodes, 1 thread each; {rounds} rounds of one step")
    print("wall: the slower rank's time per step; cpu: both ranks' CPU time per step (work, not waiting).")
    wall = ratio_table(measured, ROWS, ROWS[0], header="loop", width=44)["wall"]
    defaults, audit = (wall[r].median / wall[ROWS[0]].median for r in ROWS[1:])
    print(f"defaults with an audit every 100 steps amortized: {defaults + (audit - 1) / 100:.3f} x the plain loop; "
          f"an audit step (it recomputes all {k} micro-batches): {audit:.3f} x")
    return 0
