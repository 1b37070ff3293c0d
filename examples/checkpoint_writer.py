"""Verified checkpoints without the guard: CheckpointWriter by hand, in a plain DDP loop.

Run it with: torchrun --nproc-per-node 2 examples/checkpoint_writer.py
(CHECKPOINT_PREFIX=s3://bucket/prefix for S3; a folder by default). Run it
again and it resumes from the checkpoint RESUME.json names.
"""

import os

import torch
import torch.distributed as dist
from torch import nn

from sdcguard.agent.checkpoint import CheckpointWriter
from sdcguard.agent.weights import state_fingerprint_hex

dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.parallel.DistributedDataParallel(nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)


def fingerprint():  # this replica's fingerprint of its weights and optimizer state
    return state_fingerprint_hex(list(model.parameters()), optimizer)


def agreed_fingerprint():  # what every replica holds: never save state the replicas disagree on
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, fingerprint())
    if len(set(every)) != 1:
        raise RuntimeError(f"replicas hold different weights: {every}")
    return every[0]


ckpt = CheckpointWriter(os.environ.get("CHECKPOINT_PREFIX", "checkpoints"))  # s3://bucket/prefix or a folder
loaded = ckpt.load(model=model, optimizer=optimizer, fingerprint_fn=fingerprint)  # every rank, together
start = loaded.step if loaded else 0  # None: nothing to resume from, a fresh start
sample = loaded.data_position["sample"] if loaded else 0  # where the data stream was
if rank == 0:
    print(f"starting at step {start}", flush=True)

total_steps, save_every = int(os.environ.get("STEPS", 100)), int(os.environ.get("SAVE_EVERY", 50))
for step in range(start, total_steps):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(sample * 31 + rank))
    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    sample += 1
    if (step + 1) % save_every == 0:  # it holds the updates of steps 0 .. step, so a resume runs step + 1
        ckpt.save(step + 1, model=model, optimizer=optimizer, fingerprint=agreed_fingerprint(),
                  data_position={"sample": sample})
dist.destroy_process_group()
