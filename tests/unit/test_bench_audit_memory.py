"""The "memory" part of ``./dev bench agent``: it measures what it says, on a tiny model."""

from __future__ import annotations

import pytest
import torch

from benchmarks import audit_memory
from sdcguard.agent.testing.train import JobShape, TinyGPT

TINY = JobShape(vocab=32, dim=16, heads=2, layers=1, seq=8, batch=2)


def test_the_peak_counts_what_is_alive_together_not_what_was_allocated_in_all() -> None:
    def two_at_once() -> None:
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.empty(2000, dtype=torch.float32)
        del a, b
        c = torch.empty(500, dtype=torch.float32)
        del c

    assert audit_memory.peak_allocated(two_at_once) == 12_000


def test_an_audit_step_holds_about_one_more_set_of_gradients_with_one_micro_batch() -> None:
    # A shape whose parameters outweigh its activations, so that the gradient sets show.
    shape = JobShape(vocab=256, dim=64, heads=2, layers=1, seq=8, batch=2)
    one = audit_memory.audit_memory(shape, 1)
    two = audit_memory.audit_memory(shape, 2)
    assert one["params"] == two["params"] == sum(
        p.numel() * 4 for p in TinyGPT(256, 64, 2, 1, 8, shape.dropout).parameters())
    # One micro-batch: the recomputed gradients while .grad holds the step's (and small state saved around it).
    assert one["params"] <= one["extra"] <= 1.1 * one["params"]
    # More: their running sum and the next micro-batch's gradients are alive together.
    assert two["extra"] > 1.5 * two["params"]


def test_the_part_prints_a_row_per_micro_batch_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert audit_memory.memory_table(TINY, (1, 2)) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 2
