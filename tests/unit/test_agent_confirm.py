"""Confirmation before blame, the magnitude trigger and recomputation that changes nothing, as pure functions."""

from __future__ import annotations

import math

import pytest
import torch

from sdcguard.agent import confirm
from sdcguard.agent.confirm import (
    CLAIM_LOSS,
    CLAIM_NORMS,
    NONFINITE,
    Ring,
    judge_confirmations,
    persistence,
    replay_plan,
)
from sdcguard.agent.recompute import preserved, recompute
from sdcguard.agent.ring_audit import loss_bits
from sdcguard.agent.trigger import MagnitudeTrigger

NORM = CLAIM_NORMS
"""Column of a claim's first norm (the micro-batch digest and the loss come first)."""


def claims(world: int, norms: int = 2) -> torch.Tensor:
    """Distinct honest claims: micro-batch digests, loss bits of 1+r, a zero mask, norm-like values."""
    out = torch.zeros(world, CLAIM_NORMS + norms, dtype=torch.int64)
    for r in range(world):
        out[r, :confirm.BATCH_LANES] = 7 * r + torch.arange(confirm.BATCH_LANES) + 1
        out[r, CLAIM_LOSS] = loss_bits(torch.tensor(1.0 + r))
        out[r, CLAIM_NORMS:] = 1000 * r + torch.arange(norms)
    return out


def honest_records(c: torch.Tensor, ring: Ring, owners: set[int]) -> torch.Tensor:
    """What healthy confirmers compute: exactly the owner's claim, in the slots the ring assigns."""
    world, width = c.shape
    records = torch.zeros(world, 2, 1 + width, dtype=torch.int64)
    for rank in range(world):
        for slot, owner in ring.assignments(rank, owners):
            records[rank, slot, 0] = 1
            records[rank, slot, 1:] = c[owner]
    return records


def test_the_ring_confirms_on_the_previous_and_next_node() -> None:
    ring = Ring.of(6, 2)
    assert ring.confirmers(3) == [1, 5]
    assert ring.assignments(1, {3}) == [(0, 3)]
    assert ring.assignments(5, {3}) == [(1, 3)]
    assert Ring.of(4, 2).confirmers(3) == [1]
    assert Ring.of(2, 2).confirmers(1) == [0]  # one node: another GPU of it
    assert not Ring.of(1, 1).possible


def test_a_reproduced_claim_blames_nobody() -> None:
    ring, c = Ring.of(6, 2), claims(6)
    verdict = judge_confirmations(c, honest_records(c, ring, {3}), {3: (NONFINITE,)}, ring)
    assert [o.reproduced for o in verdict.outcomes] == [True]
    assert verdict.mismatched == []
    assert verdict.suspects == []


def test_two_confirmers_that_agree_against_the_owner_name_the_owner() -> None:
    ring, c = Ring.of(6, 2), claims(6)
    records = honest_records(c, ring, {3})
    c[3, NORM] += 1  # the owner's claim is wrong; both recomputations agree with each other
    verdict = judge_confirmations(c, records, {3: (confirm.MAGNITUDE,)}, ring)
    assert verdict.suspects == [3]
    assert verdict.localized
    assert verdict.mismatched[0].majority == 1


def test_a_confirmer_that_disagrees_with_the_other_two_is_the_suspect() -> None:
    ring, c = Ring.of(6, 2), claims(6)
    records = honest_records(c, ring, {3})
    records[5, 1, 1 + NORM] += 1  # rank 5 recomputed rank 3's micro-batch wrongly
    verdict = judge_confirmations(c, records, {3: (confirm.AUDIT,)}, ring)
    assert verdict.suspects == [5]
    assert verdict.localized


def test_three_different_answers_are_nonreproducible_and_blame_nobody() -> None:
    # Given: the owner and both confirmers computed three different results from one micro-batch
    # (what a non-deterministic kernel does).
    ring, c = Ring.of(6, 2), claims(6)
    records = honest_records(c, ring, {3})
    records[1, 0, 1 + NORM] += 1
    records[5, 1, 1 + NORM] += 2
    verdict = judge_confirmations(c, records, {3: (confirm.AUDIT,)}, ring)
    # Then: the computation is not reproducible, and no rank is a suspect.
    assert verdict.nonreproducible == [3]
    assert verdict.suspects == []
    assert verdict.mismatched == []
    assert not verdict.localized
    assert verdict.outcomes[0].nonreproducible
    assert replay_plan(verdict) == {}


