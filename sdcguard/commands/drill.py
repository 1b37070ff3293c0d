"""``sdcguard drill``: the adapter of :mod:`sdcguard.infra.drill.flow`: the whole system, end to end, on the local stand-in, from one command.

1. start the local stand-in, seed a 3-node HyperPod cluster, deploy the stack
   (the code path of ``sdcguard deploy``);
2. run the reference job fault-free (3 nodes x 2 ranks, gloo, CPU);
3. run it again with a fault on one rank's hardware: the agent detects it,
   skips the update, publishes the alarm and stops;
4. follow the incident pipeline state by state (with the replay of the
   suspect's capsule on its cordoned node: "reproduced 5/5: persistent"),
   show the incident waiting with its evidence, and approve it through
   ``sdcguard approve`` (or reject, or ask the person at the keyboard);
5. after the replacement's qualification (the capsule replayed on the new
   node), restart the job from the resume pointer on the nodes the cluster
   has now;
6. compare the recovered run's final fingerprint with the fault-free one;
7. print the timeline and the verdict; write the report directory.

With ``--chaos RATE`` that fraction of the pipeline's Kubernetes API and
SageMaker HyperPod calls fail transiently (throttling, 500, 503) from the
faulty run until the incident ends, reproducibly from ``--chaos-seed``; the
drill must still pass, and the report counts the faults and the retries that
absorbed them.

With ``--replacement-faulty`` the stand-in's replacements inherit the fault:
each fails its qualification and is cordoned, and the drill passes only if
the job never resumes onto one (a further replacement qualifies, or the
incident stops in NEEDS_ATTENTION with the job suspended).

Exit status 0 when the drill passed, 1 when a step failed (the message names it).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

from sdcguard.errors import CommandError
from sdcguard.infra.drill.failure import DrillFailed
from sdcguard.infra.drill.flow import run_drill
from sdcguard.infra.drill.job_run import Trainer, TrainerError
from sdcguard.infra.drill.options import FAULTS, SHARDINGS, Decision, DrillOptions
from sdcguard.infra.drill.report import verdict_lines
from sdcguard.infra.drill.setup import prepare
from sdcguard.infra.drill.summary import DrillSummary


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of ``sdcguard drill``."""
    defaults = DrillOptions()
    parser.add_argument("--fault", choices=FAULTS, default=defaults.fault,
                        help="the silent fault to inject (default %(default)s: a finite error the ring audit, or the magnitude trigger's confirmation, catches)")
    parser.add_argument("--fault-rank", type=int, default=defaults.fault_rank,
                        help="the rank whose GPU is faulty (default %(default)s; ranks 0-5 on 3 nodes of 2)")
    parser.add_argument("--fault-step", type=int, default=defaults.fault_step,
                        help="the first step the fault fires (default %(default)s)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps (default %(default)s)")
    decision = parser.add_mutually_exclusive_group()
    decision.add_argument("--interactive", action="store_true",
                          help="ask the person at the keyboard to approve or reject")
    decision.add_argument("--reject", action="store_true",
                          help="reject the incident as a false alarm (node released, pointer kept, job resumed)")
    parser.add_argument("--report", metavar="DIR", type=Path,
                        help="write the report here (default: a new temporary folder)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--quiet", action="store_true", help="print only the timeline and the verdict")
    output.add_argument("--json", action="store_true",
                        help="print only the JSON summary on stdout (progress goes to stderr)")
    parser.add_argument("--port", type=int, default=0, help="the stand-in's port (default: a free one)")
    parser.add_argument("--chaos", metavar="RATE", type=float, default=defaults.chaos,
                        help="fail this fraction of the pipeline's Kubernetes API and SageMaker HyperPod calls "
                             "transiently (throttling, 500, 503), e.g. 0.2 (default %(default)s: none)")
    parser.add_argument("--chaos-seed", metavar="SEED", type=int, default=defaults.chaos_seed,
                        help="which calls --chaos fails: the same seed fails the same calls (default %(default)s)")
    parser.add_argument("--sharding", choices=SHARDINGS, default=defaults.sharding,
                        help="how the job holds its weights: ddp (default) or hsdp (FSDP2, one replica group of "
                             "2 shards per node, DCP checkpoints)")
    parser.add_argument("--replacement-faulty", action="store_true",
                        help="the replacement node the stand-in hands out carries the same fault: its qualification "
                             "must fail and the job must never resume onto it (a further replacement qualifies, or "
                             "the incident stops in NEEDS_ATTENTION with the node cordoned; the verdict says which)")


