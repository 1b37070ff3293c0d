"""The DDP communication hook: detector 1 and the reduced-gradient comparison on every bucket's all-reduce.

The hook wraps each bucket's all-reduce. Before it, the local (this rank's
own) gradients are tested for NaN/Inf, which names the rank that made them,
their norm is taken (the magnitude trigger's statistic and part of the
rank's claim that a confirmation checks), and they are divided by the world
size; on audit steps the per-parameter fingerprints of the local gradients
are recorded for the ring audit (digests, never copies). After it, the
reduced gradients are tested again and fingerprinted: every rank must have
received the same bits. The results stay on the device as small tensors;
:meth:`GradientHook.summary` packs them into one int64 vector (the layout of
sdcguard.agent.nonfinite). The FSDP2 counterpart is sdcguard.agent.reduce_scatter_observer.

Two facts shape the code. DDP rebuilds its buckets after the first step, so
nothing is cached by bucket index across steps. The ``.then`` callbacks run on
gloo threads concurrently with later hook calls, so every bucket writes only
its own dictionary entry and no scratch buffer is shared.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from sdcguard.agent import fingerprint as fp
from sdcguard.agent.nonfinite import MASK_BUCKETS, local_pass, nonfinite_flag, reduced_pass


class GradientHook:
    """The communication hook and what it saw during the current step."""

    def __init__(self, names: dict[int, str], world_size: int, group: dist.ProcessGroup | None = None) -> None:
        self.names = names
        """Parameter name by ``id(param)``, to record fingerprints by name."""
        self.world_size = world_size
        self.group = group
        self.check_nonfinite = True
        self.check_reduced = True
        self.measure_norms = True
        """Take each bucket's local-gradient norm (the magnitude trigger and confirmations use it)."""
        self.measure_reduced_norm = False
        """Take each bucket's reduced-gradient norm (the step's gradient norm, when nothing clips)."""
        self.record_params = False
        self.after_reduce: list[Callable[[int, torch.Tensor], None]] = []
        """Observers called with (bucket index, this rank's reduced bucket) before it is checked (fault injection)."""
        self._local: dict[int, torch.Tensor] = {}
        self._reduced: dict[int, torch.Tensor] = {}
        self._reduced_fp: dict[int, torch.Tensor] = {}
        self._norms: dict[int, torch.Tensor] = {}
        self._reduced_norms: dict[int, torch.Tensor] = {}
        self.layout: dict[int, list[str]] = {}
        """Parameter names of each bucket, in the bucket's order: recorded on the first step and on audit
        steps (after the settling pass DDP's layout no longer changes), so a recomputation can be laid out
        as the owner's buckets were."""
        self.param_fingerprints: dict[int, torch.Tensor] = {}
        """Per-parameter fingerprints ``[n, 3]`` of each bucket's local gradients (audit steps)."""

    def begin_step(self, *, record_params: bool) -> None:
        """Forget the previous step; record per-parameter fingerprints this step if asked."""
        self.record_params = record_params
        self._local = {}
        self._reduced = {}
        self._reduced_fp = {}
        self._norms = {}
        self._reduced_norms = {}
        self.param_fingerprints = {}
        if record_params:
            self.layout = {}

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Install this hook on ``ddp`` (DDP allows one hook, before the first backward)."""
        ddp.register_comm_hook(state=self, hook=_comm_hook)

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Check, measure and (audit steps) fingerprint the local gradients, all-reduce (mean), check the result."""
        index = bucket.index()
        buffer = bucket.buffer()
        if self.record_params or index not in self.layout:
            # Listing a bucket's parameters costs per parameter: only when needed.
            self.layout[index] = [self.names.get(id(p), f"bucket{index}.{i}") for i, p in enumerate(bucket.parameters())]
        if self.record_params:
            self.param_fingerprints[index] = fp.fingerprint_many(bucket.gradients())
        # The buffer is the bucket's gradients laid end to end, so a
        # recomputation gets the same norm from their concatenation.
        local = local_pass(buffer, self.world_size, flag=self.check_nonfinite, norm=self.measure_norms)
        if local.nonfinite is not None:
            self._local[index] = local.nonfinite
        if local.norm is not None:
            self._norms[index] = local.norm
        future = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()

        def after(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = done.value()[0]
            for observer in self.after_reduce:
                observer(index, reduced)
            seen = reduced_pass(reduced, flag=self.check_nonfinite, fingerprint=self.check_reduced,
                                norm=self.measure_reduced_norm)
            if seen.nonfinite is not None:
                self._reduced[index] = seen.nonfinite
            if seen.fingerprint is not None:
                self._reduced_fp[index] = seen.fingerprint
            if seen.norm is not None:
                self._reduced_norms[index] = seen.norm
            return reduced

        return future.then(after)

    def local_mask(self, device: torch.device) -> torch.Tensor:
        """A 0-dim int64: bit b set when bucket b's local gradients were non-finite (buckets below MASK_BUCKETS)."""
        keys = sorted(self._local)
        if not keys:
            return torch.zeros((), dtype=torch.int64, device=device)
        weights = torch.tensor([1 << i if i < MASK_BUCKETS else 0 for i in keys], dtype=torch.int64, device=device)
        return (torch.stack([self._local[i] for i in keys]).to(device).to(torch.int64) * weights).sum()

    def bucket_norms(self, device: torch.device) -> torch.Tensor:
        """Each bucket's local-gradient norm in index order, as fp64 (zeros when norms are not measured)."""
        if not self._norms:
            return torch.zeros(len(self.layout), dtype=torch.float64, device=device)
        return torch.stack([self._norms[i] for i in sorted(self._norms)]).to(device, torch.float64)

    def reduced_norm(self, device: torch.device) -> torch.Tensor:
        """The global norm of this step's reduced gradients (0-dim fp64; NaN when not measured)."""
        if not self._reduced_norms:
            return torch.full((), float("nan"), dtype=torch.float64, device=device)
        norms = torch.stack([self._reduced_norms[i] for i in sorted(self._reduced_norms)]).to(device, torch.float64)
        return torch.linalg.vector_norm(norms)

    def summary(self, loss: torch.Tensor, device: torch.device) -> torch.Tensor:
        """This step's findings as an int64 vector of SUMMARY_WIDTH (see the layout constants), on ``device``.

        The any-flags hold counts (non-zero means some bucket was non-finite).
        A handful of ops whatever the bucket count: the flags are stacked once
        and spread into the five flag fields by one cached weight matrix."""
        local = sorted(self._local)
        reduced = sorted(self._reduced)
        flags = torch.stack([*(self._local[i] for i in local), *(self._reduced[i] for i in reduced),
                             nonfinite_flag(loss).to(device)]).to(torch.int64)
        fields = (flags.unsqueeze(1) * _flag_weights(tuple(local), tuple(reduced), device)).sum(0)
        if self._reduced_fp:
            rows = torch.stack([self._reduced_fp[i] for i in sorted(self._reduced_fp)])
            lanes = fp.combine(rows).to(device)
        else:
            lanes = torch.zeros(fp.LANES, dtype=torch.int64, device=device)
        return torch.cat([fields, lanes])


@functools.lru_cache(maxsize=64)
def _flag_weights(local: tuple[int, ...], reduced: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[len(local) + len(reduced) + 1, 5]`` int64: how each flag (local buckets, reduced buckets, the
    loss) adds into LOCAL_ANY, REDUCED_ANY, LOCAL_MASK, REDUCED_MASK and LOSS_NONFINITE.

    Shared and only ever read. Bucket i sets bit i of its mask (buckets at or
    past MASK_BUCKETS count only in the any-flags)."""
    rows = []
    for index in local:
        rows.append([1, 0, 1 << index if index < MASK_BUCKETS else 0, 0, 0])
    for index in reduced:
        rows.append([0, 1, 0, 1 << index if index < MASK_BUCKETS else 0, 0])
    rows.append([0, 0, 0, 0, 1])
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _comm_hook(state, bucket):
    # Deliberately unannotated: DDP compares the annotations of ``bucket`` and
    # the return value with the real classes, and postponed annotations are strings.
    return state.on_bucket(bucket)
