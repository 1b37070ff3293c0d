"""The job a campaign trains: the reference TinyGPT, or a team's own model through a factory (``--job``).

A factory is a function ``function(seed: int) -> CampaignJob``, named
``package.module:function``. The campaign resolves it once in the parent (a
bad name fails before any rank starts) and again in every rank, so it should
be cheap: the model is made by ``build``, on each rank.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sdcguard.agent.testing.train import JobShape, SyntheticData, TinyGPT, loss_fn

REFERENCE_JOB = "sdcguard.campaign.job:reference_job"
"""The default ``--job``: ``sdcguard.agent.testing.train``'s TinyGPT on its seeded synthetic data, with AdamW."""


class JobProblem(ValueError):
    """The job cannot be measured: what its factory, model or steps lack, naming ``--job``."""


@dataclass(frozen=True)
class CampaignJob:
    """What the campaign needs of a training job.

    Every rank calls ``build`` for each run of the campaign (hundreds of
    times); each run starts from the clean reference run's state, so only the
    first build's weights are trained from, and DDP hands rank 0's to the others.
    """

    build: Callable[[torch.device], tuple[nn.Module, torch.optim.Optimizer]]
    """``build(device)``: the bare model on ``device`` (the campaign wraps it in DDP) and its optimizer."""
    batch_for: Callable[[int, int], Any]
    """``batch_for(step, rank)``: the micro-batch ``rank`` trains on at ``step``, the same on every call (the
    campaign replays steps and compares bits)."""
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    """``loss_fn(module, batch)``: the scalar loss of one micro-batch."""


def reference_job(seed: int) -> CampaignJob:
    """The reference job at JobShape's sizes: exactly what ``sdcguard.agent.testing.train.build`` builds, unwrapped."""
    shape = JobShape(seed=seed)

    def build(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(shape.seed)
        model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=shape.lr)

    return CampaignJob(build=build, batch_for=SyntheticData(shape, torch.device("cpu")), loss_fn=loss_fn)


def module_and_function(spec: str) -> tuple[str, str]:
    """``package.module:function`` split in two. Raises JobProblem naming ``--job`` for another form."""
    module, colon, function = spec.partition(":")
    if not colon or not module.strip() or not function.strip() or ":" in function:
        raise JobProblem(f"--job {spec!r}: expected MODULE:FUNCTION (e.g. mypkg.sdc:campaign_job), "
                         f"a factory function(seed) -> sdcguard.campaign.job.CampaignJob")
    return module.strip(), function.strip()


def resolve(spec: str, seed: int) -> CampaignJob:
    """Import the factory ``spec`` names and call it with ``seed``.

    Raises JobProblem naming ``--job`` when the spec has no colon, the module
    does not import, it has no such attribute, the attribute is not callable,
    the call raises, or it returns something other than a CampaignJob.
    """
    module_name, function_name = module_and_function(spec)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # whatever stops the import, the user must see it
        raise JobProblem(f"--job {spec!r}: module {module_name!r} cannot be imported "
                         f"({type(exc).__name__}: {exc})") from exc
    try:
        factory = getattr(module, function_name)
    except AttributeError:
        raise JobProblem(f"--job {spec!r}: module {module_name!r} has no attribute {function_name!r}") from None
    if not callable(factory):
        raise JobProblem(f"--job {spec!r}: {function_name!r} is a {type(factory).__name__}, not a function")
    try:
        job = factory(seed)
    except Exception as exc:
        raise JobProblem(f"--job {spec!r}: {function_name}({seed}) raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(job, CampaignJob):
        raise JobProblem(f"--job {spec!r}: {function_name}({seed}) returned a {type(job).__name__}, "
                         f"not a sdcguard.campaign.job.CampaignJob")
    return job


def built(spec: str, result: Any, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``build(device)``'s result, checked: a bare module with a parameter to train, and an optimizer.

    Raises JobProblem naming ``--job`` otherwise (DDP would refuse a model with
    nothing to train, and the faults would have nothing to corrupt).
    """
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)
            and isinstance(result[1], torch.optim.Optimizer)):
        raise JobProblem(f"--job {spec!r}: build({device}) must return (nn.Module, torch.optim.Optimizer), "
                         f"got {type(result).__name__}")
    model, optimizer = result
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise JobProblem(f"--job {spec!r}: build({device}) returned a DDP model; return the bare model "
                         f"(the campaign wraps it)")
    if not any(p.requires_grad for p in model.parameters()):
        raise JobProblem(f"--job {spec!r}: the model has no parameter that requires grad: nothing trains, "
                         f"nothing can be corrupted")
    return model, optimizer


PRODUCT_MODELS = {"matmul_fwd": ("fwd",), "matmul_bwd": ("bwd",), "mercurial": ("fwd", "bwd")}
"""Fault models that corrupt matrix products, and the directions whose products they pick from."""
LINEAR_MODELS = ("activation", "null")
"""Fault models that corrupt the output of an ``nn.Linear``."""
FLOAT32_MODELS = ("gradient", "weight", "optimizer", "allreduce")
"""Fault models that flip bits of float32 parameters, their gradients or their optimizer state."""


def measured_problems(spec: str, models: set[str], products: dict[str, int], linears: list[str],
                      dtypes: set[torch.dtype]) -> list[str]:
    """What the fault models ``models`` need of the model and lack, as measured on a clean step (none: [])."""
    problems = []
    for model, directions in PRODUCT_MODELS.items():
        if model in models and not any(products.get(d, 0) for d in directions):
            problems.append(f"fault model {model}: no float32 matrix product (mm, addmm, bmm, baddbmm, "
                            f"convolution) was counted in the {' or '.join(directions)} pass of a step")
    for model in LINEAR_MODELS:
        if model in models and not linears:
            problems.append(f"fault model {model}: the model has no nn.Linear module")
    others = sorted(str(d).removeprefix("torch.") for d in dtypes if d != torch.float32)
    for model in FLOAT32_MODELS:
        if model in models and others:
            problems.append(f"fault model {model}: the bit flips are float32's, and trainable parameters are "
                            f"{', '.join(others)}")
    return [f"--job {spec!r}: {p}; leave it out of --models" for p in problems]
