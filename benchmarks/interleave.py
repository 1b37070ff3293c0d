"""How the agent benchmarks time rows against each other: interleaved on the ranks, read as ratios to a plain row.

A row is one way to take a training step (plain DDP or FSDP2, a plain loop,
a guarded variant of it). The rows take turns, one burst of steps each, in
an order rotated every round, each burst after a barrier, so a noisy
neighbour or a slow drift of the machine falls on all of them alike. A burst
counts as the slowest rank's wall time (``perf_counter``, the MAX over the
ranks) and all ranks' CPU time (``process_time``, the SUM: work, not
waiting), per step. Round 0 warms up (DDP rebuilds its buckets there) and is
dropped. The parent reads what rank 0 wrote and prints, per row, the median
and the lower quartile and their ratios to the plain row of the same run:
when the two ratios agree, the figure is not an artefact of the noise.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from sdcguard.agent.testing.train import SyntheticData, launch, loss_fn

Timings = dict[str, dict[str, list[float]]]
"""``{"wall" | "cpu": {row: [seconds per step, one per timed round]}}``, as rank 0 writes it."""


class Quartiles(NamedTuple):
    """A row's per-step times over the timed rounds, in seconds."""

    lower: float
    median: float


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: SyntheticData,
               rank: int) -> Callable[[int], None]:
    """The baseline row: ``model``'s training step on ``data`` without a guard (DDP's or FSDP2's own loop)."""
    def step(step: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, data(step, rank)).backward()
        optimizer.step()
    return step


def timed_rounds(steps: Mapping[str, Callable[[int], object]], rounds: int, *, burst: int = 1,
                 step_number: Callable[[int], int] | None = None,
                 before: Callable[[str], object] | None = None) -> Timings:
    """Time the rows interleaved, on every rank of the process group (all must call it with the same rows).

    ``steps`` maps a row's name to its step function, called with a step
    number; the rows take turns in its order, rotated by one every round.
    Each of ``rounds + 1`` rounds gives every row one burst of ``burst``
    steps; round 0 warms up and is not kept. A row's n-th step (from 0,
    counted per row) gets the number ``step_number(n)``, by default n.
    ``before(name)`` runs ahead of each of the row's bursts, outside the
    timed span (to switch what the row measures). Returns, per row and
    timed round, the slowest rank's wall time and all ranks' CPU time, each
    per step; raises whatever a step or the collectives raise.
    """
    number = step_number or (lambda n: n)
    taken = dict.fromkeys(steps, 0)
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for round_ in range(rounds + 1):
        shift = round_ % len(order)
        for name in order[shift:] + order[:shift]:
            step, numbers = steps[name], [number(taken[name] + i) for i in range(burst)]
            taken[name] += burst
            if before is not None:
                before(name)
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            for n in numbers:
                step(n)
            elapsed = torch.tensor([time.perf_counter() - started])
            used = torch.tensor([time.process_time() - cpu_started])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(used, op=dist.ReduceOp.SUM)
            if round_:
                wall[name].append(float(elapsed) / burst)
                cpu[name].append(float(used) / burst)
    return {"wall": wall, "cpu": cpu}


def write_timings(out: str, measured: Timings) -> None:
    """On rank 0, write ``measured`` to ``out`` for ``launch_timed`` to read; on the other ranks, nothing."""
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(measured))


def launch_timed(world: int, rank_main: Callable[..., None], args: tuple[Any, ...], what: str) -> Timings | None:
    """Run ``rank_main(out, *args, spool)`` on ``world`` gloo ranks, one OpenMP thread each, for an hour at most,
    with ``out`` and ``spool`` in a temporary directory; the timings rank 0 wrote to ``out``. When a rank
    failed, prints ``bench agent: {what} exited with`` the exit codes and returns None."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timings.json")
        codes = launch(world, rank_main, (out, *args, str(Path(tmp) / "spool")), env={"OMP_NUM_THREADS": "1"},
                       timeout=3600)
        if codes != [0] * world:
            print(f"bench agent: {what} exited with {codes}")
            return None
        measured: Timings = json.loads(Path(out).read_text())
    return measured


def ratio_table(measured: Timings, rows: Sequence[str], plain: str, *, header: str, width: int,
                label: Callable[[str], str] | None = None) -> dict[str, dict[str, Quartiles]]:
    """Print ``rows`` as a markdown table: median wall ms, x ``plain``'s median, the lower quartile x
    ``plain``'s, median CPU ms, x ``plain``'s; the first column is ``header``, ``width`` wide, and names a row
    ``label(row)`` (by default its name). Returns every measured row's quartiles per kind (wall, cpu), for the
    caller's own lines. Raises ``KeyError`` when ``plain`` or a row was not measured and
    ``statistics.StatisticsError`` when a row has too few rounds for quartiles."""
    name_of = label or (lambda row: row)
    stats = {kind: {name: Quartiles(*statistics.quantiles(times, n=4)[:2]) for name, times in series.items()}
             for kind, series in measured.items()}
    print(f"| {header:<{width}} | {'wall ms':>8} | {'x plain':>7} | {'q1 x plain':>10} | "
          f"{'cpu ms':>7} | {'x plain':>7} |")
    print(f"|{'-' * (width + 2)}|{'-' * 10}|{'-' * 9}|{'-' * 12}|{'-' * 9}|{'-' * 9}|")
    plain_wall, plain_cpu = stats["wall"][plain], stats["cpu"][plain]
    for name in rows:
        (q1, median), cpu_median = stats["wall"][name], stats["cpu"][name].median
        print(f"| {name_of(name):<{width}} | {median * 1e3:8.2f} | {median / plain_wall.median:7.3f} | "
              f"{q1 / plain_wall.lower:10.3f} | {cpu_median * 1e3:7.2f} | {cpu_median / plain_cpu.median:7.3f} |")
    return stats
