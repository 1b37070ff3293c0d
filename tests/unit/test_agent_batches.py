"""What batch_for must return, the micro-batch digest, and the start-up check that batch_for replays."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sdcguard.agent.batches import (
    BatchNotReplayable,
    batch_digest,
    check_replayable,
    difference,
    micro_batches,
)

CPU = torch.device("cpu")
DATA = torch.arange(1000)


def nanogpt_get_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """karpathy/nanoGPT's get_batch as a batch_for: offsets from the global RNG, whatever (step, rank)."""
    ix = torch.randint(len(DATA) - 9, (4,))
    x = torch.stack([DATA[i:i + 8] for i in ix])
    y = torch.stack([DATA[i + 1:i + 9] for i in ix])
    return x, y


def seeded_get_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, replayable: a generator seeded per (step, rank)."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    ix = torch.randint(len(DATA) - 9, (4,), generator=generator)
    x = torch.stack([DATA[i:i + 8] for i in ix])
    y = torch.stack([DATA[i + 1:i + 9] for i in ix])
    return x, y


def test_a_loader_drawing_from_the_global_rng_is_not_replayable_and_the_error_says_so() -> None:
    with pytest.raises(BatchNotReplayable) as caught:
        check_replayable(nanogpt_get_batch, 3, 1, 1, CPU)
    message = str(caught.value)
    assert message.startswith("batch_for(3, 1) is not replayable: micro-batch 0, [0] (shape (4, 8)) differs")
    assert "a seeded torch.Generator per (step, rank), not the global RNG" in message
    assert (caught.value.step, caught.value.rank) == (3, 1)
    assert isinstance(caught.value, RuntimeError)


def test_a_seeded_loader_replays_and_the_check_leaves_the_global_rng_alone() -> None:
    before = torch.get_rng_state()
    batches = check_replayable(seeded_get_batch, 3, 1, 1, CPU)
    assert torch.equal(torch.get_rng_state(), before)
    assert len(batches) == 1
    assert torch.equal(batches[0][0], seeded_get_batch(3, 1)[0])
    # Even the global-RNG loader's failed check leaves the random state as it found it.
    with pytest.raises(BatchNotReplayable):
        check_replayable(nanogpt_get_batch, 0, 0, 1, CPU)
    assert torch.equal(torch.get_rng_state(), before)


def test_what_batch_for_returns_must_fit_grad_accum_steps_and_the_error_names_batch_for() -> None:
    x, y = seeded_get_batch(0, 0)
    # K = 1: the bare micro-batch.
    assert micro_batches(lambda s, r: (x, y), 0, 0, 1)[0][0] is x
    with pytest.raises(ValueError, match=r"^batch_for: returned a list of 1 micro-batch .* the bare micro-batch"):
        micro_batches(lambda s, r: [(x, y)], 0, 0, 1)
    # K = 3: a sequence of three.
    assert len(micro_batches(lambda s, r: [(x, y)] * 3, 0, 0, 3)) == 3
    with pytest.raises(ValueError, match=r"^batch_for: returned 2 micro-batches for step 0, rank 0; grad_accum_steps "
                                         r"is 3 \(it looks like one micro-batch of 2 tensors\); with grad_accum_steps "
                                         r"3 it must return a sequence"):
        micro_batches(lambda s, r: (x, y), 0, 0, 3)
    with pytest.raises(ValueError, match=r"^batch_for: returned a tensor of shape \(4, 8\) for step 2, rank 1; "):
        micro_batches(lambda s, r: x, 2, 1, 2)
    with pytest.raises(ValueError, match=r"^batch_for: returned a dict "):
        micro_batches(lambda s, r: {"x": x}, 0, 0, 2)
    # K = 2 and one (inputs, targets) micro-batch of two dtypes: a tuple where a list of 2 was due.
    with pytest.raises(ValueError, match=r"^batch_for: returned 2 tensors of different dtypes .* looks like one "
                                         r"micro-batch"):
        micro_batches(lambda s, r: (x.float(), y), 0, 0, 2)
    with pytest.raises(ValueError, match=r"^k: must be >= 1"):
        micro_batches(lambda s, r: x, 0, 0, 0)


def test_the_digest_sees_every_input_and_the_difference_names_the_first_that_differs() -> None:
    def batch(**change: Any) -> list[Any]:
        parts: dict[str, Any] = {"ids": torch.arange(6).reshape(2, 3), "mask": torch.ones(2, 3), "causal": True}
        parts.update(change)
        return [(parts["ids"], {"mask": parts["mask"], "causal": parts["causal"]})]

    base = batch_digest(batch(), CPU)
    assert base.dtype == torch.int64
    assert base.shape == (3,)
    assert torch.equal(batch_digest(batch(), CPU), base)
    assert difference(batch(), batch()) is None
    changed = {
        "a value": batch(ids=torch.arange(6).reshape(2, 3) + (torch.arange(6).reshape(2, 3) == 5)),
        "a shape": batch(ids=torch.arange(6).reshape(3, 2)),
        "a dtype": batch(mask=torch.ones(2, 3, dtype=torch.float64)),
        "a plain leaf": batch(causal=False),
    }
    for what, other in changed.items():
        assert not torch.equal(batch_digest(other, CPU), base), what
    assert difference(batch(), changed["a value"]) == "micro-batch 0, [0] (shape (2, 3)) differs in its values"
    assert difference(batch(), changed["a shape"]) == "micro-batch 0, [0] has shape (2, 3), then (3, 2)"
    assert difference(batch(), changed["a plain leaf"]) == "micro-batch 0, [1], ['causal'] is True, then False"
    assert difference(batch(), batch() * 2) == "1 micro-batches, then 2"
    # A dict built in another order is the same micro-batch.
    reordered = [(batch()[0][0], {"causal": True, "mask": torch.ones(2, 3)})]
    assert torch.equal(batch_digest(reordered, CPU), base)


def test_the_digest_is_made_on_the_requested_device_whatever_device_the_batch_is_on() -> None:
    # The meta device refuses a CPU tensor beside its own (as CUDA does), so a CPU-made lane would raise.
    meta = torch.device("meta")
    on_cpu = batch_digest([(torch.ones(4, 8), torch.zeros(4, dtype=torch.int64), 3)], meta)
    on_meta = batch_digest([(torch.ones(4, 8, device=meta), 3)], meta)
    assert (on_cpu.device, on_meta.device) == (meta, meta)
    assert on_cpu.shape == (3,)
