"""The "fusion" part of ``./dev bench agent``: it runs, and its baseline takes the same checks one pass each."""

from __future__ import annotations

import pytest
import torch

from benchmarks import agent_fusion
from sdcguard.agent import fingerprint as fp
from sdcguard.agent.nonfinite import local_pass, reduced_pass
from sdcguard.agent.testing.train import JobShape


def test_the_baseline_gives_the_results_of_the_fused_passes() -> None:
    bucket = torch.randn(3 * 4096 + 5)
    bucket[77] = float("inf")
    one, fused = bucket.clone(), bucket.clone()
    a = agent_fusion._one_pass_local(one, 3, flag=True, norm=True)
    b = local_pass(fused, 3, flag=True, norm=True)
    assert torch.equal(one.view(torch.int32), fused.view(torch.int32))
    assert (bool(a.nonfinite), float(a.norm)) == (bool(b.nonfinite), float(b.norm))  # type: ignore[arg-type]
    c = agent_fusion._one_pass_reduced(bucket, flag=True, fingerprint=True, norm=True)
    d = reduced_pass(bucket, flag=True, fingerprint=True, norm=True)
    assert c.fingerprint is not None
    assert d.fingerprint is not None
    assert fp.to_hex(c.fingerprint) == fp.to_hex(d.fingerprint)


def test_the_part_runs_the_three_rows(capsys: pytest.CaptureFixture[str]) -> None:
    # Both guarded rows run under on_alarm="raise": an alarm on either would end the ranks, status 1.
    assert agent_fusion.fusion_table(JobShape(dim=16, layers=1, seq=8, batch=2), rounds=4) == 0
    printed = capsys.readouterr().out
    for row in agent_fusion.ROWS:
        assert f"| {row}" in printed
