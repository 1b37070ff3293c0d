"""The agent's overhead under HSDP (``./dev bench agent --sharding hsdp``): the rows of the DDP tables, each as
a ratio to the same FSDP2 loop without the guard, measured in the same run.

Four gloo ranks on the CPU as 2 replica groups of 2 shards (a ``("replicate",
"shard")`` mesh; ``fully_shard`` on each block and on the root, as
``sdcguard.agent.testing.train --sharding hsdp`` builds it), each replica group its own
simulated node, so the ring audit runs (rank (g, s) recomputes (g+1, s)); one
intra-op thread each. The configurations take turns as in the DDP table (one
burst each, in an order rotated every round), so noise falls on all alike.

Parts (``--only``): overhead (the DDP table's configurations), loop (K
micro-batches, clipping, bf16 autocast, a schedule; the plain loop uses
``set_requires_gradient_sync`` where DDP's uses ``no_sync``) and big (the
20 M+ parameter model), and tp: the same 4 ranks as 2 replicas of a TP group of
2 (a ``(2, 1, 2)`` ``("replicate", "shard", "tp")`` mesh, each block's MLP
column-/row-wise parallel, then ``fully_shard``; a TP group per simulated
node), the guard with its defaults and with an audit every step against the
same TP job unguarded. As in the DDP table, every row but the magnitude
trigger's, the forced confirmation's and the defaults has the trigger off. The
verdict and trigger-rate parts measure the DDP code paths and are not run here.
"""

from __future__ import annotations

import argparse
from typing import Any, cast

import torch
import torch.distributed as dist

from benchmarks.bench_agent import BIG, CONFIGS, TRIGGER_ROWS, overhead_figures
from benchmarks.interleave import Timings, launch_timed, plain_step, ratio_table, timed_rounds, write_timings
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.testing.train import (
    JobShape,
    SyntheticData,
    TinyGPT,
    build_sharded,
    init_process_group,
    loss_fn,
    shutdown,
)

WORLD, REPLICAS, RANKS_PER_NODE = 4, 2, 2
PLAIN = "plain FSDP2 (no guard)"
"""The baseline row: what "plain DDP" is in the DDP table."""
LOOP_ROWS = ("plain loop (no guard)", "guarded, defaults (audit /100, weights /10)", "guarded, audit every step")
TP_ROWS = ("plain FSDP2 + TP (no guard)", "guarded, defaults (audit /100, weights /10)", "guarded, audit every step")
TP = 2
"""Ranks of a TP group in the tp part (one simulated node each)."""
MAX_GRAD_NORM = 1.0


def _label(name: str) -> str:
    return PLAIN if CONFIGS.get(name, "") is None else name


def _guard(shape: JobShape, spool: str, overrides: dict[str, Any], batch_for: Any = None,
           scheduler_of: Any = None) -> tuple[Any, Any]:
    model, optimizer, mesh = build_sharded(shape, torch.device("cpu"), "hsdp", REPLICAS)
    scheduler = scheduler_of(optimizer) if scheduler_of is not None else None
    config = GuardConfig(on_alarm="raise", ranks_per_node=RANKS_PER_NODE, threads=1, spool_dir=spool, **overrides)
    guard = SDCGuard(cast("Any", model), optimizer, loss_fn=loss_fn,
                     batch_for=batch_for or SyntheticData(shape, torch.device("cpu")), config=config,
                     scheduler=scheduler, injection=None, mesh=mesh)
    return guard, scheduler


def _overhead_rank(out: str, shape: JobShape, burst: int, rounds: int, names: tuple[str, ...], spool: str) -> None:
    init_process_group()
    torch.set_num_threads(1)
    data = SyntheticData(shape, torch.device("cpu"))
    rank = dist.get_rank()
    steps: dict[str, Any] = {}
    for name in names:
        overrides = CONFIGS[name]
        if overrides is None:
            model, optimizer, _ = build_sharded(shape, torch.device("cpu"), "hsdp", REPLICAS)
            steps[name] = plain_step(model, optimizer, data, rank)
        else:
            overrides = overrides if name in TRIGGER_ROWS else {"trigger_ratio": 0.0, **overrides}
            steps[name] = _guard(shape, spool, overrides)[0].step
    write_timings(out, timed_rounds(steps, rounds, burst=burst))
    steps.clear()
    shutdown()


