"""Product checks under FSDP2 (issue 28): a transient product fault in one rank's own pass, caught and named.

Given 6 ranks as 3 simulated nodes of 2 (``sharded_world``'s layout) with
product checks on, one launch runs, each with a fresh sharded model and guard
(``sharded_scenarios.guard_for``): a bit flip in one forward and in one
backward matrix product of one rank's own pass under HSDP (a 3 x 2 mesh), one
in a forward product under pure FSDP (a 1-D mesh of 6), the same runs
without the fault, and the HSDP forward fault with product checks off (no
other check sees it at its step: the replicas all-reduce one gradient). The
flip is tests/functional/product_scenarios.py's (``product_fault``): entered
around the faulty rank's step, below the checks' interception, as a faulty kernel
would be; it hits the rank's own pass only, so the recomputations on other
nodes come out right.

Its own launch: the sharded world's launcher runs only the fault kinds of
``SDCGUARD_INJECT``, and a product fault is not one of them.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from sdcguard.agent.testing.train import init_process_group, shutdown
from sdcguard.contract import Alarm, ProductCheckEvidence
from tests.distributed import sharded_scenarios
from tests.distributed.sharded_world import RANKS_PER_NODE, WORLD, node_name
from tests.forked import launch_forked
from tests.functional.product_scenarios import product_fault, script_defaults

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 3
"""Steps a run may take: the fault fires at step 1 (step 0 audits and checks the weights, clean)."""
# A flip of bit 26 (an exponent bit: the element x256 or /256): visible, finite, not a NaN.
# Products are counted as product_scenarios counts them: the 5th forward one is blocks.0.fc's. Not the 1st
# (blocks.0.qkv): its element 5 is token 0's query, which causal attention never uses, so that flip reaches
# no loss or gradient and the guard rightly lets the update go (a warning says the checks fired).
# name: (mesh, fault, the product's site).
PRODUCT_FAULTS: dict[str, tuple[list[int], dict[str, Any], str]] = {
    "hsdp_fwd": ([3, 2], {"kind": "product", "rank": 1, "step": 1, "direction": "fwd", "product": 4,
                          "bit": 26}, "blocks.0.fc forward"),
    "hsdp_bwd": ([3, 2], {"kind": "product", "rank": 4, "step": 1, "direction": "bwd", "product": 1,
                          "bit": 26}, "head backward dW"),
    "fsdp_fwd": ([6], {"kind": "product", "rank": 3, "step": 1, "direction": "fwd", "product": 4, "bit": 26},
                 "blocks.0.fc forward"),
    "hsdp_fwd_script_defaults": ([3, 2], {"kind": "product", "rank": 1, "step": 1, "direction": "fwd", "product": 4,
                                          "bit": 26}, "blocks.0.fc forward"),
    "hsdp_fwd_compiled": ([3, 2], {"kind": "product", "rank": 1, "step": 1, "direction": "fwd", "product": 4,
                                   "bit": 26}, "blocks.0.fc forward"),
}
EXTRAS: dict[str, dict[str, Any]] = {
    "hsdp_fwd_script_defaults": {"default_device": "meta", "default_dtype": "bfloat16"},
    "hsdp_fwd_compiled": {"compiled": True},
}
"""``hsdp_fwd_script_defaults`` runs under the default device and dtype a training script may set (on a GPU,
``torch.set_default_device("cuda")``): the guard's host tensors follow neither. ``hsdp_fwd_compiled`` has each
block compiled by a backend whose code rounds otherwise than eager (as inductor's does): the own pass runs
eagerly under the product checks, and so must every recomputation compared with it (step 0's audit, the
confirmation), or every rank is blamed. The outcome of both is ``hsdp_fwd``'s."""
CLEAN = {"hsdp_clean": [3, 2], "fsdp_clean": [6]}
"""The same runs without the fault."""
UNCHECKED = "hsdp_fwd_unchecked"
"""``hsdp_fwd`` with product checks off."""


def run(out_dir: str, scenarios: list[dict[str, Any]]) -> None:
    """Every rank: run ``scenarios`` in order, then write ``out_dir/rank-R.json``."""
    init_process_group()
    rank = dist.get_rank()
    results = {}
    for scenario in scenarios:
        mesh = sharded_scenarios.make_mesh(tuple(scenario["mesh"]))
        results[scenario["name"]] = _train(scenario, mesh, Path(out_dir), rank)
        dist.barrier()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(results))
    shutdown()


