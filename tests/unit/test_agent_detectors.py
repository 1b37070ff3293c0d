"""The detectors' verdicts as pure functions of what every rank reported, and the replay they rely on."""

from __future__ import annotations

import pytest
import torch

from sdcguard.agent import fingerprint as fp
from sdcguard.agent import native
from sdcguard.agent.ddp_hook import GradientHook
from sdcguard.agent.nonfinite import (
    LOCAL_ANY,
    LOCAL_MASK,
    LOSS_NONFINITE,
    REDUCED_ANY,
    REDUCED_FP,
    REDUCED_MASK,
    SUMMARY_WIDTH,
    judge_nonfinite,
    nonfinite_flag,
)
from sdcguard.agent.replay import pin_threads, seed_for, seed_micro_batch
from sdcguard.agent.ring_audit import bits_to_hex, judge, loss_bits, name_parameters
from sdcguard.agent.weights import packed_fingerprints, state_fingerprint, vote


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kernel_mode", ["auto", "torch"])
def test_nonfinite_flag_sees_nan_and_both_infinities(
    dtype: torch.dtype, kernel_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "auto" takes the C kernel's scan of the raw bits where there is a compiler, "torch" aminmax.
    monkeypatch.setenv(native.KERNEL_ENV, kernel_mode)
    info = torch.finfo(dtype)
    t = torch.randn(20_000).to(dtype)
    t[5] = info.max  # extremes and subnormals are finite
    t[6] = -info.max
    t[7] = info.smallest_normal / 4
    t[8] = -0.0
    assert not nonfinite_flag(t)
    for where in (0, 777, 4095, 4096, 19_999):  # the scan works in blocks of 4096
        for bad in (float("nan"), float("inf"), float("-inf")):
            u = t.clone()
            u[where] = bad
            assert nonfinite_flag(u), (where, bad)
            assert nonfinite_flag(u[::2] if where % 2 == 0 else u[1::2]), (where, bad)  # strided: torch's path
    assert not nonfinite_flag(torch.arange(5))
    assert not nonfinite_flag(torch.zeros(0, dtype=dtype))
    assert nonfinite_flag(torch.tensor(float("nan"), dtype=dtype))  # the loss: a 0-dim tensor


def summaries(world: int) -> torch.Tensor:
    return torch.zeros(world, SUMMARY_WIDTH, dtype=torch.int64)


def test_nonfinite_verdict_names_the_rank_and_bucket() -> None:
    s = summaries(4)
    s[2, LOCAL_ANY], s[2, LOCAL_MASK] = 1, 0b100
    s[:, REDUCED_ANY], s[:, REDUCED_MASK] = 1, 0b100
    s[2, LOSS_NONFINITE] = 1
    verdict = judge_nonfinite(s)
    assert not verdict.clean
    assert verdict.local_ranks == [2]
    assert verdict.reduced_ranks == [0, 1, 2, 3]
    assert verdict.loss_ranks == [2]
    assert (2, 2, "local") in verdict.buckets
    assert (0, 2, "reduced") in verdict.buckets
    assert judge_nonfinite(summaries(4)).clean


def lanes(value: int) -> torch.Tensor:
    return fp.fingerprint(torch.tensor([value], dtype=torch.int64))


def test_vote_finds_the_strict_majority_and_its_dissenters() -> None:
    ballot = vote([lanes(1), lanes(1), lanes(2), lanes(1), lanes(1), lanes(1)])
    assert not ballot.unanimous
    assert ballot.majority == fp.to_hex(lanes(1))
    assert ballot.dissenters == [2]
    assert ballot.groups[0][1] == [0, 1, 3, 4, 5]


def test_an_even_split_has_no_majority() -> None:
    ballot = vote([lanes(1), lanes(2)])
    assert ballot.majority is None
    assert ballot.dissenters == []
    assert vote([lanes(1)] * 3).unanimous


def test_the_reduced_fingerprint_lanes_sit_in_the_summary() -> None:
    s = summaries(3)
    s[:, REDUCED_FP] = lanes(9)
    s[1, REDUCED_FP] = lanes(8)
    assert vote([s[r, REDUCED_FP] for r in range(3)]).dissenters == [1]


def records(world: int, buckets: int = 2) -> torch.Tensor:
    """Every rank's honest record: distinct loss bits and bucket fingerprints per rank."""
    out = torch.zeros(world, 1 + 3 * buckets, dtype=torch.int64)
    for r in range(world):
        out[r, 0] = loss_bits(torch.tensor(1.0 + r))
        out[r, 1:] = torch.arange(3 * buckets) + 100 * r
    return out


def auditors_view(owners: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """What honest auditors recompute: exactly the owner's record of the rank each audits."""
    world = owners.shape[0]
    return torch.stack([owners[(a + ranks_per_node) % world] for a in range(world)])


def test_a_clean_audit_blames_nobody() -> None:
    owners = records(6)
    verdict = judge(owners, auditors_view(owners, 2), 2)
    assert verdict.clean
    assert verdict.suspects == []
    assert len(verdict.pairs) == 6


def test_three_nodes_single_out_the_rank_that_fails_both_audits() -> None:
    owners = records(6)
    recomputed = auditors_view(owners, 2)
    # Rank 3's own result is wrong, and so is what it recomputes for rank 5.
    owners[3, 0] += 1
    recomputed[3, 4] += 1
    verdict = judge(owners, recomputed, 2)
    assert verdict.suspects == [3]
    assert verdict.localized
    assert {(p.auditor, p.audited) for p in verdict.mismatched} == {(1, 3), (3, 5)}
    wrong_loss = next(p for p in verdict.mismatched if p.audited == 3)
    assert not wrong_loss.loss_match
    assert wrong_loss.mismatched_buckets == []
    wrong_grad = next(p for p in verdict.mismatched if p.auditor == 3)
    assert wrong_grad.loss_match
    assert wrong_grad.mismatched_buckets == [1]


def test_a_single_failed_pair_is_reported_but_not_localised() -> None:
    owners = records(6)
    recomputed = auditors_view(owners, 2)
    owners[3, 1] += 1
    verdict = judge(owners, recomputed, 2)
    assert verdict.suspects == [1, 3]
    assert not verdict.localized


def test_two_nodes_name_both_ranks_of_the_pair() -> None:
    owners = records(4)
    recomputed = auditors_view(owners, 2)
    owners[3, 0] += 1
    recomputed[3, 0] += 1
    verdict = judge(owners, recomputed, 2)
    assert verdict.suspects == [1, 3]
    assert not verdict.localized


def test_failed_pairs_get_their_parameters_named() -> None:
    owners = records(6)
    recomputed = auditors_view(owners, 2)
    owners[3, 0] += 1
    recomputed[3, 0] += 1
    verdict = judge(owners, recomputed, 2)
    per_param_owner = torch.zeros(6, 3, 3, dtype=torch.int64)
    per_param_recomputed = torch.zeros(6, 3, 3, dtype=torch.int64)
    per_param_owner[3, 1] = 5  # rank 3's own gradient of "b" differs from what rank 1 recomputed
    named = name_parameters(verdict, per_param_owner, per_param_recomputed, ["a", "b", "c"], 2)
    assert next(p for p in named.pairs if p.audited == 3).mismatched_params == ["b"]


def test_loss_bits_are_exact() -> None:
    x = torch.tensor(0.1, dtype=torch.float32)
    assert float.fromhex(bits_to_hex(int(loss_bits(x)))) == float(x)
    assert loss_bits(x) != loss_bits(torch.nextafter(x, torch.tensor(1.0)))


def test_state_fingerprint_covers_weights_and_optimizer_state() -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    params = list(model.parameters())
    base = fp.to_hex(state_fingerprint(params, opt))
    assert fp.to_hex(state_fingerprint(params, opt)) == base
    state = opt.state[params[0]]["exp_avg"]
    state.view(-1)[0] = torch.nextafter(state.view(-1)[0], torch.tensor(1.0))
    assert fp.to_hex(state_fingerprint(params, opt)) != base
    assert fp.to_hex(state_fingerprint(params, None)) != fp.to_hex(state_fingerprint(params, opt))


def test_packing_keeps_large_tensors_apart_and_small_ones_together() -> None:
    rows = packed_fingerprints([torch.ones(3), torch.ones(2, dtype=torch.float64), torch.ones(5)])
    assert rows.shape == (2, 3)
    assert torch.equal(rows[0], fp.fingerprint(torch.ones(8)))


def test_seeding_makes_dropout_reproduce_per_step_and_rank() -> None:
    pin_threads(1)
    drop = torch.nn.Dropout(0.5)
    seed_micro_batch(0, 7, 3)
    a = drop(torch.ones(64))
    seed_micro_batch(0, 7, 3)
    b = drop(torch.ones(64))
    seed_micro_batch(0, 7, 4)
    c = drop(torch.ones(64))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert len({seed_for(0, s, r) for s in range(50) for r in range(50)}) == 2500
    assert torch.get_num_threads() == 1


def test_the_step_summary_packs_every_flag_and_the_reduced_fingerprint() -> None:
    hook = GradientHook({}, world_size=2)
    yes, no = torch.tensor(True), torch.tensor(False)
    hook._local = {0: no, 2: yes, 70: yes}  # bucket 70 is past the mask: it counts, it has no bit
    hook._reduced = {0: yes, 1: no}
    rows = {1: fp.fingerprint(torch.ones(3)), 0: fp.fingerprint(torch.zeros(3))}
    hook._reduced_fp = rows
    out = hook.summary(torch.tensor(float("inf")), torch.device("cpu"))
    assert out.shape == (SUMMARY_WIDTH,)
    assert out[LOCAL_ANY] == 2
    assert out[LOCAL_MASK] == 0b100
    assert out[REDUCED_ANY] == 1
    assert out[REDUCED_MASK] == 0b1
    assert out[LOSS_NONFINITE] == 1
    assert torch.equal(out[REDUCED_FP], fp.combine(torch.stack([rows[0], rows[1]])))  # in bucket order
    verdict = judge_nonfinite(torch.stack([out, torch.zeros_like(out)]))
    assert verdict.local_ranks == [0]
    assert verdict.reduced_ranks == [0]
    assert verdict.loss_ranks == [0]
    assert verdict.buckets == [(0, 2, "local"), (0, 0, "reduced")]

    clean = GradientHook({}, world_size=2)
    out = clean.summary(torch.tensor(1.0), torch.device("cpu"))
    assert torch.equal(out, torch.zeros(SUMMARY_WIDTH, dtype=torch.int64))


def test_the_vote_stays_right_when_two_fingerprints_share_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdcguard.agent import weights

    ballot = [lanes(1), lanes(1), lanes(2), lanes(1)]
    expected = vote(ballot)
    monkeypatch.setattr(weights, "_KEY_WEIGHTS", [0] * 8)  # every key collides
    collided = vote(ballot)
    assert collided == expected
    assert collided.dissenters == [2]


def test_threads_are_pinned_on_a_cpu_rank_and_left_to_the_job_on_a_gpu_rank() -> None:
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        # A GPU rank recomputes on the GPU: its data loader's torch ops keep the job's threads.
        pin_threads(1, torch.device("cuda", 1))
        assert torch.get_num_threads() == 2
        # A CPU rank recomputes on the CPU: bit-identical only with equal counts.
        pin_threads(1, torch.device("cpu"))
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="threads: must be >= 0"):
            pin_threads(-1, torch.device("cuda", 0))
    finally:
        torch.set_num_threads(saved)
