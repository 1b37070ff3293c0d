"""Detector 1 (non-finite gradients) and the reduced-gradient comparison, in one DDP communication hook.

The hook wraps each bucket's all-reduce. Before it, the local (this rank's
own) gradients are tested for NaN/Inf, which names the rank that made them,
their norm is taken (the magnitude trigger's statistic and part of the
rank's claim that a confirmation checks), and they are divided by the world
size; on audit steps the per-parameter fingerprints of the local gradients
are recorded for the ring audit (digests, never copies). After it, the
reduced gradients are tested again and fingerprinted: every rank must have
received the same bits. The results stay on the device as small tensors;
:meth:`GradientHook.summary` packs them into one int64 vector.

Done one by one, those checks are five passes over every gradient besides
the division, each about as long as a memory copy. On the CPU the C kernel
does each side in one (:func:`local_pass`, :func:`reduced_pass`): the sum of
squares and the division before, the fingerprint and the sum of squares
after; the non-finite flag comes with the sum (``agent.grad_norm``). The
results are the bits the separate passes give.

Two facts shape the code. DDP rebuilds its buckets after the first step, so
nothing is cached by bucket index across steps. The ``.then`` callbacks run on
gloo threads concurrently with later hook calls, so every bucket writes only
its own dictionary entry and no scratch buffer is shared.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agent import fingerprint as fp
from agent import grad_norm, native

# Bucket masks are one int64 word each; buckets beyond this still count in the
# any-flags, they are only left out of the per-bucket evidence.
MASK_BUCKETS = 63

# Layout of the per-step summary vector.
LOCAL_ANY, REDUCED_ANY, LOCAL_MASK, REDUCED_MASK, LOSS_NONFINITE = range(5)
REDUCED_FP = slice(5, 8)
SUMMARY_WIDTH = 8
MAX_EVIDENCE_BUCKETS = 4096
"""The contract's bound on evidence items."""


_CPU_FLAGS = (torch.zeros((), dtype=torch.bool), torch.ones((), dtype=torch.bool))
"""Shared, read-only answers of the CPU path (callers only stack and reduce them)."""


def nonfinite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on ``t``'s device: does ``t`` hold a NaN or an infinity?

    On the CPU, for a contiguous fp16/bf16/fp32/fp64 tensor, the C kernel
    scans the raw bits (exponent all ones) in one pass; measured ~1 ms less
    per step on the reference job than the five torch ops below. Elsewhere
    ``aminmax`` does it (a NaN propagates into both results, an infinity shows
    as an extreme; ~13x faster than ``isfinite().all()`` on CPU), with no host
    synchronisation.
    """
    if t.numel() == 0 or not t.is_floating_point():
        return torch.zeros((), dtype=torch.bool, device=t.device)
    if t.device.type == "cpu" and t.is_contiguous():
        float_format = native.FLOAT_FORMATS.get(str(t.dtype).removeprefix("torch."))
        kernel = native.kernel() if float_format else None
        if kernel is not None and float_format is not None:
            return _CPU_FLAGS[kernel.nonfinite(t.data_ptr(), t.numel(), float_format)]
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return ~(torch.isfinite(lo) & torch.isfinite(hi))


@dataclass(frozen=True)
class BucketPass:
    """What one pass over a bucket found; None where it was not asked for."""

    nonfinite: torch.Tensor | None = None
    """0-dim bool on the bucket's device: does it hold a NaN or an infinity?"""
    norm: torch.Tensor | None = None
    """0-dim, ``grad_norm.bucket_norm`` (fp64 on the CPU)."""
    fingerprint: torch.Tensor | None = None
    """int64 [3], ``fingerprint.fingerprint``."""


def measure(t: torch.Tensor, *, flag: bool, norm: bool) -> BucketPass:
    """``nonfinite_flag(t)`` and ``grad_norm.bucket_norm(t)``, as asked; one pass where the C kernel reads ``t``."""
    return _local(t, None, flag=flag, norm=norm)


def local_pass(buffer: torch.Tensor, divisor: int, *, flag: bool, norm: bool) -> BucketPass:
    """Before the all-reduce: ``measure(buffer)``, then ``buffer.div_(divisor)`` (the all-reduce sums, the hook
    wants the mean), with the same bits; one pass on the CPU for fp32 (halves: the kernel's pass, then torch's
    division, which rounds through fp32)."""
    return _local(buffer, divisor, flag=flag, norm=norm)


def _local(t: torch.Tensor, divisor: int | None, *, flag: bool, norm: bool) -> BucketPass:
    readable = grad_norm.kernel_for(t) if flag or norm else None
    if readable is None:
        found = BucketPass(nonfinite_flag(t) if flag else None, grad_norm.bucket_norm(t) if norm else None)
        if divisor is not None:
            t.div_(divisor)
        return found
    kernel, float_format = readable
    if divisor is not None and str(t.dtype).removeprefix("torch.") in native.DIVIDE_FORMATS:
        total = kernel.sum_of_squares_divide(t.data_ptr(), t.numel(), float_format, divisor)
    else:
        total = kernel.sum_of_squares(t.data_ptr(), t.numel(), float_format)
        if divisor is not None:
            t.div_(divisor)
    return _from_sum(total, flag=flag, norm=norm)