def test_two_nodes_name_both_unless_the_owner_alone_made_a_nan() -> None:
    ring, c = Ring.of(4, 2), claims(4)
    records = honest_records(c, ring, {3})
    c[3, NORM] += 1
    assert judge_confirmations(c, records, {3: (confirm.MAGNITUDE,)}, ring).suspects == [1, 3]
    c[3, CLAIM_LOSS] = loss_bits(torch.tensor(math.nan))
    verdict = judge_confirmations(c, records, {3: (NONFINITE,)}, ring)
    assert (verdict.suspects, verdict.localized) == ([3], True)


def test_a_replay_that_now_agrees_is_transient_one_that_does_not_persistent() -> None:
    ring, c = Ring.of(6, 2), claims(6)
    records = honest_records(c, ring, {3})
    right = c[3].clone()
    c[3, NORM] += 1
    verdict = judge_confirmations(c, records, {3: (confirm.MAGNITUDE,)}, ring)
    plan = replay_plan(verdict)
    assert list(plan) == [3]
    replays = witnessed(c, records, ring, plan)
    replays[3, 0, 0] = 1
    replays[3, 0, 1:] = right
    assert persistence(replays, plan, c, records, ring) == "transient"
    replays[3, 0, 1:] = c[3]
    assert persistence(replays, plan, c, records, ring) == "persistent"
    replays[3, 0, 0] = 0
    assert persistence(replays, plan, c, records, ring) == "unknown"


def test_the_trigger_fires_on_a_jump_against_its_own_history_only_after_warmup() -> None:
    trigger = MagnitudeTrigger(4.0, window=8, warmup=4, device=torch.device("cpu"))
    norm = torch.tensor(1.0)
    assert not trigger.fires(torch.tensor(100.0), norm)  # no history yet: never
    for i in range(6):
        assert not trigger.fires(torch.tensor(2.0 + 0.1 * i), torch.tensor(1.0 + 0.05 * i))
        trigger.observe()
    assert not trigger.fires(torch.tensor(2.5), torch.tensor(1.5))  # within 4x
    assert trigger.fires(torch.tensor(9.0), norm)  # the loss rose 4x+
    assert trigger.fires(torch.tensor(2.0), torch.tensor(0.2))  # the norm fell 4x+
    assert trigger.fires(torch.tensor(2.0), torch.tensor(math.inf))  # finite gradients whose squares overflowed
    assert not trigger.fires(torch.tensor(0.1), norm)  # a falling loss is training
    assert not trigger.fires(torch.tensor(math.nan), torch.tensor(math.nan))  # the non-finite check's business
    with pytest.raises(ValueError, match=r"^trigger_ratio:"):
        MagnitudeTrigger(1.0, 8, 4, torch.device("cpu"))


def test_a_trigger_given_another_ones_state_watches_with_its_history() -> None:
    watched = MagnitudeTrigger(4.0, window=8, warmup=4, device=torch.device("cpu"))
    for i in range(6):
        watched.fires(torch.tensor(2.0 + 0.1 * i), torch.tensor(1.0))
        watched.observe()
    fresh = MagnitudeTrigger(4.0, window=8, warmup=4, device=torch.device("cpu"))
    assert not fresh.fires(torch.tensor(9.0), torch.tensor(1.0))  # no history: it cannot fire yet
    fresh.load_state(watched.state())
    assert fresh.seen == 6
    assert torch.equal(fresh.history.nan_to_num(-1.0), watched.history.nan_to_num(-1.0))
    assert fresh.fires(torch.tensor(9.0), torch.tensor(1.0))  # now it sees the jump, as the watched one does
    assert watched.fires(torch.tensor(9.0), torch.tensor(1.0))
    # The copy is a copy: observing on one leaves the other's history alone.
    fresh.fires(torch.tensor(2.0), torch.tensor(1.0))
    fresh.observe()
    assert watched.seen == 6
    with pytest.raises(ValueError, match=r"^state: a history of shape \(8, 2\), this trigger keeps \(16, 2\)"):
        MagnitudeTrigger(4.0, window=16, warmup=4, device=torch.device("cpu")).load_state(watched.state())


class Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.lin(x)))


