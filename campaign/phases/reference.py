"""(1) The clean reference run: trained from step 0, its state kept at the start of every step.

Every other run starts from one of these states, and every faulted run's
end is compared with one. Step 1 is also the census of the model's work
(``ModelShape``), which the fault models need.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from sdcguard.campaign.injectors import ModelShape
from sdcguard.campaign.job import JobProblem, measured_problems
from sdcguard.campaign.observers import GradNormProbe
from sdcguard.campaign.rank import Rank
from sdcguard.campaign.records import ReferenceRecord
from sdcguard.campaign.step_census import StepCensus
from sdcguard.campaign.training_run import TrainingRun

CENSUS_STEP = 1
"""The clean step whose products and all-reduces are counted."""


def run(rank: Rank) -> None:
    """Train the clean run, keep it in ``rank.clean``, measure ``rank.shape``, and write the reference record.

    Raises JobProblem (on every rank alike) when the model lacks what the planned fault models corrupt."""
    end = rank.settings.last_step
    guard, module, optimizer = rank.guard("none", None)
    census = StepCensus()

    @contextlib.contextmanager
    def counted(step: int) -> Iterator[None]:
        if step != CENSUS_STEP:
            yield
            return
        # The micro-batch is made (and cached) first: products of the job's own data pipeline are no products
        # of the model, and the faulted runs, which read the cache, never compute them.
        rank.data(step, rank.rank)
        with census.counting():
            yield

    probe = GradNormProbe(module)
    training = TrainingRun(guard, probe)
    started = time.perf_counter()
    training.train(range(end), before=lambda step: rank.clean.keep(step, module, optimizer), around=counted)
    rank.clean.keep(end, module, optimizer)
    probe.remove()
    rank.shape = shape = ModelShape(
        products=dict(census.products), allreduces=census.allreduces,
        linears=[n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)],
        params=[(n, p.numel()) for n, p in module.named_parameters() if p.requires_grad])
    seconds = time.perf_counter() - started
    losses, norms = training.losses, training.norms
    del guard, training
    problems = measured_problems(rank.settings.job, {f.model for f in rank.plan.faults}, shape.products,
                                 shape.linears, {p.dtype for p in module.parameters() if p.requires_grad})
    if problems:
        raise JobProblem("; ".join(problems))
    series = rank.group.gather(losses + norms)
    model = type(module)
    rank.write(ReferenceRecord(
        steps=end, seconds=seconds, shape=shape, model=f"{model.__module__}.{model.__qualname__}",
        trainable=sum(n for _, n in shape.params),
        losses=[[series[r][s] for r in range(rank.world)] for s in range(end)],
        norms=[[series[r][end + s] for r in range(rank.world)] for s in range(end)]))
