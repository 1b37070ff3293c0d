"""The campaign's options, shared by ``./dev bench coverage`` and ``sdcguard campaign`` (no torch imported here)."""

from __future__ import annotations

import argparse

from sdcguard.campaign.faults import MODELS

DESCRIPTION = ("How much silent corruption does sdcguard catch? A fault-injection campaign on 3 simulated nodes "
               "(gloo on CPU, or one GPU per rank): every detector alone and together, and the baselines teams "
               "use today, judged on the same runs; writes coverage.txt, coverage.json and coverage.png.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the campaign's options to ``p``."""
    p.add_argument("--quick", action="store_true", help="about a minute: one fault per model and a short soak")
    p.add_argument("--out", default="build/coverage", help="output folder (default: build/coverage)")
    p.add_argument("--replay", metavar="ROW-ID", help="run only this row (e.g. matmul_fwd/transient/007), with "
                                                      "the same --job and size options as the run that listed it (the reference run and that "
                                                      "row: no clean checks, no soak)")
    p.add_argument("--job", metavar="MODULE:FUNCTION",
                   help="train your own model: a factory function(seed) -> sdcguard.campaign.job.CampaignJob (its build, "
                        "batch_for and loss_fn), importable or in the current directory (default: the reference "
                        "TinyGPT job)")
    p.add_argument("--faults-per-model", type=int, help="faults drawn per fault model (default 51)")
    p.add_argument("--models", help=f"comma-separated, of: {', '.join(MODELS)}")
    p.add_argument("--horizon", type=int, help="steps a faulted run trains from its fault (default 12)")
    p.add_argument("--audit-every", type=int,
                   help="ring audit cadence in the campaign's runs (default 10; GuardConfig's default is 100: "
                        "--audit-every 100 --fingerprint-every 10 runs under the agent's defaults)")
    p.add_argument("--fingerprint-every", type=int, help="weight fingerprint cadence (default 5; GuardConfig's is 10)")
    p.add_argument("--product-checks", action="store_true",
                   help="also run the product checks (checksums on every matrix product; off in GuardConfig's "
                        "defaults for their cost): adds the rows 'product checks' (alone) and 'all + product "
                        "checks', beside 'all sdcguard' (without them), on the same faults")
    p.add_argument("--worlds", type=int, help="process groups of 3 ranks that share the faults (default 2: on a "
                                             "machine with fewer cores than ranks one computes while another "
                                             "waits; the outcomes are the same with 1)")
    p.add_argument("--soak-steps", type=int, help="clean soak steps (x 3 ranks; default 33,334); 0 skips the soak")
    p.add_argument("--no-derive", action="store_true",
                   help="train every detector's run, also where the run without detectors already proves it silent "
                        "(every value finite for the non-finite check, identical reduced gradients for their "
                        "comparison): the same outcomes, slower")
    p.add_argument("--seed", type=int, help="the campaign seed every fault is drawn from (default 0)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="cpu (gloo, default) or cuda (a GPU per rank, NCCL)")
    p.add_argument("--timeout", type=float, help="seconds before the ranks are stopped (default 4 hours)")
