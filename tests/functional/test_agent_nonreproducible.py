"""Work that cannot be reproduced is never a hardware alarm (issue 24), on 3 simulated nodes (gloo, world 3).

A model whose forward adds run-to-run noise (1e-6 and 1e-3 relative per output
element, drawn from ``os.urandom``, which nothing seeds: what a non-deterministic kernel does)
is audited every step: every recomputation differs from the owner and from the
other, so no alarm names a rank and each step says the computation is not
reproducible. A ``batch_for`` that draws from unseeded state is refused at
start, naming ``batch_for``. The same model without the noise trains
silently.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sdcguard.agent.batches import BatchNotReplayable
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.testing.train import init_process_group, shutdown
from tests.forked import launch_forked
from tests.outbox import Outbox

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 3




def _unseeded(like: torch.Tensor) -> torch.Tensor:
    """Numbers in [-1, 1) shaped like ``like``, from the OS: no seed the guard sets reaches them. One per
    element, as a non-deterministic kernel perturbs each output on its own (1e-6 of an fp32 number near 1 is
    one of about 25 values, so one shared draw would repeat itself one time in twenty)."""
    raw = torch.frombuffer(bytearray(os.urandom(4 * like.numel())), dtype=torch.int32).to(torch.float64)
    return (raw / 2**31).reshape(like.shape).to(like.dtype)


def _run(work: str, noise: float, loader: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def batch_for(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        if loader == "global":  # nanoGPT's get_batch: offsets from the global RNG
            x = torch.randn(4, 8)
        else:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
        return x, x.sum(dim=1, keepdim=True)

    def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = module(batch[0])
        if noise:
            out = out * (1.0 + noise * _unseeded(out))
        return F.mse_loss(out, batch[1])

    config = GuardConfig(on_alarm="continue", on_nonreproducible="continue", ranks_per_node=1, audit_every=1,
                         fingerprint_every=1, trigger_ratio=0.0, spool_dir=os.path.join(work, "spool"),
                         checkpoint_prefix=os.path.join(work, "ckpt"), job_name="nonreproducible-test")
    outbox = Outbox(config)
    try:
        guard = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=batch_for, config=config, publisher=outbox,
                         injection=None)
    except BatchNotReplayable as exc:
        return {"refused": str(exc)}
    results = [guard.step(s) for s in range(STEPS)]
    return {"alarms": [a.model_dump(mode="json") for a in guard.alarms],
            "nonreproducible": [r.nonreproducible for r in results], "updated": [r.updated for r in results],
            "audited": [r.audited for r in results]}


def ranks(out_dir: str) -> None:
    """Every rank: each case in turn, then ``out_dir/rank-R.json``."""
    init_process_group()
    rank = dist.get_rank()
    results = {}
    for name, noise, loader in (("clean", 0.0, "seeded"), ("noise_1e-6", 1e-6, "seeded"),
                                ("noise_1e-3", 1e-3, "seeded"), ("global_rng", 0.0, "global")):
        results[name] = _run(os.path.join(out_dir, name), noise, loader)
        dist.barrier()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(results))
    shutdown()


@pytest.fixture(scope="module")
def three() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        codes = launch_forked(3, ranks, (out,), preload=("sdcguard.agent.guard",))
        assert codes == [0, 0, 0]
        return [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(3)]


def test_the_model_without_noise_trains_silently(three: list[dict[str, Any]]) -> None:
    for rank in three:
        assert rank["clean"]["alarms"] == []
        assert all(rank["clean"]["audited"])
        assert all(rank["clean"]["updated"])
        assert not any(rank["clean"]["nonreproducible"])


@pytest.mark.parametrize("case", ["noise_1e-6", "noise_1e-3"])
def test_noise_like_a_nondeterministic_kernel_blames_no_rank_and_says_so(three: list[dict[str, Any]],
                                                                          case: str) -> None:
    for rank in three:
        # No alarm names a rank...
        assert all(not alarm["suspects"] for alarm in rank[case]["alarms"])
        # ... and every audited step says the computation is not reproducible (its update skipped).
        assert all(rank[case]["nonreproducible"])
        assert not any(rank[case]["updated"])


def test_a_loader_that_draws_from_unseeded_state_is_refused_at_start(three: list[dict[str, Any]]) -> None:
    for rank in three:
        assert "is not replayable" in rank["global_rng"]["refused"]
        assert "batch_for(0, " in rank["global_rng"]["refused"]
