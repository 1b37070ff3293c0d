"""Fixtures shared by the whole suite."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from sdcguard.infra.local.standin import LocalStandIn
from tests.namespace import refuse_old_names

# One module, one name: the old top-level names (the folders, from a checkout) would load second copies.
refuse_old_names()


@pytest.fixture(autouse=True)
def _keep_torch_deterministic_setting() -> Iterator[None]:
    """A guard with the ring audit turns on torch's deterministic algorithms, process-wide: not past its test."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    if torch.are_deterministic_algorithms_enabled() != before:
        torch.use_deterministic_algorithms(before)


@pytest.fixture(scope="session", autouse=True)
def _spool_outside_the_working_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A guard configured from the environment (the reference job, the examples, their subprocesses) spools
    undelivered alarms into ./sdcguard-spool and republishes what it finds there: each test session (each
    worker of ``./dev test``) gets its own spool, outside the tree."""
    patch = pytest.MonkeyPatch()
    patch.setenv("SDCGUARD_SPOOL_DIR", str(tmp_path_factory.mktemp("spool")))
    yield
    patch.undo()


REPLAY_FACTORIES = ",".join((
    "tests.capsules:reference_model", "tests.capsules:compiled_reference_model", "tests.capsules:tiny_model",
    "sdcguard.agent.testing.train:replay_model", "tests.distributed.sharded_scenarios:plain_model",
    # Allowed and broken: what tests/unit/test_capsule.py checks of an allowed factory that fails.
    "sdcguard_no_such_pkg.sdc:replay_model", "tests.capsules:no_such_factory",
))
"""The factories this suite's capsules name: its replays' allow-list (``SDCGUARD_REPLAY_FACTORIES``), as an
operator's machine would set it. A test of the allow-list itself sets its own."""


@pytest.fixture(scope="session", autouse=True)
def _replays_trust_the_suites_factories() -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    patch.setenv("SDCGUARD_REPLAY_FACTORIES", REPLAY_FACTORIES)
    yield
    patch.undo()


@pytest.fixture(scope="session", autouse=True)
def _compiled_path_built() -> None:
    """The product checks' compiled path (about ten seconds to build, cached) built once per session, before any
    test forks ranks that would each build it at once. A machine that cannot build it runs the Python form."""
    from sdcguard.agent import native, native_products

    with contextlib.suppress(native.NativeKernelError, ValueError):
        native_products.build()


@pytest.fixture(scope="session")
def standin() -> Iterator[LocalStandIn]:
    """One local stand-in (moto with extensions + the local EKS API server) for the session.

    HyperPod phases are immediate. Tests share it: create uniquely named
    resources (e.g. with a uuid suffix) rather than expecting a clean slate.
    """
    with LocalStandIn(replace_seconds=0.0) as running:
        yield running
