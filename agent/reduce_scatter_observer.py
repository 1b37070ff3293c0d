"""The FSDP2 counterpart of the DDP communication hook: every FSDP group's reduce-scatter input, observed.

Each FSDP module's reduce-scatter goes through :class:`ObservedReduceScatter`
(set with ``set_custom_reduce_scatter``). Its input is that group's unsharded
local gradients, laid out by FSDP (``chunk_cat``: S rows of padded shards),
before any communication: a NaN there names the rank that made it, its norm is
the magnitude trigger's statistic and part of a confirmation's claim, and on
audit steps its fingerprint (one per FSDP group) is this rank's record.
During a recomputation the reduce-scatter is answered locally with zeros, so
nothing is sent. The DDP counterpart is sdcguard.agent.ddp_hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from sdcguard.agent import fingerprint as fp
from sdcguard.agent.nonfinite import nonfinite_flag


class GroupFindings:
    """What the reduce-scatter inputs of one pass (the rank's own, or a recomputation) showed, per FSDP group
    in backward order."""

    def __init__(self, *, record: bool) -> None:
        self.record = record
        """Fingerprint each group's input (audit steps, and confirmations on them)."""
        self.flags: list[torch.Tensor] = []
        """Each group's non-finite flag (0-dim bool), when the non-finite check is on."""
        self.rows: list[torch.Tensor] = []
        """Each group's fingerprint lanes, when ``record``."""
        self.norms: list[torch.Tensor] = []
        """Each group's local-gradient norm (fp64), when the observer measures them (trigger, confirmation)."""
        self.names: list[str] = []
        """Each group's FSDP module name."""


class ReduceScatterObserver:
    """The observers of every FSDP group's reduce-scatter input, and what they saw in the current pass.

    ``before_reduce`` observers get (group index in backward order, the
    reduce-scatter input) before it is checked (fault injection);
    ``after_reduce`` observers get (parameter index, this rank's reduced local
    shard) after the backward, before it is checked.
    """

    def __init__(self) -> None:
        self.before_reduce: list[Callable[[int, torch.Tensor], None]] = []
        self.after_reduce: list[Callable[[int, torch.Tensor], None]] = []
        self.check_nonfinite = True
        self.measure_norms = False
        self.communicate = True
        """False during a recomputation: the reduce-scatter is answered locally with zeros."""
        self.findings = GroupFindings(record=False)

    def begin(self, *, record: bool) -> GroupFindings:
        """Start a pass; returns the record of what it will see (per-group fingerprints if ``record``)."""
        self.findings = GroupFindings(record=record)
        return self.findings

    def observe(self, flat: torch.Tensor) -> None:
        """Show one FSDP group's reduce-scatter input to the ``before_reduce`` observers (fault injection),
        before it is sent."""
        for observer in self.before_reduce:
            observer(len(self.findings.names), flat)

    def on_input(self, name: str, flat: torch.Tensor) -> None:
        """One FSDP group's reduce-scatter input: flag, measure, and (when recording) fingerprint it.

        Called once the reduce-scatter is issued (:class:`ObservedReduceScatter`): it reads the input, which
        the reduce-scatter leaves as it is, so on a GPU these kernels are queued on the reduce-scatter
        stream behind the collective's launch and run while it communicates, rather than in front of it."""
        found = self.findings
        found.names.append(name)
        if self.check_nonfinite:
            found.flags.append(nonfinite_flag(flat))
        if self.measure_norms:
            # The same op on the same bits gives the same norm on the rank that recomputes it (one thread,
            # as the guard pins): a claim a confirmation compares bit for bit.
            found.norms.append(torch.linalg.vector_norm(flat, dtype=torch.float64))
        if found.record:
            found.rows.append(fp.fingerprint(flat))


class ObservedReduceScatter(DefaultReduceScatter):
    """FSDP's default reduce-scatter, with the unsharded local gradients shown to the observer first.

    With ``local_only`` (a shard group of one rank, as under tensor parallelism on a ``(G, 1, T)`` mesh) FSDP
    never calls the reduce-scatter: it copies its input to the output and all-reduces that across the
    replicas. The input is then observed as the output buffer is allocated, its last allocation before
    the copy: the local gradients are laid out by then and nothing has been sent."""

    def __init__(self, name: str, observer: ReduceScatterObserver, *, local_only: bool = False) -> None:
        self.name = name
        self.observer = observer
        self.local_only = local_only
        self._pending: torch.Tensor | None = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP's buffer; under ``local_only`` the first of a reduction's two is its input (kept), and the
        second's allocation observes it (see the class)."""
        buffer = super().allocate(size, dtype=dtype, device=device)
        if self.local_only:
            if self._pending is None:
                self._pending = buffer
            else:
                flat, self._pending = self._pending, None
                self.observer.observe(flat)
                self.observer.on_input(self.name, flat)
        return buffer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        observer = self.observer
        observer.observe(input_tensor)
        if not observer.communicate:
            output_tensor.zero_()
            observer.on_input(self.name, input_tensor)
            return None
        # Issue the collective first, then check its input (read-only for both): the checks never delay
        # the reduce-scatter. The input is FSDP's, allocated on this stream, so it outlives these kernels.
        work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        observer.on_input(self.name, input_tensor)
        return work