def test_a_recomputation_restores_the_buffers_and_the_random_state() -> None:
    torch.manual_seed(0)
    module = Normed()
    batch = torch.randn(8, 4)

    def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    before = [b.clone() for b in module.buffers()]
    rng = torch.get_rng_state()
    params = list(module.parameters())
    def seed() -> None:
        torch.manual_seed(5)

    out = recompute(module, loss_fn, batch, [n for n, _ in module.named_parameters()], params, seed)
    assert set(out.grads) == {"lin.weight", "lin.bias", "norm.weight", "norm.bias"}
    assert all(torch.equal(a, b) for a, b in zip(module.buffers(), before, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in params)
    # The check can fail: a bare forward moves the statistics (what the audit used to do).
    loss_fn(module, batch)
    assert not torch.equal(next(iter(module.buffers())), before[0])
    with preserved(module):
        loss_fn(module, batch)
        assert int(module.norm.num_batches_tracked) == 2  # type: ignore[arg-type]
    assert int(module.norm.num_batches_tracked) == 1  # type: ignore[arg-type]


def test_a_confirmer_that_rebuilt_another_micro_batch_makes_the_owner_unreplayable_not_a_suspect() -> None:
    # Given: rank 5 recomputed rank 3's step from a different micro-batch (its digest differs), and so a
    # different result; rank 1 rebuilt the same micro-batch and agrees.
    ring, c = Ring.of(6, 2), claims(6)
    records = honest_records(c, ring, {3})
    records[5, 1, 1] += 1
    records[5, 1, 1 + NORM] += 1
    verdict = judge_confirmations(c, records, {3: (confirm.MAGNITUDE,)}, ring)
    # Then: batch_for did not replay; rank 3's step is judged no further and nobody is blamed.
    assert verdict.unreplayable == [(3, 5)]
    assert verdict.outcomes == []
    assert verdict.suspects == []
    # The check can fail: the same wrong result from the same micro-batch names rank 5.
    records[5, 1, 1] -= 1
    verdict = judge_confirmations(c, records, {3: (confirm.MAGNITUDE,)}, ring)
    assert (verdict.unreplayable, verdict.suspects) == ([], [5])


def test_a_suspect_that_cannot_reproduce_its_own_result_is_nonreproducible_not_persistent() -> None:
    # Given: both confirmers agree against the owner, so the owner replays its micro-batch.
    ring, c = Ring.of(6, 2), claims(6)
    records = honest_records(c, ring, {3})
    c[3, NORM] += 1
    plan = replay_plan(judge_confirmations(c, records, {3: (confirm.MAGNITUDE,)}, ring))
    replays = witnessed(c, records, ring, plan)
    replays[3, 0, 0] = 1
    # When: its replay gives a third result, neither the majority's nor its own first one.
    replays[3, 0, 1:] = c[3]
    replays[3, 0, 1 + NORM] += 5
    verdict = confirm.judge_replays(replays, plan, c, records, ring)
    # Then: not a fault of either kind; the owner is non-reproducible.
    assert verdict == confirm.ReplayVerdict("unknown", [3])
    # The check can fail: its own first result again is persistent.
    replays[3, 0, 1:] = c[3]
    assert confirm.judge_replays(replays, plan, c, records, ring) == confirm.ReplayVerdict("persistent", [])


def witnessed(c: torch.Tensor, records: torch.Tensor, ring: Ring, plan: dict[int, confirm.Outcome]) -> torch.Tensor:
    """``[world, 2, 1 + C]`` replays where every witness got its own first result again, no suspect replayed."""
    replays = torch.zeros(c.shape[0], confirm.REPLAY_SLOTS, 1 + c.shape[1], dtype=torch.int64)
    for w, outcome in confirm.witness_plan(plan).items():
        replays[w, 1, 0] = 1
        replays[w, 1, 1:] = confirm.record_of(w, outcome.owner, c, records, ring)
    return replays


def test_two_of_three_agreeing_by_chance_is_nonreproducible_when_the_witness_cannot_repeat_itself() -> None:
    # Given: both confirmers of rank 3 agree against it, and rank 3 replays its own first result again: persistent
    # on its face. What a non-deterministic reduction with a few possible results does one time in a few dozen.
    ring, c = Ring.of(6, 2), claims(6)
    records = honest_records(c, ring, {3})
    c[3, NORM] += 1
    plan = replay_plan(judge_confirmations(c, records, {3: (confirm.MAGNITUDE,)}, ring))
    witnesses = confirm.witness_plan(plan)
    assert [(w, o.owner) for w, o in witnesses.items()] == [(1, 3)]  # the first confirmer, the majority's rank
    replays = witnessed(c, records, ring, plan)
    replays[3, 0, 0] = 1
    replays[3, 0, 1:] = c[3]
    assert confirm.judge_replays(replays, plan, c, records, ring) == confirm.ReplayVerdict("persistent", [])
    # When: the witness, replaying its own recomputation of rank 3's micro-batch, gets other bits.
    replays[1, 1, 1 + NORM] += 7
    # Then: the majority was chance; nobody is blamed.
    assert confirm.judge_replays(replays, plan, c, records, ring) == confirm.ReplayVerdict("unknown", [3])
    # A witness that did not replay at all settles nothing either way.
    replays[1, 1, 0] = 0
    assert confirm.judge_replays(replays, plan, c, records, ring).persistence == "unknown"


def test_a_faulty_confirmer_is_witnessed_by_the_owner_replaying_its_own_micro_batch() -> None:
    ring, c = Ring.of(6, 2), claims(6)
    records = honest_records(c, ring, {3})
    records[5, 1, 1 + NORM] += 1  # rank 5 (the next node) recomputed rank 3's micro-batch wrong
    plan = replay_plan(judge_confirmations(c, records, {3: (confirm.MAGNITUDE,)}, ring))
    assert list(plan) == [5]
    assert [(w, o.owner) for w, o in confirm.witness_plan(plan).items()] == [(3, 3)]
    replays = witnessed(c, records, ring, plan)
    replays[5, 0, 0] = 1
    replays[5, 0, 1:] = c[3]
    assert confirm.judge_replays(replays, plan, c, records, ring) == confirm.ReplayVerdict("transient", [])
    replays[3, 1, 1 + CLAIM_LOSS] += 1
    assert confirm.judge_replays(replays, plan, c, records, ring) == confirm.ReplayVerdict("unknown", [5])


def test_the_claim_and_verdict_paths_make_every_tensor_on_the_claims_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FakeTensorMode a CPU build makes fake CUDA tensors; a CPU tensor among them raises, as on a GPU,
    and so does reading one back to the host (``bool``), which the claim path must not do either."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sdcguard.agent.nonfinite import BucketPass

    def measure(t: torch.Tensor, *, flag: bool, norm: bool) -> BucketPass:
        # What nonfinite.measure returns on a GPU: 0-dim results on the bucket's device. (Its own isfinite of a
        # 0-dim tensor is one of the ops a CPU build cannot fake on CUDA.)
        return BucketPass(torch.zeros((), dtype=torch.bool, device=t.device) if flag else None,
                          torch.linalg.vector_norm(t.to(torch.float64)) if norm else None)

    monkeypatch.setattr(confirm, "measure", measure)
    layout = {0: ["a", "b"], 1: [], 2: ["c"]}
    with FakeTensorMode():
        cuda = torch.device("cuda", 0)
        grads = {n: torch.ones(4, device=cuda) for n in ("a", "b", "c")}
        recomputation = confirm.Recomputation(torch.ones((), device=cuda), grads)
        digest = torch.zeros(confirm.BATCH_LANES, dtype=torch.int64, device=cuda)
        for batch in (None, digest):
            claim = confirm.claim_from_recomputation(recomputation, layout, cuda, nonfinite=True, norms=True,
                                                     digests=False, batch=batch)
            assert claim.device == cuda
            assert claim.shape == (CLAIM_NORMS + len(layout),)
        world, width = 6, claim.shape[0]
        gathered = torch.zeros(world, width, dtype=torch.int64, device=cuda)
        records = torch.zeros(world, 2, 1 + width, dtype=torch.int64, device=cuda)
        flags = confirm.confirmation_flags(gathered, records, [1, 3], Ring.of(world, 2))
        assert flags.device == cuda
        assert flags.shape == (2, 6)
        assert confirm.record_of(1, 3, gathered, records, Ring.of(world, 2)).device == cuda


def test_pair_rows_name_the_confirmers_the_loss_bits_and_the_parameters_that_differ() -> None:
    # Given: an audit step's claims (two parameters' digests at the end); rank 5 got parameter "b" wrong.
    ring, c = Ring.of(6, 2), claims(6)
    c = torch.cat([c, torch.arange(6 * 6, dtype=torch.int64).reshape(6, 6)], dim=1)
    records = honest_records(c, ring, {3})
    records[5, 1, -1] += 1
    outcome = judge_confirmations(c, records, {3: (confirm.AUDIT,)}, ring).outcomes[0]
    rows = confirm.pair_rows(outcome, c, records, ring, ["a", "b"])
    loss = float.hex(4.0)
    assert rows == [(1, 3, True, loss, loss, []), (5, 3, True, loss, loss, ["b"])]
