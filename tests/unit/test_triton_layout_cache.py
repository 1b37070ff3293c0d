"""The fused fingerprint's layout cache holds every bucket of a step: a layout is built once, not on every audit
step (each build copies its metadata from the host, a wait on the host per bucket on a GPU)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch

# As in test_fingerprint_triton: Triton reads this when it is first imported (only the kernels import it).
_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    # Read again at each kernel call: another file of this worker may have removed it after this one was imported.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tf._layouts.clear()
    yield
    tf._layouts.clear()


@pytest.fixture(scope="module", autouse=True)
def _restore_interpret_setting() -> Iterator[None]:
    yield
    if _INTERPRET_BEFORE is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _INTERPRET_BEFORE


def test_a_step_of_160_buckets_finds_every_layout_again_on_the_next_step() -> None:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    buckets = [[torch.randn(64 + i), torch.randn(3)] for i in range(160)]
    first = [tf.layout_for([[t] for t in bucket]) for bucket in buckets]
    again = [tf.layout_for([[t] for t in bucket]) for bucket in buckets]
    assert all(a is b for a, b in zip(first, again, strict=True))
    # And a found layout fingerprints what is at those addresses now, as a fresh one would.
    buckets[7][0].mul_(3)
    assert torch.equal(again[7](), tf.FingerprintLayout([[t] for t in buckets[7]])())


def test_the_least_recently_used_layout_is_the_one_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    monkeypatch.setattr(tf, "LAYOUTS_KEPT", 3)
    a, b, c, d = ([[torch.randn(10 + i)]] for i in range(4))
    kept_a = tf.layout_for(a)
    tf.layout_for(b)
    tf.layout_for(c)
    assert tf.layout_for(a) is kept_a  # used again: now the most recent
    tf.layout_for(d)  # drops b, not a
    assert tf.layout_for(a) is kept_a
    assert len(tf._layouts) == 3
