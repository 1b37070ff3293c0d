"""The node-name rule has one home: ``sdcguard.contract.naming``; every user spells it through there."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdcguard.contract.naming import instance_id_of, node_name
from sdcguard.lambdas.resolve import instance_id_from_node_name

ROOT = Path(__file__).resolve().parents[2]


def test_a_node_name_round_trips() -> None:
    assert node_name("i-0123456789abcdef0") == "hyperpod-i-0123456789abcdef0"
    assert instance_id_of("hyperpod-i-0123456789abcdef0") == "i-0123456789abcdef0"
    assert instance_id_of("hyperpod-i-01234567") == "i-01234567"  # older 8-digit ids are read
    assert instance_id_from_node_name("hyperpod-i-0123456789abcdef0") == "i-0123456789abcdef0"


@pytest.mark.parametrize("name", ["ip-10-0-0-1.ec2.internal", "hyperpod-i-XYZ", "hyperpod-", "i-0123456789abcdef0"])
def test_other_names_are_not_node_names(name: str) -> None:
    assert instance_id_of(name) is None


def test_a_bad_instance_id_is_refused() -> None:
    with pytest.raises(ValueError, match="17 lowercase hex"):
        node_name("i-123")


def test_no_other_module_spells_the_rule() -> None:
    spelled = [
        str(path.relative_to(ROOT))
        for part in ("contract", "lineage", "agent", "lambdas", "infra", "sdcguard")
        for path in (ROOT / part).rglob("*.py")
        if path.name != "naming.py"
        and any(s in path.read_text() for s in ('"hyperpod-"', "'hyperpod-'", 'f"hyperpod-{', '^hyperpod-('))
    ]
    assert spelled == []
