"""Tensor parallelism under FSDP2 replicas: the meshes the guard can check, and what it refuses at start.

A 3-D job (torchtitan's ``ParallelDims``, Megatron-style TP inside a node)
parallelises each block with ``torch.distributed.tensor.parallel``
(``parallelize_module(block, mesh["tp"], {...: ColwiseParallel(), ...:
RowwiseParallel()})``) and then shards it with ``fully_shard(block,
mesh=mesh["replicate", "shard"])``, on a mesh ``(G, S, T)`` named
``("replicate", "shard", "tp")`` (or torchtitan's ``("dp_replicate",
"dp_shard", "tp")``). Rank ``(g, s, t)`` is ``g*S*T + s*T + t``, as
``init_device_mesh`` lays it out: the T ranks of a TP group are consecutive,
and each holds its own TP shard of every TP'd weight, so only ranks of the
same ``(s, t)`` *position* hold the same bits. Every comparison the guard makes
(weights, optimizer state, reduced gradients, the ring audit's digests) is
therefore made position by position across the G replicas
(sdcguard.agent.sharded), and a TP group recomputes another replica's
micro-batch as a group, with its TP collectives on its own group.

What cannot be checked is refused here, at start, with the reason and what
is supported: a TP group that spans nodes, a TP model handed a mesh without
its ``tp`` dim (the world-spanning ``tp`` mesh, a 1-rank FSDP mesh), mesh
dims of other parallelisms (context, expert, pipeline), a parameter placement
the guard does not know, and a ``tp`` dim with no TP'd parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from sdcguard.agent.batches import batch_digest
from sdcguard.agent.topology import node_of

CANONICAL = {"replicate": "replicate", "shard": "shard", "tp": "tp",
             "dp_replicate": "replicate", "dp_shard": "shard"}
"""The mesh dim names the guard knows, and what each is (torchtitan's ``dp_replicate``/``dp_shard`` included)."""

ORDER = ("replicate", "shard", "tp")
"""The order the known dims must come in (``init_device_mesh``'s layout: the TP group's ranks consecutive)."""

OTHER_PARALLELISMS = {"cp": "context parallel", "ep": "expert parallel", "pp": "pipeline parallel",
                      "etp": "expert tensor parallel", "dp_shard_cp": "context parallel (flattened with dp_shard)",
                      "dp_cp": "context parallel (flattened with dp)", "dp": "a flattened data-parallel dim"}
"""Dims of parallelisms the guard cannot check yet, named for the error."""

SUPPORTED = ("supported: a 1-D FSDP mesh, a 2-D (\"replicate\", \"shard\") HSDP mesh, or tensor parallel inside "
             "each node as a (\"replicate\", \"shard\", \"tp\") mesh (torchtitan: \"dp_replicate\", \"dp_shard\", "
             "\"tp\"; a 2-D (\"shard\", \"tp\") mesh without replicas), the model TP'd on mesh[\"tp\"] then "
             "fully_shard on mesh[\"replicate\", \"shard\"]")


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """The mesh the guard checks, read once at start."""

    mesh: DeviceMesh
    replicas: int
    """G: replica groups (1: no replica, detection without localisation)."""
    shards: int
    """S: FSDP shards per replica group."""
    tp: int
    """T: ranks of a TP group (1: no tensor parallelism)."""

    @property
    def positions(self) -> int:
        """S*T: the (shard, tp) positions of a replica group, each held by one rank of every replica."""
        return self.shards * self.tp

    def tp_group(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s TP group (``rank`` alone without TP)."""
        base = rank - rank % self.tp
        return list(range(base, base + self.tp))

    def describe(self) -> str:
        """The layout for people (a capsule's origin, a log line)."""
        if self.tp > 1:
            return f"{self.replicas} replicas x {self.shards} shards x TP {self.tp}"
        if self.replicas > 1:
            return f"{self.replicas} replicas x {self.shards} shards"
        return f"{self.shards} shards"


def read_mesh(mesh: Any, model: torch.nn.Module, *, world: int, ranks_per_node: int) -> MeshLayout:
    """The layout of ``mesh`` for ``model`` (an FSDP2 model, TP'd or not).

    Raises ``ValueError`` naming ``mesh`` or ``model`` (and TP where TP is the
    reason) for: not a DeviceMesh; dims it does not know (context, expert or
    pipeline parallel, flattened dims) or in another order; a 1-D ``tp`` mesh;
    a mesh that does not span the world rank by rank; a TP group that spans
    nodes; a TP model on a mesh without its ``tp`` dim, or a ``tp`` dim
    without a TP'd parameter; a parameter placement it does not know."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError("mesh: must be a torch.distributed.device_mesh.DeviceMesh")
    names = tuple(mesh.mesh_dim_names or ())
    tp_dims = _tp_dims_of(model)
    if mesh.ndim == 1 and names in (("tp",), ()) and tp_dims:
        raise ValueError(f"mesh: this is the model's tensor-parallel (TP) mesh of {mesh.size()} ranks: the guard "
                         f"checks TP only as part of the whole mesh it was built from (hand it that mesh, with "
                         f"its tp dim); {SUPPORTED}")
    if mesh.ndim == 1 and names == ("tp",):
        raise ValueError(f"mesh: a 1-D \"tp\" mesh is a tensor-parallel (TP) group, not an FSDP mesh; {SUPPORTED}")
    dims: tuple[str, ...]
    if mesh.ndim == 1:
        dims = ("shard",)
    else:
        unknown = [n for n in names if n not in CANONICAL]
        if unknown or len(names) != mesh.ndim:
            what = ", ".join(f"{n!r} ({OTHER_PARALLELISMS.get(n, 'unknown')})" for n in unknown) or "no names"
            raise ValueError(f"mesh: dims {names} include {what}, which the guard cannot check; {SUPPORTED}")
        dims = tuple(CANONICAL[n] for n in names)
        if dims not in (("replicate", "shard"), ("replicate", "shard", "tp"), ("shard", "tp")):
            raise ValueError(f"mesh: dims {names} are not in an order the guard checks; {SUPPORTED}")
    sizes = dict(zip(dims, (int(n) for n in mesh.shape), strict=True))
    layout = MeshLayout(mesh, sizes.get("replicate", 1), sizes["shard"], sizes.get("tp", 1))
    if mesh.mesh.reshape(-1).tolist() != list(range(world)):
        if tp_dims and layout.tp == 1:
            raise ValueError(f"mesh: the model is tensor-parallel (TP, its parameters on mesh dims {tp_dims}), and "
                             f"this mesh of {mesh.size()} rank(s) is not the whole mesh of the world of {world}: "
                             f"hand the guard the mesh with the tp dim; {SUPPORTED}")
        raise ValueError(f"mesh: must span the world rank by rank (as init_device_mesh lays it out), got "
                         f"{mesh.mesh.tolist()} for a world of {world}")
    if layout.tp > 1:
        _check_tp_within_nodes(layout, world, ranks_per_node)
    _check_params(model, layout, names)
    return layout


def _tp_dims_of(model: torch.nn.Module) -> tuple[str, ...]:
    """The mesh dims of the model's parameters beyond FSDP's own (``tp``, or another parallelism's)."""
    extra: list[str] = []
    for p in model.parameters():
        if isinstance(p, DTensor):
            for n in p.device_mesh.mesh_dim_names or ():
                if CANONICAL.get(n) not in ("replicate", "shard") and n not in extra:
                    extra.append(n)
    return tuple(extra)


def _check_tp_within_nodes(layout: MeshLayout, world: int, ranks_per_node: int) -> None:
    for base in range(0, world, layout.tp):
        group = range(base, base + layout.tp)
        if len({node_of(r, ranks_per_node) for r in group}) > 1:
            raise ValueError(
                f"mesh: a tensor-parallel (TP) group of {layout.tp} ranks (ranks {base}..{base + layout.tp - 1}) "
                f"spans nodes of {ranks_per_node} ranks (ranks_per_node): a TP group must sit inside one node, so "
                f"that a compute fault is localised to it and it recomputes as a group; supported: tp dividing "
                f"ranks_per_node")


def _check_params(model: torch.nn.Module, layout: MeshLayout, names: tuple[str, ...]) -> None:
    """Every parameter is on the guard's mesh (or its replicate/shard part) with placements it knows."""
    mesh_names = set(names)
    tp_params = 0
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        p_names = tuple(p.device_mesh.mesh_dim_names or ())
        outside = [n for n in p_names if n not in mesh_names and layout.mesh.ndim > 1]
        if outside:
            parallel = "tensor parallel (TP)" if any(CANONICAL.get(n) == "tp" for n in outside) else \
                ", ".join(OTHER_PARALLELISMS.get(n, n) for n in outside)
            raise ValueError(f"model: parameter {name!r} is {parallel} (on mesh dims {p_names}), which the mesh "
                             f"handed to the guard ({names}) does not have; {SUPPORTED}")
        for placement in p.placements:
            # FSDP2 shards a TP'd dim with _StridedShard (its shards interleave the TP ones).
            if not isinstance(placement, (Replicate, Shard, _StridedShard)):
                raise ValueError(f"model: parameter {name!r} has placement {placement!r} on mesh {p_names}, which "
                                 f"the guard does not know (it checks Replicate and Shard placements: FSDP2's and "
                                 f"ColwiseParallel/RowwiseParallel/SequenceParallel's); {SUPPORTED}")
        if "tp" in p_names and not isinstance(p.placements[p_names.index("tp")], Replicate):
            tp_params += 1
    if layout.tp > 1 and tp_params == 0:
        raise ValueError(f"mesh: it has a tensor-parallel (tp) dim of {layout.tp} but no parameter of the model is "
                         f"tensor-parallel: parallelize_module(..., mesh[\"tp\"], ...) before fully_shard, or hand "
                         f"the guard mesh[\"replicate\", \"shard\"]")


def check_tp_batches(micro_batches: Callable[[int, int], list[Any]], step: int, ranks: Iterable[int],
                     device: torch.device) -> str | None:
    """Whether the ranks of one TP group are given the same micro-batches at ``step`` (they train on one):
    None when they are, else the error's text, naming ``batch_for``. No collective: ``batch_for`` is asked for
    every rank of the group here (it must answer for any rank, as the audit recomputes others' batches)."""
    ranks = list(ranks)
    digests = [batch_digest(micro_batches(step, r), device) for r in ranks]
    for r, d in zip(ranks[1:], digests[1:], strict=True):
        if not torch.equal(d, digests[0]):
            return (f"batch_for: under tensor parallelism the ranks of a TP group train on one micro-batch, but "
                    f"batch_for({step}, {r}) differs from batch_for({step}, {ranks[0]}) (TP group {ranks}); return "
                    f"the same batch for every rank of a TP group (for example, index the data by "
                    f"rank // tp)")
    return None
