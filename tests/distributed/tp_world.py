"""The one launch of the tensor-parallel tests: 6 ranks as 3 nodes of 2, TP 2 inside each node, FSDP2 replicas.

The mesh is ``(3, 1, 2)`` named ``("replicate", "shard", "tp")``: each node
holds one replica's TP group (ranks 2n and 2n+1), each block's MLP is
column-/row-wise parallel on ``mesh["tp"]`` and ``fully_shard`` runs on
``mesh["replicate", "shard"]`` (sharded_scenarios.sharded_model). One launch
runs every scenario in one process group (the sharded world's harness,
``sharded_world.run_world``): clean runs, the unguarded job, a fault per
detector, torchtitan's dim names, no replicas (``(1, 3, 2)``), the meshes the
guard must refuse, the product checks, and a TP checkpoint saved and resumed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.distributed import sharded_world

TP_MESH = [3, 1, 2]
"""3 replicas x 1 shard x TP 2: a replica's TP group per node."""
NO_REPLICAS = [1, 3, 2]
"""FSDP (3 shards) x TP 2 on 3 nodes, no replica: detection without localisation, as for a 1-D mesh."""
TP_SITE = "blocks.0.fc"
"""The column-parallel layer whose local output shard a TP fault corrupts."""

# name, injection, detector, step, suspects, persistence. Audits and weight checks every 2 steps (step 0
# clean). A fault in one rank's TP'd layer output reaches its TP peer through the row-parallel all-reduce:
# the TP group (one node) is named. A flip of one rank's weight shard, or of its local gradients after the
# forward, stays on that rank: the rank is named.
FAULTS = [
    ("tp_weight_flip", f"kind=weight_bitflip,rank=3,step=1,bit=22,param={TP_SITE}.weight", "weight_fingerprint",
     2, [3], "unknown"),
    ("tp_layer_fault", f"kind=finite_activation,rank=3,step=2,factor=1e4,repeat=2,module={TP_SITE}",
     "ring_audit", 2, [2, 3], "persistent"),
    ("tp_layer_transient", f"kind=finite_activation,rank=3,step=2,factor=1e4,module={TP_SITE}", "ring_audit", 2,
     [2, 3], "transient"),
    ("tp_nan", f"kind=nan_activation,rank=3,step=1,module={TP_SITE}", "nonfinite_grad", 1, [2, 3], "transient"),
    ("tp_grad_flip", "kind=grad_bitflip,rank=1,step=2,bit=22,repeat=2", "ring_audit", 2, [1], "persistent"),
]
# The magnitude trigger (audits and weight checks off, a warm-up of 3 steps): the fault of rank 3's head at
# step 2 spreads to its TP peer's gradients (the column-parallel backward all-reduce); both jump at step 3.
TRIGGER = ("tp_trigger", "kind=finite_activation,rank=3,step=2,factor=1e4,repeat=2", "magnitude_trigger", 3, [2, 3],
           "persistent")
REDUCED = ("tp_reduced", "kind=reduced_grad_corrupt,rank=5,step=1,factor=2", "reduced_grad", 1, [5])
NO_REPLICA_FAULTS = [
    ("tp_fsdp_nan", f"kind=nan_activation,rank=3,step=1,module={TP_SITE}", "nonfinite_grad", 1, [2, 3],
     "transient"),
    ("tp_fsdp_layer", f"kind=finite_activation,rank=3,step=2,factor=1e4,repeat=2,module={TP_SITE}", "ring_audit",
     2, [2, 3], "persistent"),
]
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    # What the guard is handed for the TP model on (3, 1, 2), and what its error must say.
    "refuse_tp_mesh": ({"hand": "tp"}, "tensor-parallel (TP) mesh"),
    "refuse_world_tp": ({"hand": "world_tp"}, "tensor-parallel (TP) mesh of 6 ranks"),
    "refuse_fsdp_mesh": ({"hand": "fsdp"}, "the model is tensor-parallel (TP"),
    "refuse_one_rank_fsdp": ({"hand": "shard"}, "the model is tensor-parallel (TP"),
    "refuse_cp": ({"hand": ["dp_replicate", "cp", "tp"]}, "'cp' (context parallel)"),
    "refuse_across_nodes": ({"ranks_per_node": 1}, "TP group must sit inside one node"),
    "refuse_batches": ({"tp_batches_differ": True}, "batch_for"),
}
CAPSULE_FACTORY = "tests.distributed.sharded_scenarios:plain_model"
CLEAN_STEPS = 30
LONG_STEPS, LONG_AUDIT_EVERY, LONG_FINGERPRINT_EVERY = 200, 10, 5
FAULT_STEPS = 4
CHECKPOINT_STEP, CHECKPOINT_TOTAL = 2, 4


