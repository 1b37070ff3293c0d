"""The one launch of the sharded tests: 6 ranks as 3 simulated nodes of 2, and every scenario they run.

Given 6 ranks as 3 replica groups of 2 shards, each group on its own node, the
launch runs, in one process group: a scenario per fault kind (each caught at
the expected step by the detector that should see it), gradient accumulation,
two replica groups (a 2 x 3 mesh), a 1-D mesh (pure FSDP), the sharded
checkpoints (saved, resumed, refused), a clean run of ``CLEAN_STEPS`` steps
with dropout, and the reference job's loop checkpointing under HSDP (which
``test_sharded_train`` resumes through the command line). Starting 6 processes
costs more than most scenarios on a small machine, hence one launch for all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.distributed import sharded_scenarios

ROOT = Path(__file__).resolve().parents[2]
WORLD, RANKS_PER_NODE = 6, 2


def node_name(node: int) -> str:
    """The NODE_NAME the ranks of simulated node ``node`` run with."""
    return sharded_scenarios.rank_env(WORLD, RANKS_PER_NODE)[f"NODE_NAME@{node * RANKS_PER_NODE}"]


# name, injection, expected detector, step, suspects, persistence. Audits and weight checks run every 2 steps,
# so step 0 is a clean audit and a clean weight check before any fault. Every finding is confirmed by the
# ranks of the same shard position in the replica groups before and after the suspect's. repeat=2: a
# persistent fault, which also corrupts what the faulty rank recomputes (for the next replica group, and its
# own replay): "persistent"; repeat=1 hits only the rank's own pass: its replay is right, "transient".
FAULTS = [
    ("nan_activation", "kind=nan_activation,rank=3,step=1", "nonfinite_grad", 1, [3], "transient"),
    ("finite_activation", "kind=finite_activation,rank=3,step=2,factor=1e4,repeat=2", "ring_audit", 2, [3],
     "persistent"),
    ("transient_audit", "kind=finite_activation,rank=3,step=2,factor=1e4", "ring_audit", 2, [3], "transient"),
    ("grad_bitflip", "kind=grad_bitflip,rank=1,step=2,bit=22,repeat=2", "ring_audit", 2, [1], "persistent"),
    ("reduced_grad_corrupt", "kind=reduced_grad_corrupt,rank=5,step=1,factor=2", "reduced_grad", 1, [5], "unknown"),
    # The flip lands in rank 2's shard after step 1's update; the weight check at the start of step 2 sees it.
    ("weight_bitflip", "kind=weight_bitflip,rank=2,step=1,bit=22", "weight_fingerprint", 2, [2], "unknown"),
    ("node_fault", f"kind=finite_activation,node={node_name(2)},step=2,repeat=3", "ring_audit", 2, [4, 5],
     "persistent"),
]
# The magnitude trigger (after a warm-up of 3 steps) asks for a confirmation at step 5, which is no audit step.
TRIGGER_FAULTS = [
    ("trigger", "kind=finite_activation,rank=3,step=5,factor=1e4,repeat=2", "magnitude_trigger", 5, [3],
     "persistent"),
]
# Gradient accumulation (K=2): FSDP accumulates unsharded, the audit recomputes both micro-batches.
ACCUM_FAULTS = [
    ("accum_audit", "kind=finite_activation,rank=3,step=2,factor=1e4,repeat=2", "ring_audit", 2, [3], "persistent"),
]
# Two replica groups (a 2 x 3 mesh): a disagreement is detected, but with no strict majority nobody is named.
TWO_REPLICAS = [
    ("two_weight", "kind=weight_bitflip,rank=2,step=1,bit=22", "weight_fingerprint", 2, [2, 5]),
    ("two_reduced", "kind=reduced_grad_corrupt,rank=4,step=1,factor=2", "reduced_grad", 1, [1, 4]),
]
# Pure FSDP (a 1-D mesh of 6): what needs no replica.
FSDP_FAULTS = [
    ("fsdp_nan", "kind=nan_activation,rank=3,step=1", "nonfinite_grad", 1, [3], "transient"),
    ("fsdp_audit", "kind=finite_activation,rank=3,step=2,factor=1e4,repeat=2", "ring_audit", 2, [3], "persistent"),
]
UNCONFIRMED = "kind=finite_activation,rank=3,step=2,factor=1e4"
"""With confirm=False, a transient fault fails one audit pair (rank 1's of rank 3): both are named, unlocalised."""
DATA_FAULT = [1, 3, "inf"]
"""(step, rank, loss gain): a sample that makes rank 3's loss infinite at step 1, on any GPU that computes it."""
FAULT_STEPS = 4
"""Steps a fault scenario may run (each stops at its alarm, by step 2; the trigger's by step 5)."""
CLEAN_STEPS = 300
CLEAN_AUDIT_EVERY, CLEAN_FINGERPRINT_EVERY = 10, 5
CHECKPOINT_STEP, CHECKPOINT_TOTAL = 2, 4
"""The checkpoint scenarios save at step 2; the run that never stopped and the resumed one go on to step 4."""
REFERENCE_STEPS = 4
"""The reference job's loop trains this far and checkpoints there (``checkpoint_every`` = this)."""


def scenarios(tmp: Path) -> list[dict[str, Any]]:
    """Every scenario of the launch, in the order the ranks run them."""
    one, two = str(tmp / "ckpt-one"), str(tmp / "ckpt-two")
    listed: list[dict[str, Any]] = [{"name": n, "inject": i, "steps": FAULT_STEPS} for n, i, *_ in FAULTS]
    listed += [{"name": n, "inject": i, "steps": 7, "trigger_warmup": 3} for n, i, *_ in TRIGGER_FAULTS]
    listed += [{"name": "unconfirmed", "inject": UNCONFIRMED, "steps": FAULT_STEPS, "confirm": False},
               {"name": "data_fault", "poison": [DATA_FAULT], "steps": 3, "stop_at_alarm": False}]
    listed += [{"name": n, "inject": i, "steps": FAULT_STEPS, "accum": 2} for n, i, *_ in ACCUM_FAULTS]
    listed += [{"name": "accum_clean", "steps": 4, "accum": 2}]
    listed += [{"name": "products_clean", "steps": 4, "product_checks": True}]
    listed += [{"name": n, "inject": i, "steps": FAULT_STEPS, "mesh": [2, 3]} for n, i, *_ in TWO_REPLICAS]
    listed += [{"name": "fsdp_clean", "mesh": [6], "steps": 4}]
    listed += [{"name": n, "inject": i, "steps": FAULT_STEPS, "mesh": [6]} for n, i, *_ in FSDP_FAULTS]
    listed += [
        # Stop at step 2 (saved), and the run that never stopped goes on to step 4 ...
        {"name": "ckpt_first", "kind": "checkpoint", "steps": CHECKPOINT_STEP, "total": CHECKPOINT_TOTAL,
         "prefix": one},
        # ... a fresh start (other initial weights) resumes from the pointer and trains to step 4.
        {"name": "ckpt_resume", "kind": "resume", "total": CHECKPOINT_TOTAL, "prefix": one},
        {"name": "ckpt_other_mesh", "kind": "resume", "mesh": [6], "total": CHECKPOINT_TOTAL, "prefix": one},
        # A copy of those checkpoints with one byte of a shard file changed.
        {"name": "flip", "kind": "flip", "step": CHECKPOINT_STEP, "source": one, "prefix": two},
        {"name": "ckpt_refused", "kind": "resume", "total": CHECKPOINT_TOTAL, "prefix": two},
        {"name": "reference", "kind": "reference", "steps": REFERENCE_STEPS, "checkpoint_every": REFERENCE_STEPS,
         "prefix": str(tmp / "ckpt-reference")},
        {"name": "clean", "steps": CLEAN_STEPS, "audit_every": CLEAN_AUDIT_EVERY,
         "fingerprint_every": CLEAN_FINGERPRINT_EVERY, "stop_at_alarm": False},
    ]
    return listed


def run_world(tmp: Path, listed: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """Run ``listed`` on 6 ranks (forked by the scenarios' launcher); every rank's results."""
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"out_dir": str(tmp), "scenarios": listed, "world": WORLD,
                                "ranks_per_node": RANKS_PER_NODE, "timeout": timeout}))
    done = subprocess.run([sys.executable, "-m", "tests.distributed.sharded_scenarios", str(spec)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout + 60, check=False)
    assert done.returncode == 0, f"ranks failed: {done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    results = [json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    print("scenario seconds (rank 0):", {k: round(v["seconds"], 1) for k, v in results[0].items()})
    return results