def reduced_pass(reduced: torch.Tensor, *, flag: bool, fingerprint: bool, norm: bool) -> BucketPass:
    """After the all-reduce: ``nonfinite_flag``, ``fingerprint.fingerprint`` and ``grad_norm.bucket_norm`` of
    ``reduced``, as asked; one pass where the C kernel reads it, with the bits of the separate ones."""
    readable = grad_norm.kernel_for(reduced) if flag or norm else None
    if readable is None:
        return BucketPass(nonfinite_flag(reduced) if flag else None,
                          grad_norm.bucket_norm(reduced) if norm else None,
                          fp.fingerprint(reduced) if fingerprint else None)
    kernel, float_format = readable
    lanes = None
    if fingerprint:
        lanes = torch.zeros(fp.LANES, dtype=torch.int64)
        total = kernel.fingerprint_sum_of_squares(reduced.data_ptr(), reduced.numel(), float_format,
                                                  lanes.data_ptr())
        lanes.add_(fp.descriptor_lanes(reduced))
    else:
        total = kernel.sum_of_squares(reduced.data_ptr(), reduced.numel(), float_format)
    return _from_sum(total, flag=flag, norm=norm, fingerprint=lanes)


def _from_sum(total: float, *, flag: bool, norm: bool, fingerprint: torch.Tensor | None = None) -> BucketPass:
    """A kernel's sum of squares of halves or singles as the flag (not finite exactly when an element is not)
    and the norm."""
    total = grad_norm.canonical(total)
    return BucketPass(_CPU_FLAGS[not math.isfinite(total)] if flag else None,
                      grad_norm.norm_from_sum(total) if norm else None, fingerprint)


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


def gradients_fingerprint(grads: list[torch.Tensor]) -> torch.Tensor:
    """The fingerprint of a bucket's gradients laid end to end, in the bucket's order (what both audit sides compare).

    The gradients are not concatenated: ``fingerprint_concat`` streams them."""
    if not grads:
        return fp.fingerprint(torch.zeros(0))
    return fp.fingerprint_concat(grads)


def _comm_hook(state, bucket):
    # Deliberately unannotated: DDP compares the annotations of ``bucket`` and
    # the return value with the real classes, and postponed annotations are strings.
    return state.on_bucket(bucket)


def buckets_of(mask: int) -> list[int]:
    """The bucket indices whose bits are set in ``mask``."""
    return [i for i in range(MASK_BUCKETS) if mask >> i & 1]


@dataclass(frozen=True)
class NonFiniteVerdict:
    """What detector 1 concluded for one step from every rank's summary."""

    local_ranks: list[int]
    """Ranks whose own gradients were non-finite."""
    reduced_ranks: list[int]
    """Ranks whose reduced gradients were non-finite."""
    loss_ranks: list[int]
    """Ranks whose loss was non-finite."""
    buckets: list[tuple[int, int, str]]
    """(rank, bucket, "local" | "reduced") for the evidence."""

    @property
    def clean(self) -> bool:
        """Nothing non-finite anywhere."""
        return not (self.local_ranks or self.reduced_ranks)


def judge_nonfinite(summaries: torch.Tensor) -> NonFiniteVerdict:
    """Detector 1's reading of the gathered summaries (``[world, SUMMARY_WIDTH]`` int64, on the CPU).

    Vectorised: the Python work is proportional to the ranks that saw
    something, not to the world."""
    s = summaries[:, :SUMMARY_WIDTH]
    local = torch.nonzero(s[:, LOCAL_ANY]).reshape(-1).tolist()
    reduced = torch.nonzero(s[:, REDUCED_ANY]).reshape(-1).tolist()
    loss = torch.nonzero(s[:, LOSS_NONFINITE]).reshape(-1).tolist()
    buckets: list[tuple[int, int, str]] = []
    for rank in sorted(set(local) | set(reduced)):
        if len(buckets) >= MAX_EVIDENCE_BUCKETS:
            break  # the alarm carries at most this many; the rank lists stay whole
        local_mask, reduced_mask = int(s[rank, LOCAL_MASK]), int(s[rank, REDUCED_MASK])
        buckets += [(rank, b, "local") for b in buckets_of(local_mask)]
        buckets += [(rank, b, "reduced") for b in buckets_of(reduced_mask)]
    return NonFiniteVerdict(local_ranks=local, reduced_ranks=reduced, loss_ranks=loss, buckets=buckets[:MAX_EVIDENCE_BUCKETS])


def reduced_fingerprints(summaries: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's reduced-gradient fingerprint lanes from the gathered summaries."""
    return [summaries[r, REDUCED_FP] for r in range(summaries.shape[0])]