def scenarios(tmp: Path) -> list[dict[str, Any]]:
    """Every scenario of the TP launch, in the order the ranks run them."""
    ckpt = str(tmp / "ckpt-tp")
    listed: list[dict[str, Any]] = [
        {"name": "tp_clean", "steps": CLEAN_STEPS, "mesh": TP_MESH, "stop_at_alarm": False},
        {"name": "tp_unguarded", "kind": "unguarded", "steps": CLEAN_STEPS, "mesh": TP_MESH},
        {"name": "tp_titan_names", "steps": FAULT_STEPS, "mesh": TP_MESH,
         "mesh_names": ["dp_replicate", "dp_shard", "tp"], "stop_at_alarm": False},
    ]
    listed += [{"name": n, "inject": i, "steps": FAULT_STEPS, "mesh": TP_MESH} for n, i, *_ in FAULTS]
    # The persistent TP-layer fault's alarm carries a replay capsule of each suspect (the gathered full state).
    listed[[s["name"] for s in listed].index("tp_layer_fault")].update(
        capsule_factory=CAPSULE_FACTORY, prefix=str(tmp / "capsules-tp"))
    listed += [{"name": TRIGGER[0], "inject": TRIGGER[1], "steps": 5, "mesh": TP_MESH, "audit_every": 100,
                "fingerprint_every": 100, "trigger_warmup": 3}]
    listed += [{"name": REDUCED[0], "inject": REDUCED[1], "steps": FAULT_STEPS, "mesh": TP_MESH}]
    listed += [{"name": "tp_no_replicas", "steps": FAULT_STEPS, "mesh": NO_REPLICAS, "stop_at_alarm": False}]
    listed += [{"name": n, "inject": i, "steps": FAULT_STEPS, "mesh": NO_REPLICAS} for n, i, *_ in NO_REPLICA_FAULTS]
    listed += [{"name": n, "steps": 1, "mesh": TP_MESH, "expect_error": True, **extra}
               for n, (extra, _) in REFUSED.items()]
    listed += [
        {"name": "tp_products", "steps": 2, "mesh": TP_MESH, "product_checks": True},
        {"name": "hsdp_products", "steps": 2, "mesh": [3, 2], "product_checks": True},
        {"name": "tp_ckpt_first", "kind": "checkpoint", "steps": CHECKPOINT_STEP, "total": CHECKPOINT_TOTAL,
         "mesh": TP_MESH, "prefix": ckpt},
        {"name": "tp_ckpt_resume", "kind": "resume", "total": CHECKPOINT_TOTAL, "mesh": TP_MESH, "prefix": ckpt},
        # The same replicas and positions, made by FSDP instead of TP: refused before anything is loaded.
        {"name": "tp_ckpt_other_split", "kind": "resume", "total": CHECKPOINT_TOTAL, "mesh": [3, 2, 1],
         "prefix": ckpt},
        {"name": "tp_long", "steps": LONG_STEPS, "mesh": TP_MESH, "audit_every": LONG_AUDIT_EVERY,
         "fingerprint_every": LONG_FINGERPRINT_EVERY, "stop_at_alarm": False},
    ]
    return listed


def run(tmp: Path) -> list[dict[str, Any]]:
    """Run every TP scenario on 6 ranks; every rank's results."""
    return sharded_world.run_world(tmp, scenarios(tmp), timeout=600)
