"""The drill's fault as the stand-in's node hardware: registered for the drill, handed back after, and met by a
run placed on a faulty node (no stand-in process needed: the registry itself)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sdcguard.infra.drill.hardware import faulty_node, injections
from sdcguard.infra.drill.job_run import Placement
from sdcguard.infra.local.eks.node_faults import NodeFaults

SPEC = "kind=finite_activation,node=hyperpod-i-b,step=33,repeat=60"


def _stage(faults: NodeFaults) -> Any:
    return SimpleNamespace(standin=SimpleNamespace(eks=SimpleNamespace(node_faults=faults)))


def test_the_fault_is_the_nodes_for_the_drill_and_what_was_there_before_comes_back() -> None:
    faults = NodeFaults()
    faults.set({"hyperpod-i-x": "kind=nan_activation,node=hyperpod-i-x,step=1"})

    with faulty_node(_stage(faults), "hyperpod-i-b", SPEC, replacements_inherit=True):
        assert faults.to_dict() == {"faults": {"hyperpod-i-b": SPEC}, "replacements_inherit": True}
        # a replacement of the faulty node comes from the same bad batch
        assert faults.replaced("hyperpod-i-b", "hyperpod-i-c") == SPEC.replace("i-b", "i-c")

    assert faults.to_dict() == {"faults": {"hyperpod-i-x": "kind=nan_activation,node=hyperpod-i-x,step=1"},
                                "replacements_inherit": False}


def test_the_registry_is_put_back_when_the_drill_fails_inside() -> None:
    faults = NodeFaults()
    with pytest.raises(RuntimeError), faulty_node(_stage(faults), "hyperpod-i-b", SPEC, replacements_inherit=False):
        raise RuntimeError("a stage failed")
    assert faults.to_dict() == {"faults": {}, "replacements_inherit": False}


def test_a_run_placed_on_a_faulty_node_gets_its_fault_on_the_same_gpu_of_that_node() -> None:
    faults = NodeFaults()
    faults.set({"hyperpod-i-c": SPEC.replace("i-b", "i-c")})
    where = [Placement("hyperpod-i-a", "w-0"), Placement("hyperpod-i-c", "w-1"), Placement("hyperpod-i-d", "w-2")]

    # rank 3 was the faulty one (the second GPU of its node): on the nodes the job has now, rank 3 again
    assert injections(faults, where, ranks_per_node=2, local_rank=1) == {3: SPEC.replace("i-b", "i-c")}
    assert injections(NodeFaults(), where, ranks_per_node=2, local_rank=1) == {}
