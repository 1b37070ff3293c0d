"""``sdcguard replay CAPSULE``: recompute a replay capsule on this device and compare the bits.

The adapter of :func:`sdcguard.agent.capsule_replay.replay`: it imports torch only when it
runs, prints progress on stderr and the result on stdout (with ``--json``,
one object on the last line: what the pipeline's Kubernetes Job reads from
the pod's log), and exits 0 when every repetition matched the healthy bits,
1 when any did not, 2 when the capsule cannot be used here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

DESCRIPTION = """\
Recompute the step a replay capsule holds (the weights it started from, the suspect's
micro-batches, the settings that make it bit-exact) on this machine's device, N times, and
compare each repetition's loss bits and every parameter's gradient fingerprint with the
healthy recomputation's bits that the capsule records.

A capsule is untrusted input: whoever can write the job's checkpoint prefix can write one,
and the one thing of it that runs as code is the factory it names (package.module:function,
imported and called to rebuild the model). So the factory is imported only when it is on
this replay's allow-list: the job's configured factory ($SDCGUARD_CAPSULE_FACTORY, which the
pipeline's node-check Job has from the training container), the comma-separated
$SDCGUARD_REPLAY_FACTORIES, and each --allow-factory. Any other factory is refused (exit 2,
naming it and the flag) on the manifest alone, before anything of the capsule is loaded or
imported. The capsule's digests (every object's sha256 and the manifest's own) prove it was
not changed after it was written, not who wrote it: a corrupt capsule is never replayed,
but a sound one is no more trusted for that. It is refused, too, on another kind of device
or GPU model, where the software signature differs (versions, determinism settings; checked
before the factory is imported, and again after), and when its factory does not import here.

Exit status: 0 every repetition matched (this device computes the step correctly); 1 one or
more did not (the fault reproduced here: 'reproduced k/N'); 2 the capsule cannot be used
here (the reason is printed)."""

EPILOG = """\
On the suspect node, 'reproduced N/N: persistent' is the fault again, on demand;
'reproduced 0/N' is a transient fault, or a healthy suspect. A replacement qualifies only
with 0/N (exit 0). With --json the last line of stdout is one JSON object (schema_version,
capsule, step, rank, node, host, device, repeats, matched, reproduced, outcome, exit_code,
verdict, problem, reasons, expected_loss, injection, repetitions); progress goes to stderr
(--quiet silences it).

SDCGUARD_INJECT (drills and tests: a simulated faulty GPU) acts on the replay as on the
training rank it names: this replay runs as the capsule's rank, at its step, on node
$NODE_NAME. A persistent fault covering that step corrupts every repetition; a transient one
none. It is announced on stderr and named in the report's "injection"."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add CAPSULE, ``--repeat``, ``--allow-factory``, ``--json`` and ``--quiet``."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("capsule", metavar="CAPSULE",
                        help="the capsule's folder: s3://bucket/prefix/capsules/step-S-rank-R, a local folder, "
                             "or its CAPSULE.json")
    parser.add_argument("--repeat", type=_positive, default=5, metavar="N",
                        help="recompute it N times (default: 5)")
    parser.add_argument("--allow-factory", action="append", default=[], type=_factory, metavar="MODULE:FUNCTION",
                        dest="allow_factory",
                        help="also import and call this factory if the capsule names it (repeatable; by default "
                             "only $SDCGUARD_CAPSULE_FACTORY and $SDCGUARD_REPLAY_FACTORIES are allowed). Allow "
                             "only a function you would run yourself: a capsule is untrusted input")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the last line of stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--repeat: {text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--repeat: must be >= 1, got {value}")
    return value


def _factory(text: str) -> str:
    # The capsule module's pattern, restated so that --help and argument errors need no torch import.
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", text):
        raise argparse.ArgumentTypeError(f"--allow-factory: {text!r} is not package.module:function")
    return text


def run(args: argparse.Namespace) -> int:
    """Replay the capsule; print the report; return its exit status (0 match, 1 mismatch, 2 unusable, or a
    refused allow-list setting)."""
    from sdcguard.agent.capsule_replay import FactoryAllowList, replay

    try:
        allowed = FactoryAllowList.from_env(flags=args.allow_factory)
    except ValueError as exc:
        print(f"sdcguard replay: {exc}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    report = replay(args.capsule, repeats=args.repeat, progress=progress, allowed=allowed)
    if args.json:
        print(json.dumps(report.to_dict(), separators=(",", ":")), flush=True)
        return report.exit_code
    if report.problem is not None:
        print(f"capsule {report.capsule} cannot be used here ({report.problem}):")
        for reason in report.reasons:
            print(f"  {reason}")
    else:
        print(f"capsule {report.capsule}: step {report.step}, rank {report.rank}, on {report.device}")
        if report.injection:
            print(f"  under a SIMULATED fault ({report.injection})")
        for r in report.repetitions:
            print(f"  repetition {r.index}: {'match' if r.match else 'MISMATCH'}"
                  + ("" if r.loss_match else f", loss {r.loss} (expected {report.expected_loss})")
                  + (f", {len(r.mismatched_params)} gradient(s) differ: {', '.join(r.mismatched_params[:10])}"
                     if r.mismatched_params else ""))
    print(report.verdict)
    return report.exit_code