def _loop_rank(out: str, shape: JobShape, k: int, rounds: int, spool: str) -> None:
    init_process_group()
    torch.set_num_threads(1)
    data = SyntheticData(shape, torch.device("cpu"))
    rank = dist.get_rank()

    def batch_for(step: int, rank: int) -> list[Any]:
        return [data(step * k + i, rank) for i in range(k)]

    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))

    sharded, optimizer, _ = build_sharded(shape, torch.device("cpu"), "hsdp", REPLICAS)
    model: Any = sharded  # FSDPModule's methods (set_requires_gradient_sync)
    scheduler = schedule(optimizer)

    def plain(step: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(batch_for(step, rank)):
            model.set_requires_gradient_sync(i == k - 1)  # FSDP2's no_sync: accumulate unsharded
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model, batch)
            (loss / k).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        scheduler.step()

    steps: dict[str, Any] = {LOOP_ROWS[0]: plain}
    for name, audit_every in ((LOOP_ROWS[1], 100), (LOOP_ROWS[2], 1)):
        guard, _ = _guard(shape, spool, {"grad_accum_steps": k, "max_grad_norm": MAX_GRAD_NORM,
                                         "autocast_dtype": "bfloat16", "audit_every": audit_every},
                          batch_for=batch_for, scheduler_of=schedule)
        steps[name] = guard.step
    write_timings(out, timed_rounds(steps, rounds))
    steps.clear()
    shutdown()


def _tensor_parallel(shape: JobShape) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The reference model on a ``(world / TP, 1, TP)`` mesh: each block's MLP tensor-parallel, then
    ``fully_shard`` on the replicate and shard dims; its AdamW and the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD // TP, 1, TP), mesh_dim_names=("replicate", "shard", "tp"))
    torch.manual_seed(shape.seed)
    model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"fc": ColwiseParallel(), "out": RowwiseParallel()})
        fully_shard(block, mesh=mesh["replicate", "shard"])
    fully_shard(model, mesh=mesh["replicate", "shard"])
    return model, torch.optim.AdamW(model.parameters(), lr=shape.lr, fused=True), mesh


def _tp_rank(out: str, shape: JobShape, rounds: int, spool: str) -> None:
    init_process_group()
    torch.set_num_threads(1)
    data = SyntheticData(shape, torch.device("cpu"))
    rank = dist.get_rank()

    def batch_for(step: int, rank: int) -> Any:
        return data(step, rank // TP)  # a TP group trains on one micro-batch

    model, optimizer, _ = _tensor_parallel(shape)
    steps: dict[str, Any] = {TP_ROWS[0]: plain_step(model, optimizer, cast("Any", batch_for), rank)}
    for name, audit_every in ((TP_ROWS[1], 100), (TP_ROWS[2], 1)):
        model, optimizer, mesh = _tensor_parallel(shape)
        config = GuardConfig(on_alarm="raise", ranks_per_node=TP, threads=1, spool_dir=spool,
                             audit_every=audit_every)
        steps[name] = SDCGuard(cast("Any", model), optimizer, loss_fn=loss_fn, batch_for=batch_for, config=config,
                               injection=None, mesh=mesh).step
    write_timings(out, timed_rounds(steps, rounds))
    steps.clear()
    shutdown()


def _run(fn: Any, args: tuple[Any, ...]) -> Timings | None:
    # One seam for the tests, which hand the tables recorded timings instead of minutes of ranks.
    return launch_timed(WORLD, fn, args, "sharded ranks")


def _shape_line(shape: JobShape, rounds: int, burst: int) -> str:
    params = sum(p.numel() for p in TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq,
                                            shape.dropout).parameters())
    return (f"TinyGPT dim={shape.dim} layers={shape.layers} seq={shape.seq} batch={shape.batch} "
            f"({params / 1e6:.2f} M parameters) under HSDP: {WORLD} gloo ranks as {REPLICAS} replica groups of "
            f"{WORLD // REPLICAS} shards, one simulated node per group, 1 thread each; {rounds} rounds of "
            f"{burst}-step bursts")


