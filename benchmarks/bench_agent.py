"""The agent's overhead on the reference job: plain DDP, each detector alone, and the defaults, side by side.

Two gloo ranks on the CPU, each its own simulated node (so the ring audit
runs), one intra-op thread each. Every configuration has its own model and
guard; they take turns, one short burst each (by default a single step), in
an order rotated every round, so a noisy neighbour or a slow drift of the
machine falls on all of them alike. Per configuration it reports the median
and the lower quartile of the per-step times over all rounds, and their ratios
to plain DDP (the same model, data and optimizer, no guard) from the same run:
when the two ratios agree, the figure is not an artefact of the noise.
``./dev bench agent [-- --steps N --rounds R --dim D]``; with ``--sharding hsdp``
the same rows under FSDP2 on 2 replica groups of 2 shards, as ratios to the
same FSDP2 loop without the guard (benchmarks/agent_sharded.py); there, the
part ``tp`` times the guard under tensor parallelism against the same TP job
unguarded.

Six more parts (``--only`` picks among verdict, overhead, loop, big, trigger, memory, fusion):

- verdict: the Python verdict alone at simulated worlds of 8, 1,024 and
  16,384 ranks, for a step where all agree (the all-reduced flags) and for one
  where one rank disagrees (the gathered rows judged, vectorised);
- loop: the loop people run (K = 4 micro-batches, clipping, bf16 autocast, a
  schedule) guarded, as a ratio to the same loop without the guard
  (benchmarks/agent_loop.py);
- big: plain DDP, the defaults and an audit step on a model of 20 M+
  parameters, where the fixed per-step cost no longer dominates;
- trigger: the magnitude trigger's rate on clean steps of the reference job
  in the drill's shape (3 nodes x 2 ranks, audits every 10, weights every 5);
- memory: the audit step's peak extra memory on the big model, with 1 and 4
  micro-batches per step, against the parameters' size (benchmarks/audit_memory.py);
- fusion (only when named): on the big model, the communication hook's fused
  bucket passes against one pass per result (benchmarks/agent_fusion.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.agent_fusion import fusion_table
from benchmarks.agent_loop import loop_table
from benchmarks.audit_memory import memory_table
from benchmarks.interleave import (
    Quartiles,
    launch_timed,
    plain_step,
    ratio_table,
    timed_rounds,
    write_timings,
)
from sdcguard.agent import confirm
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.nonfinite import LOCAL_ANY, LOCAL_MASK, REDUCED_FP, SUMMARY_WIDTH, judge_nonfinite
from sdcguard.agent.ring_audit import judge as judge_audit
from sdcguard.agent.testing.train import (
    JobShape,
    SyntheticData,
    build,
    init_process_group,
    launch,
    loss_fn,
    shutdown,
)
from sdcguard.agent.weights import vote

# name -> GuardConfig overrides (None: plain DDP without a guard).
CONFIGS: dict[str, dict[str, Any] | None] = {
    "plain DDP": None,
    "detector 1 (non-finite)": {"reduced_grad": False, "audit_every": 0, "fingerprint_every": 0},
    "reduced-gradient compare": {"nonfinite": False, "audit_every": 0, "fingerprint_every": 0},
    "detectors 1 + reduced (every step)": {"audit_every": 0, "fingerprint_every": 0},
    "detector 2 (audit every step)": {"nonfinite": False, "reduced_grad": False, "audit_every": 1,
                                      "fingerprint_every": 0},
    "detector 3 (weights every step)": {"nonfinite": False, "reduced_grad": False, "audit_every": 0,
                                        "fingerprint_every": 1},
    "magnitude trigger alone": {"nonfinite": False, "reduced_grad": False, "audit_every": 0,
                                "fingerprint_every": 0},
    "a confirmation every step (forced)": {"audit_every": 0, "fingerprint_every": 0, "trigger_ratio": 1.000001,
                                           "trigger_warmup": 1},
    "defaults (audit /100, weights /10)": {"audit_every": 100, "fingerprint_every": 10},
    "defaults + product checks": {"audit_every": 100, "fingerprint_every": 10, "product_checks": True},
}
# Every row but these has the magnitude trigger off, so that each row isolates one detector.
TRIGGER_ROWS = ("magnitude trigger alone", "a confirmation every step (forced)", "defaults (audit /100, weights /10)",
                "defaults + product checks")
BIG = ("plain DDP", "detector 2 (audit every step)", "defaults (audit /100, weights /10)", "defaults + product checks")


def _rank_main(out: str, shape: JobShape, steps: int, rounds: int, names: tuple[str, ...], spool: str) -> None:
    init_process_group()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    data = SyntheticData(shape, device)
    rank = dist.get_rank()
    runners: dict[str, Callable[[int], object]] = {}
    for name in names:
        overrides = CONFIGS[name]
        ddp, optimizer = build(shape, device)
        if overrides is None:
            runners[name] = plain_step(ddp, optimizer, data, rank)
        else:
            overrides = {"trigger_ratio": 0.0, **overrides} if name not in TRIGGER_ROWS else overrides
            config = GuardConfig(on_alarm="raise", ranks_per_node=1, threads=1, spool_dir=spool, **overrides)
            runners[name] = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=data, config=config,
                                     injection=None).step
    write_timings(out, timed_rounds(runners, rounds, burst=steps))
    runners.clear()
    shutdown()


def main(argv: list[str]) -> int:
    """Run the benchmark and print the tables; returns 0 (1 when the ranks failed)."""
    parser = argparse.ArgumentParser(prog="bench agent")
    parser.add_argument("--steps", type=int, default=1, help="steps per burst")
    parser.add_argument("--rounds", type=int, default=150, help="bursts per configuration")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--big-dim", type=int, default=576, help="the 20 M+ parameter model's width")
    parser.add_argument("--big-layers", type=int, default=6)
    parser.add_argument("--big-rounds", type=int, default=8)
    parser.add_argument("--trigger-steps", type=int, default=2000, help="clean steps for the trigger's rate")
    parser.add_argument("--loop-k", type=int, default=4, help="micro-batches per step in the loop part")
    parser.add_argument("--loop-rounds", type=int, default=40)
    parser.add_argument("--only", default="verdict,overhead,loop,big,trigger,memory", help="comma-separated parts to run")
    parser.add_argument("--sharding", choices=("ddp", "hsdp"), default="ddp",
                        help="hsdp: the same rows under FSDP2 on 2 replica groups of 2 shards, as ratios to the same "
                             "FSDP2 loop without the guard (benchmarks/agent_sharded.py)")
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    if unknown := parts - {"verdict", "overhead", "loop", "big", "trigger", "memory", "fusion", "tp"}:
        parser.error(f"--only: unknown part(s) {sorted(unknown)}")
    if args.steps < 1 or min(args.rounds, args.big_rounds, args.loop_rounds) < 4 or args.loop_k < 1:
        parser.error("--steps and --loop-k must be at least 1, --rounds, --big-rounds and --loop-rounds at least 4 "
                     "(quartiles need data)")
    if args.sharding == "hsdp":
        from benchmarks.agent_sharded import run_parts

        return run_parts(args, parts)
    status = 0
    if "verdict" in parts:
        verdict_table()
    if "overhead" in parts:
        shape = JobShape(vocab=256, dim=args.dim, layers=args.layers, seq=args.seq, batch=args.batch)
        status |= overhead_table(shape, args.steps, args.rounds, tuple(CONFIGS))
    if "loop" in parts:
        shape = JobShape(vocab=256, dim=args.dim, layers=args.layers, seq=args.seq, batch=args.batch)
        status |= loop_table(shape, args.loop_k, args.loop_rounds)
    if "big" in parts:
        shape = JobShape(vocab=256, dim=args.big_dim, layers=args.big_layers, seq=args.seq, batch=args.batch,
                         heads=8)
        status |= overhead_table(shape, 1, args.big_rounds, BIG)
    if "memory" in parts:
        status |= memory_table(JobShape(vocab=256, dim=args.big_dim, layers=args.big_layers, seq=args.seq,
                                        batch=args.batch, heads=8))
    if "fusion" in parts:
        shape = JobShape(vocab=256, dim=args.big_dim, layers=args.big_layers, seq=args.seq, batch=args.batch,
                         heads=8)
        status |= fusion_table(shape, args.big_rounds)
    if "trigger" in parts and args.trigger_steps:
        status |= trigger_rate(args.trigger_steps)
    return status


def overhead_table(shape: JobShape, steps: int, rounds: int, names: tuple[str, ...]) -> int:
    """One interleaved run of ``names`` on 2 ranks; prints the table and the derived figures."""
    measured = launch_timed(2, _rank_main, (shape, steps, rounds, names), "ranks")
    if measured is None:
        return 1
    params = sum(p.numel() for p in build_params(shape))
    print(f"\nreference job: TinyGPT dim={shape.dim} layers={shape.layers} seq={shape.seq} batch={shape.batch} "
          f"({params / 1e6:.2f} M parameters), 2 gloo ranks on 2 simulated nodes, 1 thread each; "
          f"{rounds} rounds of {steps}-step bursts")
    print("wall: the slower rank's time per step; cpu: both ranks' CPU time per step, all threads (work, not waiting).")
    print("x plain: median / plain DDP's median; q1: the same for the lower quartiles.")
    stats = ratio_table(measured, names, "plain DDP", header="configuration", width=36)
    overhead_figures(stats["wall"], "plain DDP", confirmation="1 recomputation per rank with 2 nodes, 2 with 3 or more",
                     defaults_target=" (target <= 1.03)")
    return 0


def overhead_figures(wall: Mapping[str, Quartiles], plain: str, *, confirmation: str, baseline: str | None = None,
                     defaults_target: str = "") -> None:
    """Print what the overhead table's rows add up to, as ratios of their median wall times to ``plain``'s
    (named ``baseline`` in the text, by default ``plain``): with every configuration, the defaults amortized from their parts against
    measured directly, detector 1 alone and a confirmation (what one takes: ``confirmation``); with the big
    model's rows only, the defaults measured (then ``defaults_target``) and with their audits amortized; and
    an audit step. Raises ``KeyError`` when ``wall`` lacks plain, the defaults or the audit row."""
    baseline = baseline or plain
    ratio = {name: quartiles.median / wall[plain].median for name, quartiles in wall.items()}
    defaults = ratio["defaults (audit /100, weights /10)"]
    audit = ratio["detector 2 (audit every step)"]
    if "detector 3 (weights every step)" in ratio:
        amortized = (ratio["detectors 1 + reduced (every step)"] + (ratio["magnitude trigger alone"] - 1)
                     + (audit - 1) / 100 + (ratio["detector 3 (weights every step)"] - 1) / 10)
        print(f"defaults amortized from the parts: {amortized:.3f} x {baseline}; measured directly: {defaults:.3f} x")
        print(f"detector 1 alone: {ratio['detector 1 (non-finite)']:.3f} x (target <= 1.05)")
        cost = ratio["a confirmation every step (forced)"] - ratio["magnitude trigger alone"]
        print(f"a confirmation ({confirmation}): +{cost:.3f} x a plain step")
    else:
        # Too few steps here to reach an audit or a weight check on the defaults: they are amortized.
        print(f"defaults, measured (steps without an audit or weight check): {defaults:.3f} x {baseline}"
              f"{defaults_target}; with an audit every 100 steps amortized: {defaults + (audit - 1) / 100:.3f} x")
    print(f"an audit step vs a plain step: {audit:.3f} x (target <= 2.05)")
    if "defaults + product checks" in ratio:
        added = ratio["defaults + product checks"] / defaults - 1
        print(f"product checks on top of the defaults: {ratio['defaults + product checks']:.3f} x {baseline}, "
              f"{added:+.1%} over the defaults (target <= +5 %)")


def verdict_table(worlds: tuple[int, ...] = (8, 1024, 16384), ranks_per_node: int = 8, params: int = 64) -> None:
    """Time the Python verdict alone at simulated worlds: all agree, and one rank disagrees."""
    print(f"\nverdict at simulated worlds ({ranks_per_node} ranks per node, {params} parameters; "
          "median of 20 calls, ms)")
    print(f"| {'world':>6} | {'all agree':>9} | {'one non-finite rank':>19} | {'one reduced-grad dissenter':>26} | "
          f"{'one failed audit pair':>21} | {'one confirmation':>16} |")
    print(f"|{'-' * 8}|{'-' * 11}|{'-' * 21}|{'-' * 28}|{'-' * 23}|{'-' * 18}|")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the guard pins it; several threads stall on a busy machine
    try:
        rows = [(world, _verdict_row(world, ranks_per_node, params)) for world in worlds]
    finally:
        torch.set_num_threads(threads)
    for world, cells in rows:
        print(f"| {world:>6} | {cells[0]:9.3f} | {cells[1]:19.3f} | {cells[2]:26.3f} | {cells[3]:21.3f} | "
              f"{cells[4]:16.3f} |")


def _verdict_row(world: int, ranks_per_node: int, params: int) -> list[float]:
    rows = torch.zeros(world, SUMMARY_WIDTH, dtype=torch.int64)
    rows[:, REDUCED_FP] = torch.tensor([1, 2, 3])
    agree = torch.cat([torch.zeros(5, dtype=torch.int64), torch.tensor([1, 2, 3]),
                       torch.bitwise_not(torch.tensor([1, 2, 3]))])

    def all_agree() -> bool:  # what every rank does after the step's all-reduce (SDCGuard._agree)
        low = torch.bitwise_not(agree[8:])
        return not bool(agree[:5].any()) and bool((agree[5:8] == low).all())

    bad = rows.clone()
    bad[world // 2, LOCAL_ANY], bad[world // 2, LOCAL_MASK] = 1, 1
    dissent = rows[:, REDUCED_FP].clone()
    dissent[world // 3] += 1
    owners = torch.arange(world * (1 + 3 * params), dtype=torch.int64).reshape(world, -1)
    recomputed = owners[(torch.arange(world) + ranks_per_node) % world].clone()
    recomputed[5, 7] += 1
    ring = confirm.Ring.of(world, ranks_per_node)
    claims = torch.arange(world * 10, dtype=torch.int64).reshape(world, 10)
    records = torch.zeros(world, 2, 11, dtype=torch.int64)
    t = world // 2
    records[ring.confirmers(t)[0], 0, 1:] = claims[t]
    records[ring.confirmers(t)[-1], 1, 1:] = claims[t]
    return [_timed(all_agree), _timed(lambda: judge_nonfinite(bad)), _timed(lambda: vote(dissent)),
            _timed(lambda: judge_audit(owners, recomputed, ranks_per_node)),
            _timed(lambda: confirm.judge_confirmations(claims, records, {t: (confirm.NONFINITE,)}, ring))]


def _timed(fn: Any, calls: int = 20) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _trigger_rank(out: str, steps: int, spool: str) -> None:
    init_process_group()
    shape = JobShape()
    device = torch.device("cpu")
    ddp, optimizer = build(shape, device)
    config = GuardConfig(on_alarm="continue", ranks_per_node=2, audit_every=10, fingerprint_every=5, spool_dir=spool)
    guard = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=SyntheticData(shape, device), config=config,
                     injection=None)
    counts = {"triggered": 0, "confirmed_steps": 0, "alarms": 0, "data_faults": 0, "seconds": 0.0}
    started = time.perf_counter()
    for step in range(steps):
        result = guard.step(step)
        counts["triggered"] += result.triggered
        counts["confirmed_steps"] += bool(result.confirmed)
        counts["alarms"] += result.alarm is not None
        counts["data_faults"] += result.data_fault
    counts["seconds"] = time.perf_counter() - started
    Path(out, f"rank-{dist.get_rank()}.json").write_text(json.dumps(counts))
    shutdown()


def trigger_rate(steps: int) -> int:
    """The magnitude trigger on clean steps: the reference job in the drill's shape (3 nodes x 2 ranks)."""
    with tempfile.TemporaryDirectory() as tmp:
        codes = launch(6, _trigger_rank, (tmp, steps, str(Path(tmp) / "spool")),
                       env={"OMP_NUM_THREADS": "1"}, timeout=7200)
        if codes != [0] * 6:
            print(f"bench agent: trigger ranks exited with {codes}")
            return 1
        counts = [json.loads(Path(tmp, f"rank-{r}.json").read_text()) for r in range(6)]
    fired = sum(c["triggered"] for c in counts)
    confirmed = counts[0]["confirmed_steps"]
    print(f"\nmagnitude trigger on clean steps: reference job (TinyGPT {JobShape().dim}-dim, dropout "
          f"{JobShape().dropout}), 3 nodes x 2 ranks, audits /10, weights /5, {steps} steps")
    print(f"rank-steps that fired: {fired} of {6 * steps} ({100 * fired / (6 * steps):.2f} %, budget <= 1 %); "
          f"steps with a confirmation: {confirmed} ({100 * confirmed / steps:.2f} %); alarms: "
          f"{counts[0]['alarms']}; data faults: {counts[0]['data_faults']}; {counts[0]['seconds']:.0f} s")
    return 0


def build_params(shape: JobShape) -> list[torch.nn.Parameter]:
    """The reference model's parameters (to report its size)."""
    from sdcguard.agent.testing.train import TinyGPT

    return list(TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout).parameters())


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
