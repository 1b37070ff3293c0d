"""Replay capsules under FSDP2 (HSDP or pure FSDP): the unsharded state, and the suspect's step on a plain model.

``sdcguard replay`` (sdcguard.agent.capsule_replay) rebuilds the plain model from the
capsule's factory on one device, loads the capsule's state strictly and
recomputes the step there; no mesh, no process group. So under sharded
training the capsule holds what DDP's does, in the same format: the *full*
(unsharded) weights and buffers, the suspect's micro-batches, the settings,
and the expected bits. Where they come from differs:

1. **Agree** (every rank, one all-reduce of a flag per suspect): a capsule is
   written only if every rank has ``capsule_factory`` and the publishing rank
   finds it under ``capsule_max_bytes``, judged from the global shapes before
   anything is gathered (:func:`full_state_bytes`) plus the suspect's
   micro-batches. Every rank reaches this point with the same alarm, so
   either all gather or none does: nobody waits in a collective alone.
2. **Gather** (every rank, a collective per state entry): each sharded
   parameter's :meth:`DTensor.full_tensor`, in ``state_dict`` order; the
   publishing rank keeps a CPU copy, the others drop each one at once (one
   parameter's full size at a time). Buffers, which FSDP neither shards nor
   syncs, are the publishing rank's own, as its audit recomputation uses them.
3. **Recompute** (the publishing rank alone): the factory builds the plain
   model, the gathered state is loaded strictly, and the suspect's
   micro-batches (``batch_for(step, suspect)``) are recomputed on this rank's
   device with the step's seed (seed, step, suspect) and autocast, by
   :func:`sdcguard.agent.recompute.recompute_step`, the computation the replay runs.
   Its loss bits and per-parameter gradient fingerprints are the capsule's
   expected result.

So the expected result and the replay are the same plain computation:
a healthy device of the same kind gives its bits, one with a persistent
fault does not. It is not the sharded pass's own computation (FSDP's
all-gathers, a ``MixedPrecisionPolicy``'s casts and the reduce-scatter's
layout give other bits), which the replay never needs.

Memory: the full state on the publishing rank's CPU (capped by
``capsule_max_bytes``) and once more on its device for the recomputation,
beside its shards. A model above the cap gets no capsule; the alarm says so.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from sdcguard.agent import replay
from sdcguard.agent.capsule import (
    Expected,
    ReplaySettings,
    estimated_bytes,
    map_tensors,
    over_cap,
    write_capsule,
)
from sdcguard.agent.determinism import environment_signature
from sdcguard.agent.recompute import recompute_step

if TYPE_CHECKING:
    from sdcguard.agent.sharded import ShardedDataParallel

log = logging.getLogger(__name__)

NO_FACTORY_EVERYWHERE = ("capsule_factory (SDCGUARD_CAPSULE_FACTORY) is not set on every rank, and under sharded "
                         "training every rank must gather the state")


def full_state_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s unsharded ``state_dict`` (weights and persistent buffers), from the global
    shapes: the same on every rank, known before anything is gathered."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def gather_full_state(model: nn.Module, *, keep: bool) -> dict[str, torch.Tensor]:
    """``model``'s unsharded ``state_dict`` on the CPU, where ``keep``; ``{}`` elsewhere.

    A collective: every rank of the mesh calls it together (each sharded entry is all-gathered within its
    shard group, in ``state_dict`` order). A rank that does not keep drops each full tensor at once."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, value in model.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if keep:
                # Always a copy: a buffer is the module's own, and a shard dim of size 1 gathers nothing.
                out[name] = full.detach().to("cpu", copy=True)
            del full
    return out


@dataclass(frozen=True)
class _Plan:
    """What the publishing rank prepared before the agreement: each suspect's micro-batches, or why not."""

    batches: dict[int, list[Any]]
    refused: dict[int, str]


def _plan(parallel: ShardedDataParallel, step: int, suspects: Sequence[int], state_bytes: int) -> _Plan:
    """On the publishing rank: each suspect's micro-batches, and the suspects refused (over the cap, or
    micro-batches a capsule cannot hold) with the sentence for the alarm."""
    cap = parallel.job.config.capsule_max_bytes
    batches: dict[int, list[Any]] = {}
    refused: dict[int, str] = {}
    for suspect in suspects:
        try:
            micro = parallel.job.micro_batches(step, suspect)
            size = estimated_bytes(state_bytes, micro)
        except (ValueError, TypeError) as exc:
            refused[suspect] = f"a micro-batch cannot be stored: {exc}"
            continue
        except Exception as exc:  # this rank must still join the agreement: a loader's error is said, not raised
            log.exception("step %d: the micro-batches of rank %d could not be rebuilt for its capsule", step, suspect)
            refused[suspect] = f"its micro-batches could not be rebuilt ({type(exc).__name__}: {exc})"
            continue
        if size > cap:
            refused[suspect] = over_cap(size, cap)
        else:
            batches[suspect] = micro
    return _Plan(batches, refused)


