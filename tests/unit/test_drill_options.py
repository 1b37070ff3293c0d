"""The drill's options: what it refuses before anything starts, and the fault it injects (no stand-in needed)."""

from __future__ import annotations

import pytest

from sdcguard.cli import main
from sdcguard.infra.drill.options import CAPSULE_FAULTS, FAULTS, DrillOptions


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"replacement_faulty": True, "decision": "reject"}, "--replacement-faulty: a rejected incident replaces no node"),
        ({"replacement_faulty": True, "fault": "weight_bitflip", "steps": 60},
         "--replacement-faulty: the weight_bitflip alarm leaves no replay capsule"),
    ],
)
def test_a_faulty_replacement_is_refused_where_no_qualification_could_catch_it(changes: dict[str, object],
                                                                                says: str) -> None:
    with pytest.raises(ValueError, match="--replacement-faulty") as refused:
        DrillOptions(**changes).validate()  # type: ignore[arg-type]
    assert says in str(refused.value)


def test_a_faulty_replacement_is_accepted_for_every_fault_that_leaves_a_capsule() -> None:
    for fault in CAPSULE_FAULTS:
        DrillOptions(fault=fault, replacement_faulty=True).validate()
    assert set(CAPSULE_FAULTS) < set(FAULTS)


def test_the_command_refuses_a_faulty_replacement_with_a_rejection_before_starting_anything(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["drill", "--replacement-faulty", "--reject"]) == 1
    assert "--replacement-faulty: a rejected incident replaces no node" in capsys.readouterr().err


def test_the_injected_fault_is_persistent_except_the_weight_flip_and_bound_to_the_node() -> None:
    # The default activation fault stays on for the whole run, so a replay of the alarm's step on the node
    # meets it on every repetition; the weight flip fires once (it toggles the bit each time it fires).
    default = DrillOptions()
    assert default.injection("hyperpod-i-0abc") == "kind=finite_activation,node=hyperpod-i-0abc,step=33,repeat=60"
    assert (default.persistent, default.leaves_capsule) == (True, True)
    flip = DrillOptions(fault="weight_bitflip")
    assert flip.injection("n").endswith(",repeat=1")
    assert (flip.persistent, flip.leaves_capsule) == (False, False)
