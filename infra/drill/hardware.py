"""The faulty GPU as the stand-in holds it, so that everything run on the node meets the same fault.

The drill injects its fault into one rank's process (``SDCGUARD_INJECT``,
bound to that rank's node). The pipeline's node checks run on the node too,
as Kubernetes Jobs the stand-in starts as local processes; for a replay there
to compute wrong bits, the stand-in must know the node's GPU is faulty. The
drill registers the same spec as the node's hardware fault
(``sdcguard.infra.local.eks.node_faults``) for the length of the drill, and with
``--replacement-faulty`` asks the stand-in to hand out replacements that
inherit it (a new node from the same bad batch).

The recovered run reads the registry back: a rank placed on a node that
carries a fault gets it, so a job resumed onto a faulty replacement would
meet its fault, as it would on real hardware.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from sdcguard.infra.drill.failure import DrillFailed
from sdcguard.infra.drill.job_run import Placement
from sdcguard.infra.drill.stage import Stage

if TYPE_CHECKING:
    from sdcguard.infra.local.eks.node_faults import NodeFaults


def node_faults(stage: Stage) -> NodeFaults:
    """The stand-in's registry of node hardware faults. Raises DrillFailed ("set-up") when it has none."""
    faults = getattr(getattr(stage.standin, "eks", None), "node_faults", None)
    if faults is None:
        raise DrillFailed("set-up", "the stand-in has no EKS API server holding node hardware faults")
    return faults


@contextlib.contextmanager
def faulty_node(stage: Stage, node: str, spec: str, *, replacements_inherit: bool) -> Iterator[NodeFaults]:
    """Make ``node``'s GPU faulty on the stand-in (``spec``, an ``SDCGUARD_INJECT`` bound to it) inside the block;
    with ``replacements_inherit`` every replacement of a faulty node is faulty too. What was registered before
    is put back after."""
    faults = node_faults(stage)
    saved = faults.to_dict()
    faults.set({node: spec}, replacements_inherit=replacements_inherit)
    try:
        yield faults
    finally:
        faults.apply(saved)


def injections(faults: NodeFaults, where: Sequence[Placement], ranks_per_node: int, local_rank: int) -> dict[int, str]:
    """``SDCGUARD_INJECT`` by rank for a run on ``where``: each faulty node's spec, given to its ``local_rank``-th
    rank (one GPU of the node is the faulty one, as in the faulty run)."""
    inject = {}
    for index, place in enumerate(where):
        spec = faults.for_node(place.node_name)
        if spec is not None:
            inject[index * ranks_per_node + local_rank] = spec
    return inject
