"""GuardConfig and Topology: validated settings that name the bad field, also from the environment."""

from __future__ import annotations

import pytest

from sdcguard.agent.config import ALARM_EXIT_CODE, GuardConfig
from sdcguard.agent.topology import Topology, audited_by_ring


def test_defaults_are_the_documented_ones() -> None:
    config = GuardConfig()
    assert (config.on_alarm, config.audit_every, config.fingerprint_every) == ("stop", 100, 10)
    assert config.event_bus == "sdcguard"
    assert ALARM_EXIT_CODE == 87


@pytest.mark.parametrize(
    ("field", "value"),
    [("on_alarm", "explode"), ("ranks_per_node", 0), ("audit_every", -1), ("fingerprint_every", -5),
     ("publish_retries", 0), ("publish_budget_s", 0.0), ("threads", -1), ("event_bus", ""),
     ("trigger_ratio", 1.0), ("trigger_window", 0), ("trigger_warmup", 0), ("trigger_warmup", 33),
     ("max_data_faults", -1), ("checkpoint_retries", 0), ("checkpoint_retry_delay_s", -1.0),
     ("on_checkpoint_failure", "ignore")],
)
def test_a_bad_value_is_refused_naming_its_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        GuardConfig(**{field: value})  # type: ignore[arg-type]


def test_every_field_comes_from_sdcguard_variables() -> None:
    env = {"SDCGUARD_ON_ALARM": "continue", "SDCGUARD_RANKS_PER_NODE": "2", "SDCGUARD_AUDIT_EVERY": "50",
           "SDCGUARD_NONFINITE": "false", "SDCGUARD_PUBLISH_BUDGET_S": "2.5", "SDCGUARD_EVENT_BUS": "bus-x",
           "SDCGUARD_JOB_NAME": "gpt"}
    config = GuardConfig.from_env(env, fingerprint_every=7)
    assert config.on_alarm == "continue"
    assert config.ranks_per_node == 2
    assert config.audit_every == 50
    assert config.nonfinite is False
    assert config.publish_budget_s == 2.5
    assert config.event_bus == "bus-x"
    assert config.job_name == "gpt"
    assert config.fingerprint_every == 7
    assert GuardConfig.from_env({"SDCGUARD_RANKS_PER_NODE": "none"}).ranks_per_node is None


@pytest.mark.parametrize(
    ("env", "field"),
    [({"SDCGUARD_AUDIT_EVERY": "often"}, "audit_every"), ({"SDCGUARD_NONFINITE": "maybe"}, "nonfinite"),
     ({"SDCGUARD_ON_ALARM": "panic"}, "on_alarm")],
)
def test_a_bad_variable_is_refused_naming_field(env: dict[str, str], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        GuardConfig.from_env(env)


def test_an_unknown_override_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^audit_evry: not a GuardConfig field"):
        GuardConfig.from_env({}, audit_evry=3)


def test_topology_from_torchrun_variables() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "NODE_NAME": "hyperpod-i-0123456789abcdef0", "POD_NAME": "job-worker-1", "HOSTNAME": "job-worker-1"}
    topo = Topology.from_env(env)
    assert (topo.rank, topo.local_rank, topo.world_size, topo.ranks_per_node) == (5, 1, 8, 4)
    assert (topo.node, topo.pod, topo.host) == ("hyperpod-i-0123456789abcdef0", "job-worker-1", "job-worker-1")
    assert topo.node_index == 1
    assert topo.nodes == 2
    # The same local rank on the next and on the previous node (two nodes: the same one).
    assert topo.audits == 1
    assert topo.audited_by == 1


def test_ranks_per_node_override_simulates_nodes() -> None:
    topo = Topology.from_env({"HOSTNAME": "laptop"}, ranks_per_node=2, rank=3, world_size=6)
    assert topo.local_rank == 1
    assert topo.node_index == 1
    assert topo.node == "node-1"
    assert topo.pod == "laptop"
    assert topo.audits == 5
    assert topo.audited_by == 1
    assert [audited_by_ring(r, 6, 2) for r in range(6)] == [2, 3, 4, 5, 0, 1]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"ranks_per_node": 4, "rank": 0, "world_size": 6}, "ranks_per_node"),
     ({"rank": 6, "world_size": 6, "ranks_per_node": 1}, "rank")],
)
def test_an_impossible_topology_is_refused(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        Topology.from_env({}, **kwargs)


def test_a_malformed_rank_variable_is_named() -> None:
    with pytest.raises(ValueError, match=r"^RANK:"):
        Topology.from_env({"RANK": "three", "WORLD_SIZE": "4"})
