"""Replay capsules of a tiny reference model for the tests: written from a real recomputation, and a
defective "device" to replay them on."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdcguard.agent import capsule as cap
from sdcguard.agent import replay as seeding
from sdcguard.agent.config import AutocastDtype
from sdcguard.agent.determinism import environment_signature
from sdcguard.agent.recompute import recompute_step
from sdcguard.agent.testing.inject import flip_bit
from sdcguard.agent.testing.train import JobShape, SyntheticData, TinyGPT
from sdcguard.agent.testing.train import loss_fn as next_token_loss
from tests.compiled import rounding_otherwise

FACTORY = "tests.capsules:reference_model"
VOCAB, SEQ = 16, 6
ARGS: dict[str, cap.FactoryArg] = {"vocab": VOCAB, "dim": 8, "heads": 2, "layers": 1, "seq": SEQ, "dropout": 0.1}
SHAPE = JobShape(vocab=VOCAB, dim=8, heads=2, layers=1, seq=SEQ, batch=2)
STEP, RANK, SEED = 3, 1, 7
CPU = torch.device("cpu")


def reference_model(vocab: int = 64, dim: int = 32, heads: int = 2, layers: int = 2, seq: int = 16,
                    dropout: float = 0.1) -> tuple[nn.Module, Any]:
    """A capsule factory: the reference job's model (``sdcguard.agent.testing.train.TinyGPT``) of this shape, and its loss."""
    return TinyGPT(vocab, dim, heads, layers, seq, dropout), next_token_loss


def compiled_reference_model(**args: Any) -> tuple[nn.Module, Any]:
    """A capsule factory: :func:`reference_model` compiled (``module.compile()``) by a backend whose code rounds
    otherwise than eager, as inductor's does (``tests.compiled``)."""
    module, loss = reference_model(**args)
    module.compile(backend=rounding_otherwise)
    return module, loss


def tiny_model() -> tuple[nn.Module, Any]:
    """A capsule factory without arguments (the guard gives none): :func:`reference_model` of the tiny shape
    ``ARGS``, the model of tests/functional/test_agent_capsule.py."""
    return reference_model(**ARGS)  # type: ignore[arg-type]


def model() -> tuple[nn.Module, Any]:
    """The tiny reference model with fixed weights, and its loss."""
    torch.manual_seed(0)
    return reference_model(**ARGS)  # type: ignore[arg-type]


def recomputed(k: int = 1, autocast: AutocastDtype | None = None, grad_scale: float | None = None,
               batch: Any = None, eager: bool = False) -> dict[str, Any]:
    """A step of rank RANK recomputed as the guard's audit does, and what write_capsule needs of it
    (``batch``: this one micro-batch instead of K from the reference job's data)."""
    module, loss_fn = model()
    data = SyntheticData(SHAPE, CPU)
    batches = [data(STEP * 10 + i, RANK) for i in range(k)] if batch is None else [batch]
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    scale = None if grad_scale is None else functools.partial(
        torch.mul, other=torch.full((), grad_scale, dtype=torch.float32))

    def autocasting() -> contextlib.AbstractContextManager[Any]:
        return torch.autocast("cpu", dtype=getattr(torch, autocast)) if autocast else contextlib.nullcontext()

    rec = recompute_step(module, loss_fn, batches, [n for n, _ in named], [p for _, p in named],
                         functools.partial(seeding.seed_micro_batch, SEED, STEP, RANK), scale=scale,
                         forward_context=autocasting)
    settings = cap.ReplaySettings.capture(module, seed=SEED, step=STEP, rank=RANK, autocast_dtype=autocast,
                                          grad_scale=grad_scale, eager=eager)
    return {"module": module, "batches": batches, "settings": settings,
            "expected": cap.Expected.from_recomputation(rec), "signature": environment_signature(CPU),
            "factory": FACTORY, "factory_args": ARGS, "cap_bytes": 10**7}


def write(prefix: Path, **changes: Any) -> cap.CapsuleResult:
    """A capsule of :func:`recomputed` under ``prefix``, with ``changes`` to what write_capsule is given."""
    parts = recomputed(**{k: changes.pop(k) for k in ("k", "autocast", "grad_scale", "batch", "eager")
                          if k in changes})
    parts.update(changes)
    return cap.write_capsule(str(prefix), **parts)


@contextlib.contextmanager
def faulty_device(*, persistent: bool) -> Iterator[None]:
    """Every forward of the model's head flips bit 22 of its first output (only the first one, when
    transient): a defective device as the replay sees it, installed from outside as the injector does."""
    calls = 0

    def hook(module: nn.Module, _inputs: Any, output: Any) -> Any:
        nonlocal calls
        if not (isinstance(module, nn.Linear) and module.out_features == VOCAB):
            return None
        calls += 1
        if not persistent and calls > 1:
            return None
        out = output.clone()
        flip_bit(out, 22)
        return out

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
