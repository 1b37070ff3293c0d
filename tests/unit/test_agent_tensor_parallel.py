"""The meshes the guard checks under tensor parallelism, and what it refuses at start (one process: a fake
process group of 6 ranks, so DeviceMeshes and DTensor parameters exist without a launch)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sdcguard.agent.tensor_parallel import check_tp_batches, read_mesh

WORLD = 6


@pytest.fixture(scope="module")
def fake_world() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _tp_model(mesh: Any, *, tp: str = "tp") -> torch.nn.Module:
    """Two Linears, column- then row-parallel on ``mesh[tp]``, then ``fully_shard`` on the other dims."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    parallelize_module(model, mesh[tp], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    names = tuple(mesh.mesh_dim_names)
    fully_shard(model, mesh=mesh[tuple(n for n in names if n != tp)])
    return model


@pytest.mark.usefixtures("fake_world")
@pytest.mark.parametrize(("shape", "names", "layout"), [
    ((3, 1, 2), ("replicate", "shard", "tp"), (3, 1, 2)),
    ((3, 1, 2), ("dp_replicate", "dp_shard", "tp"), (3, 1, 2)),
    ((1, 3, 2), ("replicate", "shard", "tp"), (1, 3, 2)),
    ((3, 2), ("dp_shard", "tp"), (1, 3, 2)),
])
def test_a_tp_mesh_is_read_position_by_position(shape: tuple[int, ...], names: tuple[str, ...],
                                                layout: tuple[int, int, int]) -> None:
    mesh = _mesh(shape, names)
    read = read_mesh(mesh, _tp_model(mesh), world=WORLD, ranks_per_node=2)
    assert (read.replicas, read.shards, read.tp) == layout
    assert read.positions == layout[1] * layout[2]
    assert read.tp_group(3) == [2, 3]


@pytest.mark.usefixtures("fake_world")
def test_hsdp_and_fsdp_meshes_are_read_as_before() -> None:
    from torch.distributed.fsdp import fully_shard

    for shape, names, layout in (((3, 2), ("replicate", "shard"), (3, 2, 1)), ((6,), ("shard",), (1, 6, 1))):
        mesh = _mesh(shape, names)
        model = torch.nn.Linear(4, 12)
        fully_shard(model, mesh=mesh)
        read = read_mesh(mesh, model, world=WORLD, ranks_per_node=2)
        assert (read.replicas, read.shards, read.tp) == layout
        assert read.tp_group(3) == [3]


@pytest.mark.usefixtures("fake_world")
@pytest.mark.parametrize(("hand", "ranks_per_node", "said"), [
    ("tp", 2, "tensor-parallel (TP) mesh of 2 ranks"),
    ("fsdp", 2, "the model is tensor-parallel (TP"),
    ("shard", 2, "the model is tensor-parallel (TP"),
    ("whole", 1, "spans nodes of 1 ranks (ranks_per_node)"),
])
def test_a_tp_model_on_a_mesh_the_guard_cannot_check_is_refused_naming_tp(hand: str, ranks_per_node: int,
                                                                          said: str) -> None:
    mesh = _mesh((3, 1, 2), ("replicate", "shard", "tp"))
    model = _tp_model(mesh)
    handed = {"tp": mesh["tp"], "fsdp": mesh["replicate", "shard"], "shard": mesh["shard"], "whole": mesh}[hand]
    with pytest.raises(ValueError, match=r"^mesh: ") as raised:
        read_mesh(handed, model, world=WORLD, ranks_per_node=ranks_per_node)
    assert said in str(raised.value)
    assert "supported" in str(raised.value)


@pytest.mark.usefixtures("fake_world")
@pytest.mark.parametrize(("names", "said"), [
    (("dp_replicate", "cp", "tp"), "'cp' (context parallel)"),
    (("replicate", "ep", "tp"), "'ep' (expert parallel)"),
    (("tp", "shard", "replicate"), "not in an order the guard checks"),
])
def test_other_parallelisms_dims_are_refused_by_name(names: tuple[str, ...], said: str) -> None:
    model = _tp_model(_mesh((3, 1, 2), ("replicate", "shard", "tp")))
    with pytest.raises(ValueError, match="supported") as raised:
        read_mesh(_mesh((3, 1, 2), names), model, world=WORLD, ranks_per_node=2)
    assert said in str(raised.value)


@pytest.mark.usefixtures("fake_world")
def test_a_tp_dim_without_a_tp_parameter_and_an_unknown_placement_are_refused() -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial

    mesh = _mesh((3, 1, 2), ("replicate", "shard", "tp"))
    plain = torch.nn.Linear(4, 8)
    fully_shard(plain, mesh=mesh["replicate", "shard"])
    with pytest.raises(ValueError, match="no parameter of the model is tensor-parallel"):
        read_mesh(mesh, plain, world=WORLD, ranks_per_node=2)
    odd = torch.nn.Module()
    odd.weight = torch.nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh, [Partial()] * 3))
    with pytest.raises(ValueError, match=r"placement Partial\(sum\).*does not know"):
        read_mesh(mesh, odd, world=WORLD, ranks_per_node=2)


def test_a_tp_group_given_different_batches_is_told_to_fix_batch_for() -> None:
    def same(step: int, rank: int) -> list[Any]:
        return [torch.arange(4) + step + rank // 2]

    def differ(step: int, rank: int) -> list[Any]:
        return [torch.arange(4) + step + rank]

    assert check_tp_batches(same, 3, [2, 3], torch.device("cpu")) is None
    said = check_tp_batches(differ, 3, [2, 3], torch.device("cpu"))
    assert said is not None
    assert said.startswith("batch_for: ")
    assert "batch_for(3, 3) differs from batch_for(3, 2)" in said
