"""The fault-injection campaign: plan the faults, run them on 3 simulated nodes, judge, print, write JSON and a PNG.

``run_campaign(settings, out_dir)`` is the entry for code (a CLI command can
wrap it); ``main(argv)`` is the command line (``./dev bench coverage``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sdcguard.agent.testing.train import JobShape, launch
from sdcguard.campaign import baselines, detectors, options, report
from sdcguard.campaign.faults import PERSISTENCES, FaultSpec, draw, parse_row_id, row_id
from sdcguard.campaign.job import REFERENCE_JOB, JobProblem, resolve
from sdcguard.campaign.outcome import Detection, FaultOutcome, clean_firings, judge, table
from sdcguard.campaign.rank_plan import Phase, RankPlan
from sdcguard.campaign.settings import QUICK, Settings
from sdcguard.campaign.worker import rank_main


class CampaignFailed(RuntimeError):
    """The ranks did not finish (a crash or the time limit), or the clean run was not reproducible."""


def plan(settings: Settings, replay: str | None = None) -> list[FaultSpec]:
    """Every fault of the campaign, drawn from its row id (or only ``replay``'s). ValueError for a bad row id."""
    kwargs = {"world": settings.world, "first_step": settings.first_step, "span": settings.span,
              "horizon": settings.horizon, "checkpoint_gap": settings.checkpoint_gap}
    if replay is not None:
        parse_row_id(replay)
        return [draw(settings.seed, replay, **kwargs)]
    # With fewer faults per model than persistences, the models take turns (the quick form still has each).
    turn = len(PERSISTENCES) > settings.faults_per_model
    return [draw(settings.seed, row_id(model, PERSISTENCES[(i + m * turn) % len(PERSISTENCES)], i), **kwargs)
            for m, model in enumerate(settings.models) for i in range(settings.faults_per_model)]


def run_campaign(settings: Settings, out_dir: str | Path, *, replay: str | None = None,
                 soak: bool = True, echo: bool = True) -> dict[str, Any]:
    """Run the campaign into ``out_dir`` (coverage.json, coverage.txt, coverage.png); returns the JSON's content.

    ``replay`` runs the one row with that id (no clean checks, no soak). Raises CampaignFailed
    when a rank fails or times out, or when the clean run does not reproduce
    (then every outcome would be wrong); ValueError for bad settings, among
    them ``sdcguard.campaign.job.JobProblem`` for a job that cannot be resolved (before
    any rank starts) or lacks what the fault models corrupt (found by the ranks).
    """
    resolve(settings.job, settings.job_seed)  # the ranks resolve it again; a bad one fails here, before them
    faults = plan(settings, replay)
    worlds = min(settings.worlds, len(faults))
    if settings.device == "cuda" and torch.cuda.device_count() < settings.world * worlds:
        raise ValueError(f"device: cuda needs {settings.world * worlds} GPUs (one per rank of {worlds} group(s) "
                         f"of {settings.world}; --worlds 1 needs {settings.world}), "
                         f"{torch.cuda.device_count()} visible")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = detectors.configs(settings.audit_every, settings.fingerprint_every, settings.product_checks)
    fault_configs = [n for n in configs if n not in ("none", "defaults")]
    # A replay re-runs one row of a campaign whose clean checks have passed: the reference run, then the row.
    clean: list[Phase] = ["clean"] if replay is None else []
    soaked: list[Phase] = ["soak"] if soak and replay is None and settings.soak_steps else []
    phases: list[Phase] = [*clean, "faults", *soaked]
    work = Path(tempfile.mkdtemp(prefix="sdcguard-coverage-"))
    try:
        (work / "claims").mkdir()
        rank_plan = RankPlan(settings=settings, configs=configs, fault_configs=fault_configs, phases=phases,
                             worlds=worlds, derive=settings.derive and replay is None, faults=faults,
                             out=str(work))
        (work / "plan.json").write_text(json.dumps(rank_plan.to_dict()))
        if echo:
            print(f"coverage: {len(faults)} fault(s) on {worlds} group(s) of {settings.world} ranks; a line per "
                  f"fault done follows", file=sys.stderr, flush=True)
        started = time.perf_counter()
        codes = launch(settings.world, rank_main, (str(work / "plan.json"),), timeout=settings.timeout_s,
                       worlds=worlds)
        seconds = time.perf_counter() - started
        problems = sorted({p.read_text() for p in work.glob("job_problem.*")})
        records = merged_records([work / f"runs.{w}.jsonl" for w in range(worlds)], faults)
        shutil.copy(work / "plan.json", out / "plan.json")
        if records:
            (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if problems:
        raise JobProblem("; ".join(problems))
    if any(c != 0 for c in codes):
        raise CampaignFailed(f"ranks exited with {codes} after {seconds:.0f} s "
                             f"({sum(r['kind'] in ('fault', 'checkpoint_fault') for r in records)} of "
                             f"{len(faults)} faults done); the runs so far are in {out / 'runs.jsonl'}")
    result = summarize(settings, records, fault_configs, seconds, replay)
    (out / "coverage.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "coverage.txt").write_text(result["text"] + "\n")
    outcomes = [FaultOutcome(**{**o, "detections": {k: Detection(**v) for k, v in o["detections"].items()}})
                for o in result["outcomes"]]
    report.plot(outcomes, result["rows"], settings.horizon, out / "coverage.png",
                f"sdcguard fault-injection campaign: {len(outcomes)} faults, {settings.world} nodes x 1 rank, "
                f"audit every {settings.audit_every}, weights every {settings.fingerprint_every}"
                + (", product checks" if settings.product_checks else ""))
    if echo:
        print(result["text"], flush=True)
        print(f"\nwritten: {out / 'coverage.json'}, {out / 'coverage.txt'}, {out / 'coverage.png'}", flush=True)
    if not result["clean_ok"]:
        raise CampaignFailed("the clean run did not reproduce or a detector fired on it: "
                             + "; ".join(result["clean_problems"]))
    return result


def merged_records(paths: list[Path], faults: list[FaultSpec]) -> list[dict[str, Any]]:
    """Every world's records as one run would have written them: the first world's reference, the clean
    checks, the faults in plan order, the soak; each other world's reference is kept as ``world_reference``
    for the check that every world trained the same clean run."""
    place = {f.row_id: i for i, f in enumerate(faults)}
    head: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    tail: list[dict[str, Any]] = []
    for world, path in enumerate(paths):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["kind"] in ("fault", "checkpoint_fault"):
                done.append(record)
            elif record["kind"] == "soak":
                tail.append(record)
            elif record["kind"] == "reference" and world:
                head.append({**record, "kind": "world_reference", "world": world})
            else:
                head.append(record)
    head.sort(key=lambda r: ("reference", "clean_checks", "world_reference").index(r["kind"]))
    done.sort(key=lambda r: place[r["fault"]["row_id"]])
    return head + done + tail


def summarize(settings: Settings, records: list[dict[str, Any]], fault_configs: list[str], seconds: float,
              replay: str | None) -> dict[str, Any]:
    """The JSON document: settings, clean checks, every outcome, the tables, the soak, and the printed text."""
    reference, outcomes = judge(records, settings.checkpoint_every)
    rows = ["none", "loss_spike", "mad", *fault_configs, "checkpoint_verify"]
    clean: dict[str, Any] = next((r for r in records if r["kind"] == "clean_checks"),
                                 {"configs": {}, "restart": None})
    problems = []
    for name, check in clean["configs"].items():
        if check["alarms"]:
            problems.append(f"{name} raised {len(check['alarms'])} alarm(s) on the clean run: {check['alarms'][:3]}")
        if not check["identical"]:
            problems.append(f"{name}: the clean run's final state differs from the reference's")
    if clean["restart"] is not None and not clean["restart"]["identical"]:
        problems.append("a run restarted from a snapshot does not reproduce the clean run")
    for other in (r for r in records if r["kind"] == "world_reference"):
        if (other["losses"], other["norms"]) != (reference["losses"], reference["norms"]):
            problems.append(f"process group {other['world']} trained another clean run than group 0")
    # A baseline's firings on the clean run are its false alarms, not a broken campaign: reported, and those
    # steps are no catch in a faulted run (outcome.clean_firings).
    reference_baselines = {name: len(steps) for name, steps in clean_firings(reference).items()}
    soak = next((r for r in records if r["kind"] == "soak"), None)
    soak_summary = None
    if soak is not None:
        soak_summary = {k: v for k, v in soak.items() if k not in ("mean_losses", "norms")}
        soak_summary["world"] = settings.world
        soak_summary["dropout"] = JobShape().dropout if settings.job == REFERENCE_JOB else None
        soak_summary["baselines"] = baselines.count_firings(soak["mean_losses"], soak["norms"])
        soak_summary["false_alarms"] = len(soak["alarms"])
    models = list(dict.fromkeys(o.model for o in outcomes))
    tables = {m: table([o for o in outcomes if o.model == m], rows) for m in models}
    text_parts = [
        f"sdcguard coverage campaign: {len(outcomes)} faults in {seconds:.0f} s; {settings.world} nodes x 1 rank "
        f"({'nccl, cuda' if settings.device == 'cuda' else 'gloo, cpu'}; {worlds_line(records)}), "
        f"{job_line(settings, reference)}; "
        f"faults from step {settings.first_step} to "
        f"{settings.first_step + settings.span - 1}, each run {settings.horizon} steps past its fault; "
        f"ring audit every {settings.audit_every}, weights every {settings.fingerprint_every}, "
        f"checkpoints every {settings.checkpoint_every}; "
        + ("product checks on in their rows; " if settings.product_checks else "") + f"seed {settings.seed}",
        "caught = of the silent corruptions; latency in steps after the fault's first step; localised = named "
        "exactly the faulty node; rollback ok = the checkpoint it leads to predates the fault; persist. = its "
        "transient/persistent verdict fits the fault (computation faults); on benign = alarms on faults that changed nothing",
    ]
    if problems:
        text_parts.append("CLEAN-RUN PROBLEMS (the outcomes below are not valid):\n  " + "\n  ".join(problems))
    for model in models:
        text_parts.append(report.model_table(model, [o for o in outcomes if o.model == model], rows))
    text_parts.append("silent corruptions caught, by persistence:\n" + report.persistence_table(outcomes, rows))
    if settings.product_checks:
        text_parts.append("caught at the fault's own step, later, or missed (visible: above 1e-3), by fault "
                          "model and configuration:\n" + report.own_step_table(outcomes, rows))
    if any(reference_baselines.values()):
        text_parts.append("baselines on the clean reference run (false alarms; a faulted run's firing at those "
                          "steps is no catch): " + ", ".join(f"{n} {c}" for n, c in reference_baselines.items()))
    if soak_summary is not None:
        text_parts.append(report.soak_lines(soak_summary))
    derived = derived_runs(records)
    if derived["trained"] or derived["derived"]:
        text_parts.append(
            f"detector runs: {derived['trained']} trained, {derived['derived']} derived without training (the "
            f"non-finite check alone where every loss and gradient stayed finite: {derived['all_finite']}; the "
            f"reduced-gradient comparison alone where every rank received the same reduced gradients: "
            f"{derived['reduced_identical']}; --no-derive trains them)")
    replays = {o.row_id: f"--replay {o.row_id}" for o in outcomes}
    return {
        "settings": dataclasses.asdict(settings),
        "job": {"spec": settings.job, "seed": settings.job_seed, "model": reference.get("model"),
                "trainable": reference.get("trainable")},
        "seconds": seconds,
        "replay": replay,
        "rows": rows,
        "clean_ok": not problems,
        "clean_problems": problems,
        "clean_checks": clean,
        "reference": {k: v for k, v in reference.items() if k not in ("losses", "norms")},
        "reference_baselines": reference_baselines,
        "outcomes": [o.to_dict() for o in outcomes],
        "tables": tables,
        "soak": soak_summary,
        "replays": replays,
        "detector_runs": derived,
        **({"own_step": report.own_step_rows(outcomes, rows)} if settings.product_checks else {}),
        "text": "\n\n".join(text_parts),
    }


def derived_runs(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many detector runs of the compute faults were trained, and how many derived (by the fact that
    proved them silent)."""
    runs = [run for r in records if r["kind"] == "fault" for run in r["runs"].values()]
    shown = [run.get("derived") for run in runs]
    return {"trained": shown.count(None), "derived": len(runs) - shown.count(None),
            "all_finite": shown.count("all_finite"), "reduced_identical": shown.count("reduced_identical")}


def worlds_line(records: list[dict[str, Any]]) -> str:
    """How many process groups shared the faults, as the report's header says it."""
    worlds = 1 + sum(r["kind"] == "world_reference" for r in records)
    return "one process group" if worlds == 1 else f"{worlds} process groups sharing the faults"


def job_line(settings: Settings, reference: dict[str, Any]) -> str:
    """The job as the report's header names it: its factory, and the model that trained."""
    model = str(reference.get("model") or "?").rsplit(".", 1)[-1]
    trainable = reference.get("trainable")
    size = f", {trainable:,} trainable parameters" if trainable is not None else ""
    which = "the reference job" if settings.job == REFERENCE_JOB else "the job"
    return f"{which} {settings.job} (model {model}{size}, job seed {settings.job_seed})"


def parser() -> argparse.ArgumentParser:
    """The campaign's command line (``./dev bench coverage``; ``sdcguard campaign`` has the same options)."""
    p = argparse.ArgumentParser(prog="./dev bench coverage", description=options.DESCRIPTION)
    options.add_arguments(p)
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the parsed arguments (``--quick`` first, then each option given). ValueError naming a field."""
    base = QUICK if args.quick else Settings()
    overrides: dict[str, Any] = {k: v for k, v in {
        "faults_per_model": args.faults_per_model, "horizon": args.horizon, "audit_every": args.audit_every,
        "fingerprint_every": args.fingerprint_every, "soak_steps": args.soak_steps, "seed": args.seed,
        "worlds": args.worlds, "device": args.device,
        "product_checks": True if args.product_checks else None,
        "derive": False if args.no_derive else None,
        "timeout_s": args.timeout}.items() if v is not None}
    if args.models:
        overrides["models"] = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if args.job:
        overrides["job"] = args.job
    return dataclasses.replace(base, **overrides)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: 0 when the campaign ran and its clean run was clean, 1 otherwise, 2 for bad arguments."""
    return run_from_args(parser().parse_args(argv))


def run_from_args(args: argparse.Namespace, prog: str = "coverage") -> int:
    """Run the campaign the parsed options describe; the exit code (0 ran and clean, 1 failed, 2 bad options).

    ``--job``'s module is looked for, after the installed packages, in the current directory (as
    ``python -m`` would); the ranks inherit the path."""
    if args.job and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        settings = settings_from(args)
        if args.replay:
            parse_row_id(args.replay)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        run_campaign(settings, args.out, replay=args.replay)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except CampaignFailed as exc:
        print(f"{prog}: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
