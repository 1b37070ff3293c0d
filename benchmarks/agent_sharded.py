"""The agent's overhead under HSDP (``./dev bench agent --sharding hsdp``): the rows of the DDP tables, each as
a ratio to the same FSDP2 loop without the guard, measured in the same run.

Four gloo ranks on the CPU as 2 replica groups of 2 shards (a ``("replicate",
"shard")`` mesh; ``fully_shard`` on each block and on the root, as
``agent.train --sharding hsdp`` builds it), each replica group its own
simulated node, so the ring audit runs (rank (g, s) recomputes (g+1, s)); one
intra-op thread each. The configurations take turns as in the DDP table (one
burst each, in an order rotated every round), so noise falls on all alike.

Parts (``--only``): overhead (the DDP table's configurations), loop (K
micro-batches, clipping, bf16 autocast, a schedule; the plain loop uses
``set_requires_gradient_sync`` where DDP's uses ``no_sync``) and big (the
20 M+ parameter model). As in the DDP table, every row but the magnitude
trigger's, the forced confirmation's and the defaults has the trigger off. The
verdict and trigger-rate parts measure the DDP code paths and are not run here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from agent.config import GuardConfig
from agent.guard import SDCGuard
from agent.train import (
    JobShape,
    SyntheticData,
    TinyGPT,
    build_sharded,
    init_process_group,
    launch,
    loss_fn,
    shutdown,
)
from benchmarks.bench_agent import BIG, CONFIGS, TRIGGER_ROWS

WORLD, REPLICAS, RANKS_PER_NODE = 4, 2, 2
PLAIN = "plain FSDP2 (no guard)"
"""The baseline row: what "plain DDP" is in the DDP table."""
LOOP_ROWS = ("plain loop (no guard)", "guarded, defaults (audit /100, weights /10)", "guarded, audit every step")
MAX_GRAD_NORM = 1.0


def _label(name: str) -> str:
    return PLAIN if CONFIGS.get(name, "") is None else name


def _timed_rounds(steps: dict[str, Any], rounds: int, burst: int) -> dict[str, dict[str, list[float]]]:
    """Every runner ``burst`` steps at a time, in turn; per round, the slowest rank's wall time and all ranks'
    CPU time per step (round 0 warms up and is dropped)."""
    position = dict.fromkeys(steps, 0)
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for round_ in range(rounds + 1):
        shift = round_ % len(order)
        for name in order[shift:] + order[:shift]:
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            for _ in range(burst):
                steps[name](position[name])
                position[name] += 1
            elapsed = torch.tensor([time.perf_counter() - started])
            used = torch.tensor([time.process_time() - cpu_started])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(used, op=dist.ReduceOp.SUM)
            if round_:
                wall[name].append(float(elapsed) / burst)
                cpu[name].append(float(used) / burst)
    return {"wall": wall, "cpu": cpu}


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

            def plain(step: int, model: Any = model, optimizer: Any = optimizer) -> None:
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model, data(step, rank)).backward()
                optimizer.step()
            steps[name] = plain
        else:
            overrides = overrides if name in TRIGGER_ROWS else {"trigger_ratio": 0.0, **overrides}
            steps[name] = _guard(shape, spool, overrides)[0].step
    measured = _timed_rounds(steps, rounds, burst)
    if rank == 0:
        Path(out).write_text(json.dumps(measured))
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
    measured = _timed_rounds(steps, rounds, 1)
    if rank == 0:
        Path(out).write_text(json.dumps(measured))
    steps.clear()
    shutdown()


def _run(fn: Any, args: tuple[Any, ...]) -> dict[str, dict[str, list[float]]] | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timings.json")
        codes = launch(WORLD, fn, (out, *args, str(Path(tmp) / "spool")), env={"OMP_NUM_THREADS": "1"},
                       timeout=3600)
        if codes != [0] * WORLD:
            print(f"bench agent: sharded ranks exited with {codes}")
            return None
        measured: dict[str, dict[str, list[float]]] = json.loads(Path(out).read_text())
        return measured


def _medians(measured: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, tuple[float, float]]]:
    """(lower quartile, median) per kind (wall, cpu) and row."""
    return {kind: {name: tuple(statistics.quantiles(times, n=4)[:2]) for name, times in series.items()}  # type: ignore[misc]
            for kind, series in measured.items()}


def _table(stats: dict[str, dict[str, tuple[float, float]]], rows: list[str], plain: str, width: int,
           header: str = "configuration") -> None:
    print(f"| {header:<{width}} | {'wall ms':>8} | {'x plain':>7} | {'q1 x plain':>10} | "
          f"{'cpu ms':>7} | {'x plain':>7} |")
    print(f"|{'-' * (width + 2)}|{'-' * 10}|{'-' * 9}|{'-' * 12}|{'-' * 9}|{'-' * 9}|")
    plain_wall, plain_cpu = stats["wall"][plain], stats["cpu"][plain]
    for name in rows:
        label = _label(name)
        (q1, median), (_, cpu_median) = stats["wall"][name], stats["cpu"][name]
        print(f"| {label:<{width}} | {median * 1e3:8.2f} | {median / plain_wall[1]:7.3f} | "
              f"{q1 / plain_wall[0]:10.3f} | {cpu_median * 1e3:7.2f} | {cpu_median / plain_cpu[1]:7.3f} |")


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
    stats = _medians(measured)
    plain = next(n for n in names if CONFIGS[n] is None)
    _table(stats, list(names), plain, 36)
    ratio = {name: median / stats["wall"][plain][1] for name, (_, median) in stats["wall"].items()}
    audit = ratio["detector 2 (audit every step)"]
    defaults = ratio["defaults (audit /100, weights /10)"]
    if "detector 3 (weights every step)" in ratio:
        amortized = (ratio["detectors 1 + reduced (every step)"] + (ratio["magnitude trigger alone"] - 1)
                     + (audit - 1) / 100 + (ratio["detector 3 (weights every step)"] - 1) / 10)
        print(f"defaults amortized from the parts: {amortized:.3f} x {PLAIN}; measured directly: {defaults:.3f} x")
        print(f"detector 1 alone: {ratio['detector 1 (non-finite)']:.3f} x (target <= 1.05)")
        confirmation = ratio["a confirmation every step (forced)"] - ratio["magnitude trigger alone"]
        print(f"a confirmation (one lock-step pass per rank with 2 replica groups, 2 with 3 or more): "
              f"+{confirmation:.3f} x a plain step")
    else:
        print(f"defaults, measured (steps without an audit or weight check): {defaults:.3f} x {PLAIN}; "
              f"with an audit every 100 steps amortized: {defaults + (audit - 1) / 100:.3f} x")
    print(f"an audit step vs a plain step: {audit:.3f} x (target <= 2.05)")
    return 0


def loop_table(shape: JobShape, k: int, rounds: int) -> int:
    """The loop people run, under HSDP, guarded and not; 1 when the ranks failed."""
    measured = _run(_loop_rank, (shape, k, rounds))
    if measured is None:
        return 1
    print(f"\nthe loop people run: K={k} micro-batches, clip_grad_norm_ {MAX_GRAD_NORM}, bf16 autocast, an LR "
          f"schedule; {_shape_line(shape, rounds, 1)}")
    print("wall: the slowest rank's time per step; cpu: all ranks' CPU time per step (work, not waiting).")
    stats = _medians(measured)
    _table(stats, list(LOOP_ROWS), LOOP_ROWS[0], 44, header="loop")
    plain = stats["wall"][LOOP_ROWS[0]][1]
    defaults, audit = (stats["wall"][r][1] / plain for r in LOOP_ROWS[1:])
    print(f"defaults with an audit every 100 steps amortized: {defaults + (audit - 1) / 100:.3f} x the plain loop; "
          f"an audit step (it recomputes all {k} micro-batches): {audit:.3f} x")
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
    return status