def _options(args: argparse.Namespace) -> DrillOptions:
    decision: Decision = "ask" if args.interactive else "reject" if args.reject else "approve"
    return DrillOptions(fault=args.fault, fault_rank=args.fault_rank, fault_step=args.fault_step,
                        steps=args.steps, decision=decision, chaos=args.chaos, chaos_seed=args.chaos_seed,
                        sharding=args.sharding, replacement_faulty=args.replacement_faulty)


def run(args: argparse.Namespace) -> int:
    """Run the drill; 0 when it passed, 1 when a step failed. CommandError for bad options."""
    from sdcguard.cli import main
    from sdcguard.infra.local.standin import LocalStandIn, StandInError

    # moto warns about every template resource it skips; the drill's reader wants the drill.
    logging.getLogger("moto").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"moto\.")

    options = _options(args)
    try:
        options.validate()
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if args.interactive and not sys.stdin.isatty():
        raise CommandError("--interactive needs a terminal to ask on")
    report = args.report or Path(tempfile.mkdtemp(prefix="sdcguard-drill-"))
    stream = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        if not args.quiet:
            print(line, file=stream, flush=True)

    began = time.monotonic()
    summary = DrillSummary()
    failed: DrillFailed | None = None
    seconds: dict[str, float] = {}
    say("[1/7] starting the local stand-in (moto + the local EKS API server)")
    try:
        with LocalStandIn(port=args.port, replace_seconds=0.5) as standin:
            say(f"  stand-in at {standin.endpoint_url}, EKS API at {standin.eks.url if standin.eks else '?'} "
                f"({standin.startup_seconds:.1f} s)")
            # The launcher imports torch while the cluster is seeded and the stack deployed.
            trainer = Trainer(standin.env, report / "ranks.log")
            try:
                stage = prepare(standin, say=say)
                stage.operator = main  # the reviewer's commands run in this process, as typed
                trainer.wait_ready()
                seconds["set_up"] = round(time.monotonic() - began, 2)
                say(f"  set-up done in {seconds['set_up']:.1f} s")
                drill_began = time.monotonic()
                try:
                    summary = run_drill(stage, options, report, trainer=trainer, say=say)
                finally:
                    seconds["drill_after_set_up"] = round(time.monotonic() - drill_began, 2)
            except DrillFailed as exc:
                failed = exc
                summary = exc.summary or DrillSummary(verdict="FAILED", failed_step=exc.step, failure=exc.message)
            except TrainerError as exc:
                failed = DrillFailed("set-up", str(exc))
                summary = DrillSummary(verdict="FAILED", failed_step="set-up", failure=str(exc))
            finally:
                trainer.close()
                stopping = time.monotonic()
        seconds["stand_in_stop"] = round(time.monotonic() - stopping, 2)
    except StandInError as exc:
        raise CommandError(str(exc)) from None
    summary.drill_seconds = {**summary.drill_seconds, **seconds}
    document = json.dumps(summary.as_json(), indent=2, sort_keys=True, default=str)
    (report / "summary.json").write_text(document + "\n")
    if args.json:
        print(document)
    else:
        for line in verdict_lines(summary, failed.step if failed else None, failed.message if failed else None):
            print(line)
    return 1 if failed else 0

