"""The sharded tests' one launch, shared by every test of this folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed import sharded_world, tp_world


@pytest.fixture(scope="session")
def six(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One launch of 6 ranks (3 nodes x 2) that runs every scenario; the folder and each rank's results."""
    tmp = tmp_path_factory.mktemp("sharded")
    return tmp, sharded_world.run_world(tmp, sharded_world.scenarios(tmp), timeout=600)


@pytest.fixture(scope="session")
def tp_six(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One launch of 6 ranks (3 nodes x 2, TP 2 inside each) that runs every tensor-parallel scenario."""
    tmp = tmp_path_factory.mktemp("tp")
    return tmp, tp_world.run(tmp)
