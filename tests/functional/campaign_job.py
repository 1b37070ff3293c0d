"""A team's own job for the campaign (``--job tests.functional.campaign_job:mlp_job``): not the reference TinyGPT.

A 2-layer MLP classifier trained with SGD and momentum on its own seeded
data: points in 12 dimensions labelled by which of 4 fixed directions they
lie closest to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sdcguard.campaign.job import CampaignJob

FEATURES, HIDDEN, CLASSES, BATCH = 12, 24, 4, 32


class Mlp(nn.Module):
    """Two Linear layers with a ReLU between them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def mlp_job(seed: int) -> CampaignJob:
    """The MLP job: ``build``, a deterministic ``batch_for`` and a cross-entropy ``loss_fn``."""
    directions = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(seed + 7))

    def build(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = Mlp().to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def batch_for(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
        x = torch.randn(BATCH, FEATURES, generator=g)
        return x, (x @ directions.T).argmax(dim=1)

    def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, labels = batch
        return F.cross_entropy(module(x), labels)

    return CampaignJob(build=build, batch_for=batch_for, loss_fn=loss_fn)


class Scale(nn.Module):
    """No nn.Linear and no matrix product: one learnt weight per feature."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(FEATURES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def scale_job(seed: int) -> CampaignJob:
    """A job the product and activation fault models cannot corrupt (the campaign must say so)."""

    def build(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = Scale().to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    def batch_for(step: int, rank: int) -> torch.Tensor:
        return torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(seed + step * 101 + rank))

    return CampaignJob(build=build, batch_for=batch_for, loss_fn=lambda module, x: module(x).square().mean())
