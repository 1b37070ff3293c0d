"""The loop of ``gpt_ddp_plain.py`` under sdcguard: the same model, data, optimizer, schedule,
accumulation, clipping, bf16 autocast and checkpoint cadence; the guard runs each step.

    torchrun --nproc-per-node 8 examples/gpt_ddp_guarded.py --steps 2000
    python examples/gpt_ddp_guarded.py --spawn 3x2 --steps 20    # 3 simulated nodes of 2 ranks, gloo, CPU

The difference between the two files is what adopting the guard takes. Every
``SDCGUARD_*`` variable still applies (``GuardConfig.from_env``); the loop's own
flags win. On an alarm every rank exits with code 87 (``on_alarm="stop"``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from gpt_launch import parse_spawn, spawn
from gpt_model import GPT, GPTConfig, TokenSampler, loss_fn
from torch import nn

from sdcguard.agent import GuardConfig, SDCGuard


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100, help="steps of linear warm-up before the cosine decay")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--checkpoint-dir", default="checkpoints", help="a folder, or s3://bucket/prefix")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spawn", default="", metavar="NODESxRANKS", help="run here as a local job (gloo), e.g. 3x2")
    return p


def warmup_cosine(warmup: int, total: int, floor: float = 0.1) -> Callable[[int], float]:
    """The factor on the base learning rate: linear warm-up, then cosine decay to ``floor``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


@torch.no_grad()
def evaluate(model: nn.Module, data: TokenSampler) -> float:
    """Mean held-out loss over all ranks."""
    model.eval()
    losses = torch.stack([loss_fn(model, batch) for batch in data.held_out(4)])
    model.train()
    mean = losses.mean().reshape(1)
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    cfg = GPTConfig(seq=args.seq, dim=args.dim, layers=args.layers)
    model = nn.parallel.DistributedDataParallel(GPT(cfg).to(device),
                                                device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.module.param_groups(0.1), lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))
    scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "float16")
    data = TokenSampler(cfg, args.micro_batch, args.accum, device, seed=args.seed)
    config = GuardConfig.from_env(grad_accum_steps=args.accum, max_grad_norm=args.max_grad_norm,
                                  autocast_dtype=None if args.dtype == "float32" else args.dtype,
                                  checkpoint_prefix=args.checkpoint_dir, seed=args.seed)
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=data, scheduler=scheduler, scaler=scaler,
                     config=config)

    # The checkpoint the resume pointer names (after an alarm: the last one before the suspect window).
    for step in range(guard.resume_step(), args.steps):
        # Every micro-batch's forward and backward, the checks, then clip, update and schedule (or skip all).
        result = guard.step(step)

        if rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {result.loss:.4f} grad_norm {result.grad_norm:.3f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            held_out = evaluate(model.module, data)
            if rank == 0:
                print(f"step {step + 1} held-out loss {held_out:.4f}", flush=True)
        if (step + 1) % args.checkpoint_every == 0:  # every rank: the replicas must agree before it is saved
            guard.save_checkpoint(step + 1)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.spawn:
        return spawn(*parse_spawn(args.spawn), train, args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
