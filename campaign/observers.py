"""What a team's own monitoring would see of a run, read from outside the guard: the baselines' inputs.

``GradNormProbe`` reads each rank's local gradient norm (the MAD baseline's
input; the loss comes from the step's result). ``ReducedGradWatch`` reads the
reduced gradients where the optimizer takes them, for the facts that prove a
detector silent without training its run (``detectors.silence_shown_by``).
"""

from __future__ import annotations

import hashlib
import math

import torch


class GradNormProbe:
    """The local gradient norm of each step's first pass.

    Tensor hooks on the parameters see each local gradient before DDP
    reduces it; only the first pass of a step counts (not an audit's
    recomputation). Install it after a fault's hooks, so it sees their work.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.passes = -1
        self.squares: list[torch.Tensor] = []
        self.handles = [module.register_forward_pre_hook(lambda *_: setattr(self, "passes", self.passes + 1))]
        for p in module.parameters():
            if p.requires_grad:
                self.handles.append(p.register_hook(self._grad))

    def _grad(self, grad: torch.Tensor) -> None:
        if self.passes == 0:
            self.squares.append(grad.detach().double().pow(2).sum())

    def begin_step(self) -> None:
        """Forget the last step's gradients (call before each step)."""
        self.passes = -1
        self.squares = []

    def norm(self) -> float:
        """This step's local gradient norm (NaN when no gradient was seen)."""
        return float(torch.stack(self.squares).sum().sqrt()) if self.squares else math.nan

    def remove(self) -> None:
        """Take the hooks out."""
        for h in self.handles:
            h.remove()


class ReducedGradWatch:
    """Whether the reduced gradients were finite on this rank at every step, and a digest of their bits over
    all steps (equal digests on every rank: every rank received the same reduced gradients at every step).

    Read where the optimizer takes them, in its step pre-hook."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.finite = True
        self.chain = hashlib.sha256()
        self.handle = optimizer.register_step_pre_hook(lambda *_: self._read())

    def _read(self) -> None:
        grads = [p.grad.detach().reshape(-1) for p in self.params if p.grad is not None]
        flat = torch.cat(grads) if grads else torch.zeros(0)
        self.finite = self.finite and bool(torch.isfinite(flat).all())
        self.chain.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())

    def words(self) -> list[float]:
        """The digest as eight 32-bit words (exact in the float64 rows the ranks gather)."""
        digest = self.chain.digest()
        return [float(int.from_bytes(digest[i:i + 4], "little")) for i in range(0, 32, 4)]

    def remove(self) -> None:
        """Take the hook out."""
        self.handle.remove()