def _train(scenario: dict[str, Any], mesh: Any, out: Path, rank: int) -> dict[str, Any]:
    """Train until the first alarm (or ``steps``); the faulty rank's step is wrapped in the product fault."""
    checks = scenario.get("product_checks", True)
    guard = sharded_scenarios.guard_for({**scenario, "product_checks": checks}, mesh, out, RANKS_PER_NODE)
    fault = scenario.get("fault") or {}
    result: dict[str, Any] = {"alarm": None, "alarms": 0, "updated": 0, "flipped": 0, "product_flags": 0,
                              "products_checked": []}
    for step in range(scenario["steps"]):
        before = guard.local_fingerprint_hex()
        with product_fault(fault, step, result) if fault.get("rank") == rank else contextlib.nullcontext(), \
                script_defaults(scenario):
            r = guard.step(step)
        result["updated"] += r.updated
        if guard.products is not None:
            result["product_flags"] += int(guard.products.summary()[1])
            result["products_checked"].append(guard.products.checked)
        if r.alarm is not None:
            result["alarms"] += 1
            result["alarm"] = r.alarm.model_dump(mode="json")
            result["alarm_step_updated"] = r.updated
            result["weights_unchanged"] = guard.local_fingerprint_hex() == before
            break
    return result


@pytest.fixture(scope="module")
def products(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("sharded-products")
    scenarios = [{"name": name, "mesh": mesh, "fault": fault, "steps": STEPS, **EXTRAS.get(name, {})}
                 for name, (mesh, fault, _) in PRODUCT_FAULTS.items()]
    scenarios += [{"name": name, "mesh": mesh, "steps": STEPS} for name, mesh in CLEAN.items()]
    mesh, fault, _ = PRODUCT_FAULTS["hsdp_fwd"]
    scenarios += [{"name": UNCHECKED, "mesh": mesh, "fault": fault, "steps": fault["step"] + 1,
                   "product_checks": False}]
    env = {**sharded_scenarios.clean_env(), **sharded_scenarios.rank_env(WORLD, RANKS_PER_NODE)}
    codes = launch_forked(WORLD, run, (str(tmp), scenarios), env=env, timeout=240,
                          preload=sharded_scenarios.LAUNCHER_IMPORTS)
    assert codes == [0] * WORLD, f"ranks exited with {codes}"
    return [json.loads(Path(tmp, f"rank-{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("name", list(PRODUCT_FAULTS))
def test_a_transient_product_fault_is_caught_at_its_step_and_names_the_rank_and_the_product(
        products: list[dict[str, Any]], name: str) -> None:
    _, fault, site = PRODUCT_FAULTS[name]
    faulty = fault["rank"]
    assert [r[name]["flipped"] for r in products] == [int(r == faulty) for r in range(WORLD)]
    assert all(r[name]["alarm"] is not None for r in products), "the fault went unseen at its step"
    alarms = [Alarm.model_validate(r[name]["alarm"]) for r in products]
    alarm = alarms[0]
    # Then: one alarm on every rank, at the faulty step, by the product check, naming the rank and product.
    assert {a.alarm_id for a in alarms} == {alarm.alarm_id}
    assert alarm.step == fault["step"]
    assert alarm.detector.value == "product_check", alarm.message
    assert alarm.suspect_ranks == [faulty]
    assert alarm.localized
    assert [s.node for s in alarm.suspects] == [node_name(faulty // RANKS_PER_NODE)]
    assert isinstance(alarm.evidence, ProductCheckEvidence)
    assert [(s.rank, s.site) for s in alarm.evidence.sites] == [(faulty, site)]
    # ... confirmed by the ranks of the same shard position on the nodes before and after, which agree with
    # each other and not with the faulty rank's own pass.
    others = {(faulty + d) % WORLD for d in (-RANKS_PER_NODE, RANKS_PER_NODE)}
    assert {(p.auditor, p.audited) for p in alarm.evidence.confirmation} == {(r, faulty) for r in others}
    assert alarm.fault_persistence == "transient"
    # No rank applied the step's update, and the step before it passed the product checks.
    assert all(r[name]["alarm_step_updated"] is False and r[name]["weights_unchanged"] for r in products)
    assert all(r[name]["updated"] == fault["step"] and r[name]["alarms"] == 1 for r in products)
    assert alarm.last_clean.product_check == fault["step"] - 1


@pytest.mark.parametrize("name", list(CLEAN))
def test_the_same_runs_without_the_fault_stay_silent(products: list[dict[str, Any]], name: str) -> None:
    for r in products:
        run_ = r[name]
        assert run_["alarms"] == 0, run_["alarm"]
        assert run_["product_flags"] == 0
        assert run_["updated"] == STEPS
        assert all(n > 0 for n in run_["products_checked"]), "the unsharded products are seen"


def test_without_product_checks_the_same_fault_passes_its_step_unseen(products: list[dict[str, Any]]) -> None:
    # The control: what catches the fault at its step is the product check, not another detector.
    assert products[1][UNCHECKED]["flipped"] == 1
    for r in products:
        assert r[UNCHECKED]["alarms"] == 0, r[UNCHECKED]["alarm"]
        assert r[UNCHECKED]["updated"] == PRODUCT_FAULTS["hsdp_fwd"][1]["step"] + 1
