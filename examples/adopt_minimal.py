"""A plain DDP loop under sdcguard. Run it with: torchrun --nproc-per-node 2 examples/adopt_minimal.py"""

import os

import torch
import torch.distributed as dist
from torch import nn

from sdcguard.agent import GuardConfig, SDCGuard

dist.init_process_group("gloo")  # "nccl" on GPUs, with the model on this rank's device
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(module, batch):  # the scalar loss of one micro-batch
    x, y = batch
    return nn.functional.mse_loss(module(x), y)


def batch_for(step, rank):  # the exact micro-batch `rank` trains on at `step` (the audit recomputes it)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step * 4099 + rank))
    return x, x.sum(dim=1, keepdim=True)


total_steps, save_every = int(os.environ.get("STEPS", 1000)), int(os.environ.get("SAVE_EVERY", 500))
guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for, config=GuardConfig.from_env())
for step in range(guard.resume_step(), total_steps):  # where the resume pointer says, else 0
    guard.step(step)  # forward, backward, the checks that are due, then the update; on an alarm: exit 87
    if (step + 1) % save_every == 0:
        guard.save_checkpoint(step + 1)  # replicas must agree first; their fingerprint goes in the manifest
dist.destroy_process_group()