def overhead_table(shape: JobShape, burst: int, rounds: int, names: tuple[str, ...]) -> int:
    """The DDP table's configurations under HSDP, as ratios to the plain FSDP2 step; 1 when the ranks failed."""
    measured = _run(_overhead_rank, (shape, burst, rounds, names))
    if measured is None:
        return 1
    print(f"\nreference job, {_shape_line(shape, rounds, burst)}")
    print("wall: the slowest rank's time per step; cpu: all ranks' CPU time per step (work, not waiting).")
    print(f"x plain: median / {PLAIN}'s median; q1: the same for the lower quartiles.")
    plain = next(n for n in names if CONFIGS[n] is None)
    stats = ratio_table(measured, names, plain, header="configuration", width=36, label=_label)
    overhead_figures(stats["wall"], plain, baseline=PLAIN,
                     confirmation="one lock-step pass per rank with 2 replica groups, 2 with 3 or more")
    return 0


def loop_table(shape: JobShape, k: int, rounds: int) -> int:
    """The loop people run, under HSDP, guarded and not; 1 when the ranks failed."""
    measured = _run(_loop_rank, (shape, k, rounds))
    if measured is None:
        return 1
    print(f"\nthe loop people run: K={k} micro-batches, clip_grad_norm_ {MAX_GRAD_NORM}, bf16 autocast, an LR "
          f"schedule; {_shape_line(shape, rounds, 1)}")
    print("wall: the slowest rank's time per step; cpu: all ranks' CPU time per step (work, not waiting).")
    wall = ratio_table(measured, LOOP_ROWS, LOOP_ROWS[0], header="loop", width=44)["wall"]
    defaults, audit = (wall[r].median / wall[LOOP_ROWS[0]].median for r in LOOP_ROWS[1:])
    print(f"defaults with an audit every 100 steps amortized: {defaults + (audit - 1) / 100:.3f} x the plain loop; "
          f"an audit step (it recomputes all {k} micro-batches): {audit:.3f} x")
    return 0


def tp_table(shape: JobShape, rounds: int) -> int:
    """The guard under tensor parallelism against the same TP job unguarded; 1 when the ranks failed."""
    measured = _run(_tp_rank, (shape, rounds))
    if measured is None:
        return 1
    params = sum(p.numel() for p in TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq,
                                            shape.dropout).parameters())
    print(f"\ntensor parallel: TinyGPT dim={shape.dim} layers={shape.layers} seq={shape.seq} batch={shape.batch} "
          f"({params / 1e6:.2f} M parameters), {WORLD} gloo ranks as {WORLD // TP} replicas of a TP group of {TP} "
          f"(each block's MLP column-/row-wise parallel, then fully_shard), one simulated node per TP group, "
          f"1 thread each; {rounds} rounds")
    print("wall: the slowest rank's time per step; cpu: all ranks' CPU time per step (work, not waiting).")
    wall = ratio_table(measured, TP_ROWS, TP_ROWS[0], header="tensor parallel", width=44)["wall"]
    defaults, audit = (wall[r].median / wall[TP_ROWS[0]].median for r in TP_ROWS[1:])
    print(f"defaults with an audit every 100 steps amortized: {defaults + (audit - 1) / 100:.3f} x the unguarded TP "
          f"job; an audit step (the TP group recomputes the next replica's micro-batch): {audit:.3f} x")
    return 0


def run_parts(args: argparse.Namespace, parts: set[str]) -> int:
    """``bench agent --sharding hsdp``: the overhead, loop and big parts under HSDP (``args`` as bench_agent
    parses them); 0, or 1 when a part's ranks failed."""
    status = 0
    for part in sorted(parts & {"verdict", "trigger"}):
        print(f"\n{part}: not run under --sharding hsdp (it measures the DDP code path; see the DDP run)")
    shape = JobShape(vocab=256, dim=args.dim, layers=args.layers, seq=args.seq, batch=args.batch)
    if "overhead" in parts:
        status |= overhead_table(shape, args.steps, args.rounds, tuple(CONFIGS))
    if "loop" in parts:
        status |= loop_table(shape, args.loop_k, args.loop_rounds)
    if "big" in parts:
        big = JobShape(vocab=256, dim=args.big_dim, layers=args.big_layers, seq=args.seq, batch=args.batch, heads=8)
        status |= overhead_table(big, 1, args.big_rounds, BIG)
    if "tp" in parts:
        status |= tp_table(shape, args.loop_rounds)
    return status