def _agree(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag true on every rank (an all-reduce MIN: the one decision every rank acts on)."""
    t = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(v) for v in t.tolist()]


def write_sharded_capsules(parallel: ShardedDataParallel, *, step: int, suspects: Sequence[int], publisher: int,
                           origins: Mapping[int, Mapping[str, str]]) -> dict[int, str]:
    """Write a capsule of each of ``suspects``' step at ``step`` (see the module's docstring); on the
    publishing rank each suspect's sentence for the alarm, ``{}`` on the others.

    Every rank calls it together with the same ``suspects`` and ``publisher`` (both from the alarm, the same
    everywhere): it runs an all-reduce, then, when a capsule is due, the gather. Raises nothing the alarm
    must survive on the publishing rank (a factory that fails, a store that fails: said in the sentence);
    an error inside the gather itself would be every rank's."""
    cfg = parallel.job.config
    me = parallel.job.topology.rank
    state_bytes = full_state_bytes(parallel.model)
    plan = _Plan({}, {})
    if me == publisher and cfg.capsule_factory:
        plan = _plan(parallel, step, suspects, state_bytes)
    flags = [bool(cfg.capsule_factory) and (me != publisher or s in plan.batches) for s in suspects]
    agreed = _agree(flags, parallel.device)
    due = [s for s, ok in zip(suspects, agreed, strict=True) if ok]
    state = gather_full_state(parallel.model, keep=me == publisher) if due else {}
    if me != publisher:
        return {}
    notes = {s: f"no replay capsule: {plan.refused.get(s, NO_FACTORY_EVERYWHERE)}" for s in suspects if s not in due}
    if not due:
        return notes
    assert cfg.capsule_factory is not None  # every rank agreed it is set
    try:
        module, loss_fn = _plain_model(cfg.capsule_factory, state, parallel.device,
                                       training=parallel.model.training)
    except Exception as exc:  # the alarm is published whatever became of its capsule
        log.exception("step %d: no replay capsule: the plain model could not be built", step)
        return {**notes, **{s: f"no replay capsule: the factory's model could not take the gathered state "
                               f"({type(exc).__name__}: {exc})" for s in due}}
    del state  # loaded into the module
    for suspect in due:
        notes[suspect] = _write_one(parallel, module, loss_fn, step, suspect, plan.batches[suspect],
                                    origins.get(suspect, {}))
    return notes


def _plain_model(factory: str, state: dict[str, torch.Tensor], device: torch.device, *,
                 training: bool) -> tuple[nn.Module, Any]:
    """The factory's model with the gathered state loaded strictly, on ``device``, in ``training`` mode, and
    the factory's loss function (what the replay will run). Raises what the factory or the load raises."""
    from sdcguard.agent.capsule_replay import resolve_factory  # the replay's own resolution of the factory

    built = resolve_factory(factory)()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module) and callable(built[1])):
        raise TypeError(f"factory {factory!r} must return (nn.Module, loss_fn), got {type(built).__name__}")
    module, loss_fn = built
    module.load_state_dict(state, strict=True)
    module.to(device)
    module.train(training)
    return module, loss_fn


def _write_one(parallel: ShardedDataParallel, module: nn.Module, loss_fn: Any, step: int, suspect: int,
               batches: list[Any], origin: Mapping[str, str]) -> str:
    """Recompute ``suspect``'s step on the plain ``module`` and write its capsule; the alarm's sentence."""
    cfg, device, job = parallel.job.config, parallel.device, parallel.job
    assert cfg.capsule_factory is not None
    try:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        moved = [_to(b, device) for b in batches]
        healthy = recompute_step(module, loss_fn, moved, [n for n, _ in named], [p for _, p in named],
                                 functools.partial(replay.seed_micro_batch, cfg.seed, step, suspect, device),
                                 forward_context=functools.partial(job.forward_context, device))
        written = write_capsule(
            cfg.checkpoint_prefix, module=module, batches=batches,
            settings=ReplaySettings.capture(module, seed=cfg.seed, step=step, rank=suspect,
                                            autocast_dtype=cfg.autocast_dtype, eager=cfg.product_checks),
            expected=Expected.from_recomputation(healthy), signature=environment_signature(device),
            factory=cfg.capsule_factory, cap_bytes=cfg.capsule_max_bytes,
            origin={**origin, "sharding": _layout(parallel)})
        return written.describe()
    except Exception as exc:  # the alarm is published whatever became of its capsule
        log.exception("step %d: the replay capsule of rank %d was not written", step, suspect)
        return f"no replay capsule: writing it failed ({type(exc).__name__}: {exc})"


def _layout(parallel: ShardedDataParallel) -> str:
    """How the job held the state the capsule gathered, for people (the manifest's ``origin``)."""
    if parallel.tp > 1:
        return (f"{'HSDP' if parallel.replicated else 'FSDP'} + TP, {parallel.layout.describe()}; the full state "
                "gathered (it replays unsharded, on one process)")
    if parallel.replicated:
        return f"HSDP, {parallel.replicas} replicas x {parallel.shards} shards; the full state gathered"
    return f"FSDP, {parallel.shards} shards; the full state gathered"


def _to(batch: Any, device: torch.device) -> Any:
    """The micro-batch with its tensors on ``device`` (``batch_for`` may build them anywhere)."""
    return map_tensors(batch, functools.partial(torch.Tensor.to, device=device))
